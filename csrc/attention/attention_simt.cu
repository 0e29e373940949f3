// SIMT attention kernels: every dtype (fp32 math for fp16/bf16/fp32, fp64 for fp64), any
// head dims D, Dv <= 256; the path for what the tensor-core kernels do not take. Same
// tiling and online softmax as those: one lane per key (forward, dQ) or per query (dK/dV)
// for the dot products, one lane per output column for the accumulation.
// Also the backward's delta = rowsum(dout * o), shared by both backward families.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention/attention_common.cuh"
#include "attention/attention_plan.h"
#include "common/device.cuh"
#include "common/func_attr.h"

namespace gpu_puzzles {
namespace {

constexpr unsigned kFull = 0xffffffffu;

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -static_cast<A>(INFINITY);
}

// Block = 4 warps. RPW rows (queries or keys) per warp; NC = 32-wide column
// chunks per lane (covers max(D, Dv) <= 32 * NC). KT = 32: one lane per key (or
// query) of the streamed tile. Tiles of the streamed operand are padded by one
// element per row so that lane-per-row dot products are bank-conflict free.
constexpr int kSimtWarps = 4;
constexpr int kSimtT = 32;

// Rows [r0, r0 + R) of an (n x W) slice whose rows are ss elements apart, as A, to a
// dense R x W tile in shared memory; rows past n are zero.
template <int R, typename A, typename T>
__device__ __forceinline__ void load_rows_acc(A* dst, const T* __restrict__ src, int64_t ss, int64_t r0, int64_t n,
                                              int W, int tid) {
  for (int idx = tid; idx < R * W; idx += blockDim.x) {
    const int r = idx / W, c = idx - r * W;
    const int64_t row = r0 + r;
    dst[idx] = row < n ? to_acc<A>(src[row * ss + c]) : A(0);
  }
}

template <typename T, typename A, int NC, int RPW>
__global__ void __launch_bounds__(kSimtWarps * 32)
    attn_fwd_simt(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<T> o, A* __restrict__ lse, int64_t H,
                  int64_t G, int64_t bh0, int64_t Sq, int64_t Sk, int D, int Dv, A scale, bool causal) {
  constexpr int BM = kSimtWarps * RPW;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* Qs = reinterpret_cast<A*>(smem_raw);  // [BM][D]
  A* Ks = Qs + BM * D;                     // [KT][D+1]
  A* Vs = Ks + kSimtT * (D + 1);           // [KT][Dv]

  const int64_t bh = bh0 + blockIdx.y;
  const HeadIdx hd(bh, H, G);
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const T* __restrict__ qb = q.head(hd.b, hd.h);
  const T* __restrict__ kb = k.head(hd.b, hd.hk);
  const T* __restrict__ vb = v.head(hd.b, hd.hk);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  load_rows_acc<BM>(Qs, qb, q.ss, m0, Sq, D, tid);

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
      Ks[j * (D + 1) + c] = key < Sk ? to_acc<A>(kb[key * k.ss + c]) : A(0);
    }
    load_rows_acc<kSimtT>(Vs, vb, v.ss, n0, Sk, Dv, tid);
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
    T* orow = o.row(hd.b, hd.h, row);
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
__global__ void __launch_bounds__(128) attn_bwd_delta(Rows<const T> o, Rows<const T> dout, A* __restrict__ delta,
                                                      int64_t H, int64_t Sq, int64_t rows, int Dv) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warp leaves together
  const int64_t bh = row / Sq, i = row - bh * Sq;
  const HeadIdx hd(bh, H, 1);  // o and dout only: no kv head
  const T* __restrict__ orow = o.row(hd.b, hd.h, i);
  const T* __restrict__ drow = dout.row(hd.b, hd.h, i);
  A s = A(0);
  for (int d = lane; d < Dv; d += 32) s += to_acc<A>(orow[d]) * to_acc<A>(drow[d]);
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// dQ = scale * sum_j dS_ij k_j, dS = P (dP - delta), one block per query tile.
template <typename T, typename A, int NC, int RPW>
__global__ void __launch_bounds__(kSimtWarps * 32)
    attn_bwd_dq_simt(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<const T> dout, const A* __restrict__ lse,
                     const A* __restrict__ delta, Rows<T> dq, int64_t H, int64_t G, int64_t bh0, int64_t Sq, int64_t Sk,
                     int D, int Dv, A scale, bool causal) {
  constexpr int BM = kSimtWarps * RPW;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* Qs = reinterpret_cast<A*>(smem_raw);  // [BM][D]
  A* dOs = Qs + BM * D;                    // [BM][Dv]
  A* Ks = dOs + BM * Dv;                   // [KT][D+1]
  A* Vs = Ks + kSimtT * (D + 1);           // [KT][Dv+1]

  const int64_t bh = bh0 + blockIdx.y;
  const HeadIdx hd(bh, H, G);
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * BM;
  const T* __restrict__ qb = q.head(hd.b, hd.h);
  const T* __restrict__ dob = dout.head(hd.b, hd.h);
  const T* __restrict__ kb = k.head(hd.b, hd.hk);
  const T* __restrict__ vb = v.head(hd.b, hd.hk);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  load_rows_acc<BM>(Qs, qb, q.ss, m0, Sq, D, tid);
  load_rows_acc<BM>(dOs, dob, dout.ss, m0, Sq, Dv, tid);
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
      Ks[j * (D + 1) + c] = key < Sk ? to_acc<A>(kb[key * k.ss + c]) : A(0);
    }
    for (int idx = tid; idx < kSimtT * Dv; idx += blockDim.x) {
      const int j = idx / Dv, c = idx - j * Dv;
      const int64_t key = n0 + j;
      Vs[j * (Dv + 1) + c] = key < Sk ? to_acc<A>(vb[key * v.ss + c]) : A(0);
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
    T* out = dq.row(hd.b, hd.h, row);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int d = lane + 32 * c;
      if (d < D) out[d] = from_acc<T>(acc[rr][c] * scale);
    }
  }
}

