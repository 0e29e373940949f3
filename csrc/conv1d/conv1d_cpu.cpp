// conv1d CPU kernels. Each (batch, channel) row is one contiguous run of L
// values: the loops run along it (taps unrolled for small K), which the
// compiler vectorises; rows are spread over threads. The weight gradient is
// summed per row, then over the batch in a fixed order, so it does not depend
// on the thread count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "common/cpu_grain.h"
#include "conv1d/conv1d.h"

namespace gpu_puzzles {
namespace {

// Outputs per block of the generic (any K) row kernel: its accumulators stay in L1.
constexpr int64_t kBlock = 512;
// Widest kernel with its taps unrolled into one pass.
constexpr int kMaxUnrolledK = 8;

// out[i] = b + sum_j x[i - shift + j] * w[j] for one output i, taps outside [0, L) skipped.
template <typename T, typename A>
A edge_output(const T* x, const A* w, A b, int64_t L, int64_t K, int64_t shift, int64_t i) {
  A s = b;
  for (int64_t j = std::max<int64_t>(0, shift - i); j < std::min<int64_t>(K, L - i + shift); ++j)
    s += w[j] * static_cast<A>(x[i - shift + j]);
  return s;
}

// One row, K = KS known at compile time: one pass over the interior (every tap
// in range) with the taps in registers, the K - 1 edge outputs by edge_output.
template <int KS, typename T, typename A>
void conv_row_fixed(const T* x, const A* w, A b, T* out, int64_t L, int64_t /*K*/, int64_t shift, A* /*scratch*/) {
  A wr[KS];
  for (int j = 0; j < KS; ++j) wr[j] = w[j];
  const int64_t lo = std::min(L, shift);
  const int64_t hi = std::max(lo, L - KS + 1 + shift);
  for (int64_t i = 0; i < lo; ++i) out[i] = static_cast<T>(edge_output(x, wr, b, L, KS, shift, i));
  if (hi > lo) {  // then lo == shift
    const T* xs = x + (lo - shift);
    T* o = out + lo;
    for (int64_t i = 0; i < hi - lo; ++i) {
      A s = b;
      for (int j = 0; j < KS; ++j) s += wr[j] * static_cast<A>(xs[i + j]);
      o[i] = static_cast<T>(s);
    }
  }
  for (int64_t i = hi; i < L; ++i) out[i] = static_cast<T>(edge_output(x, wr, b, L, KS, shift, i));
}

// One row, any K: blocks of kBlock outputs, one pass per tap over the block's
// accumulators (scratch, kBlock entries); each tap's range is clipped to [0, L).
template <typename T, typename A>
void conv_row_generic(const T* x, const A* w, A b, T* out, int64_t L, int64_t K, int64_t shift, A* acc) {
  for (int64_t i0 = 0; i0 < L; i0 += kBlock) {
    const int64_t n = std::min(kBlock, L - i0);
    std::fill(acc, acc + n, b);
    for (int64_t j = 0; j < K; ++j) {
      const int64_t off = i0 + j - shift;  // x index of acc[0]'s tap j
      const int64_t lo = std::clamp<int64_t>(-off, 0, n), hi = std::clamp<int64_t>(L - off, lo, n);
      const A wj = w[j];
      for (int64_t i = lo; i < hi; ++i) acc[i] += wj * static_cast<A>(x[off + i]);
    }
    for (int64_t i = 0; i < n; ++i) out[i0 + i] = static_cast<T>(acc[i]);
  }
}

template <typename T, typename A>
using RowKernel = void (*)(const T*, const A*, A, T*, int64_t, int64_t, int64_t, A*);

template <typename T, typename A, int KS = 1>
RowKernel<T, A> row_kernel(int64_t K) {
  if constexpr (KS > kMaxUnrolledK) {
    return conv_row_generic<T, A>;
  } else {
    return K == KS ? conv_row_fixed<KS, T, A> : row_kernel<T, A, KS + 1>(K);
  }
}

// Sum over i < n of f(i) in 16 independent lanes (vectorisable without
// reassociation, and more accurate than one running sum), lanes added pairwise.
template <typename A, typename F>
A lane_sum(int64_t n, F f) {
  constexpr int W = 16;
  A lane[W] = {};
  int64_t i = 0;
  for (; i + W <= n; i += W)
    for (int l = 0; l < W; ++l) lane[l] += f(i + l);
  for (int l = 0; i < n; ++i, ++l) lane[l] += f(i);
  for (int w = W / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

struct Rows {
  int64_t rows, C, L, K;
};

Rows rows_of(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t L = x.size(-1), K = weight.size(-1);
  return {L == 0 ? 0 : x.numel() / L, weight.numel() / K, L, K};
}

// The taps in the accumulate type, each channel's reversed when flip is set.
template <typename T, typename A>
std::vector<A> taps(const T* w, const Rows& s, bool flip) {
  std::vector<A> out(static_cast<size_t>(s.C * s.K));
  for (int64_t c = 0; c < s.C; ++c)
    for (int64_t j = 0; j < s.K; ++j) out[c * s.K + j] = static_cast<A>(w[c * s.K + (flip ? s.K - 1 - j : j)]);
  return out;
}

template <typename T>
void forward(const T* x, const T* w, const T* bias, T* out, const Rows& s, int64_t shift) {
  using A = at::opmath_type<T>;
  const std::vector<A> wa = taps<T, A>(w, s, false);
  const RowKernel<T, A> row = row_kernel<T, A>(s.K);
  at::parallel_for(0, s.rows, grain_rows(s.L * s.K), [&](int64_t begin, int64_t end) {
    std::vector<A> scratch(s.K > kMaxUnrolledK ? kBlock : 0);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t c = r % s.C;
      row(x + r * s.L, wa.data() + c * s.K, bias ? static_cast<A>(bias[c]) : A(0), out + r * s.L, s.L, s.K, shift,
          scratch.data());
    }
  });
}

// dx is the forward of dy with the taps reversed and the opposite alignment;
// each row also leaves its K tap sums and its bias sum in part, (rows, K + 1),
// which are then added over the batch in order.
template <typename T>
void backward(const T* dy, const T* x, const T* w, T* dx, T* dw, T* db, const Rows& s, int64_t shift) {
  using A = at::opmath_type<T>;
  const std::vector<A> wflip = taps<T, A>(w, s, true);
  const RowKernel<T, A> row = row_kernel<T, A>(s.K);
  const int64_t K1 = s.K + 1;
  std::vector<A> part(static_cast<size_t>(s.rows * K1));
  at::parallel_for(0, s.rows, grain_rows(s.L * s.K), [&](int64_t begin, int64_t end) {
    std::vector<A> scratch(s.K > kMaxUnrolledK ? kBlock : 0);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = dy + r * s.L;
      const T* xr = x + r * s.L;
      row(g, wflip.data() + (r % s.C) * s.K, A(0), dx + r * s.L, s.L, s.K, s.K - 1 - shift, scratch.data());
      A* p = part.data() + r * K1;
      for (int64_t j = 0; j < s.K; ++j) {
        const int64_t off = j - shift;  // dw[j] pairs dy[i] with x[i + off]
        const int64_t lo = std::clamp<int64_t>(-off, 0, s.L), hi = std::clamp<int64_t>(s.L - off, lo, s.L);
        const T* gs = g + lo;
        const T* xs = xr + lo + off;
        p[j] = lane_sum<A>(hi - lo, [&](int64_t i) { return static_cast<A>(gs[i]) * static_cast<A>(xs[i]); });
      }
      p[s.K] = lane_sum<A>(s.L, [&](int64_t i) { return static_cast<A>(g[i]); });
    }
  });
  const int64_t B = s.C == 0 ? 0 : s.rows / s.C;
  at::parallel_for(0, s.C, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, B * K1)), [&](int64_t begin, int64_t end) {
    std::vector<A> acc(static_cast<size_t>(K1));
    for (int64_t c = begin; c < end; ++c) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < K1; ++j) acc[j] += part[(b * s.C + c) * K1 + j];
      for (int64_t j = 0; j < s.K; ++j) dw[c * s.K + j] = static_cast<T>(acc[j]);
      db[c] = static_cast<T>(acc[s.K]);
    }
  });
}

}  // namespace

void conv1d_forward_cpu_kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& out, bool causal) {
  const Rows s = rows_of(x, weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "conv1d_cpu", [&] {
    forward<scalar_t>(x.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
                      bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), s,
                      causal ? s.K - 1 : 0);
  });
}

void conv1d_backward_cpu_kernel(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& dx, const at::Tensor& dw, const at::Tensor& db, bool causal) {
  const Rows s = rows_of(x, weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "conv1d_backward_cpu", [&] {
    backward<scalar_t>(grad_out.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                       weight.const_data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), dw.data_ptr<scalar_t>(),
                       db.data_ptr<scalar_t>(), s, causal ? s.K - 1 : 0);
  });
}

}  // namespace gpu_puzzles
