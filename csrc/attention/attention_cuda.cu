// Fused (flash-style) attention on CUDA: out = softmax(q k^T * scale) v.
//
// Never materialises the S x S scores: keys/values stream through shared memory
// in tiles, the softmax is computed online (running max m and running sum l per
// query row), and the forward writes lse = m + log(l) per row so the backward can
// recompute the probabilities P = exp(s - lse) tile by tile. Extra memory: O(S).
//
// Two kernel families:
//  * Tensor cores (fp16/bf16, D == Dv in {64, 128}, 16-byte aligned, sm_80+):
//    FlashAttention-2 structure with mma.sync.m16n8k16 (fp32 accumulate) and
//    ldmatrix fragments from padded shared memory (row stride D+8 halves, so the
//    8 row addresses of one ldmatrix hit 8 different 16-byte bank groups).
//    forward : attn_fwd_tc2 (default): 32 query rows per warp (two m16 tiles, so each
//              K/V fragment read from shared memory feeds two mma), 4 warps = 128 rows
//              per block, 32- or 64-key K/V tiles double-buffered with cp.async (tile
//              j+1 loads during tile j, one barrier per tile); the tiling is a template
//              and GPU_PUZZLES_ATTN_FWD_CFG picks a configuration (see fwd_cfg).
//              attn_fwd_tc ("old"): 16 rows per warp, 8 warps (4 with the env knob
//              GPU_PUZZLES_ATTN_FWD_WARPS=4), Q fragments held in registers,
//              64-key K/V tiles loaded with cp.async (V(j) overlaps S = Q K(j)^T,
//              K(j+1) overlaps O += P V(j)). Both: P goes from the S accumulators
//              straight into the A operand of the P V mma.
//    backward: deterministic, no atomics, two passes after delta = rowsum(dO * O):
//              dK/dV pass: block = 64 keys (16 per warp), loops over 32-query tiles
//                (double-buffered cp.async): S^T = K Q^T, P^T = exp2(S^T - lse),
//                dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
//              dQ pass: block = 64 queries (Q, dO fragments in registers), loops over
//                32-key tiles (double-buffered): S = Q K^T, P, dP = dO V^T, dS, dQ += dS K.
//              The dQ pass recomputes S and dP (7 instead of 5 GEMMs) in exchange
//              for determinism and no fp32 dq accumulator.
//  * SIMT (any dtype, any D, Dv <= 256; fp32 math for half types, fp64 for fp64):
//    one lane per key (forward, dQ) or per query (dK/dV) for the dot products, one
//    lane per output column for the accumulation; same tiling/online softmax.
//
// Masking: key j of query i is visible iff j < Sk and (!causal || j <= i) (SDPA
// is_causal, top-left aligned). Tiles wholly above the diagonal are skipped, so a
// causal run does about half the work. Tails of Sq/Sk are zero-filled on load and
// masked to -inf; rows past Sq are computed on zeros and never stored.
// All global offsets are 64-bit. Launchers are async: no syncs, no allocations.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attention/attention.h"
#include "common/cp_async.cuh"
#include "common/device.cuh"
#include "common/func_attr.h"
#if defined(GPU_PUZZLES_WITH_SM90A)
#include "attention/attention_fwd_sm90.h"
#endif

namespace gpu_puzzles {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int64_t kMaxGridY = 65535;

template <typename A> __device__ __forceinline__ A neg_inf() { return -static_cast<A>(INFINITY); }

// =============================================================================
// SIMT kernels (generic path)
// =============================================================================
// Block = 4 warps. RPW rows (queries or keys) per warp; NC = 32-wide column
// chunks per lane (covers max(D, Dv) <= 32 * NC). KT = 32: one lane per key (or
// query) of the streamed tile. Tiles of the streamed operand are padded by one
// element per row so that lane-per-row dot products are bank-conflict free.
constexpr int kSimtWarps = 4;
constexpr int kSimtT = 32;

template <typename T, typename A, int NC, int RPW>
__global__ void __launch_bounds__(kSimtWarps * 32)
attn_fwd_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
              A* __restrict__ lse, int64_t bh0, int64_t Sq, int64_t Sk, int D, int Dv, A scale, bool causal) {
  constexpr int BM = kSimtWarps * RPW;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* Qs = reinterpret_cast<A*>(smem_raw);  // [BM][D]
  A* Ks = Qs + BM * D;                      // [KT][D+1]
  A* Vs = Ks + kSimtT * (D + 1);            // [KT][Dv]

  const int64_t bh = bh0 + blockIdx.y;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const T* qb = q + bh * Sq * D;
  const T* kb = k + bh * Sk * D;
  const T* vb = v + bh * Sk * Dv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int idx = tid; idx < BM * D; idx += blockDim.x) {
    const int r = idx / D, c = idx - r * D;
    const int64_t row = m0 + r;
    Qs[idx] = row < Sq ? to_acc<A>(qb[row * D + c]) : A(0);
  }

  A m[RPW], l[RPW], acc[RPW][NC];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    m[rr] = neg_inf<A>();
    l[rr] = A(0);
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[rr][c] = A(0);
  }

  const int64_t row_end = std::min<int64_t>(m0 + BM, Sq);  // exclusive
  const int64_t n_end = causal ? std::min<int64_t>(Sk, row_end) : Sk;
  for (int64_t n0 = 0; n0 < n_end; n0 += kSimtT) {
    __syncthreads();  // previous tile fully consumed (and Qs written, first time)
    for (int idx = tid; idx < kSimtT * D; idx += blockDim.x) {
      const int j = idx / D, c = idx - j * D;
      const int64_t key = n0 + j;
      Ks[j * (D + 1) + c] = key < Sk ? to_acc<A>(kb[key * D + c]) : A(0);
    }
    for (int idx = tid; idx < kSimtT * Dv; idx += blockDim.x) {
      const int j = idx / Dv;
      const int64_t key = n0 + j;
      Vs[idx] = key < Sk ? to_acc<A>(vb[key * Dv + (idx - j * Dv)]) : A(0);
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      const int r = warp * RPW + rr;
      const int64_t row = m0 + r;
      const int64_t key = n0 + lane;
      A s = A(0);
      const A* qr = Qs + r * D;
      const A* kr = Ks + lane * (D + 1);
      for (int c = 0; c < D; ++c) s += qr[c] * kr[c];
      s *= scale;
      const bool valid = key < Sk && (!causal || key <= row);
      s = valid ? s : neg_inf<A>();
      const A mn = max(m[rr], warp_max(s));
      if (mn == neg_inf<A>()) continue;  // warp-uniform: nothing visible yet
      const A alpha = exp(m[rr] - mn);   // m = -inf -> 0
      const A p = valid ? exp(s - mn) : A(0);
      l[rr] = l[rr] * alpha + warp_sum(p);
      m[rr] = mn;
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[rr][c] *= alpha;
      for (int jj = 0; jj < kSimtT; ++jj) {
        const A pj = __shfl_sync(kFull, p, jj);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int d = lane + 32 * c;
          if (d < Dv) acc[rr][c] += pj * Vs[jj * Dv + d];
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int64_t row = m0 + warp * RPW + rr;
    if (row >= Sq) continue;
    const A inv = l[rr] > A(0) ? A(1) / l[rr] : A(0);  // l == 0 only when Sk == 0
    T* orow = o + (bh * Sq + row) * Dv;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int d = lane + 32 * c;
      if (d < Dv) orow[d] = from_acc<T>(acc[rr][c] * inv);
    }
    if (lane == 0) lse[bh * Sq + row] = l[rr] > A(0) ? m[rr] + log(l[rr]) : neg_inf<A>();
  }
}

