// Attention backward for Hopper with warpgroup MMA (wgmma, sm_90a), warp-specialised and
// TMA-fed, via CuTe. The layout of FlashAttention-3's backward (read, not copied):
//  * CTA = one block of BN = 128 keys of one kv head: a producer warpgroup and 2 consumer
//    warpgroups, consumer w owning keys [n0 + 64 w, n0 + 64 w + 64) (wgmma M = 64).
//  * The producer loads K and V once (TMA), then streams the query blocks of BM = 64 rows of
//    every query head of the kv head's group: Q and dO tiles (TMA) into a 2-stage ring with
//    full / empty mbarriers. Their lse * log2(e) and delta rows (padded by the prep kernel)
//    each consumer stages itself, one iteration ahead.
//  * Per query block, each consumer: S^T = K_w Q^T and dP^T = V_w dO^T (SS wgmma);
//    P^T = exp2(S^T scale log2e - lse2), dS^T = P^T (dP^T - delta), masked (Sk tail,
//    causal); dV_w += P^T dO and dK_w += dS^T Q (RS wgmma: P^T, dS^T from registers, dO
//    and Q read MN-major from the very tiles the TMA wrote K-major); dS^T to shared
//    memory (double-buffered), then dQ = dS K (SS, both MN-major): each consumer takes
//    half of D's columns over all 128 keys (after a barrier over both), or at D = 64 the
//    consumers take turns computing all of it (BwdCfg::kDqTurns), and adds the result to a
//    float32 accumulator in global memory: at D = 128 through shared memory, by a writer warp's
//    bulk reduce-add (BwdCfg::kBulkDq), else by float4 atomics from its registers.
//  * dK, dV live in registers across the whole sweep (GQA: over all G query heads) and
//    are written once; dq = scale * accumulator in a last elementwise kernel.
//  * The grid is persistent where that stays balanced (one CTA an SM; WorkCursor,
//    attention_common.cuh): a CTA runs its share of the key blocks in turn, the Q / dO ring
//    running on from block to block; the next block's K and V load once both consumers
//    released the last's (kv_empty), while they store its dK and dV.
// dQ's float32 additions come in any order: not bitwise reproducible; the plan sends
// deterministic runs to the two-pass mma.sync backward (attention_bwd_sm80.cu).
//
// Built with the CUTLASS headers, for sm_90a only (setup.py), with NDEBUG as the forward.
#ifndef NDEBUG
#define NDEBUG
#endif

#include "attention/attention_bwd_sm90.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>  // first: the atom headers below build on it
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "attention/attention_common.cuh"
#include "attention/attention_sm90.cuh"
#include "common/device.cuh"
#include "common/func_attr.h"
#include "common/online_softmax.cuh"

