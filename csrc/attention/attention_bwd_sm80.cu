// Tensor-core attention backward (fp16/bf16, D == Dv in {64, 128}, sm_80+), mma.sync
// fragments as in the forward (attention_mma.cuh). Deterministic, no atomics: two passes
// after delta = rowsum(dO * O) (attention_simt.cu), each recomputing P = exp2(S - lse)
// from the forward's lse:
//   dK/dV pass: block = 64 keys (16 per warp) of one kv head, loops over the 32-query
//     tiles of each of the G query heads of its group (one double-buffered cp.async
//     pipeline across them): S^T = K Q^T, P^T = exp2(S^T - lse),
//     dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
//     So grouped heads (GQA) sum into registers and dK/dV are written once.
//   dQ pass: block = 64 queries (Q, dO fragments in registers), loops over
//     32-key tiles (double-buffered): S = Q K^T, P, dP = dO V^T, dS, dQ += dS K.
// The dQ pass recomputes S and dP (7 instead of 5 GEMMs) in exchange for determinism
// and no fp32 dq accumulator.
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

namespace gpu_puzzles {
namespace {

constexpr int kTcWarps = 4;
constexpr int kTcThreads = kTcWarps * 32;

// s += a1 X^T and d += a2 Y^T at k-step kk, X and Y row-major [NT * 8][LDS] tiles (their
// rows the n-tiles): S and dP of both kernels, one B read per operand.
template <typename Mma, int LDS, int NT, typename T>
__device__ __forceinline__ void mma_bt2(float (&s)[NT][4], float (&d)[NT][4], const uint32_t (&a1)[4],
                                        const uint32_t (&a2)[4], const T* X, const T* Y, int kk, int lane) {
#pragma unroll
  for (int np = 0; np < NT / 2; ++np) {
    const int brow = np * 16 + (lane & 7) + ((lane >> 4) << 3);
    const int bcol = kk * 16 + ((lane >> 3) & 1) * 8;
    uint32_t b[4];
    ldsm_x4(b, smem_addr(X + brow * LDS + bcol));
    Mma::run(s[2 * np], a1, b[0], b[1]);
    Mma::run(s[2 * np + 1], a1, b[2], b[3]);
    ldsm_x4(b, smem_addr(Y + brow * LDS + bcol));
    Mma::run(d[2 * np], a2, b[0], b[1]);
    Mma::run(d[2 * np + 1], a2, b[2], b[3]);
  }
}

// c0, c1 (two n-tiles) += a X for the 16 x 16 block of row-major X whose ldmatrix .trans
// address for this lane is p.
template <typename Mma, typename T>
__device__ __forceinline__ void mma_bn_pair(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4], const T* p) {
  uint32_t b[4];
  ldsm_x4_trans(b, smem_addr(p));
  Mma::run(c0, a, b[0], b[1]);
  Mma::run(c1, a, b[2], b[3]);
}

// ---- backward: dK, dV -------------------------------------------------------
constexpr int kBwdKN = 64;  // keys per block (16 per warp)
constexpr int kBwdKQ = 32;  // queries per tile

template <int D>
constexpr int tc_dkdv_smem_bytes() {
  return (2 * kBwdKN + 2 * 2 * kBwdKQ) * (D + 8) * 2 + 2 * 2 * kBwdKQ * 4;
}

template <typename T, int D>
__global__ void __launch_bounds__(kTcThreads)
    attn_bwd_dkdv_mma(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<const T> dout,
                      const float* __restrict__ lse, const float* __restrict__ delta, Rows<T> dk, Rows<T> dv,
                      int64_t Hkv, int64_t G, int64_t bh0, int64_t Sq, int64_t Sk, float scale, bool causal) {
  constexpr int LDS = D + 8;
  constexpr int NQT = kBwdKQ / 8;  // n-tiles over queries
  constexpr int NDT = D / 8;
  constexpr int KD = D / 16;
  using Mma = MmaOp<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);                        // [KN][LDS]
  T* Vs = Ks + kBwdKN * LDS;                                     // [KN][LDS]
  T* Qs = Vs + kBwdKN * LDS;                                     // [2][KQ][LDS]
  T* dOs = Qs + 2 * kBwdKQ * LDS;                                // [2][KQ][LDS]
  float* Ls = reinterpret_cast<float*>(dOs + 2 * kBwdKQ * LDS);  // [2][KQ]  lse * log2e (+inf past Sq)
  float* Dl = Ls + 2 * kBwdKQ;                                   // [2][KQ]  delta

  const int64_t bhk = bh0 + blockIdx.y;
  const KvHeadIdx hd(bhk, Hkv, G);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBwdKN;
  // The group's first query head; head h0 + gi lies gi head strides (lse, delta: gi * Sq) on.
  const T* qb = q.head(hd.b, hd.h0);
  const T* dob = dout.head(hd.b, hd.h0);
  const T* kb = k.head(hd.b, hd.hk);
  const T* vb = v.head(hd.b, hd.hk);
  const float* lb = lse + bhk * G * Sq;
  const float* db = delta + bhk * G * Sq;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const float scale_log2 = scale * kLog2e;

