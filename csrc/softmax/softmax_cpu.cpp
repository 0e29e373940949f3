// softmax / log_softmax CPU kernels, compiled once per SIMD level (common/cpu_isa.h).
// The tensor is (outer, N, inner), N the reduced dim.
//   inner == 1: one contiguous row per task step, Vectorized passes over the row
//               (max; exp and sum; scale), the row staying in L1 between passes;
//   inner > 1 : a block of up to kColBlock adjacent columns at a time, the same
//               passes vectorised across the columns (every load contiguous).
// float32 and float64 run on their own storage (float64 in double throughout,
// gradcheck's precision); float16 / bfloat16 lines, and columns narrower than a
// vector, go through a contiguous scratch row.
// Row sums are vector partials added in double per chunk (vec_loops::vsum).
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "common/cpu_vec.h"
#include "softmax/softmax.h"

namespace gpu_puzzles {
namespace GP_CPU_NS {
namespace {

using namespace vec_loops;

constexpr int64_t kColVecs = 4;  // vectors per column block

// ---- rows (contiguous) ---------------------------------------------------------

template <typename S>
void forward_row(const S* x, S* y, int64_t N, bool log) {
  using V = Vectorized<S>;
  const S m = row_max(x, N);
  const V vm(m);
  if (log) {
    const double s = vsum<S>(
        N, [&](int64_t i) { return (V::loadu(x + i) - vm).exp(); }, [&](int64_t i) { return std::exp(x[i] - m); });
    // (x - m) - log(s): x - (m + log(s)) would round log(s) to the ulp of m.
    const S ls = static_cast<S>(std::log(s));
    const V vls(ls);
    vfor<S>(N, [&](int64_t i) { (V::loadu(x + i) - vm - vls).store(y + i); }, [&](int64_t i) { y[i] = x[i] - m - ls; });
  } else {
    const double s = vsum<S>(
        N,
        [&](int64_t i) {
          const V e = (V::loadu(x + i) - vm).exp();
          e.store(y + i);
          return e;
        },
        [&](int64_t i) { return y[i] = std::exp(x[i] - m); });
    const S r = static_cast<S>(1.0 / s);
    const V vr(r);
    vfor<S>(N, [&](int64_t i) { (V::loadu(y + i) * vr).store(y + i); }, [&](int64_t i) { y[i] *= r; });
  }
}

// softmax: dx = y (dy - sum(dy y));  log_softmax: dx = dy - exp(y) sum(dy).
template <typename S>
void backward_row(const S* dy, const S* y, S* dx, int64_t N, bool log) {
  using V = Vectorized<S>;
  if (log) {
    const S s =
        static_cast<S>(vsum<S>(N, [&](int64_t i) { return V::loadu(dy + i); }, [&](int64_t i) { return dy[i]; }));
    const V vs(s);
    vfor<S>(
        N, [&](int64_t i) { (V::loadu(dy + i) - V::loadu(y + i).exp() * vs).store(dx + i); },
        [&](int64_t i) { dx[i] = dy[i] - std::exp(y[i]) * s; });
  } else {
    const S s = static_cast<S>(vsum<S>(
        N, [&](int64_t i) { return V::loadu(dy + i) * V::loadu(y + i); }, [&](int64_t i) { return dy[i] * y[i]; }));
    const V vs(s);
    vfor<S>(
        N, [&](int64_t i) { (V::loadu(y + i) * (V::loadu(dy + i) - vs)).store(dx + i); },
        [&](int64_t i) { dx[i] = y[i] * (dy[i] - s); });
  }
}

// ---- column blocks (inner > 1) ------------------------------------------------
// Columns j0 .. j0 + bw of one outer slice; element (n, j) at p[n * inner + j].
// The statistics live in kColVecs vectors; a partial vector covers the block's tail.

template <typename S>
struct ColBlock {
  using V = Vectorized<S>;
  static constexpr int64_t W = V::size();
  static constexpr int64_t B = kColVecs * W;
  int64_t bw, inner;
  V load(const S* p, int64_t k) const {
    const int64_t c = bw - k * W;
    return c >= W ? V::loadu(p + k * W) : V::loadu(p + k * W, c);
  }
  void store(const V& v, S* p, int64_t k) const {
    const int64_t c = bw - k * W;
    if (c >= W)
      v.store(p + k * W);
    else
      v.store(p + k * W, c);
  }
  int64_t vecs() const { return (bw + W - 1) / W; }
};

// Column sums over N rows: vector partials flushed into double every kSumChunk rows.
template <typename S>
struct ColSum {
  using V = Vectorized<S>;
  V acc[kColVecs];
  double total[kColVecs * V::size()];
  int64_t rows = 0;
  ColSum() {
    for (auto& a : acc) a = V(S(0));
    std::fill(std::begin(total), std::end(total), 0.0);
  }
  void add(const V& v, int64_t k) { acc[k] += v; }
  void end_row() {
    if (++rows % kSumChunk == 0) flush();
  }
  void flush() {
    for (int64_t k = 0; k < kColVecs; ++k) {
      S tmp[V::size()];
      acc[k].store(tmp);
      for (int64_t l = 0; l < V::size(); ++l) total[k * V::size() + l] += static_cast<double>(tmp[l]);
      acc[k] = V(S(0));
    }
  }
  V get(int64_t k, bool inverse) {
    flush();
    S tmp[V::size()];
    for (int64_t l = 0; l < V::size(); ++l) {
      const double t = total[k * V::size() + l];
      tmp[l] = static_cast<S>(inverse ? 1.0 / t : t);
    }
    return V::loadu(tmp);
  }
};

template <typename S>
void forward_cols(const S* x, S* y, int64_t N, const ColBlock<S>& cb, bool log) {
  using V = Vectorized<S>;
  const int64_t nv = cb.vecs(), in = cb.inner;
  V m[kColVecs];
  for (int64_t k = 0; k < nv; ++k) m[k] = cb.load(x, k);
  for (int64_t n = 1; n < N; ++n)
    for (int64_t k = 0; k < nv; ++k) m[k] = at::vec::maximum(m[k], cb.load(x + n * in, k));
  ColSum<S> s;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < nv; ++k) {
      const V e = (cb.load(x + n * in, k) - m[k]).exp();
      if (!log) cb.store(e, y + n * in, k);
      s.add(e, k);
    }
    s.end_row();
  }
  if (log) {
    V ls[kColVecs];
    for (int64_t k = 0; k < nv; ++k) ls[k] = s.get(k, false).log();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < nv; ++k) cb.store(cb.load(x + n * in, k) - m[k] - ls[k], y + n * in, k);
  } else {
    V r[kColVecs];
    for (int64_t k = 0; k < nv; ++k) r[k] = s.get(k, true);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < nv; ++k) cb.store(cb.load(y + n * in, k) * r[k], y + n * in, k);
  }
}

