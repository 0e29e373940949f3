// Internal to the sm_90a attention files (attention_fwd_sm90.cu, attention_bwd_sm90.cu):
// what both build on top of CuTe.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "attention/attention.h"

namespace gpu_puzzles {
namespace {

// Two floats to one register of 16-bit values (lo in the low half): a wgmma A-operand register.
template <class Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same<Elem, cutlass::bfloat16_t>::value) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    std::memcpy(&r, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    std::memcpy(&r, &h, 4);
  }
  return r;
}

// Named barrier id (0 is __syncthreads') over n threads, a multiple of 32: wait for all, or
// only arrive (release to the waiters, no wait). The memory clobber keeps the compiler from
// moving loads and stores across (CUTLASS's NamedBarrier has none, and renumbers the ids).
__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// A (S, D, heads, batch) view of one operand for the TMA. The host gives a dim of extent 1
// stride 0 (attention.cpp: kernel_strides); the descriptor gets 16 bytes there instead (its
// coordinate is always 0).
template <int D, class Elem>
auto tma_view(const void* p, int64_t S, int64_t heads, int64_t batch, const AttnStrides& st) {
  using namespace cute;
  const auto nz = [](int64_t stride, int64_t extent) { return extent == 1 ? int64_t{8} : stride; };
  return make_tensor(make_gmem_ptr(static_cast<const Elem*>(p)),
                     make_shape(static_cast<int>(S), Int<D>{}, static_cast<int>(heads), static_cast<int>(batch)),
                     make_stride(nz(st.s, S), Int<1>{}, nz(st.h, heads), nz(st.b, batch)));
}

// The TMA's limits on an operand: strides multiples of 16 bytes below 2^40 bytes, none 0
// on a dim of extent > 1 (an expanded tensor), extents below 2^31.
inline bool tma_operand_ok(const AttnStrides& st, int64_t S, int64_t heads, int64_t batch) {
  const auto ok = [](int64_t stride, int64_t extent) {
    return extent == 1 || (stride > 0 && (stride * 2) % 16 == 0 && stride * 2 < (int64_t{1} << 40));
  };
  const int64_t lim = int64_t{1} << 31;
  return ok(st.s, S) && ok(st.h, heads) && ok(st.b, batch) && S < lim && heads < lim && batch < lim;
}

// Accumulator values to 16-bit wgmma A-operand registers (value 2i low half, 2i + 1 high half):
// the forward's P, the backward's P^T and dS^T, each reused as the RS A operand of the next GEMM.
template <class Elem, class TC, class TA>
__device__ __forceinline__ void pack_a(const TC& acc, TA& frag) {
  cute::Tensor f32 = cute::recast<uint32_t>(frag);
#pragma unroll
  for (int i = 0; i < cute::size(f32); ++i) f32(i) = pack2<Elem>(acc(2 * i), acc(2 * i + 1));
}

// C = A B over the k-blocks of two partitioned wgmma operands (mode 2), C's old values
// dropped: the first k-block overwrites, the rest accumulate. Issue only: the caller brackets
// it with warpgroup_arrive / commit and waits.
template <int KBlocks, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void gemm_fresh(Mma& mma, const TA& a, const TB& b, TC& c) {
  mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
#pragma unroll
  for (int kb = 0; kb < KBlocks; ++kb) {
    cute::gemm(mma, a(cute::_, cute::_, kb), b(cute::_, cute::_, kb), c);
    mma.accumulate_ = cute::GMMA::ScaleOut::One;
  }
}

// Constexpr layout checks, on rows and columns that set every bit the 128-byte swizzle reads
// and cross each atom edge.
template <int Rows, int Cols, class F>
constexpr bool for_sample_cells(F&& agree) {
  constexpr int rows[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 63, Rows / 2, Rows - 1};
  constexpr int cols[] = {0, 1, 7, 8, 9, 16, 24, 31, 32, 56, 63, Cols / 2 + 1, Cols - 8, Cols - 1};
  for (int r : rows)
    for (int c : cols)
      if (!agree(r, c)) return false;
  return true;
}

// A K-major (rows x cols) tile, 128-byte swizzle, as the TMA writes it, is the MN-major
// (cols x rows) operand view KMajor's transpose: element (r, c) at the same offset.
template <class KMajor, class MNMajor, int Rows, int Cols>
constexpr bool transposed_views_agree() {
  return for_sample_cells<Rows, Cols>(
      [](int r, int c) { return static_cast<int>(KMajor{}(r, c)) == static_cast<int>(MNMajor{}(c, r)); });
}

// Stage s of a TMA ring (rows x cols x stages) holds element (r, c) where a one-stage tile
// One puts it, s whole tiles on.
template <class Ring, class One, int Rows, int Cols, int Stages>
constexpr bool ring_stages_agree() {
  for (int s = 0; s < Stages; ++s)
    if (!for_sample_cells<Rows, Cols>([s](int r, int c) {
          return static_cast<int>(Ring{}(r, c, s)) == s * Rows * Cols + static_cast<int>(One{}(r, c));
        }))
      return false;
  return true;
}

}  // namespace
}  // namespace gpu_puzzles
