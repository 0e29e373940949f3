// Tensor-core attention forward (fp16/bf16, D == Dv in {64, 128}, sm_80+):
// FlashAttention-2 structure with mma.sync.m16n8k16 (fp32 accumulate) and ldmatrix
// fragments from padded shared memory (attention_mma.cuh). P goes from the S accumulators
// straight into the A operand of the P V mma; the softmax is online
// (common/online_softmax.cuh) and lse = m + log(l) is written per query row.
//   attn_fwd_mma  (plan Mma): 16 rows per warp, 4 or 8 warps, Q fragments held in
//                registers, 64-key K/V tiles loaded with cp.async (V(j) overlaps
//                S = Q K(j)^T, K(j+1) overlaps O += P V(j)).
//   attn_fwd_mma_r32 (plan MmaR32): the tiling as template parameters; instantiated at
//                32 rows per warp, 32-key tiles, 4 warps, K/V double-buffered.
// Which one runs, and with how many warps: attention_fwd_plan (attention_plan.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention/attention_common.cuh"
#include "attention/attention_mma.cuh"
#include "attention/attention_plan.h"
#include "common/cp_async.cuh"
#include "common/device.cuh"
#include "common/func_attr.h"
#include "common/online_softmax.cuh"

namespace gpu_puzzles {
namespace {

// WARPS warps x 16 query rows per block. 8 warps (128 rows) halve the K/V bytes
// streamed from L2 per FLOP compared with 4 (at 64 rows, 64 keys and D = 128 a
// block does 64 FLOP per byte loaded, which at 300 TFLOP/s is ~4.7 TB/s of L2).
constexpr int kFwdBN = 64;  // keys per tile

template <int D, int WARPS>
constexpr int mma_fwd_smem_bytes() {
  return (16 * WARPS + 2 * kFwdBN) * (D + 8) * 2;
}

template <typename T, int D, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    attn_fwd_mma(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<T> o, float* __restrict__ lse, int64_t H,
                 int64_t G, int64_t bh0, int64_t Sq, int64_t Sk, float scale_log2, bool causal) {
  constexpr int BM = 16 * WARPS;  // query rows per block (16 per warp)
  constexpr int NT = WARPS * 32;
  constexpr int LDS = D + 8;
  constexpr int NKT = kFwdBN / 8;  // S n-tiles (keys)
  constexpr int NDT = D / 8;       // O n-tiles (head dim)
  constexpr int KD = D / 16;       // k-steps over the head dim
  using Mma = MmaOp<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);  // [BM][LDS]
  T* Ks = Qs + BM * LDS;                   // [BN][LDS]
  T* Vs = Ks + kFwdBN * LDS;               // [BN][LDS]

  const int64_t bh = bh0 + blockIdx.y;
  // Causal: heaviest query tiles (largest m0) first, for a better tail.
  const int64_t mblk = causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int64_t m0 = mblk * BM;
  const auto [hd, qb, kb, vb] = qkv_heads(q, k, v, bh, H, G);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;

  const int n_tiles = key_tiles<BM, kFwdBN>(m0, Sq, Sk, causal);

  load_tile_async<BM, D, LDS, NT>(Qs, qb, q.ss, m0, Sq, tid);
  if (n_tiles > 0) load_tile_async<kFwdBN, D, LDS, NT>(Ks, kb, k.ss, 0, Sk, tid);
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
    load_tile_async<kFwdBN, D, LDS, NT>(Vs, vb, v.ss, n0, Sk, tid);
    cp_async_commit();