namespace gpu_puzzles {
namespace {

using namespace cute;

// Query rows of the lse2 / delta rows the prep kernel writes: Sq rounded up, so every
// query block's rows are there.
constexpr int64_t kPadRows = 128;
int64_t padded_rows(int64_t Sq) { return (Sq + kPadRows - 1) / kPadRows * kPadRows; }

template <class Elem, int D_, bool DqTurns_ = false>
struct BwdCfg {
  // A 3-stage Q / dO ring ran 0.93-0.96x this at D = 128 from 4096 rows and 0.99-1.02x at D = 64
  // (benchmarks/results/attention_bwd_stages_h100.json).
  static constexpr int D = D_, BN = 128, BM = 64, kStages = 2;
  static constexpr int kThreads = 384;  // producer + 2 consumer warpgroups
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // dQ = dS K for the query block: each consumer takes half of D's columns over all BN keys,
  // so it needs the other's dS (a barrier over both). At D = 64, each consumer taking all
  // columns over its own 64 keys, with no barrier, adds twice the float32 partials and ran
  // 0.96-0.97x this (benchmarks/results/attention_bwd_dq_h100.json).
  //
  // At D = 64 (kDqTurns) the consumers instead take turns: the consumer of iteration parity
  // it & 1 computes all of dQ (N = 64), the other goes on to its next block. An N = 32 SS
  // wgmma reads 1.5x the shared memory an N = 64 one does per FLOP, and the SS GEMMs already
  // run at the shared-memory rate; at D = 128 all of dQ (64 x 128 float32) would not fit
  // the registers.
  static constexpr bool kDqTurns = DqTurns_;
  static_assert(!kDqTurns || D == 64, "turns: all of dQ in registers at D = 64 only");
  static constexpr int DQN = kDqTurns ? D : D / 2;
  // dQ tiles to global memory: each consumer stores its float32 tile to shared memory and a
  // writer warp of the producer warpgroup adds it with one bulk reduce-add (FA3's dQ writer).
  // The float4 atomics from registers it replaces held the consumers at the next use of their
  // registers until the queue of atomics had drained, the warpgroups in step: at D = 128 the
  // writer ran 1.05-1.12x them at five shapes of 1024-16384 rows, 0.95x at (2,16,1024,128)
  // causal; at D = 64 (column split) 0.92-0.94x, so there the atomics stay
  // (benchmarks/results/attention_bwd_bulk_h100.json).
  static constexpr bool kBulkDq = D == 128;
  static_assert(BM == 64 && kPadRows % BM == 0, "BM: one wgmma M, one consumer's dq tile");
  using LayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<BM>, Int<D>>{}));
  using LayoutQt =  // the same tile as the (D, BM) MN-major B operand of dK += dS^T Q
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<Int<D>, Int<BM>>{}, Step<_2, _1>{}));
  using LayoutQRing = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                             Shape<Int<BM>, Int<D>, Int<kStages>>{}));  // the TMA's view
  using LayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<BN>, Int<D>>{}));
  using LayoutKt =  // K as the (D, BN) MN-major B operand of dQ = dS K
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<Int<D>, Int<BN>>{}, Step<_2, _1>{}));
  // dS as the (BM, BN) MN-major A operand of dQ = dS K (queries contiguous).
  using LayoutdS =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<Int<BM>, Int<BN>>{}, Step<_2, _1>{}));
  using OpSdP = decltype(SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<BM>, Int<D>>, GMMA::Major::K,
                                                    GMMA::Major::K>());
  using OpKV = decltype(SM90::GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<D>, Int<BM>>, GMMA::Major::K,
                                                   GMMA::Major::MN>());
  using OpQ = decltype(SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<DQN>, Int<BN>>, GMMA::Major::MN,
                                                  GMMA::Major::MN>());
  using MmaSdP = decltype(make_tiled_mma(OpSdP{}));
  using MmaKV = decltype(make_tiled_mma(OpKV{}));
  using MmaQ = decltype(make_tiled_mma(OpQ{}));
  // P^T and dS^T become the RS A operand in registers as the forward's P does: the
  // accumulator's values [8 kk, 8 kk + 8) are the A fragment of k-step kk.
  static_assert(std::is_same<typename MMA_Traits<OpSdP>::CLayout, GMMA::CLayout_64xN<BM>>::value, "S C layout");
  static_assert(std::is_same<typename MMA_Traits<OpKV>::CLayout, GMMA::CLayout_64xN<D>>::value, "dKV C layout");
  static_assert(std::is_same<typename MMA_Traits<OpQ>::CLayout, GMMA::CLayout_64xN<DQN>>::value, "dQ C layout");
  static_assert(std::is_same<typename MMA_Traits<OpKV>::ALayout, GMMA::ALayout_64x16>::value, "P A layout");
  static_assert(std::is_same<GMMA::ALayout_64x16, GMMA::CLayout_64xN<16>>::value, "A == C(64x16)");
  static constexpr uint32_t kKVBytes = 2 * BN * D * sizeof(Elem);
  static constexpr uint32_t kStageBytes = 2 * BM * D * sizeof(Elem);
  struct Smem {
    alignas(1024) Elem k[BN * D];
    alignas(1024) Elem v[BN * D];
    alignas(1024) Elem q[kStages * BM * D];
    alignas(1024) Elem dout[kStages * BM * D];
    alignas(1024) Elem ds[2 * BM * BN];
    alignas(128) float dq[kBulkDq ? 2 : 1][kBulkDq ? 64 * DQN : 4];  // per consumer: its dQ tile, tile order
    alignas(16) float rows[2][2][2 * BM];  // per consumer: lse2 then delta of a query block, by iteration parity
    alignas(8) uint64_t kv_full, kv_empty;
    uint64_t full[kStages], empty[kStages];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem));
  static_assert((BM * D * sizeof(Elem)) % 1024 == 0 && (BM * BN * sizeof(Elem)) % 1024 == 0, "1024-byte tiles");
};

// Named barriers (named_sync / named_arrive): 1 both consumers' dS written; 2 + c consumer c's
// dQ tile stored (the writer warp waits); 4 + c that buffer read by the bulk copy (consumer c waits).
constexpr int kDqSyncThreads = 128 + 32;  // a consumer warpgroup and the writer warp

template <class Cfg>
constexpr bool bwd_layouts_agree() {
  constexpr int D = Cfg::D, BM = Cfg::BM, BN = Cfg::BN;
  if (!transposed_views_agree<typename Cfg::LayoutQ, typename Cfg::LayoutQt, BM, D>()) return false;
  if (!transposed_views_agree<typename Cfg::LayoutK, typename Cfg::LayoutKt, BN, D>()) return false;
  return ring_stages_agree<typename Cfg::LayoutQRing, typename Cfg::LayoutQ, BM, D, Cfg::kStages>();
}

// lse2 = lse * log2(e) and delta = rowsum(dout * o) per query row, padded to kPadRows rows
// per (batch, head) with lse2 = +inf (P = 0) and delta = 0; and the float32 dq accumulator
// zeroed (BH * Sqp * D floats: D a row), which a separate memset wrote at full bandwidth
// but as a second pass and launch. D / 8 threads a row, 8 elements each: 16-byte loads
// where o's rows are 16-byte aligned (kVec; dout's always are: the plan checks).
template <class T, int D, bool kVec>
__global__ void __launch_bounds__(256)
    attn_bwd_prep_sm90(Rows<const T> o, Rows<const T> dout, const float* __restrict__ lse, float* __restrict__ lse2,
                       float* __restrict__ delta, float* __restrict__ dq_acc, int64_t H, int64_t Sq, int64_t Sqp) {
  constexpr int kTpr = D / 8;  // threads a row: a power of two dividing the warp
  static_assert(kTpr <= 32 && (kTpr & (kTpr - 1)) == 0, "row group within a warp");
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (256 / kTpr) + threadIdx.x / kTpr;
  const int c = (threadIdx.x % kTpr) * 8;
  float4* z = reinterpret_cast<float4*>(dq_acc + row * D + c);  // the grid covers exactly BH * Sqp rows
  z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
  z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t bh = row / Sqp, i = row - bh * Sqp;
  float s = 0.f;
  if (i < Sq) {
    const HeadIdx hd(bh, H, 1);
    const T* orow = o.row(hd.b, hd.h, i) + c;
    const uint4 dv = *reinterpret_cast<const uint4*>(dout.row(hd.b, hd.h, i) + c);
    const T* d8 = reinterpret_cast<const T*>(&dv);
    if constexpr (kVec) {
      const uint4 ov = *reinterpret_cast<const uint4*>(orow);
      const T* o8 = reinterpret_cast<const T*>(&ov);
#pragma unroll
      for (int e = 0; e < 8; ++e) s += static_cast<float>(o8[e]) * static_cast<float>(d8[e]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) s += static_cast<float>(orow[e]) * static_cast<float>(d8[e]);
    }
  }
#pragma unroll
  for (int w = kTpr / 2; w > 0; w /= 2) s += __shfl_xor_sync(0xffffffffu, s, w);
  if (c == 0) {
    lse2[row] = i < Sq ? lse[bh * Sq + i] * kLog2e : INFINITY;
    delta[row] = s;
  }
}