// delta[i] = sum_d dout[i, d] * o[i, d]: one warp per row. Shared by both paths.
template <typename T, typename A>
__global__ void __launch_bounds__(128)
attn_bwd_delta(const T* __restrict__ o, const T* __restrict__ dout, A* __restrict__ delta, int64_t rows, int Dv) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warp leaves together
  const T* orow = o + row * Dv;
  const T* drow = dout + row * Dv;
  A s = A(0);
  for (int d = lane; d < Dv; d += 32) s += to_acc<A>(orow[d]) * to_acc<A>(drow[d]);
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// dQ = scale * sum_j dS_ij k_j, dS = P (dP - delta), one block per query tile.
template <typename T, typename A, int NC, int RPW>
__global__ void __launch_bounds__(kSimtWarps * 32)
attn_bwd_dq_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 const T* __restrict__ dout, const A* __restrict__ lse, const A* __restrict__ delta,
                 T* __restrict__ dq, int64_t bh0, int64_t Sq, int64_t Sk, int D, int Dv, A scale, bool causal) {
  constexpr int BM = kSimtWarps * RPW;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* Qs = reinterpret_cast<A*>(smem_raw);  // [BM][D]
  A* dOs = Qs + BM * D;                     // [BM][Dv]
  A* Ks = dOs + BM * Dv;                    // [KT][D+1]
  A* Vs = Ks + kSimtT * (D + 1);            // [KT][Dv+1]

  const int64_t bh = bh0 + blockIdx.y;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const T* qb = q + bh * Sq * D;
  const T* dob = dout + bh * Sq * Dv;
  const T* kb = k + bh * Sk * D;
  const T* vb = v + bh * Sk * Dv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int idx = tid; idx < BM * D; idx += blockDim.x) {
    const int r = idx / D;
    const int64_t row = m0 + r;
    Qs[idx] = row < Sq ? to_acc<A>(qb[row * D + (idx - r * D)]) : A(0);
  }
  for (int idx = tid; idx < BM * Dv; idx += blockDim.x) {
    const int r = idx / Dv;
    const int64_t row = m0 + r;
    dOs[idx] = row < Sq ? to_acc<A>(dob[row * Dv + (idx - r * Dv)]) : A(0);
  }
  A lse_r[RPW], dl_r[RPW], acc[RPW][NC];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int64_t row = m0 + warp * RPW + rr;
    lse_r[rr] = row < Sq ? lse[bh * Sq + row] : A(0);
    dl_r[rr] = row < Sq ? delta[bh * Sq + row] : A(0);
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[rr][c] = A(0);
  }

  const int64_t row_end = std::min<int64_t>(m0 + BM, Sq);
  const int64_t n_end = causal ? std::min<int64_t>(Sk, row_end) : Sk;
  for (int64_t n0 = 0; n0 < n_end; n0 += kSimtT) {
    __syncthreads();
    for (int idx = tid; idx < kSimtT * D; idx += blockDim.x) {
      const int j = idx / D, c = idx - j * D;
      const int64_t key = n0 + j;
      Ks[j * (D + 1) + c] = key < Sk ? to_acc<A>(kb[key * D + c]) : A(0);
    }
    for (int idx = tid; idx < kSimtT * Dv; idx += blockDim.x) {
      const int j = idx / Dv, c = idx - j * Dv;
      const int64_t key = n0 + j;
      Vs[j * (Dv + 1) + c] = key < Sk ? to_acc<A>(vb[key * Dv + c]) : A(0);
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      const int r = warp * RPW + rr;
      const int64_t row = m0 + r;
      const int64_t key = n0 + lane;
      A s = A(0), dp = A(0);
      const A* qr = Qs + r * D;
      const A* kr = Ks + lane * (D + 1);
      for (int c = 0; c < D; ++c) s += qr[c] * kr[c];
      const A* dr = dOs + r * Dv;
      const A* vr = Vs + lane * (Dv + 1);
      for (int c = 0; c < Dv; ++c) dp += dr[c] * vr[c];
      const bool valid = row < Sq && key < Sk && (!causal || key <= row);
      const A p = valid ? exp(s * scale - lse_r[rr]) : A(0);
      const A ds = p * (dp - dl_r[rr]);
      for (int jj = 0; jj < kSimtT; ++jj) {
        const A dsj = __shfl_sync(kFull, ds, jj);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int d = lane + 32 * c;
          if (d < D) acc[rr][c] += dsj * Ks[jj * (D + 1) + d];
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int64_t row = m0 + warp * RPW + rr;
    if (row >= Sq) continue;
    T* out = dq + (bh * Sq + row) * D;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int d = lane + 32 * c;
      if (d < D) out[d] = from_acc<T>(acc[rr][c] * scale);
    }
  }
}

// dV = sum_i P_ij dout_i, dK = scale * sum_i dS_ij q_i, one block per key tile.
template <typename T, typename A, int NC, int RPW>
__global__ void __launch_bounds__(kSimtWarps * 32)
attn_bwd_dkdv_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   const T* __restrict__ dout, const A* __restrict__ lse, const A* __restrict__ delta,
                   T* __restrict__ dk, T* __restrict__ dv, int64_t bh0, int64_t Sq, int64_t Sk, int D, int Dv,
                   A scale, bool causal) {
  constexpr int BN = kSimtWarps * RPW;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* Ks = reinterpret_cast<A*>(smem_raw);  // [BN][D]
  A* Vs = Ks + BN * D;                      // [BN][Dv]
  A* Qs = Vs + BN * Dv;                     // [QT][D+1]
  A* dOs = Qs + kSimtT * (D + 1);           // [QT][Dv+1]
  A* Ls = dOs + kSimtT * (Dv + 1);          // [QT]
  A* Dl = Ls + kSimtT;                      // [QT]

  const int64_t bh = bh0 + blockIdx.y;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
  const T* qb = q + bh * Sq * D;
  const T* dob = dout + bh * Sq * Dv;
  const T* kb = k + bh * Sk * D;
  const T* vb = v + bh * Sk * Dv;
  const A* lb = lse + bh * Sq;
  const A* db = delta + bh * Sq;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int idx = tid; idx < BN * D; idx += blockDim.x) {
    const int r = idx / D;
    const int64_t key = n0 + r;
    Ks[idx] = key < Sk ? to_acc<A>(kb[key * D + (idx - r * D)]) : A(0);
  }
  for (int idx = tid; idx < BN * Dv; idx += blockDim.x) {
    const int r = idx / Dv;
    const int64_t key = n0 + r;
    Vs[idx] = key < Sk ? to_acc<A>(vb[key * Dv + (idx - r * Dv)]) : A(0);
  }
  A dk_acc[RPW][NC], dv_acc[RPW][NC];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr)
#pragma unroll
    for (int c = 0; c < NC; ++c) dk_acc[rr][c] = dv_acc[rr][c] = A(0);

  // Causal: queries i < n0 see none of this block's keys.
  const int64_t q_begin = causal ? (n0 / kSimtT) * kSimtT : 0;
  for (int64_t q0 = q_begin; q0 < Sq; q0 += kSimtT) {
    __syncthreads();
    for (int idx = tid; idx < kSimtT * D; idx += blockDim.x) {
      const int i = idx / D, c = idx - i * D;
      const int64_t qi = q0 + i;
      Qs[i * (D + 1) + c] = qi < Sq ? to_acc<A>(qb[qi * D + c]) : A(0);
    }
    for (int idx = tid; idx < kSimtT * Dv; idx += blockDim.x) {
      const int i = idx / Dv, c = idx - i * Dv;
      const int64_t qi = q0 + i;
      dOs[i * (Dv + 1) + c] = qi < Sq ? to_acc<A>(dob[qi * Dv + c]) : A(0);
    }
    if (tid < kSimtT) {
      const int64_t qi = q0 + tid;
      Ls[tid] = qi < Sq ? lb[qi] : A(0);
      Dl[tid] = qi < Sq ? db[qi] : A(0);
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      const int r = warp * RPW + rr;
      const int64_t key = n0 + r;
      const int64_t qi = q0 + lane;
      A s = A(0), dp = A(0);
      const A* qr = Qs + lane * (D + 1);
      const A* kr = Ks + r * D;
      for (int c = 0; c < D; ++c) s += qr[c] * kr[c];
      const A* dr = dOs + lane * (Dv + 1);
      const A* vr = Vs + r * Dv;
      for (int c = 0; c < Dv; ++c) dp += dr[c] * vr[c];
      const bool valid = qi < Sq && key < Sk && (!causal || key <= qi);
      const A p = valid ? exp(s * scale - Ls[lane]) : A(0);
      const A ds = p * (dp - Dl[lane]);
      for (int ii = 0; ii < kSimtT; ++ii) {
        const A pi = __shfl_sync(kFull, p, ii);
        const A dsi = __shfl_sync(kFull, ds, ii);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int d = lane + 32 * c;
          if (d < Dv) dv_acc[rr][c] += pi * dOs[ii * (Dv + 1) + d];
          if (d < D) dk_acc[rr][c] += dsi * Qs[ii * (D + 1) + d];
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int64_t key = n0 + warp * RPW + rr;
    if (key >= Sk) continue;
    T* dkr = dk + (bh * Sk + key) * D;
    T* dvr = dv + (bh * Sk + key) * Dv;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int d = lane + 32 * c;
      if (d < D) dkr[d] = from_acc<T>(dk_acc[rr][c] * scale);
      if (d < Dv) dvr[d] = from_acc<T>(dv_acc[rr][c]);
    }
  }
}

// =============================================================================
// Tensor-core kernels (fp16 / bf16, sm_80+)
// =============================================================================
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
//      (matrices: rows 0-7/cols 0-7 -> a0, rows 8-15/cols 0-7 -> a1, rows 0-7/cols 8-15 -> a2, rows 8-15/cols 8-15 -> a3)
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

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