    float s[NKT][4];
#pragma unroll
    for (int i = 0; i < NKT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
      for (int np = 0; np < NKT / 2; ++np) {
        uint32_t b[4];
        ldsm_x4(b, smem_addr(Ks + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8));
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
    for (int h = 0; h < 2; ++h)
      online_softmax_step<false, true, NKT, NDT>([&](int nt, int e) -> float& { return s[nt][e]; },
                                                 [&](int dt, int e) -> float& { return acc[dt][e]; }, m_r[h], l_r[h],
                                                 h);

    __syncthreads();  // every warp is done reading K(j)
    if (j + 1 < n_tiles) load_tile_async<kFwdBN, D, LDS, NT>(Ks, kb, k.ss, n0 + kFwdBN, Sk, tid);
    cp_async_commit();   // possibly empty group: keeps the wait counts uniform
    cp_async_wait<1>();  // V(j) has landed
    __syncthreads();

#pragma unroll
    for (int kk = 0; kk < NKT / 2; ++kk) {
      uint32_t pa[4];
      Mma::pack_a(pa, s, kk);
#pragma unroll
      for (int dp = 0; dp < NDT / 2; ++dp) {
        uint32_t b[4];
        ldsm_x4_trans(b,
                      smem_addr(Vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + dp * 16 + (lane >> 4) * 8));
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
      T* orow = o.row(hd.b, hd.h, row);
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
// Same math and masking as attn_fwd_mma, with the tiling as template parameters:
//   RPW    query rows per warp, 16 or 32. At 32 each warp holds two m16 tiles, so every
//          K / V B-fragment read by ldmatrix feeds two mma instead of one: half the
//          shared-memory traffic per FLOP (at 16 rows, smem bandwidth caps mma.sync).
//   BN     keys per K/V tile, 32 or 64 (S accumulators: RPW/16 * BN/2 floats per lane).
//   WARPS  4 or 8; BM = RPW * WARPS query rows per block.
//   STAGES 2: K/V double-buffered; tile j+1 is fetched (cp.async) during all of tile
//          j's compute, one __syncthreads per tile. 1: the single-buffer schedule of
//          attn_fwd_mma (V(j) overlaps S = Q K(j)^T, K(j+1) overlaps O += P V(j)).
// Q fragments are held in registers when they fit in 32 registers (RPW = 16, or D = 64);
// otherwise (RPW = 32, D = 128) they are re-read from shared memory at each k-step, as
// O (MT * D/2 floats) + S (MT * BN/2 floats) already use most of the register file.
// Causal: a warp whose rows all precede a tile's first key skips that tile's math (it
// still joins the loads and barriers); only tiles that cross the diagonal or the key
// tail are masked. Warps whose rows are all past Sq skip the math too (never stored).
template <int D, int RPW, int BN, int WARPS, int STAGES>
constexpr int tc_fwd2_smem_bytes() {
  return (RPW * WARPS + STAGES * 2 * BN) * (D + 8) * 2;
}

template <typename T, int D, int RPW, int BN, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32)
    attn_fwd_mma_r32(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<T> o, float* __restrict__ lse, int64_t H,
                     int64_t G, int64_t bh0, int64_t Sq, int64_t Sk, float scale_log2, bool causal) {
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
  const auto [hd, qb, kb, vb] = qkv_heads(q, k, v, bh, H, G);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t wrow0 = m0 + warp * RPW;  // this warp's first query row

  const int n_tiles = key_tiles<BM, BN>(m0, Sq, Sk, causal);

  load_tile_async<BM, D, LDS, NT>(Qs, qb, q.ss, m0, Sq, tid);
  if (n_tiles > 0) {
    load_tile_async<BN, D, LDS, NT>(Ks, kb, k.ss, 0, Sk, tid);
    if constexpr (STAGES == 2) load_tile_async<BN, D, LDS, NT>(Vs, vb, v.ss, 0, Sk, tid);
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
  auto scores = [&](float(&s)[MT][NKT][4], const T* Kt, int64_t n0) {
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
        ldsm_x4(b, smem_addr(Kt + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8));
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
      for (int h = 0; h < 2; ++h)
        online_softmax_step<true, true, NKT, NDT>([&](int nt, int e) -> float& { return s[mi][nt][e]; },
                                                  [&](int dt, int e) -> float& { return acc[mi][dt][e]; }, m_r[mi][h],
                                                  l_r[mi][h], h);
  };

  // O += P V for the BN keys at Vt; P comes straight from the S accumulators.
  auto pv = [&](const float(&s)[MT][NKT][4], const T* Vt) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) Mma::pack_a(pa[mi], s[mi], kk);
#pragma unroll
      for (int dp = 0; dp < NDT / 2; ++dp) {
        uint32_t b[4];
        ldsm_x4_trans(b,
                      smem_addr(Vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + dp * 16 + (lane >> 4) * 8));
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
        load_tile_async<BN, D, LDS, NT>(Ks + (st ^ 1) * BN * LDS, kb, k.ss, n0 + BN, Sk, tid);
        load_tile_async<BN, D, LDS, NT>(Vs + (st ^ 1) * BN * LDS, vb, v.ss, n0 + BN, Sk, tid);
      }
      cp_async_commit();
      if (active) {
        float s[MT][NKT][4];
        scores(s, Ks + st * BN * LDS, n0);
        pv(s, Vs + st * BN * LDS);
      }
    } else {
      // Invariant: K(j) resident and visible; every warp is done with V(j-1).
      load_tile_async<BN, D, LDS, NT>(Vs, vb, v.ss, n0, Sk, tid);
      cp_async_commit();
      float s[MT][NKT][4];
      if (active) scores(s, Ks, n0);
      __syncthreads();  // every warp is done reading K(j)
      if (j + 1 < n_tiles) load_tile_async<BN, D, LDS, NT>(Ks, kb, k.ss, n0 + BN, Sk, tid);
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
        T* orow = o.row(hd.b, hd.h, row);
#pragma unroll
        for (int dt = 0; dt < NDT; ++dt) {
          const uint32_t pk = Mma::pack(acc[mi][dt][2 * h] * inv, acc[mi][dt][2 * h + 1] * inv);
          *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) = pk;
        }
        if (t == 0) lse[bh * Sq + row] = l > 0.f ? (m_r[mi][h] + log2f(l)) * kLn2 : -INFINITY;
      }
    }
}

// ---- launchers ------------------------------------------------------------------

// Kern over a grid of ceil(Sq / ROWS) query tiles x BH, THREADS threads, SMEM bytes.
template <auto Kern, int ROWS, int THREADS, int SMEM, typename T>
cudaError_t launch_fwd(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
  cudaError_t e = set_smem<Kern>(dev, SMEM);
  if (e != cudaSuccess) return e;
  const unsigned gx = ceil_div_u(a.Sq, ROWS);
  const float sl = a.scale * kLog2e;
  return for_bh_chunks(a.BH(), [&](int64_t bh0, unsigned nbh) {
    Kern<<<dim3(gx, nbh), THREADS, SMEM, stream>>>(
        rows_of<const T>(a.q, a.sq), rows_of<const T>(a.k, a.sk), rows_of<const T>(a.v, a.sv), rows_of<T>(a.o, a.so),
        static_cast<float*>(a.lse), a.H, a.G(), bh0, a.Sq, a.Sk, sl, a.causal);
  });
}

// The plan's tilings, the only ones instantiated (build time): attn_fwd_mma with 4 or 8
// warps, attn_fwd_mma_r32 at 32 rows per warp, 32-key tiles, 4 warps, 2 stages. Its template
// takes more (RPW 16/32, BN 32/64, WARPS 4/8, STAGES 1/2); the others measured slower
// (benchmarks/results/attention_sweep_h200.txt).
template <typename T, int D>
cudaError_t launch_fwd_mma(const AttentionFwdArgs& a, const AttnFwdPlan& p, int dev, cudaStream_t stream) {
  if (p.kernel == AttnFwdKernel::MmaR32) {
    constexpr int RPW = 32, BN = 32, WARPS = 4, STAGES = 2;
    return launch_fwd<attn_fwd_mma_r32<T, D, RPW, BN, WARPS, STAGES>, RPW * WARPS, WARPS * 32,
                      tc_fwd2_smem_bytes<D, RPW, BN, WARPS, STAGES>(), T>(a, dev, stream);
  }
  if (p.warps == 4)
    return launch_fwd<attn_fwd_mma<T, D, 4>, 16 * 4, 4 * 32, mma_fwd_smem_bytes<D, 4>(), T>(a, dev, stream);
  return launch_fwd<attn_fwd_mma<T, D, 8>, 16 * 8, 8 * 32, mma_fwd_smem_bytes<D, 8>(), T>(a, dev, stream);
}

template <typename T>
cudaError_t launch_fwd_mma_t(const AttentionFwdArgs& a, const AttnFwdPlan& p, int dev, cudaStream_t stream) {
  return a.D == 64 ? launch_fwd_mma<T, 64>(a, p, dev, stream) : launch_fwd_mma<T, 128>(a, p, dev, stream);
}

}  // namespace

cudaError_t attention_fwd_mma(const AttentionFwdArgs& a, const AttnFwdPlan& p, int dev, cudaStream_t stream) {
  return a.dtype == DType::BFloat16 ? launch_fwd_mma_t<__nv_bfloat16>(a, p, dev, stream)
                                    : launch_fwd_mma_t<__half>(a, p, dev, stream);
}

}  // namespace gpu_puzzles