// The float32 dq accumulator, per (batch * head, block of 64 query rows, column half): one
// contiguous 64 x DQN tile, in the order of the consumers' wgmma fragments, so that a warp's
// atomics cover whole lines: float4 j of thread t (128 a warpgroup) at 4 (128 j + t), holding
// its accumulator values 4 j .. 4 j + 3. Rows run to Sqp (padded).
template <int D, int DQN>
__host__ __device__ __forceinline__ int64_t dq_tile_offset(int64_t bh, int qb64, int half, int64_t Sqp) {
  return ((bh * (Sqp / 64) + qb64) * (D / DQN) + half) * (64 * DQN);
}

// dq = scale * accumulator. Value i of wgmma thread t of a 64 x N fragment sits at row
// 16 (t / 32) + (t % 32) / 4 + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 (t % 4) + (i & 1); so
// the float4s j of threads 4 m .. 4 m + 3 (64 contiguous bytes of the tile) hold columns
// 8 j .. 8 j + 7 of rows r = 16 (m / 8) + m % 8 and r + 8. Each thread takes one such
// (m, j): two 16-byte stores, and the lanes of a warp run over j first, so that a row's
// stores are adjacent.
template <class Cfg, class T>
__global__ void __launch_bounds__(256) attn_bwd_dq_out_sm90(const float* __restrict__ dq_acc, Rows<T> dq, int64_t H,
                                                            int64_t Sq, int64_t Sqp, int64_t n, float scale) {
  constexpr int D = Cfg::D, DQN = Cfg::DQN, kJ = DQN / 8;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(e % kJ), m = static_cast<int>((e / kJ) % 32);
    const int64_t tile = e / (kJ * 32);
    const float4* src = reinterpret_cast<const float4*>(dq_acc + tile * (64 * DQN) + 512 * j + 16 * m);
    float4 f[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) f[q] = src[q];
    const int half = static_cast<int>(tile % (D / DQN));
    const int64_t qb = tile / (D / DQN), nqb = Sqp / 64, bh = qb / nqb;
    const int64_t row = (qb - bh * nqb) * 64 + 16 * (m / 8) + m % 8;
    const int col = half * DQN + 8 * j;
    const HeadIdx hd(bh, H, 1);
    if (row < Sq) {
      uint4 u;
      u.x = pack2<T>(f[0].x * scale, f[0].y * scale);
      u.y = pack2<T>(f[1].x * scale, f[1].y * scale);
      u.z = pack2<T>(f[2].x * scale, f[2].y * scale);
      u.w = pack2<T>(f[3].x * scale, f[3].y * scale);
      *reinterpret_cast<uint4*>(dq.row(hd.b, hd.h, row) + col) = u;
    }
    if (row + 8 < Sq) {
      uint4 u;
      u.x = pack2<T>(f[0].z * scale, f[0].w * scale);
      u.y = pack2<T>(f[1].z * scale, f[1].w * scale);
      u.z = pack2<T>(f[2].z * scale, f[2].w * scale);
      u.w = pack2<T>(f[3].z * scale, f[3].w * scale);
      *reinterpret_cast<uint4*>(dq.row(hd.b, hd.h, row + 8) + col) = u;
    }
  }
}

