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

#include <cute/tensor.hpp>  // first: the atom headers below build on it
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "attention/attention_common.cuh"
#include "attention/attention_sm90.cuh"
#include "common/cp_async.cuh"
#include "common/device.cuh"
#include "common/func_attr.h"
#include "common/online_softmax.cuh"

namespace gpu_puzzles {
namespace {

using namespace cute;

template <class Elem, int D_, int BN_, int NWG_>
struct Sm90FwdCfg {
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
  using OpS = decltype(SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<BN>, Int<D>>, GMMA::Major::K,
                                                  GMMA::Major::K>());
  using OpO = decltype(SM90::GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<D>, Int<BN>>, GMMA::Major::K,
                                                  GMMA::Major::MN>());
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

// ---- The warp-specialised forward (knob attention_fwd=ws) --------------------------------
//
// Why: above, every thread issues K/V copies and a CTA-wide barrier per tile keeps the
// warpgroups in lockstep, so their softmax phases coincide while the tensor cores idle.
// Here (the layout of FlashAttention-3's forward):
//  * warpgroup 0 is the producer: one thread issues TMA bulk-tensor loads of the Q tile
//    (once) and of each K and V tile into a kStages-deep ring. Each stage has a "full"
//    mbarrier, where the copy engine completes the tile's bytes, and an "empty" one, where
//    each consumer warpgroup arrives once it is done with the stage. The producer gives
//    its registers to the consumers (setmaxnreg).
//  * warpgroups 1 and 2 are the consumers, 64 query rows each, with the per-tile math of
//    the kernel above; they wait only on the stage barriers, so they drift apart and one
//    warpgroup's softmax runs under the other's GEMMs.
//  * The TMA reads (row, head, batch) through the tensors' own strides, so q/k/v views
//    of a fused projection are read in place, and zero-fills rows past Sq / Sk.
//  * V's tile lands as K's does (keys x D, 128-byte swizzle): that is the MN-major
//    (D x keys) layout the PV GEMM reads (ws_layouts_agree below).
//  * kOverlap (knob "ws2"): each consumer also overlaps its own GEMMs with its softmax
//    (S of the next tile is issued before P V of the last one; see the loop); kPingpong
//    ("ws3") on top makes the consumers take turns to issue their GEMMs.
//  * kConsumers = 3 ("ws192", D = 64 only): 192 query rows a CTA, three consumers taking
//    turns. At D = 64 a tile's GEMMs are half as long against the same softmax, so a third
//    consumer keeps the tensor cores busier (FlashAttention-3's D = 64 tiling).
template <class Elem, int D_, int BN_, int Stages_, int Consumers_, bool Overlap_, bool Pingpong_>
struct WsFwdCfg {
  using Base = Sm90FwdCfg<Elem, D_, BN_, Consumers_>;  // tiles, MMAs and register layouts of the kernel above
  static constexpr int D = D_, BN = BN_, kStages = Stages_, BM = Base::BM, kConsumers = Consumers_;
  static_assert(kConsumers == 2 || kConsumers == 3, "consumers");
  // The consumers' loop (see attn_fwd_ws_sm90): overlapped GEMMs and softmax, and turns.
  static constexpr bool kOverlap = Overlap_, kPingpong = Pingpong_;
  static_assert(kOverlap || !kPingpong, "pingpong is built on the overlapped loop");
  static_assert(kPingpong || kConsumers == 2, "three consumers run the overlapped loop with turns only");
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // setmaxnreg: 128 x 24 + 256 x 240 registers fit the SM's 64 K, or 128 x 32 + 384 x 160.
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32, kConsumerRegs = kConsumers == 2 ? 240 : 160;
  using LayoutQ = typename Base::LayoutQ;    // (BM, D)
  using LayoutK = typename Base::LayoutK;    // (BN, D), one stage
  using LayoutVt = typename Base::LayoutVt;  // (D, BN), one stage
  using LayoutKV = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                          Shape<Int<BN>, Int<D>, Int<kStages>>{}));  // the TMA's view of the ring
  using MmaS = typename Base::MmaS;
  using MmaO = typename Base::MmaO;
  static constexpr int kTileElems = BN * D;
  static constexpr uint32_t kQBytes = BM * D * sizeof(Elem), kTileBytes = kTileElems * sizeof(Elem);
  using LayoutQ2 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                          Shape<Int<BM>, Int<D>, _2>{}));  // the TMA's view of both Q buffers
  struct Smem {
    alignas(1024) Elem q[2 * BM * D];  // two items' Q: the next one's loads while this one's runs
    alignas(1024) Elem k[kStages * kTileElems];
    alignas(1024) Elem v[kStages * kTileElems];
    alignas(8) uint64_t q_full[2], q_empty[2];
    uint64_t k_full[kStages], k_empty[kStages], v_full[kStages], v_empty[kStages];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem));
};