// dV = sum_i P_ij dout_i, dK = scale * sum_i dS_ij q_i, one block per key tile of a kv
// head (grid over B * Hkv); the sums run over the queries of all G query heads of its
// group, so dK and dV are written once, in a fixed order.
template <typename T, typename A, int NC, int RPW>
__global__ void __launch_bounds__(kSimtWarps * 32)
    attn_bwd_dkdv_simt(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<const T> dout, const A* __restrict__ lse,
                       const A* __restrict__ delta, Rows<T> dk, Rows<T> dv, int64_t Hkv, int64_t G, int64_t bh0,
                       int64_t Sq, int64_t Sk, int D, int Dv, A scale, bool causal) {
  constexpr int BN = kSimtWarps * RPW;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* Ks = reinterpret_cast<A*>(smem_raw);  // [BN][D]
  A* Vs = Ks + BN * D;                     // [BN][Dv]
  A* Qs = Vs + BN * Dv;                    // [QT][D+1]
  A* dOs = Qs + kSimtT * (D + 1);          // [QT][Dv+1]
  A* Ls = dOs + kSimtT * (Dv + 1);         // [QT]
  A* Dl = Ls + kSimtT;                     // [QT]

  const int64_t bhk = bh0 + blockIdx.y;
  const KvHeadIdx hd(bhk, Hkv, G);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
  const T* __restrict__ kb = k.head(hd.b, hd.hk);
  const T* __restrict__ vb = v.head(hd.b, hd.hk);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  load_rows_acc<BN>(Ks, kb, k.ss, n0, Sk, D, tid);
  load_rows_acc<BN>(Vs, vb, v.ss, n0, Sk, Dv, tid);
  A dk_acc[RPW][NC], dv_acc[RPW][NC];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr)
#pragma unroll
    for (int c = 0; c < NC; ++c) dk_acc[rr][c] = dv_acc[rr][c] = A(0);

  // Causal: queries i < n0 see none of this block's keys.
  const int64_t q_begin = causal ? (n0 / kSimtT) * kSimtT : 0;
  for (int64_t gi = 0; gi < G; ++gi) {  // the group's query heads, in order
    const T* __restrict__ qb = q.head(hd.b, hd.h0 + gi);
    const T* __restrict__ dob = dout.head(hd.b, hd.h0 + gi);
    const A* lb = lse + (bhk * G + gi) * Sq;
    const A* db = delta + (bhk * G + gi) * Sq;
    for (int64_t q0 = q_begin; q0 < Sq; q0 += kSimtT) {
      __syncthreads();
      for (int idx = tid; idx < kSimtT * D; idx += blockDim.x) {
        const int i = idx / D, c = idx - i * D;
        const int64_t qi = q0 + i;
        Qs[i * (D + 1) + c] = qi < Sq ? to_acc<A>(qb[qi * q.ss + c]) : A(0);
      }
      for (int idx = tid; idx < kSimtT * Dv; idx += blockDim.x) {
        const int i = idx / Dv, c = idx - i * Dv;
        const int64_t qi = q0 + i;
        dOs[i * (Dv + 1) + c] = qi < Sq ? to_acc<A>(dob[qi * dout.ss + c]) : A(0);
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
  }  // query heads of the group

#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int64_t key = n0 + warp * RPW + rr;
    if (key >= Sk) continue;
    T* dkr = dk.row(hd.b, hd.hk, key);
    T* dvr = dv.row(hd.b, hd.hk, key);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int d = lane + 32 * c;
      if (d < D) dkr[d] = from_acc<T>(dk_acc[rr][c] * scale);
      if (d < Dv) dvr[d] = from_acc<T>(dv_acc[rr][c]);
    }
  }
}

// ---- launchers ------------------------------------------------------------------