template <typename T> struct MmaOp;
template <> struct MmaOp<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
  // Same, not volatile: a pure register op the compiler may schedule freely (attn_fwd_tc2).
  static __device__ __forceinline__ void run_nv(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <> struct MmaOp<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
  // Same, not volatile: a pure register op the compiler may schedule freely (attn_fwd_tc2).
  static __device__ __forceinline__ void run_nv(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// Copy rows [row0, row0 + ROWS) of a row-major (S, D) matrix into smem with row
// stride LDS elements; rows >= S are zero-filled. NT threads cooperate.
template <int ROWS, int D, int LDS, int NT, typename T>
__device__ __forceinline__ void load_tile_async(T* __restrict__ dst, const T* __restrict__ src, int64_t row0,
                                                int64_t S, int tid) {
  load_rows_async<ROWS, D, NT>([dst](int r, int c) { return dst + r * LDS + c; }, src, row0, S, tid);
}

// 2^x with one MUFU.EX2: flushes subnormal results to 0 (probabilities below 2^-126 of
// the row max) and skips exp2f's subnormal-range fix-up; 2^-inf = 0. attn_fwd_tc2 only.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr int kTcWarps = 4;
constexpr int kTcThreads = kTcWarps * 32;

// ---- forward ----------------------------------------------------------------
// WARPS warps x 16 query rows per block. 8 warps (128 rows) halve the K/V bytes
// streamed from L2 per FLOP compared with 4 (at 64 rows, 64 keys and D = 128 a
// block does 64 FLOP per byte loaded, which at 300 TFLOP/s is ~4.7 TB/s of L2).
constexpr int kFwdBN = 64;  // keys per tile

template <int D, int WARPS> constexpr int tc_fwd_smem_bytes() { return (16 * WARPS + 2 * kFwdBN) * (D + 8) * 2; }

template <typename T, int D, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
attn_fwd_tc(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
            float* __restrict__ lse, int64_t bh0, int64_t Sq, int64_t Sk, float scale_log2, bool causal) {
  constexpr int BM = 16 * WARPS;  // query rows per block (16 per warp)
  constexpr int NT = WARPS * 32;
  constexpr int LDS = D + 8;
  constexpr int NKT = kFwdBN / 8;  // S n-tiles (keys)
  constexpr int NDT = D / 8;       // O n-tiles (head dim)
  constexpr int KD = D / 16;       // k-steps over the head dim
  using Mma = MmaOp<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);  // [BM][LDS]
  T* Ks = Qs + BM * LDS;                // [BN][LDS]
  T* Vs = Ks + kFwdBN * LDS;                // [BN][LDS]

  const int64_t bh = bh0 + blockIdx.y;
  // Causal: heaviest query tiles (largest m0) first, for a better tail.
  const int64_t mblk = causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int64_t m0 = mblk * BM;
  const T* qb = q + bh * Sq * D;
  const T* kb = k + bh * Sk * D;
  const T* vb = v + bh * Sk * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;

  const int64_t row_end = std::min<int64_t>(m0 + BM, Sq);
  const int64_t n_end = causal ? std::min<int64_t>(Sk, row_end) : Sk;
  const int n_tiles = static_cast<int>((n_end + kFwdBN - 1) / kFwdBN);

  load_tile_async<BM, D, LDS, NT>(Qs, qb, m0, Sq, tid);
  if (n_tiles > 0) load_tile_async<kFwdBN, D, LDS, NT>(Ks, kb, 0, Sk, tid);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t qf[KD][4];
#pragma unroll
  for (int kk = 0; kk < KD; ++kk)
    ldsm_x4(qf[kk], smem_addr(Qs + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8));

  float acc[NDT][4];
#pragma unroll
  for (int i = 0; i < NDT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m_r[2] = {-INFINITY, -INFINITY};  // running max (log2 domain), rows g and g+8
  float l_r[2] = {0.f, 0.f};              // per-lane partial row sums
  const int64_t row_g[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};

  for (int j = 0; j < n_tiles; ++j) {
    const int64_t n0 = static_cast<int64_t>(j) * kFwdBN;
    // Invariant: K(j) resident and visible; every warp is done with V(j-1).
    load_tile_async<kFwdBN, D, LDS, NT>(Vs, vb, n0, Sk, tid);
    cp_async_commit();

    float s[NKT][4];
#pragma unroll
    for (int i = 0; i < NKT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
      for (int np = 0; np < NKT / 2; ++np) {
        uint32_t b[4];
        ldsm_x4(b, smem_addr(Ks + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 +
                             ((lane >> 3) & 1) * 8));
        Mma::run(s[2 * np], qf[kk], b[0], b[1]);
        Mma::run(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }

    // Scale into the log2 domain and mask: key tail, and above the diagonal.
    const bool need_mask = (n0 + kFwdBN > Sk) || (causal && n0 + kFwdBN - 1 > m0);
#pragma unroll
    for (int nt = 0; nt < NKT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * scale_log2;
        if (need_mask) {
          const int64_t col = n0 + nt * 8 + 2 * t + (e & 1);
          const int64_t row = row_g[e >> 1];
          if (col >= Sk || (causal && col > row)) x = -INFINITY;
        }
        s[nt][e] = x;
      }

    // Online softmax on rows g (e = 0, 1) and g + 8 (e = 2, 3).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m_r[h];
#pragma unroll
      for (int nt = 0; nt < NKT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
      mx = quad_max(mx);
      const float base = mx == -INFINITY ? 0.f : mx;  // row still fully masked
      const float alpha = exp2f(m_r[h] - base);       // old max -inf -> 0
      m_r[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NKT; ++nt) {
        s[nt][2 * h] = exp2f(s[nt][2 * h] - base);
        s[nt][2 * h + 1] = exp2f(s[nt][2 * h + 1] - base);
        sum += s[nt][2 * h] + s[nt][2 * h + 1];
      }
      l_r[h] = l_r[h] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < NDT; ++dt) {
        acc[dt][2 * h] *= alpha;
        acc[dt][2 * h + 1] *= alpha;
      }
    }

    __syncthreads();  // every warp is done reading K(j)
    if (j + 1 < n_tiles) load_tile_async<kFwdBN, D, LDS, NT>(Ks, kb, n0 + kFwdBN, Sk, tid);
    cp_async_commit();  // possibly empty group: keeps the wait counts uniform
    cp_async_wait<1>();  // V(j) has landed
    __syncthreads();

#pragma unroll
    for (int kk = 0; kk < NKT / 2; ++kk) {
      uint32_t pa[4];
      pa[0] = Mma::pack(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = Mma::pack(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = Mma::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = Mma::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < NDT / 2; ++dp) {
        uint32_t b[4];
        ldsm_x4_trans(b, smem_addr(Vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + dp * 16 +
                                   (lane >> 4) * 8));
        Mma::run(acc[2 * dp], pa, b[0], b[1]);
        Mma::run(acc[2 * dp + 1], pa, b[2], b[3]);
      }
    }
    cp_async_wait<0>();  // K(j+1) has landed
    __syncthreads();     // ... is visible, and every warp is done with V(j)
  }

  // Epilogue: O / l, lse = (m + log2 l) * ln2 (natural log).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(l_r[h]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t row = row_g[h];
    if (row < Sq) {
      T* orow = o + (bh * Sq + row) * D;
#pragma unroll
      for (int dt = 0; dt < NDT; ++dt) {
        const uint32_t pk = Mma::pack(acc[dt][2 * h] * inv, acc[dt][2 * h + 1] * inv);
        *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) = pk;
      }
      if (t == 0) lse[bh * Sq + row] = l > 0.f ? (m_r[h] + log2f(l)) * kLn2 : -INFINITY;
    }
  }
}

// ---- forward, v2 (configurable) -----------------------------------------------
// Same math and masking as attn_fwd_tc, with the tiling as template parameters:
//   RPW    query rows per warp, 16 or 32. At 32 each warp holds two m16 tiles, so every
//          K / V B-fragment read by ldmatrix feeds two mma instead of one: half the
//          shared-memory traffic per FLOP (at 16 rows, smem bandwidth caps mma.sync).
//   BN     keys per K/V tile, 32 or 64 (S accumulators: RPW/16 * BN/2 floats per lane).
//   WARPS  4 or 8; BM = RPW * WARPS query rows per block.
//   STAGES 2: K/V double-buffered; tile j+1 is fetched (cp.async) during all of tile
//          j's compute, one __syncthreads per tile. 1: the single-buffer schedule of
//          attn_fwd_tc (V(j) overlaps S = Q K(j)^T, K(j+1) overlaps O += P V(j)).
// Q fragments are held in registers when they fit in 32 registers (RPW = 16, or D = 64);
// otherwise (RPW = 32, D = 128) they are re-read from shared memory at each k-step, as
// O (MT * D/2 floats) + S (MT * BN/2 floats) already use most of the register file.
// Causal: a warp whose rows all precede a tile's first key skips that tile's math (it
// still joins the loads and barriers); only tiles that cross the diagonal or the key
// tail are masked. Warps whose rows are all past Sq skip the math too (never stored).
template <int D, int RPW, int BN, int WARPS, int STAGES> constexpr int tc_fwd2_smem_bytes() {
  return (RPW * WARPS + STAGES * 2 * BN) * (D + 8) * 2;
}

template <typename T, int D, int RPW, int BN, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32)
attn_fwd_tc2(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
             float* __restrict__ lse, int64_t bh0, int64_t Sq, int64_t Sk, float scale_log2, bool causal) {
  static_assert(RPW == 16 || RPW == 32, "RPW");
  static_assert(BN == 32 || BN == 64, "BN");
  static_assert(STAGES == 1 || STAGES == 2, "STAGES");
  constexpr int MT = RPW / 16;     // m16 tiles per warp
  constexpr int BM = RPW * WARPS;  // query rows per block
  constexpr int NT = WARPS * 32;
  constexpr int LDS = D + 8;
  constexpr int NKT = BN / 8;  // S n-tiles (keys)
  constexpr int NDT = D / 8;   // O n-tiles (head dim)
  constexpr int KD = D / 16;   // k-steps over the head dim
  constexpr bool QREG = MT * KD * 4 <= 32;
  using Mma = MmaOp<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);  // [BM][LDS]
  T* Ks = Qs + BM * LDS;                   // [STAGES][BN][LDS]
  T* Vs = Ks + STAGES * BN * LDS;          // [STAGES][BN][LDS]

  const int64_t bh = bh0 + blockIdx.y;
  const int64_t mblk = causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;  // heaviest first
  const int64_t m0 = mblk * BM;
  const T* qb = q + bh * Sq * D;
  const T* kb = k + bh * Sk * D;
  const T* vb = v + bh * Sk * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t wrow0 = m0 + warp * RPW;  // this warp's first query row

  const int64_t row_end = std::min<int64_t>(m0 + BM, Sq);
  const int64_t n_end = causal ? std::min<int64_t>(Sk, row_end) : Sk;
  const int n_tiles = static_cast<int>((n_end + BN - 1) / BN);

  load_tile_async<BM, D, LDS, NT>(Qs, qb, m0, Sq, tid);
  if (n_tiles > 0) {
    load_tile_async<BN, D, LDS, NT>(Ks, kb, 0, Sk, tid);
    if constexpr (STAGES == 2) load_tile_async<BN, D, LDS, NT>(Vs, vb, 0, Sk, tid);
  }
  cp_async_commit();

  uint32_t qf[QREG ? MT : 1][QREG ? KD : 1][4];
  if constexpr (STAGES == 1 || QREG) {
    cp_async_wait<0>();
    __syncthreads();
  }
  if constexpr (QREG) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int kk = 0; kk < KD; ++kk)
        ldsm_x4(qf[mi][kk], smem_addr(Qs + (warp * RPW + mi * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8));
  }

  float acc[MT][NDT][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int i = 0; i < NDT; ++i) acc[mi][i][0] = acc[mi][i][1] = acc[mi][i][2] = acc[mi][i][3] = 0.f;
  float m_r[MT][2], l_r[MT][2];  // running max (log2 domain) and per-lane partial sums, rows g, g + 8
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) m_r[mi][0] = m_r[mi][1] = -INFINITY, l_r[mi][0] = l_r[mi][1] = 0.f;

  // s = Q K^T for this warp's rows and the BN keys at Kt (log2-scaled, masked), then the
  // online-softmax update; on return s holds the unnormalised probabilities.
  auto scores = [&](float (&s)[MT][NKT][4], const T* Kt, int64_t n0) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int i = 0; i < NKT; ++i) s[mi][i][0] = s[mi][i][1] = s[mi][i][2] = s[mi][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        if constexpr (QREG) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mi][e] = qf[mi][kk][e];
        } else {
          ldsm_x4(a[mi], smem_addr(Qs + (warp * RPW + mi * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8));
        }
      }