template <typename S>
void backward_cols(const S* dy, const S* y, S* dx, int64_t N, const ColBlock<S>& cb, bool log) {
  using V = Vectorized<S>;
  const int64_t nv = cb.vecs(), in = cb.inner;
  ColSum<S> s;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < nv; ++k) {
      const V g = cb.load(dy + n * in, k);
      s.add(log ? g : g * cb.load(y + n * in, k), k);
    }
    s.end_row();
  }
  V t[kColVecs];
  for (int64_t k = 0; k < nv; ++k) t[k] = s.get(k, false);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < nv; ++k) {
      const V g = cb.load(dy + n * in, k), v = cb.load(y + n * in, k);
      cb.store(log ? g - v.exp() * t[k] : v * (g - t[k]), dx + n * in, k);
    }
}

// ---- drivers --------------------------------------------------------------------

// Float32 / float64 storage: rows or column blocks, in parallel.
template <typename S>
void run_native(const SoftmaxArgs& a, bool backward) {
  const S* p = static_cast<const S*>(a.a);
  const S* q = static_cast<const S*>(a.b);
  S* out = static_cast<S*>(a.out);
  const int64_t N = a.N, inner = a.inner;
  if (inner == 1) {
    at::parallel_for(0, a.outer, grain_rows(N), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        if (backward)
          backward_row<S>(q + r * N, p + r * N, out + r * N, N, a.log);
        else
          forward_row<S>(p + r * N, out + r * N, N, a.log);
      }
    });
    return;
  }
  constexpr int64_t B = ColBlock<S>::B;
  const int64_t blocks = (inner + B - 1) / B;
  at::parallel_for(0, a.outer * blocks, grain_rows(N * std::min(inner, B)), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t o = t / blocks, j0 = (t % blocks) * B;
      const ColBlock<S> cb{std::min(B, inner - j0), inner};
      const int64_t off = o * N * inner + j0;
      if (backward)
        backward_cols<S>(q + off, p + off, out + off, N, cb, a.log);
      else
        forward_cols<S>(p + off, out + off, N, cb, a.log);
    }
  });
}

// Float16 / bfloat16, and columns narrower than a vector: each line (N elements,
// `inner` apart) through a contiguous scratch row of the compute type.
template <typename T>
void run_lines(const SoftmaxArgs& a, bool backward) {
  using S = compute_t<T>;
  const T* p = static_cast<const T*>(a.a);
  const T* q = static_cast<const T*>(a.b);
  T* out = static_cast<T*>(a.out);
  const int64_t N = a.N, inner = a.inner;
  at::parallel_for(0, a.outer * inner, grain_rows(N), [&](int64_t lo, int64_t hi) {
    std::vector<S> buf((backward ? 3 : 2) * N);
    S *fa = buf.data(), *fo = fa + N, *fb = fo + N;
    for (int64_t l = lo; l < hi; ++l) {
      const int64_t base = (l / inner) * N * inner + l % inner;
      load_line(p + base, fa, N, inner);
      if (backward) {
        load_line(q + base, fb, N, inner);
        backward_row<S>(fb, fa, fo, N, a.log);
      } else {
        forward_row<S>(fa, fo, N, a.log);
      }
      store_line(fo, out + base, N, inner);
    }
  });
}

template <typename T>
void run(const SoftmaxArgs& a, bool backward) {
  constexpr bool kNative = std::is_same_v<T, float> || std::is_same_v<T, double>;
  if constexpr (kNative) {
    if (a.inner == 1 || a.inner >= Vectorized<T>::size()) return run_native<T>(a, backward);
  }
  run_lines<T>(a, backward);
}

}  // namespace

void softmax_forward_cpu(const SoftmaxArgs& a) {
  dispatch_dtype(a.dtype, [&](auto t) { run<decltype(t)>(a, false); });
}

void softmax_backward_cpu(const SoftmaxArgs& a) {
  dispatch_dtype(a.dtype, [&](auto t) { run<decltype(t)>(a, true); });
}

}  // namespace GP_CPU_NS
}  // namespace gpu_puzzles