// Chunk count (32 columns each) covering a head dim, as a template dispatch.
template <typename F>
cudaError_t dispatch_nc(int64_t dmax, F&& f) {
  if (dmax <= 32) return f(std::integral_constant<int, 1>{});
  if (dmax <= 64) return f(std::integral_constant<int, 2>{});
  if (dmax <= 128) return f(std::integral_constant<int, 4>{});
  return f(std::integral_constant<int, 8>{});
}

template <typename T>
constexpr int simt_rpw() {
  return sizeof(acc_t<T>) == 8 ? 2 : 4;
}

template <typename T>
cudaError_t launch_fwd_simt(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
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
    return for_bh_chunks(a.BH(), [&](int64_t bh0, unsigned nbh) {
      kern<<<dim3(gx, nbh), kSimtWarps * 32, smem, stream>>>(
          rows_of<const T>(a.q, a.sq), rows_of<const T>(a.k, a.sk), rows_of<const T>(a.v, a.sv), rows_of<T>(a.o, a.so),
          static_cast<A*>(a.lse), a.H, a.G(), bh0, a.Sq, a.Sk, D, Dv, static_cast<A>(a.scale), a.causal);
    });
  });
}

template <typename T>
cudaError_t launch_bwd_simt(const AttentionBwdArgs& a, const acc_t<T>* delta, int dev, cudaStream_t stream) {
  using A = acc_t<T>;
  constexpr int RPW = simt_rpw<T>();
  return dispatch_nc(std::max(a.D, a.Dv), [&](auto nc) -> cudaError_t {
    constexpr int NC = decltype(nc)::value;
    const int D = static_cast<int>(a.D), Dv = static_cast<int>(a.Dv);
    const Rows<const T> q = rows_of<const T>(a.q, a.sq), k = rows_of<const T>(a.k, a.sk),
                        v = rows_of<const T>(a.v, a.sv), dout = rows_of<const T>(a.dout, a.sdo);
    const A* lse = static_cast<const A*>(a.lse);
    const A scale = static_cast<A>(a.scale);
    constexpr int R = kSimtWarps * RPW;
    if (a.Sk > 0) {
      const size_t smem_kv =
          sizeof(A) * (static_cast<size_t>(R) * D + R * Dv + kSimtT * (D + 1) + kSimtT * (Dv + 1) + 2 * kSimtT);
      constexpr auto kkv = attn_bwd_dkdv_simt<T, A, NC, RPW>;
      cudaError_t e = set_smem<kkv>(dev, smem_kv);
      if (e != cudaSuccess) return e;
      e = for_bh_chunks(a.BHkv(), [&](int64_t bh0, unsigned nbh) {
        kkv<<<dim3(ceil_div_u(a.Sk, R), nbh), kSimtWarps * 32, smem_kv, stream>>>(
            q, k, v, dout, lse, delta, rows_of<T>(a.dk, a.sdk), rows_of<T>(a.dv, a.sdv), a.Hkv, a.G(), bh0, a.Sq, a.Sk,
            D, Dv, scale, a.causal);
      });
      if (e != cudaSuccess) return e;
    }
    const size_t smem_q = sizeof(A) * (static_cast<size_t>(R) * D + R * Dv + kSimtT * (D + 1) + kSimtT * (Dv + 1));
    constexpr auto kq = attn_bwd_dq_simt<T, A, NC, RPW>;
    cudaError_t e = set_smem<kq>(dev, smem_q);
    if (e != cudaSuccess) return e;
    return for_bh_chunks(a.BH(), [&](int64_t bh0, unsigned nbh) {
      kq<<<dim3(ceil_div_u(a.Sq, R), nbh), kSimtWarps * 32, smem_q, stream>>>(
          q, k, v, dout, lse, delta, rows_of<T>(a.dq, a.sdq), a.H, a.G(), bh0, a.Sq, a.Sk, D, Dv, scale, a.causal);
    });
  });
}

}  // namespace

cudaError_t attention_fwd_simt(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
  return dispatch_dtype(a.dtype, [&](auto tag) { return launch_fwd_simt<decltype(tag)>(a, dev, stream); });
}

cudaError_t attention_bwd_delta(const AttentionBwdArgs& a, void* delta, cudaStream_t stream) {
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const int64_t rows = a.BH() * a.Sq;
    attn_bwd_delta<T, A>
        <<<ceil_div_u(rows, 4), 128, 0, stream>>>(rows_of<const T>(a.o, a.so), rows_of<const T>(a.dout, a.sdo),
                                                  static_cast<A*>(delta), a.H, a.Sq, rows, static_cast<int>(a.Dv));
    return cudaGetLastError();
  });
}

cudaError_t attention_bwd_simt(const AttentionBwdArgs& a, const void* delta, int dev, cudaStream_t stream) {
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch_bwd_simt<T>(a, static_cast<const acc_t<T>*>(delta), dev, stream);
  });
}

}  // namespace gpu_puzzles