#pragma unroll
      for (int np = 0; np < NKT / 2; ++np) {
        uint32_t b[4];
        ldsm_x4(b, smem_addr(Kt + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 +
                             ((lane >> 3) & 1) * 8));
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          Mma::run_nv(s[mi][2 * np], a[mi], b[0], b[1]);
          Mma::run_nv(s[mi][2 * np + 1], a[mi], b[2], b[3]);
        }
      }
    }
    const bool need_mask = (n0 + BN > Sk) || (causal && n0 + BN - 1 > wrow0);
    // Tile-relative 32-bit bounds (fewer live 64-bit registers): key column c (0..BN) is
    // visible to warp row r (0..RPW) iff c < kv_lim and (!causal || c <= r + diag).
    const int kv_lim = static_cast<int>(std::min<int64_t>(Sk - n0, BN));
    const int diag = static_cast<int>(std::max<int64_t>(std::min<int64_t>(wrow0 - n0, BN), -2 * RPW));
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int nt = 0; nt < NKT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mi][nt][e] * scale_log2;
          if (need_mask) {
            const int c = nt * 8 + 2 * t + (e & 1);
            const int r = mi * 16 + g + 8 * (e >> 1);
            if (c >= kv_lim || (causal && c > r + diag)) x = -INFINITY;
          }
          s[mi][nt][e] = x;
        }
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m_r[mi][h];
#pragma unroll
        for (int nt = 0; nt < NKT; ++nt) mx = fmaxf(mx, fmaxf(s[mi][nt][2 * h], s[mi][nt][2 * h + 1]));
        mx = quad_max(mx);
        const float base = mx == -INFINITY ? 0.f : mx;  // row still fully masked
        const float alpha = exp2_ftz(m_r[mi][h] - base);   // old max -inf -> 0
        m_r[mi][h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NKT; ++nt) {
          s[mi][nt][2 * h] = exp2_ftz(s[mi][nt][2 * h] - base);
          s[mi][nt][2 * h + 1] = exp2_ftz(s[mi][nt][2 * h + 1] - base);
          sum += s[mi][nt][2 * h] + s[mi][nt][2 * h + 1];
        }
        l_r[mi][h] = l_r[mi][h] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < NDT; ++dt) {
          acc[mi][dt][2 * h] *= alpha;
          acc[mi][dt][2 * h + 1] *= alpha;
        }
      }
  };

  // O += P V for the BN keys at Vt; P comes straight from the S accumulators.
  auto pv = [&](const float (&s)[MT][NKT][4], const T* Vt) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        pa[mi][0] = Mma::pack(s[mi][2 * kk][0], s[mi][2 * kk][1]);
        pa[mi][1] = Mma::pack(s[mi][2 * kk][2], s[mi][2 * kk][3]);
        pa[mi][2] = Mma::pack(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
        pa[mi][3] = Mma::pack(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < NDT / 2; ++dp) {
        uint32_t b[4];
        ldsm_x4_trans(b, smem_addr(Vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + dp * 16 +
                                   (lane >> 4) * 8));
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          Mma::run_nv(acc[mi][2 * dp], pa[mi], b[0], b[1]);
          Mma::run_nv(acc[mi][2 * dp + 1], pa[mi], b[2], b[3]);
        }
      }
    }
  };

  for (int j = 0; j < n_tiles; ++j) {
    const int64_t n0 = static_cast<int64_t>(j) * BN;
    // Warp-uniform: rows all past Sq (never stored) or all above this tile's keys.
    const bool active = wrow0 < Sq && !(causal && n0 > wrow0 + RPW - 1);
    if constexpr (STAGES == 2) {
      const int st = j & 1;
      cp_async_wait<0>();  // tile j (issued one iteration ago, or in the prologue) landed
      __syncthreads();     // ... and is visible; every warp is done with tile j-1 (stage st^1)
      if (j + 1 < n_tiles) {
        load_tile_async<BN, D, LDS, NT>(Ks + (st ^ 1) * BN * LDS, kb, n0 + BN, Sk, tid);
        load_tile_async<BN, D, LDS, NT>(Vs + (st ^ 1) * BN * LDS, vb, n0 + BN, Sk, tid);
      }
      cp_async_commit();
      if (active) {
        float s[MT][NKT][4];
        scores(s, Ks + st * BN * LDS, n0);
        pv(s, Vs + st * BN * LDS);
      }
    } else {
      // Invariant: K(j) resident and visible; every warp is done with V(j-1).
      load_tile_async<BN, D, LDS, NT>(Vs, vb, n0, Sk, tid);
      cp_async_commit();
      float s[MT][NKT][4];
      if (active) scores(s, Ks, n0);
      __syncthreads();  // every warp is done reading K(j)
      if (j + 1 < n_tiles) load_tile_async<BN, D, LDS, NT>(Ks, kb, n0 + BN, Sk, tid);
      cp_async_commit();   // possibly empty group: keeps the wait counts uniform
      cp_async_wait<1>();  // V(j) has landed
      __syncthreads();
      if (active) pv(s, Vs);
      cp_async_wait<0>();  // K(j+1) has landed
      __syncthreads();     // ... is visible, and every warp is done with V(j)
    }
  }
  cp_async_wait<0>();

  // Epilogue: O / l, lse = (m + log2 l) * ln2 (natural log).
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = quad_sum(l_r[mi][h]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int64_t row = wrow0 + mi * 16 + g + 8 * h;
      if (row < Sq) {
        T* orow = o + (bh * Sq + row) * D;
#pragma unroll
        for (int dt = 0; dt < NDT; ++dt) {
          const uint32_t pk = Mma::pack(acc[mi][dt][2 * h] * inv, acc[mi][dt][2 * h + 1] * inv);
          *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) = pk;
        }
        if (t == 0) lse[bh * Sq + row] = l > 0.f ? (m_r[mi][h] + log2f(l)) * kLn2 : -INFINITY;
      }
    }
}

