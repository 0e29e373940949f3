// Internal to attention_fwd_sm80.cu and attention_bwd_sm80.cu: the tensor-core
// (mma.sync, sm_80+) building blocks of the fp16/bf16 kernels. Operands are staged in
// padded shared memory (row stride D + 8 halves, so the 8 row addresses of one ldmatrix
// hit 8 different 16-byte bank groups) and read as fragments with ldmatrix; the
// accumulators are fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_common.cuh"
#include "common/cp_async.cuh"

namespace gpu_puzzles {
namespace {  // one copy per .cu file

// PTX fragment layouts used below (mma.m16n8k16, 16-bit inputs; g = lane >> 2,
// t = lane & 3; each 32-bit register holds two consecutive-column elements, the
// lower column in the low half):
//   A (16x16, row-major): a0 = A[g][2t..2t+1],   a1 = A[g+8][2t..2t+1],
//                         a2 = A[g][2t+8..+9],   a3 = A[g+8][2t+8..+9]
//   B (16x8, "col"):      b0 = B[2t..2t+1][g],   b1 = B[2t+8..+9][g]   (k index first)
//   C (16x8, fp32):       c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
// ldmatrix.x4: lanes 8i..8i+7 give the 8 row addresses (16 bytes each) of matrix
// i, and register ri of lane l receives M_i[l>>2][2(l&3)..+1]; with .trans it
// receives M_i[2(l&3)][l>>2], M_i[2(l&3)+1][l>>2].
// Hence, for an operand stored row-major in shared memory X[row][col]:
//  * A fragment of rows r0..r0+15, cols k0..k0+15 (ldsm_A):
//      lane l points at X[r0 + (l & 15)][k0 + (l >> 4) * 8]
//      (matrices: rows 0-7/cols 0-7 -> a0, rows 8-15/cols 0-7 -> a1, rows 0-7/cols 8-15 -> a2, rows 8-15/cols 8-15 ->
//      a3)
//  * B fragments with B[kk][n] = X[n][kk] (X = K for Q K^T), two n-tiles n0..n0+15 (ldsm_Bt):
//      lane l points at X[n0 + (l & 7) + ((l >> 4) << 3)][k0 + ((l >> 3) & 1) * 8]
//      r0 = b0 (n-tile 0), r1 = b1 (n-tile 0), r2 = b0 (n-tile 1), r3 = b1 (n-tile 1)
//      (b0 = B[2t..][g] = X[g][2t..], a plain row read of X)
//  * B fragments with B[kk][n] = X[kk][n] (X = V for P V), k rows k0..k0+15, two n-tiles n0..n0+15
//    (ldsm_Bn, .trans):
//      lane l points at X[k0 + (l & 7) + ((l >> 3) & 1) * 8][n0 + (l >> 4) * 8]
//      r0 = b0 (n-tile 0), r1 = b1 (n-tile 0), r2 = b0 (n-tile 1), r3 = b1 (n-tile 1)
//      (.trans gives X[k0+2t][n0+g], X[k0+2t+1][n0+g] = b0)
//  * An fp32 accumulator C (16 x 2*8*j ...) becomes the A operand of the next mma
//    for k-step kk (columns 16kk..16kk+15 = n-tiles 2kk, 2kk+1):
//      a0 = pack(C[2kk][0], C[2kk][1]), a1 = pack(C[2kk][2], C[2kk][3]),
//      a2 = pack(C[2kk+1][0], C[2kk+1][1]), a3 = pack(C[2kk+1][2], C[2kk+1][3]).

// smem_addr, cp.async and its groups: common/cp_async.cuh.

// Four 8x8 b16 matrices from shared memory, transposed with kTrans.
template <bool kTrans>
__device__ __forceinline__ void ldsm_x4_impl(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) { ldsm_x4_impl<false>(r, addr); }
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) { ldsm_x4_impl<true>(r, addr); }

// One mma.sync.m16n8k16 (fp32 accumulate), C += A B, 16-bit inputs of PTX type TY
// ("f16" | "bf16"); ASM is `asm volatile` or plain `asm`.
#define GP_ATTN_MMA_16816(ASM, TY)                          \
  ASM("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY    \
      ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, " \
      "{%0, %1, %2, %3};\n"                                 \
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])      \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <typename T>
struct MmaOp {
  static_assert(is_half_type<T>(), "mma.sync kernels take fp16 / bf16");
  static constexpr bool kHalf = std::is_same<T, __half>::value;
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (kHalf) {
      GP_ATTN_MMA_16816(asm volatile, "f16");
    } else {
      GP_ATTN_MMA_16816(asm volatile, "bf16");
    }
#endif
  }
  // Same, not volatile: a pure register op the compiler may schedule freely (attn_fwd_mma_r32).
  static __device__ __forceinline__ void run_nv(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (kHalf) {
      GP_ATTN_MMA_16816(asm, "f16");
    } else {
      GP_ATTN_MMA_16816(asm, "bf16");
    }
#endif
  }
  // Two floats as one 32-bit register of T (lo in the low 16 bits).
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    if constexpr (kHalf) {
      __half2 h = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&h);
    } else {
      __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&h);
    }
  }
  // The A operand of k-step kk from fp32 accumulator n-tiles c[2kk], c[2kk + 1] (above).
  template <int NT>
  static __device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c)[NT][4], int kk) {
    a[0] = pack(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
};

#undef GP_ATTN_MMA_16816

// Grid row bh's heads hd and the first rows of q's head hd.h (qb) and of k's and v's head
// hd.hk (kb, vb).
template <typename T>
struct QkvHeads {
  HeadIdx hd;
  const T *qb, *kb, *vb;
};
template <typename T>
__device__ __forceinline__ QkvHeads<T> qkv_heads(const Rows<const T>& q, const Rows<const T>& k, const Rows<const T>& v,
                                                 int64_t bh, int64_t H, int64_t G) {
  const HeadIdx hd(bh, H, G);
  return {hd, q.head(hd.b, hd.h), k.head(hd.b, hd.hk), v.head(hd.b, hd.hk)};
}

// Copy rows [row0, row0 + ROWS) of an (S, D) matrix whose rows are ld elements apart into
// smem with row stride LDS elements; rows >= S are zero-filled. NT threads cooperate.
template <int ROWS, int D, int LDS, int NT, typename T>
__device__ __forceinline__ void load_tile_async(T* __restrict__ dst, const T* __restrict__ src, int64_t ld,
                                                int64_t row0, int64_t S, int tid) {
  load_rows_async<ROWS, D, NT>([dst](int r, int c) { return dst + r * LDS + c; }, src, ld, row0, S, tid);
}

}  // namespace
}  // namespace gpu_puzzles
