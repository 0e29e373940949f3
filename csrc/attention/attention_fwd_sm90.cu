// Attention forward for Hopper with warpgroup MMA (wgmma, sm_90a), via CuTe.
//
// Why: wgmma reads both operands of S = Q K^T straight from swizzled shared memory
// and runs 64 x N x 16 per instruction per warpgroup, asynchronously; the mma.sync
// kernels (attention_fwd_sm80.cu) stay well below it at D = 128
// (benchmarks/results/attention_sweep_h100.txt).
//
// Design (no warp specialisation):
//  * CTA = NWG = 2 (or 3) consumer warpgroups; warpgroup w owns query rows
//    [m0 + 64 w, m0 + 64 w + 64) (wgmma M = 64). BM = 64 NWG query rows per CTA.
//  * Q tile (BM x D) in shared memory, K-major, 128-byte swizzle (GMMA layout).
//  * K and V tiles of BN = 128 (or 64) keys stream through a 2-stage ring, loaded with
//    cp.async (16-byte chunks, rows past Sk zero-filled): tile j+1 is fetched while
//    tile j is computed; one __syncthreads per tile. cp.async writes go through the
//    generic proxy and wgmma reads through the async proxy, so every thread fences
//    (fence.proxy.async.shared::cta) after its copies land, before the barrier.
//  * S = Q K^T: SS wgmma (both K-major), fp32 accumulators in registers.
//  * Online softmax on the accumulator fragment (common/online_softmax.cuh: exp2,
//    log2(e) * scale folded in; running max and per-thread partial sums; a row's values
//    live in the 4 lanes of a quad, see CLayout_64xN below).
//  * P -> fp16/bf16 in registers, reused as the register A operand of O += P V (RS
//    wgmma). V stays as loaded (keys x D, D contiguous), which as the B operand
//    (N = D, K = keys) is MN-major: allowed for 16-bit types.
//  * Causal: key tiles wholly above the diagonal are never loaded; a warpgroup whose
//    rows all precede a tile's first key skips its math; diagonal / tail tiles mask.
//    CTAs run heaviest-first. Rows past Sq are computed on zeros, never stored.
//  * Epilogue: O / l straight from registers (4-byte stores), lse = (m + log2 l) ln2.
//
// Built only with the CUTLASS headers (setup.py); the sm_90 target must be sm_90a.
// On any other target the kernel body is a trap: the host launches it only after
// checking that the loaded image was compiled from compute_90(a) for a 9.x device.
//
// CuTe's device asserts inside the GMMA code make ptxas serialise the wgmma pipeline
// (warning C7510 / slow code); none of them guards our logic, so build this file
// with NDEBUG.
#ifndef NDEBUG
#define NDEBUG
#endif

#include "attention/attention_fwd_sm90.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "attention/attention_common.cuh"
#include "common/cp_async.cuh"
#include "common/device.cuh"
#include "common/func_attr.h"
#include "common/online_softmax.cuh"

