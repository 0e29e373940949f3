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
}