template <class Cfg, class Elem, class TmaQ, class TmaKV>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    attn_bwd_ws_sm90(CUTE_GRID_CONSTANT const TmaQ tma_q, CUTE_GRID_CONSTANT const TmaQ tma_do,
                     CUTE_GRID_CONSTANT const TmaKV tma_k, CUTE_GRID_CONSTANT const TmaKV tma_v,
                     const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
                     const Rows<Elem> dk, const Rows<Elem> dv, int H, int Hkv, int B, int64_t bh0, BlockOrder order,
                     int Sq, int Sqp, int Sk, float scale, bool causal) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int D = Cfg::D, BN = Cfg::BN, BM = Cfg::BM, ST = Cfg::kStages, DQN = Cfg::DQN;
  static_assert(bwd_layouts_agree<Cfg>(), "tiles must land in the layouts the GEMMs read");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  typename Cfg::Smem& sm = *reinterpret_cast<typename Cfg::Smem*>(smem_raw);

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform by construction; tell the compiler
  const int G = H / Hkv;
  // The CTA's items (WorkCursor): key block nblk of kv row bhk, nblk 0 first (causal: it has the
  // most query blocks); iteration it of an item: query head h0 + it / n_qt, its block it % n_qt.
  struct Item {
    int b, hk, h0, nblk, n0, q_begin, n_qt, n_it;
  };
  const auto item_at = [&](int w) {
    Item t;
    int row;
    order.of32(w, t.nblk, row);
    const int bhk = static_cast<int>(bh0) + row;  // B * Hkv < 2^31 (supported())
    t.b = bhk / Hkv;
    t.hk = bhk - t.b * Hkv;
    t.h0 = t.hk * G;
    t.n0 = t.nblk * BN;
    t.q_begin = causal ? t.n0 / BM * BM : 0;
    t.n_qt = t.q_begin < Sq ? (Sq - t.q_begin + BM - 1) / BM : 0;
    t.n_it = t.n_qt * G;
    return t;
  };

  if (tid == 0) {
    TxBarrier::init(&sm.kv_full, 1);
    Barrier::init(&sm.kv_empty, 2);
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      TxBarrier::init(&sm.full[s], 1);
      Barrier::init(&sm.empty[s], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (tid == 0) {
      // Item r's K and V: loaded once both consumers released item r - 1's (kv_empty). The Q / dO
      // tiles of all items go through the ring in turn: tile qt to stage qt % ST.
      Tensor mK = tma_k.get_tma_tensor(make_shape(Sk, Int<D>{}, Hkv, B));
      Tensor mV = tma_v.get_tma_tensor(make_shape(Sk, Int<D>{}, Hkv, B));
      Tensor sK = make_tensor(make_smem_ptr(sm.k), typename Cfg::LayoutK{});
      Tensor sV = make_tensor(make_smem_ptr(sm.v), typename Cfg::LayoutK{});
      Tensor mQ = tma_q.get_tma_tensor(make_shape(Sq, Int<D>{}, H, B));
      Tensor mdO = tma_do.get_tma_tensor(make_shape(Sq, Int<D>{}, H, B));
      Tensor sQ = make_tensor(make_smem_ptr(sm.q), typename Cfg::LayoutQRing{});  // (BM, D, ST)
      Tensor sdO = make_tensor(make_smem_ptr(sm.dout), typename Cfg::LayoutQRing{});
      int qt = 0;
      WorkCursor items;
      for (int r = 0;; ++r) {
        const int w = items.next(order);
        if (w < 0) break;
        const Item t = item_at(w);
        if (r > 0) Barrier::wait(&sm.kv_empty, static_cast<uint32_t>((r - 1) & 1));
        Tensor gK = local_tile(mK(_, _, t.hk, t.b), Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));  // (BN, D, n)
        Tensor gV = local_tile(mV(_, _, t.hk, t.b), Shape<Int<BN>, Int<D>>{}, make_coord(_, _0{}));
        auto [tKg, tKs] = tma_partition(tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto [tVg, tVs] = tma_partition(tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        TxBarrier::arrive_and_expect_tx(&sm.kv_full, Cfg::kKVBytes);
        copy(tma_k.with(sm.kv_full), tKg(_, t.nblk), tKs);
        copy(tma_v.with(sm.kv_full), tVg(_, t.nblk), tVs);
        for (int it = 0; it < t.n_it; ++it, ++qt) {
          const int st = qt % ST;
          const int gi = it / t.n_qt, qblk = t.q_begin / BM + (it - gi * t.n_qt);
          if (qt >= ST) Barrier::wait(&sm.empty[st], static_cast<uint32_t>(((qt / ST) & 1) ^ 1));
          Tensor gQ = local_tile(mQ(_, _, t.h0 + gi, t.b), Shape<Int<BM>, Int<D>>{}, make_coord(_, _0{}));
          Tensor gdO = local_tile(mdO(_, _, t.h0 + gi, t.b), Shape<Int<BM>, Int<D>>{}, make_coord(_, _0{}));
          auto [tQg, tQs] = tma_partition(tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
          auto [tdOg, tdOs] =
              tma_partition(tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
          TxBarrier::arrive_and_expect_tx(&sm.full[st], Cfg::kStageBytes);
          copy(tma_q.with(sm.full[st]), tQg(_, qblk), tQs(_, st));
          copy(tma_do.with(sm.full[st]), tdOg(_, qblk), tdOs(_, st));
        }
      }
    } else if (Cfg::kBulkDq && tid / 32 == 1) {
      // The dQ writer: it walks the consumers' items and iterations, and per iteration takes
      // both consumers' tiles (named barriers 2 + c), adds each with one bulk reduce-add, and
      // releases the buffers once the copies have read them (4 + c).
      constexpr uint32_t kTileBytes = 64 * DQN * sizeof(float);
      named_arrive(4, kDqSyncThreads);
      named_arrive(5, kDqSyncThreads);
      WorkCursor items;
      for (;;) {
        const int w = items.next(order);
        if (w < 0) break;
        const Item t = item_at(w);
        for (int gi = 0; gi < G; ++gi) {
          const int64_t bhq = static_cast<int64_t>(t.b) * H + t.h0 + gi;
          for (int qi = 0; qi < t.n_qt; ++qi) {
            named_sync(2, kDqSyncThreads);
            named_sync(3, kDqSyncThreads);
            if (tid == 32) {
#pragma unroll
              for (int c = 0; c < 2; ++c)
                asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                                 dq_acc + dq_tile_offset<D, DQN>(bhq, t.q_begin / 64 + qi, c, Sqp)),
                             "r"(static_cast<uint32_t>(__cvta_generic_to_shared(sm.dq[c]))), "n"(kTileBytes)
                             : "memory");
              asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
              asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
            }
            __syncwarp();
            named_arrive(4, kDqSyncThreads);
            named_arrive(5, kDqSyncThreads);
          }
        }
      }
      if (tid == 32) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int cw = wg - 1, wtid = tid % 128;
    typename Cfg::MmaSdP mma_sdp;
    typename Cfg::MmaKV mma_kv;
    typename Cfg::MmaQ mma_q;
    auto thr_sdp = mma_sdp.get_thread_slice(wtid);
    auto thr_kv = mma_kv.get_thread_slice(wtid);
    auto thr_q = mma_q.get_thread_slice(wtid);

    Tensor sK = make_tensor(make_smem_ptr(sm.k), typename Cfg::LayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(sm.v), typename Cfg::LayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(sm.k), typename Cfg::LayoutKt{});  // (D, BN)
    Tensor tSrK = thr_sdp.partition_fragment_A(local_tile(sK, Shape<_64, Int<D>>{}, make_coord(cw, 0)));
    Tensor tSrV = thr_sdp.partition_fragment_A(local_tile(sV, Shape<_64, Int<D>>{}, make_coord(cw, 0)));
    // dQ's B operand: K^T, this consumer's columns of D (all of them, kDqTurns) over every key.
    Tensor tQrKt =
        thr_q.partition_fragment_B(local_tile(sKt, Shape<Int<DQN>, Int<BN>>{}, make_coord(Cfg::kDqTurns ? 0 : cw, 0)));

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<_64, Int<BM>>{});   // S^T: (key, query)
    Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<_64, Int<BM>>{});  // dP^T
    Tensor tKVrdV = partition_fragment_C(mma_kv, Shape<_64, Int<D>>{});
    Tensor tKVrdK = partition_fragment_C(mma_kv, Shape<_64, Int<D>>{});
    Tensor tQrdQ = partition_fragment_C(mma_q, Shape<_64, Int<DQN>>{});
    Tensor tKVrP = make_tensor<Elem>(Shape<Shape<_2, _2, _2>, _1, Int<BM / 16>>{});
    Tensor tKVrdS = make_tensor<Elem>(Shape<Shape<_2, _2, _2>, _1, Int<BM / 16>>{});
    static_assert(decltype(size(tKVrP))::value == decltype(size(tSrS))::value, "P fragment");
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<_64, Int<BM>>{}));
    Tensor tKVc = thr_kv.partition_C(make_identity_tensor(Shape<_64, Int<D>>{}));
    Tensor tQc = thr_q.partition_C(make_identity_tensor(Shape<_64, Int<DQN>>{}));
    // stmatrix call p stores 4 8 x 8 blocks of dS^T: block j is registers ds32(4 p + j), i.e.
    // accumulator rows (keys) 16 warp + 8 (j & 1) + (0..7), columns (queries) 8 (2 p + (j >> 1)) + (0..7)
    // (value i of the fragment: row half (i >> 1) & 1, column block i >> 2). Lane l gives the
    // address of row l % 8 of block l / 8: 8 consecutive queries of one key, 16 contiguous bytes
    // in the MN-major tile. Byte offsets within a buffer (buffers are 1024-byte aligned, so the
    // swizzle is the same in both).
    uint32_t ds_row_off[BM / 16];
    {
      Tensor sdS0 = make_tensor(make_smem_ptr(sm.ds), typename Cfg::LayoutdS{});
      const int lane = wtid % 32, j = lane / 8;
      const int key = 64 * cw + 16 * (wtid / 32) + 8 * (j & 1) + lane % 8;
#pragma unroll
      for (int p = 0; p < BM / 16; ++p)
        ds_row_off[p] = static_cast<uint32_t>((&sdS0(8 * (2 * p + (j >> 1)), key) - sm.ds) * sizeof(Elem));
    }
    const float sl = scale * kLog2e;

    // The barrier after both consumers' dS is written (each one's dQ reads both halves).
    const auto ds_barrier = [] { named_sync(1, 256); };
    // The lse2 / delta rows of iteration it, this consumer's copy: thread wtid (2 BM = 128)
    // loads value wtid (lse2 of query wtid, then delta of query wtid - BM) from global memory
    // during iteration it - 1 and stores it to rows[cw][it & 1] before that iteration's
    // ds_barrier, which also follows every read of rows[cw][(it - 1) & 1]: so the staging
    // needs no barrier of its own.
    // Across items likewise: an item's first rows are stored after the last item's final
    // ds_barrier and before this item's first one.
    static_assert(2 * BM == 128, "one row value a consumer thread");
    int qt = 0;  // the Q / dO ring's tile of this item's first iteration
    WorkCursor items;
    for (int r = 0;; ++r) {
      const int w = items.next(order);
      if (w < 0) break;
      const Item t = item_at(w);
      const int n_qt = t.n_qt, n_it = t.n_it, q_begin = t.q_begin;
      const int key0 = t.n0 + 64 * cw;               // this warpgroup's first key
      const auto row_value = [&](int g2, int qi2) {  // of query head h0 + g2, its block qi2 from q_begin
        const int64_t r0 = (static_cast<int64_t>(t.b) * H + t.h0 + g2) * Sqp + q_begin + qi2 * BM;
        return wtid < BM ? lse2[r0 + wtid] : delta[r0 + wtid - BM];
      };
      clear(tKVrdV);
      clear(tKVrdK);
      if (n_it > 0) sm.rows[cw][0][wtid] = row_value(0, 0);
      ds_barrier();

      TxBarrier::wait(&sm.kv_full, static_cast<uint32_t>(r & 1));
      int gi = 0, qi = 0;  // iteration it's query head h0 + gi and block qi: counters, not divisions
      for (int it = 0; it < n_it; ++it) {
        const int st = (qt + it) % ST;
        const int q0 = q_begin + qi * BM;
        const int qn = qi + 1 == n_qt ? 0 : qi + 1, gn = qn == 0 ? gi + 1 : gi;  // the next iteration's
        const bool stage_next = it + 1 < n_it;
        const float next_row = stage_next ? row_value(gn, qn) : 0.f;
        TxBarrier::wait(&sm.full[st], static_cast<uint32_t>(((qt + it) / ST) & 1));
        Tensor sQ = make_tensor(make_smem_ptr(sm.q + st * BM * D), typename Cfg::LayoutQ{});
        Tensor sdO = make_tensor(make_smem_ptr(sm.dout + st * BM * D), typename Cfg::LayoutQ{});
        Tensor sQt = make_tensor(make_smem_ptr(sm.q + st * BM * D), typename Cfg::LayoutQt{});
        Tensor sdOt = make_tensor(make_smem_ptr(sm.dout + st * BM * D), typename Cfg::LayoutQt{});
        Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);
        Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);

        // S^T = K_w Q^T and dP^T = V_w dO^T, two batches: P^T is computed while dP^T runs.
        warpgroup_fence_operand(tSrS);
        warpgroup_fence_operand(tSrdP);
        warpgroup_arrive();
        gemm_fresh<D / 16>(mma_sdp, tSrK, tSrQ, tSrS);
        warpgroup_commit_batch();
        gemm_fresh<D / 16>(mma_sdp, tSrV, tSrdO, tSrdP);
        warpgroup_commit_batch();

        // P^T; key r sees query c iff key < Sk and (!causal || key <= query). Values i, i + 1
        // are queries c, c + 1 (c even) of one key: their lse2 / delta are one 8-byte load.
        const float* l2 = sm.rows[cw][it & 1];
        const float* dl = sm.rows[cw][it & 1] + BM;
        const bool need_mask = key0 + 64 > Sk || (causal && key0 + 63 > q0);
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
#pragma unroll
        for (int i = 0; i < size(tSrS); i += 2) {
          const float2 l = *reinterpret_cast<const float2*>(l2 + get<1>(tScS(i)));
          tSrS(i) = exp2_ftz(tSrS(i) * sl - l.x);  // padded rows: 0
          tSrS(i + 1) = exp2_ftz(tSrS(i + 1) * sl - l.y);
        }
        // The mask in a loop of its own: tested inside the loop above, ptxas branched per pair.
        if (need_mask) {
#pragma unroll
          for (int i = 0; i < size(tSrS); ++i) {
            const int key = key0 + get<0>(tScS(i)), c = get<1>(tScS(i));
            if (key >= Sk || (causal && key > q0 + c)) tSrS(i) = 0.f;
          }
        }
        pack_a<Elem>(tSrS, tKVrP);

        // dV += P^T dO runs while dS^T = P^T (dP^T - delta) is computed.
        Tensor tKVrdOt = thr_kv.partition_fragment_B(sdOt);
        Tensor tKVrQt = thr_kv.partition_fragment_B(sQt);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrdP);
        warpgroup_fence_operand(tKVrdV);
        warpgroup_fence_operand(tKVrP);
        warpgroup_arrive();
