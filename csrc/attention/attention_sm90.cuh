// Internal to the sm_90a attention files: what they build on top of CuTe.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "attention/attention.h"

namespace gpu_puzzles {
namespace {

// Two floats to one register of 16-bit values (lo in the low half): a wgmma A-operand register.
template <class Elem> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
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

}  // namespace
}  // namespace gpu_puzzles
