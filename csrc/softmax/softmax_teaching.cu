// The curriculum's softmax kernels (algorithm tree / shuffle / online): one block
// per row of a contiguous last dim, looping over the row (the host moves another
// dim last first). For the notebook, not for speed.
#include "softmax/softmax_kernels.cuh"

namespace gpu_puzzles {
namespace {

using namespace softmax_detail;

// ---- the curriculum's steps: one block per row, looping over the row --------
template <typename T, int ALGO, bool BWD>
__global__ void __launch_bounds__(kLoopThreads) looped_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                                              T* __restrict__ out, int64_t rows, int64_t N, bool log) {
  using A = acc_t<T>;
  __shared__ A buf[kLoopThreads];
  __shared__ A red[33];
  const int t = threadIdx.x;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* ar = a + row * N;
    T* outr = out + row * N;
    if constexpr (!BWD) {
      A m = neg_inf<A>(), s = A(0);
      if (ALGO == int(SoftmaxAlgo::Online)) {
        for (int64_t i = t; i < N; i += kLoopThreads) online_add(m, s, to_acc<A>(ar[i]));
        block_merge(m, s, red);
      } else {
        for (int64_t i = t; i < N; i += kLoopThreads) m = max_a(m, to_acc<A>(ar[i]));
        m = ALGO == int(SoftmaxAlgo::Tree) ? tree_reduce<true>(m, buf) : block_max(m, red);
        for (int64_t i = t; i < N; i += kLoopThreads) s += exp_a(to_acc<A>(ar[i]) - m);
        s = ALGO == int(SoftmaxAlgo::Tree) ? tree_reduce<false>(s, buf) : block_sum(s, red);
      }
      const A sub = log ? log_a(s) : A(0);
      const A mul = A(1) / s;
      for (int64_t i = t; i < N; i += kLoopThreads) {
        const A x = to_acc<A>(ar[i]);
        outr[i] = from_acc<T>(log ? x - m - sub : exp_a(x - m) * mul);
      }
    } else {
      const T* br = b + row * N;
      A s = A(0);
      for (int64_t i = t; i < N; i += kLoopThreads) s += log ? to_acc<A>(br[i]) : to_acc<A>(ar[i]) * to_acc<A>(br[i]);
      s = ALGO == int(SoftmaxAlgo::Tree) ? tree_reduce<false>(s, buf) : block_sum(s, red);
      for (int64_t i = t; i < N; i += kLoopThreads) {
        const A y = to_acc<A>(ar[i]), g = to_acc<A>(br[i]);
        outr[i] = from_acc<T>(log ? g - exp_a(y) * s : y * (g - s));
      }
    }
  }
}

}  // namespace

namespace softmax_detail {

cudaError_t launch_teaching(const SoftmaxArgs& a, SoftmaxAlgo algo, cudaStream_t st, bool bwd) {
  if (a.inner != 1) return cudaErrorInvalidValue;  // the host moves the dim last first
  const unsigned g = grid_for(a.outer);
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* A_ = static_cast<const T*>(a.a);
    const T* B_ = static_cast<const T*>(a.b);
    T* O = static_cast<T*>(a.out);
    auto launch = [&](auto kernel) { kernel<<<g, kLoopThreads, 0, st>>>(A_, B_, O, a.outer, a.N, a.log); };
    constexpr int kTree = int(SoftmaxAlgo::Tree), kShuffle = int(SoftmaxAlgo::Shuffle),
                  kOnline = int(SoftmaxAlgo::Online);
    if (algo == SoftmaxAlgo::Tree)
      launch(bwd ? looped_kernel<T, kTree, true> : looped_kernel<T, kTree, false>);
    else if (algo == SoftmaxAlgo::Shuffle)
      launch(bwd ? looped_kernel<T, kShuffle, true> : looped_kernel<T, kShuffle, false>);
    else
      launch(bwd ? looped_kernel<T, kOnline, true> : looped_kernel<T, kOnline, false>);
    return cudaGetLastError();
  });
}

}  // namespace softmax_detail
}  // namespace gpu_puzzles