  const int64_t q_begin = causal ? (n0 / kBwdKQ) * kBwdKQ : 0;
  const int n_qt = q_begin < Sq ? static_cast<int>((Sq - q_begin + kBwdKQ - 1) / kBwdKQ) : 0;
  const int n_it = n_qt * static_cast<int>(G);  // iteration it: query head it / n_qt, its tile it % n_qt

  auto issue_q_tile = [&](int it) {
    const int buf = it & 1;
    const int gi = it / n_qt;
    const int64_t q0 = q_begin + static_cast<int64_t>(it - gi * n_qt) * kBwdKQ;
    load_tile_async<kBwdKQ, D, LDS, kTcThreads>(Qs + buf * kBwdKQ * LDS, qb + gi * q.sh, q.ss, q0, Sq, tid);
    load_tile_async<kBwdKQ, D, LDS, kTcThreads>(dOs + buf * kBwdKQ * LDS, dob + gi * dout.sh, dout.ss, q0, Sq, tid);
    if (tid < kBwdKQ) {
      const int64_t qi = q0 + tid;
      Ls[buf * kBwdKQ + tid] = qi < Sq ? lb[gi * Sq + qi] * kLog2e : INFINITY;
      Dl[buf * kBwdKQ + tid] = qi < Sq ? db[gi * Sq + qi] : 0.f;
    }
  };

  load_tile_async<kBwdKN, D, LDS, kTcThreads>(Ks, kb, k.ss, n0, Sk, tid);
  load_tile_async<kBwdKN, D, LDS, kTcThreads>(Vs, vb, v.ss, n0, Sk, tid);
  if (n_it > 0) issue_q_tile(0);
  cp_async_commit();