// ---- backward: dK, dV -------------------------------------------------------
constexpr int kBwdKN = 64;  // keys per block (16 per warp)
constexpr int kBwdKQ = 32;  // queries per tile

template <int D> constexpr int tc_dkdv_smem_bytes() {
  return (2 * kBwdKN + 2 * 2 * kBwdKQ) * (D + 8) * 2 + 2 * 2 * kBwdKQ * 4;
}

template <typename T, int D>
__global__ void __launch_bounds__(kTcThreads)
attn_bwd_dkdv_tc(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                 T* __restrict__ dk, T* __restrict__ dv, int64_t bh0, int64_t Sq, int64_t Sk, float scale,
                 bool causal) {
  constexpr int LDS = D + 8;
  constexpr int NQT = kBwdKQ / 8;  // n-tiles over queries
  constexpr int NDT = D / 8;
  constexpr int KD = D / 16;
  using Mma = MmaOp<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);  // [KN][LDS]
  T* Vs = Ks + kBwdKN * LDS;                // [KN][LDS]
  T* Qs = Vs + kBwdKN * LDS;                // [2][KQ][LDS]
  T* dOs = Qs + 2 * kBwdKQ * LDS;           // [2][KQ][LDS]
  float* Ls = reinterpret_cast<float*>(dOs + 2 * kBwdKQ * LDS);  // [2][KQ]  lse * log2e (+inf past Sq)
  float* Dl = Ls + 2 * kBwdKQ;                                    // [2][KQ]  delta

  const int64_t bh = bh0 + blockIdx.y;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBwdKN;
  const T* qb = q + bh * Sq * D;
  const T* dob = dout + bh * Sq * D;
  const T* kb = k + bh * Sk * D;
  const T* vb = v + bh * Sk * D;
  const float* lb = lse + bh * Sq;
  const float* db = delta + bh * Sq;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const float scale_log2 = scale * kLog2e;

  const int64_t q_begin = causal ? (n0 / kBwdKQ) * kBwdKQ : 0;
  const int n_qt = q_begin < Sq ? static_cast<int>((Sq - q_begin + kBwdKQ - 1) / kBwdKQ) : 0;

  auto issue_q_tile = [&](int it) {
    const int buf = it & 1;
    const int64_t q0 = q_begin + static_cast<int64_t>(it) * kBwdKQ;
    load_tile_async<kBwdKQ, D, LDS, kTcThreads>(Qs + buf * kBwdKQ * LDS, qb, q0, Sq, tid);
    load_tile_async<kBwdKQ, D, LDS, kTcThreads>(dOs + buf * kBwdKQ * LDS, dob, q0, Sq, tid);
    if (tid < kBwdKQ) {
      const int64_t qi = q0 + tid;
      Ls[buf * kBwdKQ + tid] = qi < Sq ? lb[qi] * kLog2e : INFINITY;
      Dl[buf * kBwdKQ + tid] = qi < Sq ? db[qi] : 0.f;
    }
  };

  load_tile_async<kBwdKN, D, LDS, kTcThreads>(Ks, kb, n0, Sk, tid);
  load_tile_async<kBwdKN, D, LDS, kTcThreads>(Vs, vb, n0, Sk, tid);
  if (n_qt > 0) issue_q_tile(0);
  cp_async_commit();

  float dk_acc[NDT][4], dv_acc[NDT][4];
