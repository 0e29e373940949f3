// Softmax rows (inner == 1, input rows at any row strides: RowStrides) held in registers: a warp or a block per row
// (rows_regs_kernel), the forward's packed warp-per-row kernel (row_warp_fwd_kernel),
// and the split path for rows too long for one block (split_stats / split_apply),
// which is also the fallback of the cluster kernels.
#include "softmax/softmax_kernels.cuh"

namespace gpu_puzzles {
namespace {

using namespace softmax_detail;

// ---- rows in registers: LANES lanes of a warp (BLOCK = false) or a block per row
// Thread t of a G-thread group holds chunks c = 0..CH-1 of V elements starting
// at (c * G + t) * V: each 16-byte load of a warp is one contiguous 512 bytes.
// Short rows: a warp holds 32 / LANES rows. The row loop is warp-uniform (the
// shuffles need every lane); a lane past the last row works on an empty row
// (Nr = 0: loads give the fill value, stores write nothing). Warps exit
// independently (no block barrier is used in warp mode).
template <typename T, int CH, bool BLOCK, bool BWD, int LANES = 32>
__global__ void __launch_bounds__(BLOCK ? 1024 : kWarpRowsThreads)
    rows_regs_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t rows, int64_t N,
                     RowStrides la, RowStrides lb, bool log, bool vec) {
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: a power of two up to 32");
  __shared__ A red[33];
  const int G = BLOCK ? int(blockDim.x) : LANES;
  const int t = BLOCK ? int(threadIdx.x) : int(threadIdx.x & (LANES - 1));
  const int64_t rpw = BLOCK ? 1 : 32 / LANES;  // rows per warp and step
  const int64_t per = BLOCK ? 1 : (blockDim.x >> 5) * rpw;
  const int64_t first =
      BLOCK ? int64_t(blockIdx.x) : (int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpw;
  const int64_t step = int64_t(gridDim.x) * per;
  for (int64_t r0 = first; r0 < rows; r0 += step) {
    const int64_t row = BLOCK ? r0 : r0 + (threadIdx.x & 31) / LANES;
    const bool valid = row < rows;
    const int64_t Nr = valid ? N : 0;
    const T* ar = row_ptr(a, la, valid ? row : 0);
    T* outr = out + (valid ? row : 0) * N;
    A v[CH][V];
    if constexpr (!BWD) {
      const A m = group_max<BLOCK, LANES>(regs_load_max<T>(v, ar, G, t, Nr, vec), red);
      const A s = group_sum<BLOCK, LANES>(regs_exp_sum(v, m, log), red);
      regs_store_fwd(outr, v, s, log, G, t, Nr, vec);
    } else {
      // softmax: dx = y (dy - sum(dy y));  log_softmax: dx = dy - exp(y) sum(dy)
      const T* br = row_ptr(b, lb, valid ? row : 0);
      A g[CH][V];
      const A s = group_sum<BLOCK, LANES>(regs_load_dot<T>(v, g, ar, br, G, t, Nr, log, vec), red);
      regs_store_bwd(outr, v, g, s, log, G, t, Nr, vec);
    }
  }
}

// ---- long rows: split across blocks ----------------------------------------
// Block `blk` of the split kernels: its row, and the bounds [lo, hi) of its chunk.
struct SplitChunk {
  int64_t row, lo, hi;
};
__device__ __forceinline__ SplitChunk split_chunk(int64_t blk, int64_t S, int64_t N) {
  const int64_t lo = (blk % S) * kSplitChunk;
  return {blk / S, lo, min(N, lo + kSplitChunk)};
}

// Block `blk` = row * S + c reduces elements [c * kSplitChunk, ...) of its row to
// a partial: (max, sum) for the forward, sum for the backward.
template <typename T, bool BWD>
__global__ void __launch_bounds__(kSplitThreads)
    split_stats_kernel(const T* __restrict__ a, const T* __restrict__ b, acc_t<T>* __restrict__ ws, int64_t rows,
                       int64_t N, int64_t S, RowStrides la, RowStrides lb, bool log, bool vec) {
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  __shared__ A red[33];
  for (int64_t blk = blockIdx.x; blk < rows * S; blk += gridDim.x) {
    const auto [row, lo, hi] = split_chunk(blk, S, N);
    const T* ar = row_ptr(a, la, row);
    A m = neg_inf<A>(), s = A(0);
    for (int64_t i = lo + int64_t(threadIdx.x) * V; i < hi; i += int64_t(kSplitThreads) * V) {
      A va[V];
      if constexpr (!BWD) {
        load_chunk<T, V>(va, ar, i, hi, vec, neg_inf<A>());
#pragma unroll
        for (int k = 0; k < V; ++k) online_add(m, s, va[k]);
      } else {
        A vb[V];
        load_chunk<T, V>(va, ar, i, hi, vec, A(0));
        load_chunk<T, V>(vb, row_ptr(b, lb, row), i, hi, vec, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) s += log ? vb[k] : va[k] * vb[k];
      }
    }
    if constexpr (!BWD) {
      block_merge(m, s, red);
      if (threadIdx.x == 0) {
        ws[2 * blk] = m;
        ws[2 * blk + 1] = s;
      }
    } else {
      s = block_sum(s, red);
      if (threadIdx.x == 0) ws[blk] = s;
    }
  }
}

// Merge the row's S partials (same order in every block: deterministic), then
// write this block's chunk.
template <typename T, bool BWD>
__global__ void __launch_bounds__(kSplitThreads)
    split_apply_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                       const acc_t<T>* __restrict__ ws, int64_t rows, int64_t N, int64_t S, RowStrides la,
                       RowStrides lb, bool log, bool vec) {
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  __shared__ A red[33];
  for (int64_t blk = blockIdx.x; blk < rows * S; blk += gridDim.x) {
    const auto [row, lo, hi] = split_chunk(blk, S, N);
    A m = neg_inf<A>(), s = A(0);
    if constexpr (!BWD) {
      for (int64_t j = threadIdx.x; j < S; j += kSplitThreads)
        online_merge(m, s, ws[2 * (row * S + j)], ws[2 * (row * S + j) + 1]);
      block_merge(m, s, red);
    } else {
      for (int64_t j = threadIdx.x; j < S; j += kSplitThreads) s += ws[row * S + j];
      s = block_sum(s, red);
    }
    const A sub = log ? log_a(s) : A(0);
    const A mul = A(1) / s;
    const T* ar = row_ptr(a, la, row);
    T* outr = out + row * N;
    for (int64_t i = lo + int64_t(threadIdx.x) * V; i < hi; i += int64_t(kSplitThreads) * V) {
      A va[V];
      load_chunk<T, V>(va, ar, i, hi, vec, A(0));
      if constexpr (!BWD) {
#pragma unroll
        for (int k = 0; k < V; ++k) va[k] = log ? va[k] - m - sub : exp_a(va[k] - m) * mul;
      } else {
        A vb[V];
        load_chunk<T, V>(vb, row_ptr(b, lb, row), i, hi, vec, A(0));
#pragma unroll
        for (int k = 0; k < V; ++k) va[k] = log ? vb[k] - exp_a(va[k]) * s : va[k] * (vb[k] - s);
      }
      store_chunk<T, V>(outr, va, i, hi, vec);
    }
  }
}

// ---- rows of 128 V < N <= 512 V (8 KB), 2- and 4-byte types: a warp per row ----
// Lane l holds chunks c = 0..CH-1 at (c * 32 + l) * V as raw 32-bit words (8 KB
// of bf16 is 64 registers per lane, not 128 floats): each warp load is a
// contiguous 512 bytes and all CH loads are in flight before the first use. No
// block barrier (the block path syncs 6 times per row): warps retire rows on
// their own, 4 per block. ptxas holds the converted floats too (~157 registers
// for 8 KB rows of bf16, no spill): 3 blocks, 12 rows, 96 KB of loads in flight
// per SM (the block path had 5 rows).

// Element k (compile-time) of a chunk of 4 words, as float; bf16 and fp16 take
// two per word (element 2i in the low half), float one.
template <typename T>
__device__ __forceinline__ float word_elem(const uint32_t (&w)[4], int k) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[k]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(k & 1 ? w[k >> 1] & 0xffff0000u : w[k >> 1] << 16);
  } else {
    const uint32_t h = k & 1 ? w[k >> 1] >> 16 : w[k >> 1] & 0xffffu;
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  }
}
template <typename T>
__device__ __forceinline__ uint32_t bits_of(float v) {
  if constexpr (sizeof(T) == 4)
    return __float_as_uint(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  else
    return __half_as_ushort(__float2half_rn(v));
}
template <typename T>
__device__ __forceinline__ void set_word_elem(uint32_t (&w)[4], int k, float v) {
  if constexpr (sizeof(T) == 4) {
    w[k] = __float_as_uint(v);
  } else if (k & 1) {
    w[k >> 1] = (w[k >> 1] & 0xffffu) | (bits_of<T>(v) << 16);
  } else {
    w[k >> 1] = (w[k >> 1] & 0xffff0000u) | bits_of<T>(v);
  }
}

template <typename T, int CH, bool LOG>
__global__ void __launch_bounds__(kRowWarpThreads, 3)
    row_warp_fwd_kernel(const T* __restrict__ a, T* __restrict__ out, int64_t rows, int64_t N, RowStrides la,
                        bool vec) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "2- and 4-byte types");
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31;
  constexpr int kWarps = kRowWarpThreads / 32;
  const uint32_t ninf = bits_of<T>(-INFINITY) * (sizeof(T) == 2 ? 0x10001u : 1u);  // -inf in every slot
  const int64_t step = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); row < rows; row += step) {  // warp-uniform
    const T* ar = row_ptr(a, la, row) + lane * V;
    T* outr = out + row * N + lane * V;
    const int64_t rem = N - int64_t(lane) * V;  // elements from this lane's first
    uint32_t r[CH][4];
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int i0 = c * 32 * V;  // < 8 KB / 2: int is enough
      if (vec) {
        if (i0 < rem) {
          const uint4 q = __ldg(reinterpret_cast<const uint4*>(ar + i0));
          r[c][0] = q.x;
          r[c][1] = q.y;
          r[c][2] = q.z;
          r[c][3] = q.w;
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) r[c][i] = ninf;
        }
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) r[c][i] = ninf;
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (i0 + k < rem) set_word_elem<T>(r[c], k, to_acc<float>(ar[i0 + k]));
      }
    }
    float m = -INFINITY;
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int k = 0; k < V; ++k) m = fmaxf(m, word_elem<T>(r[c], k));
    m = warp_max(m);
    const ExpShift<T> ex(m);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