namespace gpu_puzzles {
namespace {

using namespace cute;

template <class Elem, int D_, int BN_, int NWG_> struct Sm90FwdCfg {
  static constexpr int D = D_, BN = BN_, NWG = NWG_;
  static constexpr int BM = 64 * NWG;
  static constexpr int kThreads = 128 * NWG;
  static_assert(D == 64 || D == 128, "D");
  static_assert(BN % 64 == 0 && BN <= 256, "BN");
  // 128-byte swizzle: a Q/K row of D >= 64 halves spans whole 128-byte swizzle rows;
  // V^T (D x keys, D contiguous) uses the MN-major atom (64 D-elements x 8 keys).
  using LayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<BM>, Int<D>>{}));
  using LayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<BN>, Int<D>>{}));
  // Atoms ordered K-first (Step<_2, _1>), as CUTLASS's sm90 collective builder orders MN-major tiles.
  using LayoutVt =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<Int<D>, Int<BN>>{}, Step<_2, _1>{}));
  // One warpgroup per TiledMMA (each warpgroup runs its own 64-row problem).
  using OpS = decltype(SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<BN>, Int<D>>,
                                                  GMMA::Major::K, GMMA::Major::K>());
  using OpO = decltype(SM90::GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<D>, Int<BN>>,
                                                  GMMA::Major::K, GMMA::Major::MN>());
  using MmaS = decltype(make_tiled_mma(OpS{}));
  using MmaO = decltype(make_tiled_mma(OpO{}));
  // The softmax and the P -> A-operand reuse rely on these register layouts:
  // accumulator value i of a thread = (col + (i & 1), row + 8 * ((i >> 1) & 1), col + 8 * (i >> 2)),
  // and the 64x16 A fragment has the same form, so S values [8 kk, 8 kk + 8) are
  // exactly the A fragment of k-step kk of P V.
  static_assert(std::is_same<typename MMA_Traits<OpS>::Shape_MNK, Shape<_64, Int<BN>, _16>>::value, "S atom N");
  static_assert(std::is_same<typename MMA_Traits<OpO>::Shape_MNK, Shape<_64, Int<D>, _16>>::value, "O atom N");
  static_assert(std::is_same<typename MMA_Traits<OpS>::CLayout, GMMA::CLayout_64xN<BN>>::value, "S C layout");
  static_assert(std::is_same<typename MMA_Traits<OpO>::CLayout, GMMA::CLayout_64xN<D>>::value, "O C layout");
  static_assert(std::is_same<typename MMA_Traits<OpO>::ALayout, GMMA::ALayout_64x16>::value, "P A layout");
  static_assert(std::is_same<GMMA::ALayout_64x16, GMMA::CLayout_64xN<16>>::value, "A == C(64x16)");
  static_assert(cosize(LayoutQ{}) == BM * D && cosize(LayoutK{}) == BN * D && cosize(LayoutVt{}) == BN * D,
                "compact smem tiles");
  static constexpr int kTileElems = BN * D;
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Elem)) * (BM * D + 2 * 2 * kTileElems);
  static_assert((BM * D * sizeof(Elem)) % 1024 == 0 && (kTileElems * sizeof(Elem)) % 1024 == 0,
                "every tile starts 1024-byte aligned (128-byte swizzle phase)");
};

// Device code below is compiled for sm_90a only (the other targets get the trap stub).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
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

// The pieces both forward kernels run per key tile, on one warpgroup's 64 query rows.

// S = Q K^T (SS wgmma, both K-major), completed on return.
template <int D, class Mma, class TQ, class TK, class TS>
__device__ __forceinline__ void gemm_qk(Mma& mma_s, const TQ& tSrQ, const TK& tSrK, TS& tSrS) {
  warpgroup_fence_operand(tSrS);
  warpgroup_arrive();
  mma_s.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int kb2 = 0; kb2 < D / 16; ++kb2) {
    cute::gemm(mma_s, tSrQ(_, _, kb2), tSrK(_, _, kb2), tSrS);
    mma_s.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
}

// Scale to the log2 domain and mask. Key c (tile-relative) is visible to tile row r
// iff c < kv_lim and (!causal || c <= r + diag).
template <int BN, class TS, class TC>
__device__ __forceinline__ void scale_mask(TS& tSrS, const TC& tScS, float scale_log2, int64_t n0, int64_t Sk,
                                           int64_t wrow0, bool causal) {
  const bool need_mask = (n0 + BN > Sk) || (causal && n0 + BN - 1 > wrow0);
  const int kv_lim = static_cast<int>(std::min<int64_t>(Sk - n0, BN));
  const int diag = static_cast<int>(std::max<int64_t>(std::min<int64_t>(wrow0 - n0, BN), -2 * BN));
#pragma unroll
  for (int i = 0; i < size(tSrS); ++i) {
    float x = tSrS(i) * scale_log2;
    if (need_mask) {
      const int r = get<0>(tScS(i)), c = get<1>(tScS(i));
      if (c >= kv_lim || (causal && c > r + diag)) x = -INFINITY;
    }
    tSrS(i) = x;
  }
}

// Online softmax (value i is in row half h = (i >> 1) & 1, n-tile i / 4), then P to
// 16-bit pairs (value 2i low half, 2i + 1 high half: one A register each).
template <int BN, int D, class Elem, class TS, class TO, class TP>
__device__ __forceinline__ void softmax_to_p(TS& tSrS, TO& tOrO, TP& tOrP, float (&m_r)[2], float (&l_r)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
    online_softmax_step<true, false, BN / 8, D / 8>(
        [&](int nb, int e) -> float& { return tSrS(4 * nb + e); },
        [&](int nb, int e) -> float& { return tOrO(4 * nb + e); }, m_r[h], l_r[h], h);
  Tensor tOrP32 = recast<uint32_t>(tOrP);
#pragma unroll
  for (int i = 0; i < size(tOrP32); ++i) tOrP32(i) = pack2<Elem>(tSrS(2 * i), tSrS(2 * i + 1));
}