// The ring's stage s, element (key r, dim c), sits where a one-stage K tile and the PV
// GEMM's V^T view put it.
template <class Cfg>
constexpr bool ws_layouts_agree() {
  return ring_stages_agree<typename Cfg::LayoutKV, typename Cfg::LayoutK, Cfg::BN, Cfg::D, Cfg::kStages>() &&
         ring_stages_agree<typename Cfg::LayoutQ2, typename Cfg::LayoutQ, Cfg::BM, Cfg::D, 2>() &&
         transposed_views_agree<typename Cfg::LayoutK, typename Cfg::LayoutVt, Cfg::BN, Cfg::D>();
}

// Device code below is compiled for sm_90a only (the other targets get the trap stub).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The pieces both forward kernels run per key tile, on one warpgroup's 64 query rows.

// S = Q K^T (SS wgmma, both K-major): issued; completed on return of gemm_qk.
template <int D, class Mma, class TQ, class TK, class TS>
__device__ __forceinline__ void issue_qk(Mma& mma_s, const TQ& tSrQ, const TK& tSrK, TS& tSrS) {
  warpgroup_fence_operand(tSrS);
  warpgroup_arrive();
  gemm_fresh<D / 16>(mma_s, tSrQ, tSrK, tSrS);
  warpgroup_commit_batch();
}

template <int D, class Mma, class TQ, class TK, class TS>
__device__ __forceinline__ void gemm_qk(Mma& mma_s, const TQ& tSrQ, const TK& tSrK, TS& tSrS) {
  issue_qk<D>(mma_s, tSrQ, tSrK, tSrS);
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
}

// Scale to the log2 domain (kScale) and mask. Key c (tile-relative) is visible to tile row r
// iff c < kv_lim and (!causal || c <= r + diag). Two loops, so that tiles needing no mask
// branch past the mask's compares (ptxas predicates them when they sit in one loop).
template <bool kMask, bool kScale, class TS, class TC>
__device__ __forceinline__ void scale_mask_loop(TS& tSrS, const TC& tScS, float scale_log2, int kv_lim, int diag,
                                                bool causal) {
#pragma unroll
  for (int i = 0; i < size(tSrS); ++i) {
    float x = kScale ? tSrS(i) * scale_log2 : tSrS(i);
    if constexpr (kMask) {
      const int r = get<0>(tScS(i)), c = get<1>(tScS(i));
      if (c >= kv_lim || (causal && c > r + diag)) x = -INFINITY;
    }
    tSrS(i) = x;
  }
}

// kScale = false: the mask alone, the scores left unscaled (softmax_rows_unscaled).
template <int BN, bool kScale = true, class TS, class TC>
__device__ __forceinline__ void scale_mask(TS& tSrS, const TC& tScS, float scale_log2, int64_t n0, int64_t Sk,
                                           int64_t wrow0, bool causal) {
  if ((n0 + BN > Sk) || (causal && n0 + BN - 1 > wrow0)) {
    const int kv_lim = static_cast<int>(std::min<int64_t>(Sk - n0, BN));
    const int diag = static_cast<int>(std::max<int64_t>(std::min<int64_t>(wrow0 - n0, BN), -2 * BN));
    scale_mask_loop<true, kScale>(tSrS, tScS, scale_log2, kv_lim, diag, causal);
  } else if constexpr (kScale) {
    scale_mask_loop<false, true>(tSrS, tScS, scale_log2, 0, 0, false);
  }
}

// Online softmax (value i is in row half h = (i >> 1) & 1, n-tile i / 4), then P.
template <int BN, int D, class Elem, class TS, class TO, class TP>
__device__ __forceinline__ void softmax_to_p(TS& tSrS, TO& tOrO, TP& tOrP, float (&m_r)[2], float (&l_r)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
    online_softmax_step<true, false, BN / 8, D / 8>([&](int nb, int e) -> float& { return tSrS(4 * nb + e); },
                                                    [&](int nb, int e) -> float& { return tOrO(4 * nb + e); }, m_r[h],
                                                    l_r[h], h);
  pack_a<Elem>(tSrS, tOrP);
}