#pragma unroll
      for (int k = 0; k < V; ++k) s += ex(word_elem<T>(r[c], k));  // padding: exp(-inf) = 0
    }
    s = warp_sum(s);
    const float ls = LOG ? logf(s) : 0.f;
    const float inv = 1.f / s;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float x = word_elem<T>(r[c], k);
        set_word_elem<T>(r[c], k, LOG ? (x - m) - ls : ex(x) * inv);
      }
      const int i0 = c * 32 * V;
      if (vec) {
        if (i0 < rem) __stcs(reinterpret_cast<uint4*>(outr + i0), make_uint4(r[c][0], r[c][1], r[c][2], r[c][3]));
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (i0 + k < rem) outr[i0 + k] = from_acc<T>(word_elem<T>(r[c], k));
      }
    }
  }
}

template <typename T, bool BWD>
cudaError_t launch_split_typed(const SoftmaxArgs& a, void* workspace, cudaStream_t st, bool vec) {
  if (workspace == nullptr) return cudaErrorInvalidValue;
  const auto [A_, B_, O] = typed_ptrs<T>(a);
  const int64_t rows = a.outer, N = a.N, S = cdiv(N, kSplitChunk);
  auto* ws = static_cast<acc_t<T>*>(workspace);
  const unsigned g = grid_for(rows * S);
  split_stats_kernel<T, BWD><<<g, kSplitThreads, 0, st>>>(A_, B_, ws, rows, N, S, a.la, a.lb, a.log, vec);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  split_apply_kernel<T, BWD><<<g, kSplitThreads, 0, st>>>(A_, B_, O, ws, rows, N, S, a.la, a.lb, a.log, vec);
  return cudaGetLastError();
}