// O += P V (RS wgmma: P from registers), completed on return.
template <int BN, class Mma, class TP, class TV, class TO>
__device__ __forceinline__ void gemm_pv(Mma& mma_o, TP& tOrP, const TV& tOrV, TO& tOrO) {
  warpgroup_fence_operand(tOrP);
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
#pragma unroll
  for (int kb2 = 0; kb2 < BN / 16; ++kb2) cute::gemm(mma_o, tOrP(_, _, kb2), tOrV(_, _, kb2), tOrO);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(tOrO);
  warpgroup_fence_operand(tOrP);
}

// Epilogue: O / l, lse = (m + log2 l) * ln2 (natural log); l == 0 only when Sk == 0.
template <int D, class Elem, class TO, class TC>
__device__ __forceinline__ void store_rows(TO& tOrO, const TC& tOcO, const float (&m_r)[2], const float (&l_r)[2],
                                           const Rows<Elem>& o, float* __restrict__ lse, const HeadIdx& hd,
                                           int64_t bh, int64_t wrow0, int64_t Sq) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(l_r[h]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t row = wrow0 + get<0>(tOcO(2 * h));
    if (row < Sq) {
      Elem* orow = o.row(hd.b, hd.h, row);
#pragma unroll
      for (int nb = 0; nb < D / 8; ++nb) {
        const int i = 4 * nb + 2 * h;
        const int c = get<1>(tOcO(i));  // even; value i + 1 is column c + 1
        *reinterpret_cast<uint32_t*>(orow + c) = pack2<Elem>(tOrO(i) * inv, tOrO(i + 1) * inv);
      }
      if (get<1>(tOcO(0)) == 0) lse[bh * Sq + row] = l > 0.f ? (m_r[h] + log2f(l)) * kLn2 : -INFINITY;
    }
  }
}