// O += P V (RS wgmma: P from registers): issued; completed on return of gemm_pv.
template <int BN, class Mma, class TP, class TV, class TO>
__device__ __forceinline__ void issue_pv(Mma& mma_o, TP& tOrP, const TV& tOrV, TO& tOrO) {
  warpgroup_fence_operand(tOrP);
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
#pragma unroll
  for (int kb2 = 0; kb2 < BN / 16; ++kb2) cute::gemm(mma_o, tOrP(_, _, kb2), tOrV(_, _, kb2), tOrO);
  warpgroup_commit_batch();
}

template <int BN, class Mma, class TP, class TV, class TO>
__device__ __forceinline__ void gemm_pv(Mma& mma_o, TP& tOrP, const TV& tOrV, TO& tOrO) {
  issue_pv<BN>(mma_o, tOrP, tOrV, tOrO);
  warpgroup_wait<0>();
  warpgroup_fence_operand(tOrO);
  warpgroup_fence_operand(tOrP);
}

// Epilogue: O / l, lse = (m + log2 l) * ln2 (natural log); l == 0 only when Sk == 0.
template <int D, class Elem, class TO, class TC>
__device__ __forceinline__ void store_rows(TO& tOrO, const TC& tOcO, const float (&m_r)[2], const float (&l_r)[2],
                                           const Rows<Elem>& o, float* __restrict__ lse, const HeadIdx& hd, int64_t bh,
                                           int64_t wrow0, int64_t Sq) {
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

// For the overlapped consumer loop of the warp-specialised kernel: the softmax without the
// O rescale (done once the running P V product is complete).

// online_softmax_step with no output fragment, on the unscaled scores (masked ones -inf): m,
// l and the probabilities only; scale_log2 > 0 (attention_forward_ws_supported).
template <int BN, class TS>
__device__ __forceinline__ void softmax_rows_unscaled(TS& tSrS, float scale_log2, float (&m_r)[2], float (&l_r)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)  // with no output n-tiles the second accessor is never called
    online_softmax_step<true, false, BN / 8, 0, true>([&](int nb, int e) -> float& { return tSrS(4 * nb + e); },
                                                      [&](int nb, int e) -> float& { return tSrS(4 * nb + e); }, m_r[h],
                                                      l_r[h], h, scale_log2);
}

// O *= alpha, alpha = 2^(m_prev - m) as online_softmax_step computes it.
template <int D, class TO>
__device__ __forceinline__ void rescale_o(TO& tOrO, const float (&m_prev)[2], const float (&m_r)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float alpha = exp2_ftz(m_prev[h] - (m_r[h] == -INFINITY ? 0.f : m_r[h]));
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      tOrO(4 * dt + 2 * h) *= alpha;
      tOrO(4 * dt + 2 * h + 1) *= alpha;
    }
  }
}

template <class Cfg, class Elem>
__device__ __forceinline__ void fwd_sm90_body(const Rows<const Elem> q, const Rows<const Elem> k,
                                              const Rows<const Elem> v, const Rows<Elem> o, float* __restrict__ lse,
                                              int64_t H, int64_t G, int64_t bh0, int64_t Sq, int64_t Sk,
                                              float scale_log2, bool causal) {
  constexpr int D = Cfg::D, BN = Cfg::BN, BM = Cfg::BM, NT = Cfg::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Elem* q_s = reinterpret_cast<Elem*>(smem_raw);
  Elem* k_s = q_s + BM * D;                                              // [2][BN * D]
  Elem* v_s = k_s + 2 * Cfg::kTileElems;                                 // [2][BN * D]
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

  const int n_tiles = key_tiles<BM, BN>(m0, Sq, Sk, causal);

  auto load_kv = [&](int stage, int64_t n0) {
    Tensor sK = make_tensor(make_smem_ptr(k_s + stage * Cfg::kTileElems), typename Cfg::LayoutK{});    // (BN, D)
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
    cp_async_wait<0>();                                             // tile j (and Q) landed for this thread's copies
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
                  float* __restrict__ lse, int64_t H, int64_t G, int64_t bh0, int64_t Sq, int64_t Sk, float scale_log2,
                  bool causal) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  fwd_sm90_body<Cfg, Elem>(q, k, v, o, lse, H, G, bh0, Sq, Sk, scale_log2, causal);
#elif defined(__CUDA_ARCH__)
  __trap();  // not sm_90a: the host never launches this image (attention_forward_sm90_available)
#endif
}