  float dk_acc[NDT][4], dv_acc[NDT][4];
#pragma unroll
  for (int i = 0; i < NDT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[i][e] = dv_acc[i][e] = 0.f;

  const int kw = warp * 16;  // this warp's key rows within the block
  const int64_t key_g[2] = {n0 + kw + g, n0 + kw + g + 8};

  for (int it = 0; it < n_it; ++it) {
    const int buf = it & 1;
    const int64_t q0 = q_begin + static_cast<int64_t>(it % n_qt) * kBwdKQ;
    cp_async_wait<0>();
    __syncthreads();  // tile it visible; every warp done with tile it-1 (the other buffer)
    if (it + 1 < n_it) issue_q_tile(it + 1);
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
      mma_bt2<Mma, LDS>(st, dpt, ka, va, Qb, dOb, kk, lane);
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
      Mma::pack_a(pa, st, kk);
      Mma::pack_a(sa, dpt, kk);
      const int brow = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int dp = 0; dp < NDT / 2; ++dp) {
        const int bcol = dp * 16 + (lane >> 4) * 8;
        mma_bn_pair<Mma>(dv_acc[2 * dp], dv_acc[2 * dp + 1], pa, dOb + brow * LDS + bcol);
        mma_bn_pair<Mma>(dk_acc[2 * dp], dk_acc[2 * dp + 1], sa, Qb + brow * LDS + bcol);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t key = key_g[h];
    if (key >= Sk) continue;
    T* dkr = dk.row(hd.b, hd.hk, key);
    T* dvr = dv.row(hd.b, hd.hk, key);
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

template <int D>
constexpr int tc_dq_smem_bytes() {
  return (2 * kBwdQM + 2 * 2 * kBwdQN) * (D + 8) * 2;
}

// D = 64: at most 128 registers, so 4 blocks (16 warps) share an SM; ptxas fits the kernel
// in them without spilling, and left free it takes ~150 (3 blocks).
template <typename T, int D>
__global__ void __launch_bounds__(kTcThreads, D == 64 ? 4 : 1)
    attn_bwd_dq_mma(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<const T> dout,
                    const float* __restrict__ lse, const float* __restrict__ delta, Rows<T> dq, int64_t H, int64_t G,
                    int64_t bh0, int64_t Sq, int64_t Sk, float scale, bool causal) {
  constexpr int LDS = D + 8;
  constexpr int NKT = kBwdQN / 8;  // n-tiles over keys
  constexpr int NDT = D / 8;
  constexpr int KD = D / 16;
  using Mma = MmaOp<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);  // [QM][LDS]
  T* dOs = Qs + kBwdQM * LDS;              // [QM][LDS]
  T* Ks = dOs + kBwdQM * LDS;              // [2][QN][LDS]
  T* Vs = Ks + 2 * kBwdQN * LDS;           // [2][QN][LDS]

  const int64_t bh = bh0 + blockIdx.y;
  const int64_t mblk = causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int64_t m0 = mblk * kBwdQM;
  const auto [hd, qb, kb, vb] = qkv_heads(q, k, v, bh, H, G);
  const T* dob = dout.head(hd.b, hd.h);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const float scale_log2 = scale * kLog2e;

  const int n_tiles = key_tiles<kBwdQM, kBwdQN>(m0, Sq, Sk, causal);

  const int64_t row_g[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};
  float lse2[2], dl[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    lse2[h] = row_g[h] < Sq ? lse[bh * Sq + row_g[h]] * kLog2e : INFINITY;
    dl[h] = row_g[h] < Sq ? delta[bh * Sq + row_g[h]] : 0.f;
  }

  load_tile_async<kBwdQM, D, LDS, kTcThreads>(Qs, qb, q.ss, m0, Sq, tid);
  load_tile_async<kBwdQM, D, LDS, kTcThreads>(dOs, dob, dout.ss, m0, Sq, tid);
  if (n_tiles > 0) {
    load_tile_async<kBwdQN, D, LDS, kTcThreads>(Ks, kb, k.ss, 0, Sk, tid);
    load_tile_async<kBwdQN, D, LDS, kTcThreads>(Vs, vb, v.ss, 0, Sk, tid);
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
      load_tile_async<kBwdQN, D, LDS, kTcThreads>(Ks + (buf ^ 1) * kBwdQN * LDS, kb, k.ss, n0 + kBwdQN, Sk, tid);
      load_tile_async<kBwdQN, D, LDS, kTcThreads>(Vs + (buf ^ 1) * kBwdQN * LDS, vb, v.ss, n0 + kBwdQN, Sk, tid);
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
      mma_bt2<Mma, LDS>(s, dp, qf[kk], df[kk], Kb, Vb, kk, lane);
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
      Mma::pack_a(sa, s, kk);
      const int brow = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int dt2 = 0; dt2 < NDT / 2; ++dt2)
        mma_bn_pair<Mma>(acc[2 * dt2], acc[2 * dt2 + 1], sa, Kb + brow * LDS + dt2 * 16 + (lane >> 4) * 8);
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row_g[h];
    if (row >= Sq) continue;
    T* out = dq.row(hd.b, hd.h, row);
#pragma unroll
    for (int dt = 0; dt < NDT; ++dt)
      *reinterpret_cast<uint32_t*>(out + dt * 8 + 2 * t) =
          Mma::pack(acc[dt][2 * h] * scale, acc[dt][2 * h + 1] * scale);
  }
}

// ---- launcher -------------------------------------------------------------------

template <typename T, int D>
cudaError_t launch_bwd_mma(const AttentionBwdArgs& a, const float* delta, int dev, cudaStream_t stream) {
  constexpr int smem_kv = tc_dkdv_smem_bytes<D>();
  constexpr int smem_q = tc_dq_smem_bytes<D>();
  constexpr auto kkv = attn_bwd_dkdv_mma<T, D>;
  constexpr auto kq = attn_bwd_dq_mma<T, D>;
  cudaError_t e = set_smem<kkv>(dev, smem_kv);
  if (e != cudaSuccess) return e;
  e = set_smem<kq>(dev, smem_q);
  if (e != cudaSuccess) return e;
  const Rows<const T> q = rows_of<const T>(a.q, a.sq), k = rows_of<const T>(a.k, a.sk), v = rows_of<const T>(a.v, a.sv),
                      dout = rows_of<const T>(a.dout, a.sdo);
  const float* lse = static_cast<const float*>(a.lse);
  if (a.Sk > 0) {
    e = for_bh_chunks(a.BHkv(), [&](int64_t bh0, unsigned nbh) {
      kkv<<<dim3(ceil_div_u(a.Sk, kBwdKN), nbh), kTcThreads, smem_kv, stream>>>(
          q, k, v, dout, lse, delta, rows_of<T>(a.dk, a.sdk), rows_of<T>(a.dv, a.sdv), a.Hkv, a.G(), bh0, a.Sq, a.Sk,
          a.scale, a.causal);
    });
    if (e != cudaSuccess) return e;
  }
  return for_bh_chunks(a.BH(), [&](int64_t bh0, unsigned nbh) {
    kq<<<dim3(ceil_div_u(a.Sq, kBwdQM), nbh), kTcThreads, smem_q, stream>>>(
        q, k, v, dout, lse, delta, rows_of<T>(a.dq, a.sdq), a.H, a.G(), bh0, a.Sq, a.Sk, a.scale, a.causal);
  });
}

}  // namespace

cudaError_t attention_bwd_mma(const AttentionBwdArgs& a, const float* delta, int dev, cudaStream_t stream) {
  if (a.dtype == DType::BFloat16)
    return a.D == 64 ? launch_bwd_mma<__nv_bfloat16, 64>(a, delta, dev, stream)
                     : launch_bwd_mma<__nv_bfloat16, 128>(a, delta, dev, stream);
  return a.D == 64 ? launch_bwd_mma<__half, 64>(a, delta, dev, stream)
                   : launch_bwd_mma<__half, 128>(a, delta, dev, stream);
}

}  // namespace gpu_puzzles