template <class Cfg, class Elem>
__device__ __forceinline__ void fwd_sm90_body(const Rows<const Elem> q, const Rows<const Elem> k,
                                              const Rows<const Elem> v, const Rows<Elem> o,
                                              float* __restrict__ lse, int64_t H, int64_t G, int64_t bh0,
                                              int64_t Sq, int64_t Sk, float scale_log2, bool causal) {
  constexpr int D = Cfg::D, BN = Cfg::BN, BM = Cfg::BM, NT = Cfg::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Elem* q_s = reinterpret_cast<Elem*>(smem_raw);
  Elem* k_s = q_s + BM * D;                // [2][BN * D]
  Elem* v_s = k_s + 2 * Cfg::kTileElems;   // [2][BN * D]
  Tensor sQ = make_tensor(make_smem_ptr(q_s), typename Cfg::LayoutQ{});  // (BM, D)

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform by construction; tell the compiler
  const int wtid = tid % 128;
  const int64_t bh = bh0 + blockIdx.y;
  const int64_t mblk = causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;  // heaviest first
  const int64_t m0 = mblk * BM;
  const int64_t wrow0 = m0 + 64 * wg;  // this warpgroup's first query row
  const HeadIdx hd(bh, H, G);
  const Elem* qb = q.head(hd.b, hd.h);
  const Elem* kb = k.head(hd.b, hd.hk);
  const Elem* vb = v.head(hd.b, hd.hk);

  const int64_t row_end = std::min<int64_t>(m0 + BM, Sq);
  const int64_t n_end = causal ? std::min<int64_t>(Sk, row_end) : Sk;
  const int n_tiles = static_cast<int>((n_end + BN - 1) / BN);

  auto load_kv = [&](int stage, int64_t n0) {
    Tensor sK = make_tensor(make_smem_ptr(k_s + stage * Cfg::kTileElems), typename Cfg::LayoutK{});   // (BN, D)
    Tensor sVt = make_tensor(make_smem_ptr(v_s + stage * Cfg::kTileElems), typename Cfg::LayoutVt{});  // (D, BN)
    load_rows_async<BN, D, NT>([&](int r, int c) { return &sK(r, c); }, kb, k.ss, n0, Sk, tid);
    // The swizzles permute 16-byte units only: 8 consecutive d of one key stay contiguous.
    load_rows_async<BN, D, NT>([&](int r, int c) { return &sVt(c, r); }, vb, v.ss, n0, Sk, tid);
  };

  load_rows_async<BM, D, NT>([&](int r, int c) { return &sQ(r, c); }, qb, q.ss, m0, Sq, tid);
  if (n_tiles > 0) load_kv(0, 0);
  cp_async_commit();

  typename Cfg::MmaS mma_s;
  typename Cfg::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(wtid);
  auto thr_o = mma_o.get_thread_slice(wtid);
  Tensor sQw = local_tile(sQ, Shape<_64, Int<D>>{}, make_coord(wg, 0));  // (64, D), this warpgroup's rows
  Tensor tSrQ = thr_s.partition_fragment_A(sQw);                         // descriptors (1, 1, D/16)

  Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, Int<BN>>{});  // fp32 ((2,2,BN/8),1,1)
  Tensor tOrO = partition_fragment_C(mma_o, Shape<_64, Int<D>>{});   // fp32 ((2,2,D/8),1,1)
  static_assert(decltype(size(tSrS))::value == BN / 2, "S fragment");
  static_assert(decltype(size(tOrO))::value == D / 2, "O fragment");
  static_assert(decltype(size<2>(tSrQ))::value == D / 16, "Q k-blocks");
  // P as the RS A operand: k-step kk holds S values [8 kk, 8 kk + 8) (compact, column-major).
  Tensor tOrP = make_tensor<Elem>(Shape<Shape<_2, _2, _2>, _1, Int<BN / 16>>{});
  static_assert(decltype(size(tOrP))::value == BN / 2, "P fragment");
  // (row, col) of each accumulator value in the warpgroup's 64 x N tile.
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<_64, Int<BN>>{}));
  Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<_64, Int<D>>{}));
  clear(tOrO);

  float m_r[2] = {-INFINITY, -INFINITY};  // running max per row half (log2 domain)
  float l_r[2] = {0.f, 0.f};              // this thread's partial row sums

  for (int j = 0; j < n_tiles; ++j) {
    const int st = j & 1;
    const int64_t n0 = static_cast<int64_t>(j) * BN;
    cp_async_wait<0>();  // tile j (and Q) landed for this thread's copies
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // ... visible to wgmma (async proxy)
    __syncthreads();  // ... for all threads; every warpgroup is done with stage st ^ 1 (tile j - 1)
    if (j + 1 < n_tiles) load_kv(st ^ 1, n0 + BN);
    cp_async_commit();

    // Warpgroup-uniform: rows all past Sq (never stored) or all above this tile's keys.
    const bool active = wrow0 < Sq && !(causal && n0 > wrow0 + 63);
    if (!active) continue;
    Tensor sK = make_tensor(make_smem_ptr(k_s + st * Cfg::kTileElems), typename Cfg::LayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(v_s + st * Cfg::kTileElems), typename Cfg::LayoutVt{});
    Tensor tSrK = thr_s.partition_fragment_B(sK);   // (1, 1, D/16)
    Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (1, 1, BN/16)

    gemm_qk<D>(mma_s, tSrQ, tSrK, tSrS);
    scale_mask<BN>(tSrS, tScS, scale_log2, n0, Sk, wrow0, causal);
    softmax_to_p<BN, D, Elem>(tSrS, tOrO, tOrP, m_r, l_r);
    gemm_pv<BN>(mma_o, tOrP, tOrV, tOrO);
  }
  cp_async_wait<0>();  // no copy may outlive the CTA (the last group is empty)
  store_rows<D>(tOrO, tOcO, m_r, l_r, o, lse, hd, bh, wrow0, Sq);
}

#endif  // sm_90a device code

template <class Cfg, class Elem>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
attn_fwd_sm90(const Rows<const Elem> q, const Rows<const Elem> k, const Rows<const Elem> v, const Rows<Elem> o,
              float* __restrict__ lse, int64_t H, int64_t G, int64_t bh0, int64_t Sq, int64_t Sk,
              float scale_log2, bool causal) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  fwd_sm90_body<Cfg, Elem>(q, k, v, o, lse, H, G, bh0, Sq, Sk, scale_log2, causal);