// A persistent grid (one CTA an SM, WorkCursor in attention_common.cuh) loads the next item's Q
// and K while it finishes the last (double-buffered Q).
struct WsItem {
  int bh, b, h, hk;  // (batch, head) row, its batch, query head and kv head (B * H < 2^31: ws_supported)
  int mblk, n_tiles;
  int64_t m0;
};

// Item w of the ordered list.
template <int BM, int BN>
__device__ __forceinline__ WsItem ws_item(int w, const BlockOrder& order, int64_t bh0, int H, int G, int Sq, int Sk,
                                          bool causal) {
  int blk, row;
  order.of32(w, blk, row);
  WsItem it;
  it.bh = static_cast<int>(bh0) + row;
  it.b = it.bh / H;
  it.h = it.bh - it.b * H;
  it.hk = it.h / G;
  it.mblk = causal ? order.gx - 1 - blk : blk;  // heaviest first
  it.m0 = static_cast<int64_t>(it.mblk) * BM;
  it.n_tiles = key_tiles<BM, BN>(it.m0, Sq, Sk, causal);
  return it;
}

template <class Cfg, class Elem, class TmaQ, class TmaKV>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    attn_fwd_ws_sm90(CUTE_GRID_CONSTANT const TmaQ tma_q, CUTE_GRID_CONSTANT const TmaKV tma_k,
                     CUTE_GRID_CONSTANT const TmaKV tma_v, const Rows<Elem> o, float* __restrict__ lse, int H, int Hkv,
                     int B, int64_t bh0, BlockOrder order, int Sq, int Sk, float scale_log2, bool causal) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int D = Cfg::D, BN = Cfg::BN, BM = Cfg::BM, ST = Cfg::kStages;
  static_assert(ws_layouts_agree<Cfg>(), "V's tile must land in the layout the PV GEMM reads");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  typename Cfg::Smem& sm = *reinterpret_cast<typename Cfg::Smem*>(smem_raw);

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform by construction; tell the compiler
  const int G = H / Hkv;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      TxBarrier::init(&sm.q_full[s], 1);
      Barrier::init(&sm.q_empty[s], Cfg::kConsumers);
    }
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      TxBarrier::init(&sm.k_full[s], 1);
      TxBarrier::init(&sm.v_full[s], 1);
      Barrier::init(&sm.k_empty[s], Cfg::kConsumers);
      Barrier::init(&sm.v_empty[s], Cfg::kConsumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    // Producer. The CTA's key tiles, over all its items, go through the ring in turn: tile kt
    // to stage kt % ST; from a stage's second use on, it first waits until every consumer
    // released the stage's previous tile (the empty barrier's completion of parity
    // (kt / ST - 1) & 1). Q buffer r & 1 likewise, per item r.
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (tid == 0) {
      Tensor mQ = tma_q.get_tma_tensor(make_shape(Sq, Int<D>{}, H, B));
      Tensor mK = tma_k.get_tma_tensor(make_shape(Sk, Int<D>{}, Hkv, B));
      Tensor mV = tma_v.get_tma_tensor(make_shape(Sk, Int<D>{}, Hkv, B));
      Tensor sQ = make_tensor(make_smem_ptr(sm.q), typename Cfg::LayoutQ2{});  // (BM, D, 2)
      Tensor sK = make_tensor(make_smem_ptr(sm.k), typename Cfg::LayoutKV{});  // (BN, D, ST)
      Tensor sV = make_tensor(make_smem_ptr(sm.v), typename Cfg::LayoutKV{});
      int kt = 0;
      WorkCursor items;
      for (int r = 0;; ++r) {
        const int w = items.next(order);
        if (w < 0) break;
        const WsItem item = ws_item<BM, BN>(w, order, bh0, H, G, Sq, Sk, causal);
        const int h = item.h, hk = item.hk, b = item.b;
        const int qs = r & 1;
        if (r >= 2) Barrier::wait(&sm.q_empty[qs], static_cast<uint32_t>(((r >> 1) & 1) ^ 1));
        Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<BM>, Int<D>>{}, make_coord(_, _0{}));  // (BM, D, blocks)
        auto [tQg, tQs] = tma_partition(tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        TxBarrier::arrive_and_expect_tx(&sm.q_full[qs], Cfg::kQBytes);
        copy(tma_q.with(sm.q_full[qs]), tQg(_, item.mblk), tQs(_, qs));

        Tensor gK = local_tile(mK(_, _, hk, b), Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));  // (BN, D, tiles)
        Tensor gV = local_tile(mV(_, _, hk, b), Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));
        auto [tKg, tKs] = tma_partition(tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto [tVg, tVs] = tma_partition(tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        for (int j = 0; j < item.n_tiles; ++j, ++kt) {
          const int st = kt % ST;
          const uint32_t parity = static_cast<uint32_t>((kt / ST) & 1);
          if (kt >= ST) Barrier::wait(&sm.k_empty[st], parity ^ 1u);
          TxBarrier::arrive_and_expect_tx(&sm.k_full[st], Cfg::kTileBytes);
          copy(tma_k.with(sm.k_full[st]), tKg(_, j), tKs(_, st));
          if (kt >= ST) Barrier::wait(&sm.v_empty[st], parity ^ 1u);
          TxBarrier::arrive_and_expect_tx(&sm.v_full[st], Cfg::kTileBytes);
          copy(tma_v.with(sm.v_full[st]), tVg(_, j), tVs(_, st));
        }
      }
    }
  } else {
    // Consumers: warpgroup cw owns query rows [m0 + 64 cw, m0 + 64 cw + 64) of each item.
    // Every stage is waited for and released by all of them, also where one skips the math.
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int cw = wg - 1, wtid = tid % 128;
    typename Cfg::MmaS mma_s;
    typename Cfg::MmaO mma_o;
    auto thr_s = mma_s.get_thread_slice(wtid);
    auto thr_o = mma_o.get_thread_slice(wtid);
    Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, Int<BN>>{});
    Tensor tOrO = partition_fragment_C(mma_o, Shape<_64, Int<D>>{});
    Tensor tOrP = make_tensor<Elem>(Shape<Shape<_2, _2, _2>, _1, Int<BN / 16>>{});
    Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<_64, Int<BN>>{}));
    Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<_64, Int<D>>{}));
    const auto sk_at = [&](int st) {
      return make_tensor(make_smem_ptr(sm.k + st * Cfg::kTileElems), typename Cfg::LayoutK{});
    };
    const auto svt_at = [&](int st) {
      return make_tensor(make_smem_ptr(sm.v + st * Cfg::kTileElems), typename Cfg::LayoutVt{});
    };
    // Pingpong (kPingpong): the consumers take turns, in a ring, to issue their GEMMs, so
    // that one's softmax runs under the others' GEMMs. Each step, consumer cw waits on
    // named barrier 1 + cw, issues, then arrives on the next one's (0 is __syncthreads').
    // Each takes n_tiles + 1 turns an item (the first and the last step peeled), the ring
    // running on across items; the last consumer lets 0 start, so its very last turn
    // passes on nothing.
    constexpr int NC = Cfg::kConsumers;
    const auto sched_sync = [&] {
      if constexpr (Cfg::kPingpong) named_sync(1 + cw, 256);
    };
    const auto sched_arrive = [&](bool last) {
      if constexpr (Cfg::kPingpong) {
        if (!(last && cw == NC - 1)) named_arrive(1 + (cw + 1) % NC, 256);
      }
    };
    if constexpr (Cfg::kPingpong) {
      if (cw == NC - 1) named_arrive(1, 256);
    }
    const auto stage = [](int t) { return t % ST; };
    const auto phase = [](int t) { return static_cast<uint32_t>((t / ST) & 1); };

    int kt = 0;  // the ring's tile of this item's first key tile
    WorkCursor items;
    int w = items.next(order);
    for (int r = 0; w >= 0; ++r) {
      const int w_next = items.next(order);
      const bool final_item = w_next < 0;
      const WsItem item = ws_item<BM, BN>(w, order, bh0, H, G, Sq, Sk, causal);
      const HeadIdx hd(item.bh, H, G);  // store_rows' (64-bit) view of the same row
      const int n_tiles = item.n_tiles;
      const int64_t wrow0 = item.m0 + 64 * cw;
      const int qs = r & 1;
      Tensor sQ = make_tensor(make_smem_ptr(sm.q + qs * BM * D), typename Cfg::LayoutQ{});
      Tensor tSrQ = thr_s.partition_fragment_A(local_tile(sQ, Shape<_64, Int<D>>{}, make_coord(cw, 0)));
      clear(tOrO);
      float m_r[2] = {-INFINITY, -INFINITY};
      float l_r[2] = {0.f, 0.f};

      TxBarrier::wait(&sm.q_full[qs], static_cast<uint32_t>((r >> 1) & 1));
      if constexpr (Cfg::kOverlap) {
        // Intra-warpgroup overlap (FlashAttention-3): step j issues S(j) = Q K(j)^T, then
        // O += P(j-1) V(j-1), runs tile j's softmax while that product is in flight, and
        // rescales O by tile j's alpha once it is done. A warpgroup does the math of every
        // tile or, with its rows all past Sq, of none. Causal, at BM = 192 a tile may lie
        // wholly above a consumer's rows: masked to -inf, it adds nothing (the first tile
        // holds key 0, which every row sees, so the running max is finite by then). The
        // first and the last step are peeled, so that no wgmma is in flight across a branch
        // (ptxas would serialise).
        static_assert(BN == 128 && (BM == 128 || BM == 192), "tilings the loop was checked for");
        if (wrow0 < Sq) {
          TxBarrier::wait(&sm.k_full[stage(kt)], phase(kt));
          sched_sync();
          issue_qk<D>(mma_s, tSrQ, thr_s.partition_fragment_B(sk_at(stage(kt))), tSrS);
          sched_arrive(false);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tSrS);
          if (wtid == 0) Barrier::arrive(&sm.k_empty[stage(kt)]);
          scale_mask<BN, false>(tSrS, tScS, scale_log2, 0, Sk, wrow0, causal);
          softmax_rows_unscaled<BN>(tSrS, scale_log2, m_r, l_r);  // O is still 0: nothing to rescale
          pack_a<Elem>(tSrS, tOrP);
          for (int j = 1; j < n_tiles; ++j) {
            const int st = stage(kt + j), pst = stage(kt + j - 1);
            TxBarrier::wait(&sm.k_full[st], phase(kt + j));
            sched_sync();
            issue_qk<D>(mma_s, tSrQ, thr_s.partition_fragment_B(sk_at(st)), tSrS);
            TxBarrier::wait(&sm.v_full[pst], phase(kt + j - 1));
            issue_pv<BN>(mma_o, tOrP, thr_o.partition_fragment_B(svt_at(pst)), tOrO);
            sched_arrive(false);
            warpgroup_wait<1>();  // S(j) done; P(j-1) V(j-1) may still run
            warpgroup_fence_operand(tSrS);
            if (wtid == 0) Barrier::arrive(&sm.k_empty[st]);
            const float m_prev[2] = {m_r[0], m_r[1]};
            scale_mask<BN, false>(tSrS, tScS, scale_log2, static_cast<int64_t>(j) * BN, Sk, wrow0, causal);
            softmax_rows_unscaled<BN>(tSrS, scale_log2, m_r, l_r);
            warpgroup_wait<0>();
            warpgroup_fence_operand(tOrO);
            warpgroup_fence_operand(tOrP);
            if (wtid == 0) Barrier::arrive(&sm.v_empty[pst]);
            rescale_o<D>(tOrO, m_prev, m_r);
            pack_a<Elem>(tSrS, tOrP);
          }
          const int lst = stage(kt + n_tiles - 1);
          TxBarrier::wait(&sm.v_full[lst], phase(kt + n_tiles - 1));
          sched_sync();
          issue_pv<BN>(mma_o, tOrP, thr_o.partition_fragment_B(svt_at(lst)), tOrO);
          sched_arrive(final_item);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          warpgroup_fence_operand(tOrP);
          if (wtid == 0) Barrier::arrive(&sm.v_empty[lst]);
        } else {
          // Rows all past Sq: the same waits, turns and releases, without the math.
          for (int j = 0; j <= n_tiles; ++j) {
            if (j < n_tiles) TxBarrier::wait(&sm.k_full[stage(kt + j)], phase(kt + j));
            sched_sync();
            if (j > 0) TxBarrier::wait(&sm.v_full[stage(kt + j - 1)], phase(kt + j - 1));
            sched_arrive(j == n_tiles && final_item);
            if (j < n_tiles && wtid == 0) Barrier::arrive(&sm.k_empty[stage(kt + j)]);
            if (j > 0 && wtid == 0) Barrier::arrive(&sm.v_empty[stage(kt + j - 1)]);
          }
        }
      } else {
        for (int j = 0; j < n_tiles; ++j) {
          const int st = stage(kt + j);
          const uint32_t parity = phase(kt + j);
          const int64_t n0 = static_cast<int64_t>(j) * BN;
          // Warpgroup-uniform: rows all past Sq (never stored) or all above this tile's keys.
          const bool active = wrow0 < Sq && !(causal && n0 > wrow0 + 63);
          TxBarrier::wait(&sm.k_full[st], parity);
          if (active) gemm_qk<D>(mma_s, tSrQ, thr_s.partition_fragment_B(sk_at(st)), tSrS);  // completed: K may go
          if (wtid == 0) Barrier::arrive(&sm.k_empty[st]);
          if (active) {
            scale_mask<BN>(tSrS, tScS, scale_log2, n0, Sk, wrow0, causal);
            softmax_to_p<BN, D, Elem>(tSrS, tOrO, tOrP, m_r, l_r);
          }
          TxBarrier::wait(&sm.v_full[st], parity);
          if (active) gemm_pv<BN>(mma_o, tOrP, thr_o.partition_fragment_B(svt_at(st)), tOrO);
          if (wtid == 0) Barrier::arrive(&sm.v_empty[st]);
        }
      }
      if (wtid == 0) Barrier::arrive(&sm.q_empty[qs]);  // every GEMM reading this Q is complete
      kt += n_tiles;
      store_rows<D>(tOrO, tOcO, m_r, l_r, o, lse, hd, item.bh, wrow0, Sq);
      w = w_next;
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // not sm_90a: the host never launches this image (attention_forward_sm90_available)
#endif
}