#pragma unroll
  for (int i = 0; i < NDT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[i][e] = dv_acc[i][e] = 0.f;

  const int kw = warp * 16;  // this warp's key rows within the block
  const int64_t key_g[2] = {n0 + kw + g, n0 + kw + g + 8};

  for (int it = 0; it < n_qt; ++it) {
    const int buf = it & 1;
    const int64_t q0 = q_begin + static_cast<int64_t>(it) * kBwdKQ;
    cp_async_wait<0>();
    __syncthreads();  // tile it visible; every warp done with tile it-1 (the other buffer)
    if (it + 1 < n_qt) issue_q_tile(it + 1);
    cp_async_commit();

    const T* Qb = Qs + buf * kBwdKQ * LDS;
    const T* dOb = dOs + buf * kBwdKQ * LDS;
    const float* Lb = Ls + buf * kBwdKQ;
    const float* Db = Dl + buf * kBwdKQ;

    // S^T (16 keys x 32 queries) = K_w Q^T and dP^T = V_w dO^T.
    float st[NQT][4], dpt[NQT][4];
#pragma unroll
    for (int i = 0; i < NQT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t ka[4], va[4];
      ldsm_x4(ka, smem_addr(Ks + (kw + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8));
      ldsm_x4(va, smem_addr(Vs + (kw + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int np = 0; np < NQT / 2; ++np) {
        const int brow = np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int bcol = kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t b[4];
        ldsm_x4(b, smem_addr(Qb + brow * LDS + bcol));
        Mma::run(st[2 * np], ka, b[0], b[1]);
        Mma::run(st[2 * np + 1], ka, b[2], b[3]);
        ldsm_x4(b, smem_addr(dOb + brow * LDS + bcol));
        Mma::run(dpt[2 * np], va, b[0], b[1]);
        Mma::run(dpt[2 * np + 1], va, b[2], b[3]);
      }
    }

    // P^T = exp2(S^T * scale * log2e - lse * log2e); dS^T = P^T (dP^T - delta).
    // Element e of n-tile nt: key row kw + g + 8 (e >> 1), query col nt*8 + 2t + (e & 1).
    const bool need_mask = (n0 + kBwdKN > Sk) || (causal && n0 + kBwdKN - 1 > q0);
#pragma unroll
    for (int nt = 0; nt < NQT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1);
        float p = exp2f(st[nt][e] * scale_log2 - Lb[qc]);  // query past Sq: lse = +inf -> 0
        if (need_mask) {
          const int64_t key = key_g[e >> 1];
          if (key >= Sk || (causal && key > q0 + qc)) p = 0.f;
        }
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - Db[qc]);
      }

    // dV += P^T dO and dK += dS^T Q (k = queries, 2 k-steps of 16).
#pragma unroll
    for (int kk = 0; kk < NQT / 2; ++kk) {
      uint32_t pa[4], sa[4];
      pa[0] = Mma::pack(st[2 * kk][0], st[2 * kk][1]);
      pa[1] = Mma::pack(st[2 * kk][2], st[2 * kk][3]);
      pa[2] = Mma::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      pa[3] = Mma::pack(st[2 * kk + 1][2], st[2 * kk + 1][3]);
      sa[0] = Mma::pack(dpt[2 * kk][0], dpt[2 * kk][1]);
      sa[1] = Mma::pack(dpt[2 * kk][2], dpt[2 * kk][3]);
      sa[2] = Mma::pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      sa[3] = Mma::pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
      const int brow = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int dp = 0; dp < NDT / 2; ++dp) {
        const int bcol = dp * 16 + (lane >> 4) * 8;
        uint32_t b[4];
        ldsm_x4_trans(b, smem_addr(dOb + brow * LDS + bcol));
        Mma::run(dv_acc[2 * dp], pa, b[0], b[1]);
        Mma::run(dv_acc[2 * dp + 1], pa, b[2], b[3]);
        ldsm_x4_trans(b, smem_addr(Qb + brow * LDS + bcol));
        Mma::run(dk_acc[2 * dp], sa, b[0], b[1]);
        Mma::run(dk_acc[2 * dp + 1], sa, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t key = key_g[h];
    if (key >= Sk) continue;
    T* dkr = dk + (bh * Sk + key) * D;
    T* dvr = dv + (bh * Sk + key) * D;
#pragma unroll
    for (int dt = 0; dt < NDT; ++dt) {
      *reinterpret_cast<uint32_t*>(dkr + dt * 8 + 2 * t) =
          Mma::pack(dk_acc[dt][2 * h] * scale, dk_acc[dt][2 * h + 1] * scale);
      *reinterpret_cast<uint32_t*>(dvr + dt * 8 + 2 * t) = Mma::pack(dv_acc[dt][2 * h], dv_acc[dt][2 * h + 1]);
    }
  }
}

// ---- backward: dQ -----------------------------------------------------------
constexpr int kBwdQM = 64;  // queries per block (16 per warp)
constexpr int kBwdQN = 32;  // keys per tile

template <int D> constexpr int tc_dq_smem_bytes() { return (2 * kBwdQM + 2 * 2 * kBwdQN) * (D + 8) * 2; }

template <typename T, int D>
__global__ void __launch_bounds__(kTcThreads)
attn_bwd_dq_tc(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
               T* __restrict__ dq, int64_t bh0, int64_t Sq, int64_t Sk, float scale, bool causal) {
  constexpr int LDS = D + 8;
  constexpr int NKT = kBwdQN / 8;  // n-tiles over keys
  constexpr int NDT = D / 8;
  constexpr int KD = D / 16;
  using Mma = MmaOp<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);  // [QM][LDS]
  T* dOs = Qs + kBwdQM * LDS;               // [QM][LDS]
  T* Ks = dOs + kBwdQM * LDS;               // [2][QN][LDS]
  T* Vs = Ks + 2 * kBwdQN * LDS;            // [2][QN][LDS]

  const int64_t bh = bh0 + blockIdx.y;
  const int64_t mblk = causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int64_t m0 = mblk * kBwdQM;
  const T* qb = q + bh * Sq * D;
  const T* dob = dout + bh * Sq * D;
  const T* kb = k + bh * Sk * D;
  const T* vb = v + bh * Sk * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const float scale_log2 = scale * kLog2e;

  const int64_t row_end = std::min<int64_t>(m0 + kBwdQM, Sq);
  const int64_t n_end = causal ? std::min<int64_t>(Sk, row_end) : Sk;
  const int n_tiles = static_cast<int>((n_end + kBwdQN - 1) / kBwdQN);

  const int64_t row_g[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};
  float lse2[2], dl[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    lse2[h] = row_g[h] < Sq ? lse[bh * Sq + row_g[h]] * kLog2e : INFINITY;
    dl[h] = row_g[h] < Sq ? delta[bh * Sq + row_g[h]] : 0.f;
  }

  load_tile_async<kBwdQM, D, LDS, kTcThreads>(Qs, qb, m0, Sq, tid);
  load_tile_async<kBwdQM, D, LDS, kTcThreads>(dOs, dob, m0, Sq, tid);
  if (n_tiles > 0) {
    load_tile_async<kBwdQN, D, LDS, kTcThreads>(Ks, kb, 0, Sk, tid);
    load_tile_async<kBwdQN, D, LDS, kTcThreads>(Vs, vb, 0, Sk, tid);
  }
  cp_async_commit();

  float acc[NDT][4];
#pragma unroll
  for (int i = 0; i < NDT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  const int qw = warp * 16;

  // Q_w and dO_w fragments stay in registers for the whole key loop: per key tile
  // each warp then reads only K and V from shared memory (48 instead of 64
  // ldmatrix per 96 mma), which is what bounds this kernel.
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[KD][4], df[KD][4];
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) {
    ldsm_x4(qf[kk], smem_addr(Qs + (qw + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8));
    ldsm_x4(df[kk], smem_addr(dOs + (qw + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8));
  }

  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    const int64_t n0 = static_cast<int64_t>(j) * kBwdQN;
    cp_async_wait<0>();
    __syncthreads();  // tile j visible; every warp done with tile j-1 (the other buffer)
    if (j + 1 < n_tiles) {
      load_tile_async<kBwdQN, D, LDS, kTcThreads>(Ks + (buf ^ 1) * kBwdQN * LDS, kb, n0 + kBwdQN, Sk, tid);
      load_tile_async<kBwdQN, D, LDS, kTcThreads>(Vs + (buf ^ 1) * kBwdQN * LDS, vb, n0 + kBwdQN, Sk, tid);
    }
    cp_async_commit();
    const T* Kb = Ks + buf * kBwdQN * LDS;
    const T* Vb = Vs + buf * kBwdQN * LDS;

    // S = Q_w K^T, dP = dO_w V^T (16 queries x 32 keys).
    float s[NKT][4], dp[NKT][4];
#pragma unroll
    for (int i = 0; i < NKT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
      for (int np = 0; np < NKT / 2; ++np) {
        const int brow = np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int bcol = kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t b[4];
        ldsm_x4(b, smem_addr(Kb + brow * LDS + bcol));
        Mma::run(s[2 * np], qf[kk], b[0], b[1]);
        Mma::run(s[2 * np + 1], qf[kk], b[2], b[3]);
        ldsm_x4(b, smem_addr(Vb + brow * LDS + bcol));
        Mma::run(dp[2 * np], df[kk], b[0], b[1]);
        Mma::run(dp[2 * np + 1], df[kk], b[2], b[3]);
      }
    }

    // dS = P (dP - delta); element e of n-tile nt: row g + 8 (e >> 1), key nt*8 + 2t + (e & 1).
    const bool need_mask = (n0 + kBwdQN > Sk) || (causal && n0 + kBwdQN - 1 > m0);
#pragma unroll
    for (int nt = 0; nt < NKT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        float p = exp2f(s[nt][e] * scale_log2 - lse2[h]);
        if (need_mask) {
          const int64_t key = n0 + nt * 8 + 2 * t + (e & 1);
          if (key >= Sk || (causal && key > row_g[h])) p = 0.f;
        }
        s[nt][e] = p * (dp[nt][e] - dl[h]);
      }

    // dQ += dS K (k = keys, 2 k-steps of 16).
#pragma unroll
    for (int kk = 0; kk < NKT / 2; ++kk) {
      uint32_t sa[4];
      sa[0] = Mma::pack(s[2 * kk][0], s[2 * kk][1]);
      sa[1] = Mma::pack(s[2 * kk][2], s[2 * kk][3]);
      sa[2] = Mma::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      sa[3] = Mma::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      const int brow = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int dt2 = 0; dt2 < NDT / 2; ++dt2) {
        uint32_t b[4];
        ldsm_x4_trans(b, smem_addr(Kb + brow * LDS + dt2 * 16 + (lane >> 4) * 8));
        Mma::run(acc[2 * dt2], sa, b[0], b[1]);
        Mma::run(acc[2 * dt2 + 1], sa, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row_g[h];
    if (row >= Sq) continue;
    T* out = dq + (bh * Sq + row) * D;
#pragma unroll
    for (int dt = 0; dt < NDT; ++dt)
      *reinterpret_cast<uint32_t*>(out + dt * 8 + 2 * t) = Mma::pack(acc[dt][2 * h] * scale, acc[dt][2 * h + 1] * scale);
  }
}

// =============================================================================
// Host side
// =============================================================================
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Per-device caches: common/func_attr.h (cacheable_device, set_smem).

bool device_has_sm80(int dev, cudaError_t& err) {
  static std::atomic<int> major_plus1[kMaxCachedDevices];  // 0: not queried yet
  err = cudaSuccess;
  int major = cacheable_device(dev) ? major_plus1[dev].load(std::memory_order_relaxed) - 1 : -1;
  if (major < 0) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err != cudaSuccess) return false;
    if (cacheable_device(dev)) major_plus1[dev].store(major + 1, std::memory_order_relaxed);
  }
  return major >= 8;
}

template <typename T> constexpr bool is_half_type() {
  return std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;
}

// Call f(bh0, nbh) for chunks of at most 65535 (grid.y limit).
template <typename F> cudaError_t for_bh_chunks(int64_t BH, F&& f) {
  for (int64_t bh0 = 0; bh0 < BH; bh0 += kMaxGridY) {
    f(bh0, static_cast<unsigned>(std::min<int64_t>(kMaxGridY, BH - bh0)));
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Chunk count (32 columns each) covering a head dim, as a template dispatch.
template <typename F> cudaError_t dispatch_nc(int64_t dmax, F&& f) {
  if (dmax <= 32) return f(std::integral_constant<int, 1>{});
  if (dmax <= 64) return f(std::integral_constant<int, 2>{});
  if (dmax <= 128) return f(std::integral_constant<int, 4>{});
  return f(std::integral_constant<int, 8>{});
}

template <typename T> constexpr int simt_rpw() { return sizeof(acc_t<T>) == 8 ? 2 : 4; }

template <typename T> bool tc_ok_fwd(const AttentionFwdArgs& a) {
  if constexpr (!is_half_type<T>()) {
    return false;
  } else {
    return a.D == a.Dv && (a.D == 64 || a.D == 128) && aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
           aligned16(a.o);
  }
}

template <typename T> bool tc_ok_bwd(const AttentionBwdArgs& a) {
  if constexpr (!is_half_type<T>()) {
    return false;
  } else {
    return a.D == a.Dv && (a.D == 64 || a.D == 128) && aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
           aligned16(a.dout) && aligned16(a.dq) && aligned16(a.dk) && aligned16(a.dv);
  }
}

// Warps per forward block. Measured (bf16, non-causal, H200, 2026-11-21): D=128 runs
// 253 TFLOP/s with 4 warps vs 236 with 8; D=64 runs 242 with 8 vs 215 with 4. So 4
// for D=128 and 8 for D=64; GPU_PUZZLES_ATTN_FWD_WARPS=4|8 overrides (read once).
int fwd_tc_warps(int64_t D) {
  static const int forced = [] {
    const char* e = std::getenv("GPU_PUZZLES_ATTN_FWD_WARPS");
    const int w = e != nullptr ? std::atoi(e) : 0;
    return (w == 4 || w == 8) ? w : 0;
  }();
  if (forced != 0) return forced;
  return D >= 128 ? 4 : 8;
}

template <typename T, int D, int WARPS>
cudaError_t launch_fwd_tc(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
  constexpr int smem = tc_fwd_smem_bytes<D, WARPS>();
  constexpr auto kern = attn_fwd_tc<T, D, WARPS>;
  cudaError_t e = set_smem<kern>(dev, smem);
  if (e != cudaSuccess) return e;
  const unsigned gx = ceil_div_u(a.Sq, 16 * WARPS);
  const float sl = a.scale * kLog2e;
  return for_bh_chunks(a.BH, [&](int64_t bh0, unsigned nbh) {
    kern<<<dim3(gx, nbh), WARPS * 32, smem, stream>>>(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v), static_cast<T*>(a.o),
        static_cast<float*>(a.lse), bh0, a.Sq, a.Sk, sl, a.causal);
  });
}

template <typename T, int D, int RPW, int BN, int WARPS, int STAGES>
cudaError_t launch_fwd_tc2(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
  constexpr int smem = tc_fwd2_smem_bytes<D, RPW, BN, WARPS, STAGES>();
  constexpr auto kern = attn_fwd_tc2<T, D, RPW, BN, WARPS, STAGES>;
  cudaError_t e = set_smem<kern>(dev, smem);
  if (e != cudaSuccess) return e;
  const unsigned gx = ceil_div_u(a.Sq, RPW * WARPS);
  const float sl = a.scale * kLog2e;
  return for_bh_chunks(a.BH, [&](int64_t bh0, unsigned nbh) {
    kern<<<dim3(gx, nbh), WARPS * 32, smem, stream>>>(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v), static_cast<T*>(a.o),
        static_cast<float*>(a.lse), bh0, a.Sq, a.Sk, sl, a.causal);
  });
}

// Forward tensor-core configuration: GPU_PUZZLES_ATTN_FWD_CFG=<name> (read once; for
// benchmark sweeps). "old" is attn_fwd_tc (warps from fwd_tc_warps); the others are
// attn_fwd_tc2 r<rows per warp>_bn<keys per tile>_w<warps>_s<stages>. Unset/"auto": the
// default below; an unknown name warns once on stderr and uses the default. "wgmma" / "wgmma3":
// the sm_90a kernel of attention_fwd_sm90.cu with 2 / 3 warpgroups per CTA where the build
// has it and the device/shape allow, else the tc kernels (auto uses it too: sm90_warpgroups).
enum class FwdCfg { Auto, Old, R32Bn32W4S2, Wgmma, Wgmma3 };
struct FwdCfgName {
  const char* name;
  FwdCfg cfg;
};
constexpr FwdCfgName kFwdCfgNames[] = {
    {"auto", FwdCfg::Auto}, {"old", FwdCfg::Old}, {"r32_bn32_w4_s2", FwdCfg::R32Bn32W4S2}, {"wgmma", FwdCfg::Wgmma},
    {"wgmma3", FwdCfg::Wgmma3}};
constexpr FwdCfg kFwdCfgDefault = FwdCfg::Auto;
// Auto: D = 128 -> r32_bn32_w4_s2, D = 64 -> old (8 warps). Measured on an H200 (bf16
// forward TFLOP/s, benchmarks/attention_sweep.py; (4,32,4096,128) / causal / (8,16,2048,64) /
// causal): old 250 / 236 / 229 / 183; r32_bn32_w4_s2 255 / 235 / 199 / 164;
// r32_bn64_w4_s2 236 / 214 / 188 / 149; r32_bn32_w8_s2 226 / 203 / 154 / 117;
// r16_bn64_w8_s2 188 / 176 / 139 / 125; r32_bn64_w4_s1 (FlashAttention-2's tiling) 239 / 213 /
// 179 / 145. Only the two kept are instantiated (build time); the template takes any of them.
// Registers per thread, sm_90, fp16 = bf16 (nvcc 13.0): r32_bn32_w4_s2 243 (D=128) / 168
// (D=64), smem 68 / 36 KiB; old w4 249 / 140, w8 216 / 127. The BN=64, 32-row tiles spill at D=128.

FwdCfg fwd_cfg() {
  static const FwdCfg cfg = [] {
    const char* e = std::getenv("GPU_PUZZLES_ATTN_FWD_CFG");
    if (e == nullptr || *e == '\0') return kFwdCfgDefault;
    for (const auto& n : kFwdCfgNames)
      if (std::strcmp(e, n.name) == 0) return n.cfg;
    std::fprintf(stderr, "gpu_puzzles: unknown GPU_PUZZLES_ATTN_FWD_CFG=%s; using the default\n", e);
    return kFwdCfgDefault;
  }();
  return cfg;
}

// Share of the SM slots a grid of `ctas` one-CTA-per-SM blocks keeps busy over its waves.
double wave_fill(int64_t ctas, int sms) {
  const int64_t waves = (ctas + sms - 1) / sms;
  return static_cast<double>(ctas) / static_cast<double>(waves * sms);
}

// The sm_90a wgmma forward's warpgroups per CTA for this call, 0 = not that kernel.
// Auto, D = 128: 3 warpgroups (BM = 192) unless 2 (BM = 128) fill the waves better by more
// than 3's per-CTA speed-up (1.075x: 356 vs 331 TFLOP/s at (4,32,4096,128)). Both kernels hold
// one CTA per SM at D = 128 (launch bounds; 221 / 141 registers). Example, H100 (132 SMs),
// forward TFLOP/s wgmma3 -> wgmma (benchmarks/results/attention_small_sweep_h100.txt):
// (1,16,2048) 176 CTAs = 1.33 waves vs 256 = 1.94, 224 -> 299; (2,16,1024) 205 -> 266;
// (8,16,2048) stays with wgmma3, 338 vs 312.
// Auto, D = 64: the mma.sync kernel ("old"): equal to wgmma3 at (8,16,2048,64) (229-237 vs
// 233-234) and ahead at shorter or fewer sequences ((2,16,1024,64) 201 vs 140), causal too.
// Where supported() says no (not a 9.x GPU, fp32, unaligned) the tc kernels below run.
int sm90_warpgroups(const AttentionFwdArgs& a, int dev, cudaError_t& err) {
  err = cudaSuccess;
  switch (fwd_cfg()) {
    case FwdCfg::Wgmma: return 2;
    case FwdCfg::Wgmma3: return 3;
    case FwdCfg::Auto: {
      if (a.D != 128 || a.Dv != 128) return 0;
      const int sms = device_sm_count(dev, err);
      if (sms <= 0) return 0;
      const int64_t ctas3 = a.BH * ((a.Sq + 191) / 192), ctas2 = a.BH * ((a.Sq + 127) / 128);
      return 1.075 * wave_fill(ctas3, sms) >= wave_fill(ctas2, sms) ? 3 : 2;
    }
    default: return 0;
  }
}

template <typename T, int D> cudaError_t launch_fwd_tc(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
  FwdCfg cfg = fwd_cfg();
  if (cfg == FwdCfg::Auto || cfg == FwdCfg::Wgmma || cfg == FwdCfg::Wgmma3)  // wgmma: its fallback
    cfg = D == 128 ? FwdCfg::R32Bn32W4S2 : FwdCfg::Old;
  if (cfg == FwdCfg::R32Bn32W4S2) return launch_fwd_tc2<T, D, 32, 32, 4, 2>(a, dev, stream);
  return fwd_tc_warps(D) == 4 ? launch_fwd_tc<T, D, 4>(a, dev, stream) : launch_fwd_tc<T, D, 8>(a, dev, stream);
}

template <typename T> cudaError_t launch_fwd_simt(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
  using A = acc_t<T>;
  constexpr int RPW = simt_rpw<T>();
  return dispatch_nc(std::max(a.D, a.Dv), [&](auto nc) -> cudaError_t {
    constexpr int NC = decltype(nc)::value;
    const int D = static_cast<int>(a.D), Dv = static_cast<int>(a.Dv);
    const size_t smem = sizeof(A) * (static_cast<size_t>(kSimtWarps * RPW) * D + kSimtT * (D + 1) + kSimtT * Dv);
    constexpr auto kern = attn_fwd_simt<T, A, NC, RPW>;
    cudaError_t e = set_smem<kern>(dev, smem);
    if (e != cudaSuccess) return e;
    const unsigned gx = ceil_div_u(a.Sq, kSimtWarps * RPW);
    return for_bh_chunks(a.BH, [&](int64_t bh0, unsigned nbh) {
      kern<<<dim3(gx, nbh), kSimtWarps * 32, smem, stream>>>(
          static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v), static_cast<T*>(a.o),
          static_cast<A*>(a.lse), bh0, a.Sq, a.Sk, D, Dv, static_cast<A>(a.scale), a.causal);
    });
  });
}

template <typename T> cudaError_t forward_typed(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
  if constexpr (is_half_type<T>()) {
    if (tc_ok_fwd<T>(a)) {
      cudaError_t e = cudaSuccess;
#if defined(GPU_PUZZLES_WITH_SM90A)
      const int wg = sm90_warpgroups(a, dev, e);
      if (e != cudaSuccess) return e;
      if (wg > 0) {
        if (attention_forward_sm90_supported(a, dev, e)) return attention_forward_sm90(a, wg, dev, stream);
        if (e != cudaSuccess) return e;
      }
#endif
      if (device_has_sm80(dev, e))
        return a.D == 64 ? launch_fwd_tc<T, 64>(a, dev, stream) : launch_fwd_tc<T, 128>(a, dev, stream);
      if (e != cudaSuccess) return e;
    }
  }
  return launch_fwd_simt<T>(a, dev, stream);
}

template <typename T, int D>
cudaError_t launch_bwd_tc(const AttentionBwdArgs& a, const float* delta, int dev, cudaStream_t stream) {
  constexpr int smem_kv = tc_dkdv_smem_bytes<D>();
  constexpr int smem_q = tc_dq_smem_bytes<D>();
  constexpr auto kkv = attn_bwd_dkdv_tc<T, D>;
  constexpr auto kq = attn_bwd_dq_tc<T, D>;
  cudaError_t e = set_smem<kkv>(dev, smem_kv);
  if (e != cudaSuccess) return e;
  e = set_smem<kq>(dev, smem_q);
  if (e != cudaSuccess) return e;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* dout = static_cast<const T*>(a.dout);
  const float* lse = static_cast<const float*>(a.lse);
  if (a.Sk > 0) {
    e = for_bh_chunks(a.BH, [&](int64_t bh0, unsigned nbh) {
      kkv<<<dim3(ceil_div_u(a.Sk, kBwdKN), nbh), kTcThreads, smem_kv, stream>>>(
          q, k, v, dout, lse, delta, static_cast<T*>(a.dk), static_cast<T*>(a.dv), bh0, a.Sq, a.Sk, a.scale,
          a.causal);
    });
    if (e != cudaSuccess) return e;
  }
  return for_bh_chunks(a.BH, [&](int64_t bh0, unsigned nbh) {
    kq<<<dim3(ceil_div_u(a.Sq, kBwdQM), nbh), kTcThreads, smem_q, stream>>>(
        q, k, v, dout, lse, delta, static_cast<T*>(a.dq), bh0, a.Sq, a.Sk, a.scale, a.causal);
  });
}

template <typename T>
cudaError_t launch_bwd_simt(const AttentionBwdArgs& a, const acc_t<T>* delta, int dev, cudaStream_t stream) {
  using A = acc_t<T>;
  constexpr int RPW = simt_rpw<T>();
  return dispatch_nc(std::max(a.D, a.Dv), [&](auto nc) -> cudaError_t {
    constexpr int NC = decltype(nc)::value;
    const int D = static_cast<int>(a.D), Dv = static_cast<int>(a.Dv);
    const T* q = static_cast<const T*>(a.q);
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    const T* dout = static_cast<const T*>(a.dout);
    const A* lse = static_cast<const A*>(a.lse);
    const A scale = static_cast<A>(a.scale);
    constexpr int R = kSimtWarps * RPW;
    if (a.Sk > 0) {
      const size_t smem_kv = sizeof(A) * (static_cast<size_t>(R) * D + R * Dv + kSimtT * (D + 1) +
                                          kSimtT * (Dv + 1) + 2 * kSimtT);
      constexpr auto kkv = attn_bwd_dkdv_simt<T, A, NC, RPW>;
      cudaError_t e = set_smem<kkv>(dev, smem_kv);
      if (e != cudaSuccess) return e;
      e = for_bh_chunks(a.BH, [&](int64_t bh0, unsigned nbh) {
        kkv<<<dim3(ceil_div_u(a.Sk, R), nbh), kSimtWarps * 32, smem_kv, stream>>>(
            q, k, v, dout, lse, delta, static_cast<T*>(a.dk), static_cast<T*>(a.dv), bh0, a.Sq, a.Sk, D, Dv,
            scale, a.causal);
      });
      if (e != cudaSuccess) return e;
    }
    const size_t smem_q =
        sizeof(A) * (static_cast<size_t>(R) * D + R * Dv + kSimtT * (D + 1) + kSimtT * (Dv + 1));
    constexpr auto kq = attn_bwd_dq_simt<T, A, NC, RPW>;
    cudaError_t e = set_smem<kq>(dev, smem_q);
    if (e != cudaSuccess) return e;
    return for_bh_chunks(a.BH, [&](int64_t bh0, unsigned nbh) {
      kq<<<dim3(ceil_div_u(a.Sq, R), nbh), kSimtWarps * 32, smem_q, stream>>>(
          q, k, v, dout, lse, delta, static_cast<T*>(a.dq), bh0, a.Sq, a.Sk, D, Dv, scale, a.causal);
    });
  });
}

template <typename T>
cudaError_t backward_typed(const AttentionBwdArgs& a, void* workspace, int dev, cudaStream_t stream) {
  using A = acc_t<T>;
  A* delta = static_cast<A*>(workspace);
  const int64_t rows = a.BH * a.Sq;
  attn_bwd_delta<T, A><<<ceil_div_u(rows, 4), 128, 0, stream>>>(static_cast<const T*>(a.o),
                                                                 static_cast<const T*>(a.dout), delta, rows,
                                                                 static_cast<int>(a.Dv));
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if constexpr (is_half_type<T>()) {
    if (tc_ok_bwd<T>(a)) {
      if (device_has_sm80(dev, e))
        return a.D == 64 ? launch_bwd_tc<T, 64>(a, delta, dev, stream) : launch_bwd_tc<T, 128>(a, delta, dev, stream);
      if (e != cudaSuccess) return e;
    }
  }
  return launch_bwd_simt<T>(a, delta, dev, stream);
}

}  // namespace

int64_t attention_backward_workspace_bytes(const AttentionBwdArgs& a) {
  const int64_t elem = a.dtype == DType::Float64 ? 8 : 4;
  return ((a.BH * a.Sq * elem + 255) / 256) * 256;  // delta = rowsum(dout * o), one per query row
}

LaunchStatus attention_forward_cuda(const AttentionFwdArgs& a, cudaStream_t stream) {
  if (a.BH <= 0 || a.Sq <= 0) return static_cast<LaunchStatus>(cudaSuccess);
  if (a.D <= 0 || a.Dv <= 0 || a.D > kAttentionMaxHeadDim || a.Dv > kAttentionMaxHeadDim)
    return static_cast<LaunchStatus>(cudaErrorInvalidValue);
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess)
    e = dispatch_dtype(a.dtype, [&](auto tag) { return forward_typed<decltype(tag)>(a, dev, stream); });
  return static_cast<LaunchStatus>(e);
}