#elif defined(__CUDA_ARCH__)
  __trap();  // not sm_90a: the host never launches this image (attention_forward_sm90_available)
#endif
}

// Tilings (registers per thread are fp32 O D/2 + S BN/2 + 16-bit P BN/4; nvcc 13.0, no spills):
//  2 warpgroups ("wgmma"): BM = 128, BN = 128; 221 regs / 160 KiB smem (D = 128), 166 / 80 KiB (D = 64).
//  3 warpgroups ("wgmma3"): BM = 192 (a third less K/V traffic from L2 per FLOP, 12 warps to hide
//    latency), BN = 64 at D = 128 (141 regs, 112 KiB; BN = 128 would pass the 168-register cap of
//    384 threads) and BN = 128 at D = 64 (160 regs, 88 KiB).
template <class Elem, int D> using FwdCfgSm90 = Sm90FwdCfg<Elem, D, 128, 2>;
template <class Elem, int D> using FwdCfgSm90W3 = Sm90FwdCfg<Elem, D, D == 128 ? 64 : 128, 3>;

template <class Cfg, class Elem> cudaError_t launch_sm90(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
  constexpr auto kern = attn_fwd_sm90<Cfg, Elem>;
  cudaError_t e = set_smem<kern>(dev, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  const unsigned gx = static_cast<unsigned>((a.Sq + Cfg::BM - 1) / Cfg::BM);
  const float sl = a.scale * kLog2e;
  return for_bh_chunks(a.BH(), [&](int64_t bh0, unsigned nbh) {
    kern<<<dim3(gx, nbh), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
        rows_of<const Elem>(a.q, a.sq), rows_of<const Elem>(a.k, a.sk), rows_of<const Elem>(a.v, a.sv),
        rows_of<Elem>(a.o, a.so), static_cast<float*>(a.lse), a.H, a.G(), bh0, a.Sq, a.Sk, sl, a.causal);
  });
}

template <class Elem>
cudaError_t launch_sm90_d(const AttentionFwdArgs& a, int warpgroups, int dev, cudaStream_t stream) {
  if (warpgroups == 3)
    return a.D == 64 ? launch_sm90<FwdCfgSm90W3<Elem, 64>, Elem>(a, dev, stream)
                     : launch_sm90<FwdCfgSm90W3<Elem, 128>, Elem>(a, dev, stream);
  return a.D == 64 ? launch_sm90<FwdCfgSm90<Elem, 64>, Elem>(a, dev, stream)
                   : launch_sm90<FwdCfgSm90<Elem, 128>, Elem>(a, dev, stream);
}

}  // namespace

bool attention_forward_sm90_available(int dev, cudaError_t& err) {
  err = cudaSuccess;
  // Per device: 0 unknown, 1 yes, 2 no. A 9.x device, and the kernel's loaded code
  // compiled from compute_90(a) (a JIT from older PTX would run the trap stub).
  static std::atomic<int> state[kMaxCachedDevices];
  const bool cache = cacheable_device(dev);
  int s = cache ? state[dev].load(std::memory_order_relaxed) : 0;
  if (s == 0) {
    int major = 0;
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err != cudaSuccess) return false;
    bool ok = false;
    if (major == 9) {
      cudaFuncAttributes fa;
      const cudaError_t fe = cudaFuncGetAttributes(
          &fa, attn_fwd_sm90<FwdCfgSm90<cutlass::half_t, 64>, cutlass::half_t>);
      if (fe == cudaSuccess) {
        ok = fa.ptxVersion >= 90 && fa.ptxVersion < 100 && fa.binaryVersion >= 90 && fa.binaryVersion < 100;
      } else {
        (void)cudaGetLastError();  // no image for this device: not available, not an error
      }
    }
    s = ok ? 1 : 2;
    if (cache) state[dev].store(s, std::memory_order_relaxed);
  }
  return s == 1;
}

cudaError_t attention_forward_sm90(const AttentionFwdArgs& a, int warpgroups, int dev, cudaStream_t stream) {
  warpgroups = warpgroups == 3 ? 3 : 2;
  return a.dtype == DType::BFloat16 ? launch_sm90_d<cutlass::bfloat16_t>(a, warpgroups, dev, stream)
                                    : launch_sm90_d<cutlass::half_t>(a, warpgroups, dev, stream);
}

}  // namespace gpu_puzzles
