// Interface between embedding.cpp (host checks) and the kernels: embedding_cpu.cpp,
// and the torch-free embedding_cuda.cu (at::Tensor is only declared here).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dtype.h"
#include "common/row_strides.h"

namespace at {
class Tensor;
}

namespace gpu_puzzles {

// CPU kernels (embedding_cpu.cpp) on contiguous tensors: indices int32 or
// int64 (T tokens, any shape), weight (V, E), out (T, E) and grad_out (T, E)
// of one floating dtype, grad_weight (V, E) written whole; padding_idx in
// [0, V) or -1 for none.
void embedding_forward_cpu_kernel(const at::Tensor& indices, const at::Tensor& weight, const at::Tensor& out);
void embedding_backward_cpu_kernel(const at::Tensor& grad_out, const at::Tensor& indices, const at::Tensor& grad_weight,
                                   int64_t padding_idx);

// out[t, :] = weight[idx[t], :] for idx[t] in [0, V), else zeros.
// idx: T int32 (idx64 = false) or int64 values, token t at row_offset(is, t) (index views
// such as input_ids[:, :-1] are read in place); weight (V, E) with rows
// every w_stride elements; out (T, E) contiguous.
struct EmbeddingFwdArgs {
  const void* idx;
  bool idx64;
  const void* weight;
  void* out;
  int64_t T, V, E;
  DType dtype;
  RowStrides is;
  int64_t w_stride;
};

// Coalesced: a group of lanes per token row, 16-byte vectors when E and the
// pointers allow it.
LaunchStatus embedding_forward_cuda(const EmbeddingFwdArgs& a, cudaStream_t stream);
// The seed's 2D grid: 16x16 blocks, x over tokens, y over the embedding dim.
LaunchStatus embedding_forward_2d_cuda(const EmbeddingFwdArgs& a, cudaStream_t stream);

// Sorted-segment backward (deterministic): the host sorts the indices (stable)
// and passes the sorted keys and their token positions.
// Entries of the sorted array are cut into tiles of kEmbTile; grad rows of a
// segment that lies inside one tile are summed straight into grad_weight, the
// rest leave per-tile partial sums that a second pass adds in tile order.
constexpr int64_t kEmbTile = 16;

struct EmbeddingBwdArgs {
  const void* grad_out;       // T rows of E, row t at row_offset(gs, t); weight dtype
  const int64_t* sorted_key;  // (T,) ascending, stable
  const int64_t* sorted_pos;  // (T,) token position of each sorted key
  int64_t* seg;               // (V, 2) workspace: [start, end) of each valid key's run
  void* partial;              // (2 * tiles, E) accumulate-type workspace
  void* grad_weight;          // (V, E), weight dtype; every element is written
  int64_t T, V, E;
  int64_t padding_idx;  // normalised to [0, V), or -1 for none
  DType dtype;
  RowStrides gs;
};

// Elements of the accumulate type the partial workspace needs.
int64_t embedding_backward_partial_elems(int64_t T, int64_t E);

LaunchStatus embedding_backward_sorted_cuda(const EmbeddingBwdArgs& a, cudaStream_t stream);

// The 2D kernel's own backward: the same 16x16 grid, one atomicAdd per
// (token, element) into an accumulate-type (V, E) buffer (zeroed here), then
// converted to grad_weight (acc may alias grad_weight when the dtypes match).
// Not deterministic: the host uses the sorted path when determinism is asked for.
LaunchStatus embedding_backward_2d_atomic_cuda(const void* grad_out, const void* idx, bool idx64, void* acc,
                                               void* grad_weight, int64_t T, int64_t V, int64_t E, int64_t padding_idx,
                                               DType dtype, cudaStream_t stream);

}  // namespace gpu_puzzles
