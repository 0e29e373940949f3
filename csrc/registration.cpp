// Every schema of the gpu_puzzles library, in one place, and the Python module
// init. Kernels are registered per backend next to their code
// (TORCH_LIBRARY_IMPL in csrc/<op>/<op>.cpp); Python adds fake kernels and
// autograd in gpu_puzzles/ops/<op>.py.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// An empty module: importing gpu_puzzles._C loads this library, whose static
// initialisers register the ops with the dispatcher. No pybind11 needed.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(gpu_puzzles, m) {
  // ---- conv1d ------------------------------------------------------------
  // algorithm: "auto" (fastest for the shape), "fast" (vector + warp-shuffle
  // halo, K <= 9), "tiled" (shared-memory tile with halo), "naive" (one thread
  // per output). The latter two are the curriculum's steps, kept for the notebook.
  m.def("conv1d(Tensor x, Tensor weight, Tensor? bias=None, bool causal=False, str algorithm=\"auto\") -> Tensor");
  m.def("conv1d_backward(Tensor grad_out, Tensor x, Tensor weight, bool causal, str algorithm=\"auto\") -> (Tensor, Tensor, Tensor)");

  // ---- embedding ---------------------------------------------------------
  // embedding: the coalesced kernel; embedding_2d: the seed's 16x16 2D grid,
  // kept as the counter-example. Out-of-range indices give zero rows and no
  // gradient; padding_idx as in F.embedding. The backward returns the dense
  // (num_weights, E) weight gradient; deterministic=True forces a bit-identical
  // path (the coalesced op's backward always is).
  m.def("embedding(Tensor indices, Tensor weight, int? padding_idx=None) -> Tensor");
  m.def("embedding_2d(Tensor indices, Tensor weight, int? padding_idx=None) -> Tensor");
  m.def("embedding_backward(Tensor grad_out, Tensor indices, SymInt num_weights, int? padding_idx, bool deterministic) -> Tensor");
  m.def("embedding_2d_backward(Tensor grad_out, Tensor indices, SymInt num_weights, int? padding_idx, bool deterministic) -> Tensor");

  // ---- softmax -----------------------------------------------------------
  // algorithm: "auto" (fastest for the shape), or the curriculum's steps kept for
  // the notebook: "tree" (the seed's shared-memory tree reduction), "shuffle"
  // (warp-shuffle reduction), "online" (single-pass running max and sum).
  // The backward takes the forward's output, not its input.
  m.def("softmax(Tensor x, int dim=-1, str algorithm=\"auto\") -> Tensor");
  m.def("log_softmax(Tensor x, int dim=-1, str algorithm=\"auto\") -> Tensor");
  m.def("softmax_backward(Tensor grad_out, Tensor out, int dim, str algorithm=\"auto\") -> Tensor");
  m.def("log_softmax_backward(Tensor grad_out, Tensor out, int dim, str algorithm=\"auto\") -> Tensor");

  // ---- layernorm_linear ----------------------------------------------------
  // layer_norm returns (y, mean, rstd); mean/rstd are float32 (float64 for a
  // float64 x), shaped like x without its last dim, and feed the backward.
  m.def("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps=1e-05) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)");
  // y = linear_weight @ layer_norm(x) + linear_bias, without writing layer_norm(x); returns (y, mean, rstd).
  m.def("fused_layernorm_linear(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor linear_weight, Tensor? linear_bias=None, float eps=1e-05) -> (Tensor, Tensor, Tensor)");
  // -> (dx, d ln_weight, d ln_bias, d linear_weight, d linear_bias)
  m.def("fused_layernorm_linear_backward(Tensor grad_out, Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor linear_weight, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The curriculum's kernel (one thread per row computes everything), forward only, for the notebook.
  m.def("fused_layernorm_linear_naive(Tensor x, Tensor ln_weight, Tensor ln_bias, Tensor linear_weight, Tensor? linear_bias=None, float eps=1e-05) -> Tensor");

  // ---- attention -----------------------------------------------------------
  // softmax(q k^T * scale) v; scale=None means 1/sqrt(D); causal is SDPA's
  // is_causal (key j visible to query i iff j <= i). Returns (out, lse): lse is
  // the log-sum-exp of each query row's scaled scores (float32, float64 for a
  // float64 q), saved for the backward so the S x S probabilities never exist.
  m.def("attention(Tensor q, Tensor k, Tensor v, float? scale=None, bool causal=False) -> (Tensor, Tensor)");
  // -> (dq, dk, dv)
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float? scale, bool causal) -> (Tensor, Tensor, Tensor)");
  // The curriculum's chain (attention_unfused in Python): our transpose, our
  // tiled matmul, the softmax op, our matmul. matmul is batched (..., M, K) @
  // (..., K, N) times alpha; causal_mask writes -inf where col > row.
  m.def("transpose_last2(Tensor x) -> Tensor");
  m.def("matmul(Tensor a, Tensor b, float alpha=1.0, bool causal_mask=False) -> Tensor");
}