// Tilings (registers per thread are fp32 O D/2 + S BN/2 + 16-bit P BN/4; nvcc 13.0, no spills):
//  2 warpgroups ("wgmma"): BM = 128, BN = 128; 221 regs / 160 KiB smem (D = 128), 166 / 80 KiB (D = 64).
//  3 warpgroups ("wgmma3"): BM = 192 (a third less K/V traffic from L2 per FLOP, 12 warps to hide
//    latency), BN = 64 at D = 128 (141 regs, 112 KiB; BN = 128 would pass the 168-register cap of
//    384 threads) and BN = 128 at D = 64 (160 regs, 88 KiB).
template <class Elem, int D>
using FwdCfgSm90 = Sm90FwdCfg<Elem, D, 128, 2>;
template <class Elem, int D>
using FwdCfgSm90W3 = Sm90FwdCfg<Elem, D, D == 128 ? 64 : 128, 3>;

// Both kernels' launch: Kern's shared memory raised to Cfg::kSmemBytes, then a grid of
// query blocks of Cfg::BM rows by (batch, head) chunks; launch(grid, bh0) launches one chunk.
template <class Cfg, auto Kern, class F>
cudaError_t launch_blocks(const AttentionFwdArgs& a, int dev, F&& launch) {
  cudaError_t e = set_smem<Kern>(dev, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  const unsigned gx = static_cast<unsigned>((a.Sq + Cfg::BM - 1) / Cfg::BM);
  return for_bh_chunks(a.BH(), [&](int64_t bh0, unsigned nbh) { launch(dim3(gx, nbh), bh0); });
}

template <class Cfg, class Elem>
cudaError_t launch_sm90(const AttentionFwdArgs& a, int dev, cudaStream_t stream) {
  constexpr auto kern = attn_fwd_sm90<Cfg, Elem>;
  const float sl = a.scale * kLog2e;
  return launch_blocks<Cfg, kern>(a, dev, [&](dim3 grid, int64_t bh0) {
    kern<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
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

// The warp-specialised kernel: BN = 128 keys a tile, 2 stages (160 KiB of shared memory at
// D = 128, 80 KiB at D = 64, 88 KiB with 3 consumers).
// Variant 0: plain ("ws"); 1: overlapped ("ws2"); 2: overlapped with pingpong ("ws3");
// 3: ws3 with 3 consumers ("ws192", D = 64 only).
template <class Elem, int D, int Variant>
using FwdCfgWs = WsFwdCfg<Elem, D, 128, 2, Variant == 3 ? 3 : 2, Variant >= 1, Variant >= 2>;

template <class Cfg, class Elem>
cudaError_t launch_ws(const AttentionFwdArgs& a, const AttnGridPlan& grid, int dev, cudaStream_t stream) {
  constexpr int D = Cfg::D;
  const auto tma_q = make_tma_atom(SM90_TMA_LOAD{}, tma_view<D, Elem>(a.q, a.Sq, a.H, a.B, a.sq),
                                   typename Cfg::LayoutQ{}, Shape<Int<Cfg::BM>, Int<D>>{});
  const auto tma_k = make_tma_atom(SM90_TMA_LOAD{}, tma_view<D, Elem>(a.k, a.Sk, a.Hkv, a.B, a.sk),
                                   typename Cfg::LayoutK{}, Shape<Int<Cfg::BN>, Int<D>>{});
  const auto tma_v = make_tma_atom(SM90_TMA_LOAD{}, tma_view<D, Elem>(a.v, a.Sk, a.Hkv, a.B, a.sv),
                                   typename Cfg::LayoutK{}, Shape<Int<Cfg::BN>, Int<D>>{});
  constexpr auto kern =
      attn_fwd_ws_sm90<Cfg, Elem, std::remove_const_t<decltype(tma_q)>, std::remove_const_t<decltype(tma_k)>>;
  const float sl = a.scale * kLog2e;
  cudaError_t e = set_smem<kern>(dev, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  const int gx = static_cast<int>((a.Sq + Cfg::BM - 1) / Cfg::BM);
  // What a (batch, head) row's blocks read: its share of K and V (G rows read one kv head).
  const int64_t row_bytes = 2 * a.Sk * D * static_cast<int64_t>(sizeof(Elem)) / a.G();
  return for_ordered_grids(a.BH(), gx, a.causal, row_bytes, grid, dev,
                           [&](int64_t bh0, const BlockOrder& order, unsigned ctas) {
                             kern<<<ctas, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
                                 tma_q, tma_k, tma_v, rows_of<Elem>(a.o, a.so), static_cast<float*>(a.lse),
                                 static_cast<int>(a.H), static_cast<int>(a.Hkv), static_cast<int>(a.B), bh0, order,
                                 static_cast<int>(a.Sq), static_cast<int>(a.Sk), sl, a.causal);
                           });
}

template <class Elem, int Variant>
cudaError_t launch_ws_d(const AttentionFwdArgs& a, const AttnGridPlan& grid, int dev, cudaStream_t stream) {
  return a.D == 64 ? launch_ws<FwdCfgWs<Elem, 64, Variant>, Elem>(a, grid, dev, stream)
                   : launch_ws<FwdCfgWs<Elem, 128, Variant>, Elem>(a, grid, dev, stream);
}

template <class Elem>
cudaError_t launch_ws_v(const AttentionFwdArgs& a, int variant, const AttnGridPlan& grid, int dev,
                        cudaStream_t stream) {
  if (variant == 3 && a.D == 64) return launch_ws<FwdCfgWs<Elem, 64, 3>, Elem>(a, grid, dev, stream);
  return variant >= 2   ? launch_ws_d<Elem, 2>(a, grid, dev, stream)
         : variant == 1 ? launch_ws_d<Elem, 1>(a, grid, dev, stream)
                        : launch_ws_d<Elem, 0>(a, grid, dev, stream);
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
      const cudaError_t fe =
          cudaFuncGetAttributes(&fa, attn_fwd_sm90<FwdCfgSm90<cutlass::half_t, 64>, cutlass::half_t>);
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

bool attention_forward_ws_supported(const AttentionFwdArgs& a) {
  // scale > 0: the row max is taken before scaling (softmax_rows_unscaled).
  return tma_operand_ok(a.sq, a.Sq, a.H, a.B) && tma_operand_ok(a.sk, a.Sk, a.Hkv, a.B) &&
         tma_operand_ok(a.sv, a.Sk, a.Hkv, a.B) && a.Sk > 0 && a.BH() < (int64_t{1} << 31) && a.scale > 0.f;
}

cudaError_t attention_forward_sm90_ws(const AttentionFwdArgs& a, int variant, const AttnGridPlan& grid, int dev,
                                      cudaStream_t stream) {
  return a.dtype == DType::BFloat16 ? launch_ws_v<cutlass::bfloat16_t>(a, variant, grid, dev, stream)
                                    : launch_ws_v<cutlass::half_t>(a, variant, grid, dev, stream);
}

}  // namespace gpu_puzzles
