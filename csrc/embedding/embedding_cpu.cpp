// embedding CPU kernels. The forward copies rows, tokens spread over threads.
// The backward first groups the tokens by vocabulary row (a counting sort that
// keeps token order within a row), then writes every row of grad_weight once,
// rows spread over threads: zeros, or its tokens' gradients summed in token
// order, so the result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/cpu_grain.h"
#include "embedding/embedding.h"

namespace gpu_puzzles {
namespace {

template <typename T, typename I>
void forward(const I* idx, const T* w, T* out, int64_t T_, int64_t V, int64_t E) {
  at::parallel_for(0, T_, grain_rows(E), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t v = static_cast<int64_t>(idx[t]);
      T* dst = out + t * E;
      if (v >= 0 && v < V)
        std::memcpy(dst, w + v * E, E * sizeof(T));
      else
        std::fill(dst, dst + E, T(0));
    }
  });
}

// Tokens grouped by row: the tokens of row v are pos[start[v] .. start[v + 1]),
// in token order. Out-of-range and padding tokens are left out.
template <typename I>
void group_by_row(const I* idx, int64_t T_, int64_t V, int64_t pad, std::vector<int64_t>& start,
                  std::vector<int64_t>& pos) {
  start.assign(static_cast<size_t>(V + 1), 0);
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t v = static_cast<int64_t>(idx[t]);
    if (v >= 0 && v < V && v != pad) ++start[v + 1];
  }
  for (int64_t v = 0; v < V; ++v) start[v + 1] += start[v];
  pos.resize(static_cast<size_t>(start[V]));
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t v = static_cast<int64_t>(idx[t]);
    if (v >= 0 && v < V && v != pad) pos[next[v]++] = t;
  }
}

// Zeros by plain vector stores. The zero comes from a volatile so that the
// compiler cannot turn the loop into a memset call, whose rep stosb at row
// sizes is slower on freshly mapped pages (a new grad_weight) than these stores.
template <typename T>
void zero_row(T* p, int64_t n) {
  volatile int zero = 0;
  const T z = static_cast<T>(zero);
  for (int64_t i = 0; i < n; ++i) p[i] = z;
}

template <typename T, typename I>
void backward(const T* g, const I* idx, T* gw, int64_t T_, int64_t V, int64_t E, int64_t pad) {
  using A = at::opmath_type<T>;
  std::vector<int64_t> start, pos;
  group_by_row(idx, T_, V, pad, start, pos);
  at::parallel_for(0, V, grain_rows(E), [&](int64_t begin, int64_t end) {
    // Half types sum in float here, then round once.
    std::vector<A> acc(std::is_same<T, A>::value ? 0 : E);
    for (int64_t v = begin; v < end; ++v) {
      T* dst = gw + v * E;
      const int64_t* p = pos.data() + start[v];
      const int64_t n = start[v + 1] - start[v];
      if (n == 0) {
        zero_row(dst, E);
      } else if constexpr (std::is_same<T, A>::value) {
        std::memcpy(dst, g + p[0] * E, E * sizeof(T));
        for (int64_t k = 1; k < n; ++k) {
          const T* src = g + p[k] * E;
          for (int64_t e = 0; e < E; ++e) dst[e] += src[e];
        }
      } else {
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t k = 0; k < n; ++k) {
          const T* src = g + p[k] * E;
          for (int64_t e = 0; e < E; ++e) acc[e] += static_cast<A>(src[e]);
        }
        for (int64_t e = 0; e < E; ++e) dst[e] = static_cast<T>(acc[e]);
      }
    }
  });
}

}  // namespace

void embedding_forward_cpu_kernel(const at::Tensor& indices, const at::Tensor& weight, const at::Tensor& out) {
  const int64_t V = weight.size(0), E = weight.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "embedding_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "embedding_cpu", [&] {
      forward<scalar_t, index_t>(indices.const_data_ptr<index_t>(), weight.const_data_ptr<scalar_t>(),
                                 out.data_ptr<scalar_t>(), indices.numel(), V, E);
    });
  });
}

void embedding_backward_cpu_kernel(const at::Tensor& grad_out, const at::Tensor& indices, const at::Tensor& grad_weight,
                                   int64_t padding_idx) {
  const int64_t V = grad_weight.size(0), E = grad_weight.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(), "embedding_backward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "embedding_backward_cpu", [&] {
      backward<scalar_t, index_t>(grad_out.const_data_ptr<scalar_t>(), indices.const_data_ptr<index_t>(),
                                  grad_weight.data_ptr<scalar_t>(), indices.numel(), V, E, padding_idx);
    });
  });
}

}  // namespace gpu_puzzles
