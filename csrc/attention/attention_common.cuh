// Internal to the attention .cu files: what the kernel families share on the host and the
// device. The kernels' layout and masking contract is in attention.h.
//
// Masking: key j of query i is visible iff j < Sk and (!causal || j <= i) (SDPA
// is_causal, top-left aligned). Tiles wholly above the diagonal are skipped, so a
// causal run does about half the work. Tails of Sq/Sk are zero-filled on load and
// masked to -inf; rows past Sq are computed on zeros and never stored.
// All global offsets are 64-bit. Launchers are async: no syncs, no allocations.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention/attention.h"
#include "attention/attention_plan.h"
#include "common/func_attr.h"

namespace gpu_puzzles {
namespace {  // one copy per .cu file: nothing here is shared across files at link time

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int64_t kMaxGridY = 65535;

template <typename T>
constexpr bool is_half_type() {
  return std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;
}

// One operand's rows in its (B, H, S, Dlast) layout (attention.h: AttnStrides): the one
// place the kernels turn (batch, head, row) into an address.
template <typename T>
struct Rows {
  T* p;
  int64_t sb, sh, ss;  // element strides of batch, head, row; Dlast is contiguous
  __device__ __forceinline__ T* head(int64_t b, int64_t h) const { return p + b * sb + h * sh; }
  __device__ __forceinline__ T* row(int64_t b, int64_t h, int64_t s) const { return head(b, h) + s * ss; }
};

template <typename T, typename P>
Rows<T> rows_of(P* p, const AttnStrides& st) {
  return Rows<T>{static_cast<T*>(p), st.b, st.h, st.s};
}

// The (batch, query head) of grid row bh (a grid over B * H), and the kv head it reads:
// h / G, G = H / Hkv query heads per kv head (attention.h).
struct HeadIdx {
  int64_t b, h, hk;
  __device__ __forceinline__ HeadIdx(int64_t bh, int64_t H, int64_t G) : b(bh / H), h(bh - b * H), hk(h / G) {}
};

// The (batch, kv head) of grid row bhk of the dK/dV kernels (a grid over B * Hkv), and the
// first of its G query heads, h0 = hk * G: query head h0 + i is query grid row bhk * G + i
// (its lse and delta rows).
struct KvHeadIdx {
  int64_t b, hk, h0;
  __device__ __forceinline__ KvHeadIdx(int64_t bhk, int64_t Hkv, int64_t G)
      : b(bhk / Hkv), hk(bhk - b * Hkv), h0(hk * G) {}
};

// The key tiles of BN that query rows [m0, m0 + BM) see: up to Sk, causal up to their last row.
template <int BM, int BN>
__device__ __forceinline__ int key_tiles(int64_t m0, int64_t Sq, int64_t Sk, bool causal) {
  const int64_t row_end = std::min<int64_t>(m0 + BM, Sq);
  const int64_t n_end = causal ? std::min<int64_t>(Sk, row_end) : Sk;
  return static_cast<int>((n_end + BN - 1) / BN);
}

// Call f(bh0, nbh) for chunks of at most 65535 (grid.y limit).
template <typename F>
cudaError_t for_bh_chunks(int64_t BH, F&& f) {
  for (int64_t bh0 = 0; bh0 < BH; bh0 += kMaxGridY) {
    f(bh0, static_cast<unsigned>(std::min<int64_t>(kMaxGridY, BH - bh0)));
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Causal grids of the sm_90a kernels: blocks of a (batch, head) differ in work by up to the
// number of blocks, and the GPU starts CTAs in blockIdx order. In a grid of (batch, head)-major
// order the heaviest blocks of the last heads start last and set the end. A 1D grid instead
// runs, chunk by chunk of `cb` (batch, head) rows, block 0 of every row of the chunk, then
// block 1, and so on: the heaviest first (a longest-first list schedule), while the rows in
// flight share the L2. cb = 1 is (batch, head)-major order.
struct BlockOrder {
  int64_t nbh, cb;  // (batch, head) rows of this launch, rows a chunk
  int gx;           // blocks a row
  __host__ __device__ __forceinline__ void of(int64_t idx, int& blk, int64_t& bh) const {
    const int64_t per_chunk = static_cast<int64_t>(gx) * cb;
    const int64_t c = idx / per_chunk, r = idx - c * per_chunk;
    const int64_t n = std::min<int64_t>(cb, nbh - c * cb);  // rows of this chunk (the last may have fewer)
    blk = static_cast<int>(r / n);
    bh = c * cb + (r - blk * n);
  }
  // of() in 32-bit arithmetic, for launches of fewer than 2^31 blocks (for_ordered_grids) whose
  // rows fit an int: the persistent kernels' producers decode an item per block under a
  // 24-register cap, where 64-bit divisions spilled.
  __device__ __forceinline__ void of32(int idx, int& blk, int& row) const {
    const int cb32 = static_cast<int>(cb), per_chunk = gx * cb32;
    const int c = idx / per_chunk, r = idx - c * per_chunk;
    const int n = min(cb32, static_cast<int>(nbh) - c * cb32);
    blk = r / n;
    row = c * cb32 + (r - blk * n);
  }
  __host__ __device__ __forceinline__ unsigned blocks() const { return static_cast<unsigned>(nbh * gx); }
};

// The items (blocks of an ordered list, BlockOrder) a CTA of a persistent grid runs, in turn:
// chunk by chunk, in rounds of gridDim.x items, CTA c taking item c of even rounds and
// gridDim.x - 1 - c of odd ones. Over a chunk's heaviest-first list (causal) the snake pairs
// each CTA's heavier items with lighter ones; rounds restart at each chunk, so that the pairing
// holds in every chunk (rounds running across the chunks handed the same CTAs the heavy items
// chunk after chunk: the (4,32,4096,128) causal forward ran 0.74x one CTA a block). With one CTA
// a block, each CTA has one item.
struct WorkCursor {
  int start = 0, count = 0, round = 0;  // the chunk's first item and size; the CTA's round in it
  // The next item's index, or -1 when the CTA has none left (32-bit: for_ordered_grids).
  __device__ __forceinline__ int next(const BlockOrder& order) {
    const int total = static_cast<int>(order.blocks()), g = static_cast<int>(gridDim.x);
    const int c = static_cast<int>(blockIdx.x);
    int per_chunk = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(order.gx) * order.cb, total));
    if (per_chunk < g) per_chunk = total;  // chunks smaller than a round (order "rows"): one list
    for (;;) {
      if (count == 0) count = std::min(per_chunk, total - start);  // entering a chunk
      const int64_t p = static_cast<int64_t>(round) * g + ((round & 1) ? g - 1 - c : c);
      if (p < count) {
        ++round;
        return start + static_cast<int>(p);
      }
      start += count;
      if (start >= total) return -1;
      count = 0;
      round = 0;
    }
  }
};

// The sm_90a kernels' 1D grids over BH (batch, head) rows of gx blocks each: calls
// f(bh0, order, ctas) for launches of order.blocks() blocks (rows bh0 on) on `ctas` CTAs
// (attn_grid_ctas), each fitting gridDim.x (2^31 - 1), in the order above (attn_chunk_rows
// with `bytes_per_row` and device dev's SM count); `g` is the plan's (attention_plan.h).
template <typename F>
cudaError_t for_ordered_grids(int64_t BH, int gx, bool causal, int64_t bytes_per_row, const AttnGridPlan& g, int dev,
                              F&& f) {
  cudaError_t e = cudaSuccess;
  const int sms = device_sm_count(dev, e);
  if (e != cudaSuccess) return e;
  const int64_t step = std::max<int64_t>(1, ((int64_t{1} << 31) - 1) / std::max(gx, 1));
  for (int64_t bh0 = 0; bh0 < BH; bh0 += step) {
    const int64_t nbh = std::min<int64_t>(step, BH - bh0);
    const BlockOrder order{nbh, attn_chunk_rows(g, causal, nbh, gx, sms, bytes_per_row), gx};
    f(bh0, order, attn_grid_ctas(g, order.blocks(), static_cast<int64_t>(gx) * order.cb, causal, sms));
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace gpu_puzzles
