// Host helpers for calling a torch-free CUDA launcher from ATen code: the op
// runs under a device guard, on PyTorch's current stream (required for CUDA
// graphs and torch.compile(mode="reduce-overhead")), and every launch's status
// is turned into a Python exception.
#pragma once
#ifdef WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#define GP_CUDA_CHECK_STATUS(status) C10_CUDA_CHECK(static_cast<cudaError_t>(status))

namespace gpu_puzzles {
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
}  // namespace gpu_puzzles
#endif