#pragma unroll
        for (int kb = 0; kb < BM / 16; ++kb) cute::gemm(mma_kv, tKVrP(_, _, kb), tKVrdOt(_, _, kb), tKVrdV);
        warpgroup_commit_batch();
#pragma unroll
        for (int i = 0; i < size(tSrdP); i += 2) {
          const float2 d = *reinterpret_cast<const float2*>(dl + get<1>(tScS(i)));
          tSrdP(i) = tSrS(i) * (tSrdP(i) - d.x);
          tSrdP(i + 1) = tSrS(i + 1) * (tSrdP(i + 1) - d.y);
        }
        pack_a<Elem>(tSrdP, tKVrdS);
        // dS^T to the dQ GEMM's A tile (query c, key 64 cw + r), 8 x 8 blocks at a time (stmatrix).
        Tensor sdS = make_tensor(make_smem_ptr(sm.ds + (it & 1) * BM * BN), typename Cfg::LayoutdS{});
        {
          Tensor ds32 = recast<uint32_t>(tKVrdS);
          const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(sm.ds + (it & 1) * BM * BN));
#pragma unroll
          for (int p = 0; p < BM / 16; ++p)
            asm volatile(
                "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(base + ds_row_off[p]),
                "r"(ds32(4 * p)), "r"(ds32(4 * p + 1)), "r"(ds32(4 * p + 2)), "r"(ds32(4 * p + 3))
                : "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> wgmma's reads

        // dK += dS^T Q runs while the other consumer finishes its half of dS.
        warpgroup_fence_operand(tKVrdK);
        warpgroup_fence_operand(tKVrdS);
        warpgroup_arrive();
#pragma unroll
        for (int kb = 0; kb < BM / 16; ++kb) cute::gemm(mma_kv, tKVrdS(_, _, kb), tKVrQt(_, _, kb), tKVrdK);
        warpgroup_commit_batch();
        if (stage_next) sm.rows[cw][(it + 1) & 1][wtid] = next_row;
        // Whether this consumer computes dQ this iteration (turns), and which columns it adds.
        const bool dq_here = !Cfg::kDqTurns || (it & 1) == cw;
        const int dq_part = Cfg::kDqTurns ? 0 : cw;
        if constexpr (Cfg::kDqTurns) {
          // No wgmma in flight across the branch below (ptxas would serialise them all).
          warpgroup_wait<0>();
          warpgroup_fence_operand(tKVrdV);
          warpgroup_fence_operand(tKVrdK);
          warpgroup_fence_operand(tKVrP);
          warpgroup_fence_operand(tKVrdS);
          if (wtid == 0) Barrier::arrive(&sm.empty[st]);  // this consumer's GEMMs have read Q and dO
        }
        ds_barrier();  // the dS the dQ GEMM reads is written

        if (dq_here) {
          // dQ = dS K (this consumer's columns; dS is all BM x BN of both consumers).
          Tensor tQrdS = thr_q.partition_fragment_A(sdS);
          warpgroup_fence_operand(tQrdQ);
          warpgroup_arrive();
          gemm_fresh<BN / 16>(mma_q, tQrdS, tQrKt, tQrdQ);
          warpgroup_commit_batch();
          warpgroup_wait<0>();
          warpgroup_fence_operand(tKVrdV);
          warpgroup_fence_operand(tKVrdK);
          warpgroup_fence_operand(tKVrP);
          warpgroup_fence_operand(tKVrdS);
          warpgroup_fence_operand(tQrdQ);
          if (!Cfg::kDqTurns && wtid == 0) Barrier::arrive(&sm.empty[st]);  // Q and dO are read

          if constexpr (Cfg::kBulkDq) {
            // The tile to shared memory in the accumulator's order (float4 j of thread t at
            // 4 (128 j + t): conflict-free), for the writer warp's bulk reduce-add.
            named_sync(4 + cw, kDqSyncThreads);  // the buffer's last tile is read
#pragma unroll
            for (int j = 0; j < DQN / 8; ++j)
              *reinterpret_cast<float4*>(&sm.dq[cw][j * 512 + wtid * 4]) =
                  make_float4(tQrdQ(4 * j), tQrdQ(4 * j + 1), tQrdQ(4 * j + 2), tQrdQ(4 * j + 3));
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> the bulk copy
            named_arrive(2 + cw, kDqSyncThreads);
          } else {
            // One float4 atomic add per 4 values of the fragment, straight from registers (a
            // warp's 32 cover 512 contiguous bytes of the tile).
            const int64_t bhq = static_cast<int64_t>(t.b) * H + t.h0 + gi;
            float* dst = dq_acc + dq_tile_offset<D, DQN>(bhq, q0 / 64, dq_part, Sqp) + wtid * 4;
#pragma unroll
            for (int j = 0; j < DQN / 8; ++j)
              atomicAdd(reinterpret_cast<float4*>(dst + j * 512),
                        make_float4(tQrdQ(4 * j), tQrdQ(4 * j + 1), tQrdQ(4 * j + 2), tQrdQ(4 * j + 3)));
          }
        }
        gi = gn;
        qi = qn;
      }

      qt += n_it;
      if (wtid == 0) Barrier::arrive(&sm.kv_empty);  // every GEMM of this consumer reading K and V is complete

        // dK = scale * sum dS^T Q, dV = sum P^T dO: this warpgroup's 64 key rows.