LaunchStatus attention_backward_cuda(const AttentionBwdArgs& a, void* workspace, cudaStream_t stream) {
  if (a.BH <= 0) return static_cast<LaunchStatus>(cudaSuccess);
  if (a.D <= 0 || a.Dv <= 0 || a.D > kAttentionMaxHeadDim || a.Dv > kAttentionMaxHeadDim)
    return static_cast<LaunchStatus>(cudaErrorInvalidValue);
  if (a.Sq <= 0) {
    // No queries: no gradient reaches k or v.
    const int64_t nk = a.BH * a.Sk;
    const size_t es = a.dtype == DType::Float64 ? 8 : a.dtype == DType::Float32 ? 4 : 2;
    if (nk > 0) {
      cudaError_t e = cudaMemsetAsync(a.dk, 0, nk * a.D * es, stream);
      if (e == cudaSuccess) e = cudaMemsetAsync(a.dv, 0, nk * a.Dv * es, stream);
      if (e != cudaSuccess) return static_cast<LaunchStatus>(e);
    }
    return static_cast<LaunchStatus>(cudaSuccess);
  }
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess)
    e = dispatch_dtype(a.dtype, [&](auto tag) { return backward_typed<decltype(tag)>(a, workspace, dev, stream); });
  return static_cast<LaunchStatus>(e);
}

}  // namespace gpu_puzzles
