// One line per op registers its CPU kernel and, in CUDA builds, its CUDA kernel:
//   TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) { GP_IMPL(m, "conv1d", conv1d_cpu, conv1d_cuda); }
// (a fragment takes a dispatch key per kernel; the schemas stay in registration.cpp).
// Without CUDA the CUDA name is never expanded, so it need not exist.
#pragma once
#include <torch/library.h>

#ifdef WITH_CUDA
#define GP_IMPL(m, name, cpu_fn, cuda_fn)                              \
  do {                                                                 \
    (m).impl(name, torch::dispatch(c10::DispatchKey::CPU, &cpu_fn));   \
    (m).impl(name, torch::dispatch(c10::DispatchKey::CUDA, &cuda_fn)); \
  } while (0)
#else
#define GP_IMPL(m, name, cpu_fn, cuda_fn) (m).impl(name, torch::dispatch(c10::DispatchKey::CPU, &cpu_fn))
#endif