#pragma unroll
      for (int i = 0; i < size(tKVrdK); i += 2) {
        const int key = key0 + get<0>(tKVc(i)), c = get<1>(tKVc(i));
        if (key < Sk) {
          *reinterpret_cast<uint32_t*>(dk.row(t.b, t.hk, key) + c) =
              pack2<Elem>(tKVrdK(i) * scale, tKVrdK(i + 1) * scale);
          *reinterpret_cast<uint32_t*>(dv.row(t.b, t.hk, key) + c) = pack2<Elem>(tKVrdV(i), tKVrdV(i + 1));
        }
      }
    }
    if constexpr (Cfg::kBulkDq) named_sync(4 + cw, kDqSyncThreads);  // the writer's last release
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // not sm_90a: the host never launches this image (attention_forward_sm90_available)
#endif
}

template <class Cfg, class Elem>
cudaError_t launch_bwd(const AttentionBwdArgs& a, const AttnGridPlan& grid, void* workspace, int dev,
                       cudaStream_t stream) {
  constexpr int D = Cfg::D;
  const int64_t Sqp = padded_rows(a.Sq);
  float* lse2 = static_cast<float*>(workspace);
  float* delta = lse2 + a.BH() * Sqp;
  float* dq_acc = delta + a.BH() * Sqp;
  {
    const int64_t rows = a.BH() * Sqp;  // a multiple of kPadRows, so of the rows a block takes
    constexpr int kRowsPerBlock = 256 / (D / 8);
    static_assert(kPadRows % kRowsPerBlock == 0, "whole blocks");
    const auto o = rows_of<const Elem>(a.o, a.so);
    const auto dout = rows_of<const Elem>(a.dout, a.sdo);
    const auto* lse = static_cast<const float*>(a.lse);
    const unsigned blocks = static_cast<unsigned>(rows / kRowsPerBlock);
    if (attn_rows_aligned16(a.o, a.so, sizeof(Elem)))
      attn_bwd_prep_sm90<Elem, D, true><<<blocks, 256, 0, stream>>>(o, dout, lse, lse2, delta, dq_acc, a.H, a.Sq, Sqp);
    else
      attn_bwd_prep_sm90<Elem, D, false><<<blocks, 256, 0, stream>>>(o, dout, lse, lse2, delta, dq_acc, a.H, a.Sq, Sqp);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  const auto tma_q = make_tma_atom(SM90_TMA_LOAD{}, tma_view<D, Elem>(a.q, a.Sq, a.H, a.B, a.sq),
                                   typename Cfg::LayoutQ{}, Shape<Int<Cfg::BM>, Int<D>>{});
  const auto tma_do = make_tma_atom(SM90_TMA_LOAD{}, tma_view<D, Elem>(a.dout, a.Sq, a.H, a.B, a.sdo),
                                    typename Cfg::LayoutQ{}, Shape<Int<Cfg::BM>, Int<D>>{});
  const auto tma_k = make_tma_atom(SM90_TMA_LOAD{}, tma_view<D, Elem>(a.k, a.Sk, a.Hkv, a.B, a.sk),
                                   typename Cfg::LayoutK{}, Shape<Int<Cfg::BN>, Int<D>>{});
  const auto tma_v = make_tma_atom(SM90_TMA_LOAD{}, tma_view<D, Elem>(a.v, a.Sk, a.Hkv, a.B, a.sv),
                                   typename Cfg::LayoutK{}, Shape<Int<Cfg::BN>, Int<D>>{});
  constexpr auto kern =
      attn_bwd_ws_sm90<Cfg, Elem, std::remove_const_t<decltype(tma_q)>, std::remove_const_t<decltype(tma_k)>>;
  cudaError_t e = set_smem<kern>(dev, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  const int gx = static_cast<int>(ceil_div_u(a.Sk, Cfg::BN));
  // What a kv head's blocks read and add to: Q, dO and the float32 dq of its G query heads.
  const int64_t row_bytes = a.G() * a.Sq * D * static_cast<int64_t>(2 * sizeof(Elem) + sizeof(float));
  // Persistent or one CTA a block: the plan's (attention_bwd_plan, attn_grid_ctas).
  e = for_ordered_grids(
      a.BHkv(), gx, a.causal, row_bytes, grid, dev, [&](int64_t bh0, const BlockOrder& order, unsigned ctas) {
        kern<<<ctas, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
            tma_q, tma_do, tma_k, tma_v, lse2, delta, dq_acc, rows_of<Elem>(a.dk, a.sdk), rows_of<Elem>(a.dv, a.sdv),
            static_cast<int>(a.H), static_cast<int>(a.Hkv), static_cast<int>(a.B), bh0, order, static_cast<int>(a.Sq),
            static_cast<int>(Sqp), static_cast<int>(a.Sk), a.scale, a.causal);
      });
  if (e != cudaSuccess) return e;
  const int64_t n = a.BH() * Sqp * D / 16;  // 16 floats a thread
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, int64_t{1} << 20));
  attn_bwd_dq_out_sm90<Cfg, Elem>
      <<<blocks, 256, 0, stream>>>(dq_acc, rows_of<Elem>(a.dq, a.sdq), a.H, a.Sq, Sqp, n, a.scale);
  return cudaGetLastError();
}