template <typename T, bool BWD>
cudaError_t launch_rows_typed(const SoftmaxArgs& a, const Plan& p, void* workspace, cudaStream_t st) {
  const auto [A_, B_, O] = typed_ptrs<T>(a);
  const int64_t rows = a.outer, N = a.N;
  const bool vec = vec_ok(a, BWD);
  switch (p.kind) {
    case Kind::WarpRows: {
      // Rows of up to 16 vectors share a warp, p.lanes lanes a row; else a warp a row, p.ch chunks a lane.
      const int per = kWarpRowsThreads / 32 * (32 / p.lanes);
      const auto k = p.lanes == 1    ? rows_regs_kernel<T, 1, false, BWD, 1>
                     : p.lanes == 2  ? rows_regs_kernel<T, 1, false, BWD, 2>
                     : p.lanes == 4  ? rows_regs_kernel<T, 1, false, BWD, 4>
                     : p.lanes == 8  ? rows_regs_kernel<T, 1, false, BWD, 8>
                     : p.lanes == 16 ? rows_regs_kernel<T, 1, false, BWD, 16>
                     : p.ch == 1     ? rows_regs_kernel<T, 1, false, BWD>
                     : p.ch == 2     ? rows_regs_kernel<T, 2, false, BWD>
                                     : rows_regs_kernel<T, 4, false, BWD>;
      k<<<grid_for(cdiv(rows, per)), kWarpRowsThreads, 0, st>>>(A_, B_, O, rows, N, a.la, a.lb, a.log, vec);
      break;
    }
    case Kind::BlockRows: {
      const auto k = p.ch == 1 ? rows_regs_kernel<T, 1, true, BWD> : rows_regs_kernel<T, 2, true, BWD>;
      k<<<grid_for(rows), p.threads, 0, st>>>(A_, B_, O, rows, N, a.la, a.lb, a.log, vec);
      break;
    }
    case Kind::RowWarp: {
      if constexpr (!BWD && sizeof(T) <= 4) {
        const unsigned g = grid_for(cdiv(rows, kRowWarpThreads / 32));
        auto k = p.ch == 8 ? (a.log ? row_warp_fwd_kernel<T, 8, true> : row_warp_fwd_kernel<T, 8, false>)
                           : (a.log ? row_warp_fwd_kernel<T, 16, true> : row_warp_fwd_kernel<T, 16, false>);
        k<<<g, kRowWarpThreads, 0, st>>>(A_, O, rows, N, a.la, vec);
      } else {
        return cudaErrorInvalidValue;  // forward, 2- and 4-byte types only
      }
      break;
    }
    case Kind::Split:
      return launch_split_typed<T, BWD>(a, workspace, st, vec);
    default:
      return cudaErrorInvalidValue;  // not a kernel of this file
  }
  return cudaGetLastError();
}

}  // namespace

namespace softmax_detail {

cudaError_t launch_rows(const SoftmaxArgs& a, const Plan& p, void* workspace, cudaStream_t st, bool bwd) {
  return dispatch_typed(a, bwd, [&](auto tag, auto bwd_c) {
    return launch_rows_typed<decltype(tag), decltype(bwd_c)::value>(a, p, workspace, st);
  });
}

cudaError_t launch_split(const SoftmaxArgs& a, void* workspace, cudaStream_t st, bool bwd) {
  return dispatch_typed(a, bwd, [&](auto tag, auto bwd_c) {
    return launch_split_typed<decltype(tag), decltype(bwd_c)::value>(a, workspace, st, vec_ok(a, bwd_c));
  });
}

}  // namespace softmax_detail
}  // namespace gpu_puzzles
