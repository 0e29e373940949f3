// Loop helpers for the CPU kernel files compiled per SIMD level (common/cpu_isa.h):
// at::vec::Vectorized bodies with scalar tails, sums that stay accurate on long
// rows, and rows of another storage type seen as the compute type. Everything here
// is inside GP_CPU_NS, so each level gets its own copy: include this header only
// from a file whose kernels are in GP_CPU_NS.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/cpu_grain.h"  // grain_rows
#include "common/cpu_isa.h"
#include "common/dtype.h"

namespace gpu_puzzles {
namespace GP_CPU_NS {
namespace vec_loops {

using at::vec::Vectorized;

// Elements summed in vector lanes before the partial goes into a double total: a
// lane then adds at most kSumChunk / lanes terms, so a float sum over a long row
// keeps ~1e-6 relative error instead of drifting.
constexpr int64_t kSumChunk = 4096;

// Calls vf(i) for i = 0, W, 2W, ... while a whole vector fits, then sf(i) for each
// tail element (W = Vectorized<S>::size()).
template <typename S, typename VF, typename SF>
inline void vfor(int64_t n, VF&& vf, SF&& sf) {
  constexpr int64_t W = Vectorized<S>::size();
  int64_t i = 0;
  for (; i + W <= n; i += W) vf(i);
  for (; i < n; ++i) sf(i);
}

// Independent accumulators in the reductions below: one would chain every vector
// add on the previous one (latency-bound on rows that sit in L1).
constexpr int kAcc = 4;

// sum over i of vf(i) (a Vectorized<S> of elements i..i+W) and sf(i) on the tail,
// as vfor visits them; vector partials per kSumChunk elements, added in double.
template <typename S, typename VF, typename SF>
inline double vsum(int64_t n, VF&& vf, SF&& sf) {
  using V = Vectorized<S>;
  constexpr int64_t W = V::size();
  double total = 0;
  for (int64_t c0 = 0; c0 < n; c0 += kSumChunk) {
    const int64_t c1 = std::min(n, c0 + kSumChunk);
    V acc[kAcc];
    for (auto& a : acc) a = V(S(0));
    int64_t i = c0;
    for (; i + kAcc * W <= c1; i += kAcc * W)
      for (int k = 0; k < kAcc; ++k) acc[k] += vf(i + k * W);
    for (; i + W <= c1; i += W) acc[0] += vf(i);
    double tail = 0;
    for (; i < c1; ++i) tail += static_cast<double>(sf(i));
    const V a = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    total += static_cast<double>(at::vec::vec_reduce_all<S>([](V& x, V& y) { return x + y; }, a)) + tail;
  }
  return total;
}

// Two sums in one pass: vf(i, a, b) adds its vectors into the accumulators a and b,
// sf(i, a, b) its tail elements into the doubles a and b.
template <typename S, typename VF, typename SF>
inline void vsum2(int64_t n, double& sa, double& sb, VF&& vf, SF&& sf) {
  using V = Vectorized<S>;
  constexpr int64_t W = V::size();
  sa = sb = 0;
  const auto add = [](V& x, V& y) { return x + y; };
  for (int64_t c0 = 0; c0 < n; c0 += kSumChunk) {
    const int64_t c1 = std::min(n, c0 + kSumChunk);
    V a[2] = {V(S(0)), V(S(0))}, b[2] = {V(S(0)), V(S(0))};
    int64_t i = c0;
    for (; i + 2 * W <= c1; i += 2 * W) {
      vf(i, a[0], b[0]);
      vf(i + W, a[1], b[1]);
    }
    for (; i + W <= c1; i += W) vf(i, a[0], b[0]);
    for (; i < c1; ++i) sf(i, sa, sb);
    V ra = a[0] + a[1], rb = b[0] + b[1];
    sa += static_cast<double>(at::vec::vec_reduce_all<S>(add, ra));
    sb += static_cast<double>(at::vec::vec_reduce_all<S>(add, rb));
  }
}

// max over a contiguous row; NaN propagates (as torch.max does).
template <typename S>
inline S row_max(const S* x, int64_t n) {
  using V = Vectorized<S>;
  constexpr int64_t W = V::size();
  if (n < kAcc * W) return at::vec::reduce_all<S>([](V& a, V& b) { return at::vec::maximum(a, b); }, x, n);
  V m[kAcc];
  for (int k = 0; k < kAcc; ++k) m[k] = V::loadu(x + k * W);
  int64_t i = kAcc * W;
  for (; i + kAcc * W <= n; i += kAcc * W)
    for (int k = 0; k < kAcc; ++k) m[k] = at::vec::maximum(m[k], V::loadu(x + i + k * W));
  for (; i + W <= n; i += W) m[0] = at::vec::maximum(m[0], V::loadu(x + i));
  V r = at::vec::maximum(at::vec::maximum(m[0], m[1]), at::vec::maximum(m[2], m[3]));
  S best = at::vec::vec_reduce_all<S>([](V& a, V& b) { return at::vec::maximum(a, b); }, r);
  for (; i < n; ++i) best = (x[i] != x[i] || x[i] > best) ? x[i] : best;  // NaN wins
  return best;
}

// The compute type of storage type T: double for double, float otherwise
// (float16 / bfloat16 are computed in float; they are not the speed target).
template <typename T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// A line of storage type T, elements `stride` apart, copied into a contiguous row
// of compute type S, and back.
template <typename T, typename S>
inline void load_line(const T* src, S* dst, int64_t n, int64_t stride = 1) {
  if (stride == 1 && !std::is_same_v<T, S>) {
    at::vec::convert(src, dst, n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<S>(src[i * stride]);
  }
}
template <typename S, typename T>
inline void store_line(const S* src, T* dst, int64_t n, int64_t stride = 1) {
  if (stride == 1 && !std::is_same_v<T, S>) {
    at::vec::convert(src, dst, n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i * stride] = static_cast<T>(src[i]);
  }
}

// A contiguous row of storage type T seen as compute type S: the storage itself
// when T == S, else a scratch copy (RowIn converts on get, RowOut converts back on put).
template <typename T, typename S>
struct RowIn {
  static constexpr bool kSame = std::is_same_v<T, S>;
  std::vector<S> buf;
  explicit RowIn(int64_t n) : buf(kSame ? 0 : n) {}
  const S* get(const T* p) {
    if constexpr (kSame) {
      return p;
    } else {
      load_line(p, buf.data(), static_cast<int64_t>(buf.size()));
      return buf.data();
    }
  }
};
template <typename T, typename S>
struct RowOut {
  static constexpr bool kSame = std::is_same_v<T, S>;
  std::vector<S> buf;
  T* dst = nullptr;
  explicit RowOut(int64_t n) : buf(kSame ? 0 : n) {}
  S* get(T* p) {
    dst = p;
    if constexpr (kSame)
      return p;
    else
      return buf.data();
  }
  void put() {
    if constexpr (!kSame) store_line(buf.data(), dst, static_cast<int64_t>(buf.size()));
  }
};

// fn(T{}) with T the storage type of dt.
template <typename F>
inline void dispatch_dtype(DType dt, F&& fn) {
  switch (dt) {
    case DType::Float32:
      fn(float{});
      break;
    case DType::Float64:
      fn(double{});
      break;
    case DType::Float16:
      fn(c10::Half{});
      break;
    case DType::BFloat16:
      fn(c10::BFloat16{});
      break;
  }
}

}  // namespace vec_loops
}  // namespace GP_CPU_NS
}  // namespace gpu_puzzles