template <class Elem>
cudaError_t launch_bwd_d(const AttentionBwdArgs& a, const AttnBwdPlan& p, void* ws, int dev, cudaStream_t stream) {
  if (a.D != 64) return launch_bwd<BwdCfg<Elem, 128>, Elem>(a, p.grid, ws, dev, stream);
  // D = 64: dQ by turns or by column halves, as the plan says (attention_bwd_plan).
  return p.dq_turns ? launch_bwd<BwdCfg<Elem, 64, true>, Elem>(a, p.grid, ws, dev, stream)
                    : launch_bwd<BwdCfg<Elem, 64, false>, Elem>(a, p.grid, ws, dev, stream);
}

}  // namespace

bool attention_backward_sm90_supported(const AttentionBwdArgs& a) {
  // int32 TMA coordinates and kernel row indices; padded lse2 rows below 2^31 as well.
  return tma_operand_ok(a.sq, a.Sq, a.H, a.B) && tma_operand_ok(a.sdo, a.Sq, a.H, a.B) &&
         tma_operand_ok(a.sk, a.Sk, a.Hkv, a.B) && tma_operand_ok(a.sv, a.Sk, a.Hkv, a.B) && a.Sk > 0 && a.Sq > 0 &&
         padded_rows(a.Sq) < (int64_t{1} << 31) && a.H < (int64_t{1} << 31) && a.BHkv() < (int64_t{1} << 31);
}

int64_t attention_backward_sm90_workspace_bytes(const AttentionBwdArgs& a) {
  return a.BH() * padded_rows(a.Sq) * (2 + a.D) * static_cast<int64_t>(sizeof(float));
}

cudaError_t attention_backward_sm90(const AttentionBwdArgs& a, const AttnBwdPlan& p, void* workspace, int dev,
                                    cudaStream_t stream) {
  return a.dtype == DType::BFloat16 ? launch_bwd_d<cutlass::bfloat16_t>(a, p, workspace, dev, stream)
                                    : launch_bwd_d<cutlass::half_t>(a, p, workspace, dev, stream);
}

}  // namespace gpu_puzzles
