// Softmax / log_softmax forward and backward on CUDA: the plan (which kernel for
// which shape), the launch with its fallbacks, and the entry points of softmax.h.
//
// Tensors are (outer, N, inner), reduced over N; outputs contiguous. Inputs of
// rows (inner == 1) may sit at any row strides (RowStrides, two outer levels), the
// rest are contiguous. The auto kernels:
//   rows (inner == 1), N <= 128 * V : one warp per row, the row in registers
//                                      (V = elements per 16-byte vector); rows of
//                                      N <= 16 V share a warp, a lane per vector;
//   rows, N <= 2048 * V             : one block per row, the row in registers,
//                                      so x (or y and dy) is read exactly once;
//   rows, N <= 131072 on sm_90      : a cluster of 2-8 blocks per row, the row in
//                                      their registers, partials exchanged through
//                                      distributed shared memory: one read;
//   rows, longer (or few long rows) : split: each block reduces a chunk to a
//                                      partial (max, sum), a second kernel merges
//                                      the row's partials and writes its chunk;
//   columns (inner > 1)             : threads over inner (coalesced), each
//                                      reducing over N with a running (max, sum);
//                                      the block's tile is kept in shared memory
//                                      when it fits, so x is read once.
// The forward (2- and 4-byte types) takes faster kernels where they apply:
//   rows, 128 V < N <= 512 V        : one warp per row, packed in registers, no
//                                      block barrier (row_warp_fwd_kernel);
//   rows, 2048 V < N <= 131072      : a cluster per row with a single DSMEM
//                                      exchange and 2 blocks per SM (cluster_fwd_kernel);
//   columns, 512 < N <= 4096        : a cluster per 128-byte column tile, N split
//                                      over its blocks, in registers (inner_cluster_fwd_kernel).
// With the knobs at their defaults (softmax_tuning(), below):
//   rows, 2048 V < N (forward and backward, any N, alignment and row stride):
//                                      clusters of 2-16 blocks, each holding its slice
//                                      of the row (of y and dy) in shared memory
//                                      (smem_own_rows_kernel where every input row
//                                      starts at the output row's offset within 16
//                                      bytes, ALIGNED where that offset is 0 and
//                                      N % V == 0; else smem_rows_kernel, which shifts;
//                                      softmax_smem_align caps it; softmax_rows=staged, forward,
//                                      N % V == 0 and aligned: persistent clusters with
//                                      the next rows' slices in flight,
//                                      staged_rows_fwd_kernel; softmax_rows=cluster: the
//                                      register cluster kernels above);
//   columns, N > 512, inner % V == 0, aligned (forward and backward): clusters
//                                      per 128-byte column tile, staged through
//                                      shared memory (staged_cols_kernel).
// A refused cluster launch falls back to the older kernels.
// The teaching kernels (tree / shuffle / online) run one block per row.
// Statistics are float (double for float64); exp is the accurate expf/exp.
// Index arithmetic is 64-bit: tensors may exceed 2^31 elements.
#include <atomic>
#include <initializer_list>
#include <mutex>
#include <vector>

#include "common/kernel_choice.h"
#include "softmax/softmax_kernels.cuh"

namespace gpu_puzzles {
namespace softmax_detail {

unsigned grid_for(int64_t blocks) { return unsigned(std::max<int64_t>(1, std::min(blocks, kMaxGrid))); }

cudaLaunchAttribute cluster_attr(int64_t cs) {
  cudaLaunchAttribute at{};
  at.id = cudaLaunchAttributeClusterDimension;
  at.val.clusterDim.x = unsigned(cs);
  at.val.clusterDim.y = 1;
  at.val.clusterDim.z = 1;
  return at;
}

namespace {

// Clusters need sm_90 and a kernel compiled for it (a compute_80 PTX JIT-ed on
// Hopper would run the kernel's empty sm_80 body).
bool cluster_ok(bool bwd) {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major < 9) return false;
  cudaFuncAttributes fa{};
  const cudaError_t e = cudaFuncGetAttributes(&fa, cluster_rows_kernel_handle(bwd));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return fa.ptxVersion >= 90;
}

// The forward cluster kernels: sm_90 code present, and the GPU can hold at least
// one cluster of the largest size at the kernel's block size (asked once per
// device and kernel; the answer does not change).
bool cluster_fwd_ok(const void* kernel, int threads) {
  static std::atomic<int> known[2][64];                             // [kernel][device]: 0 unknown, 1 yes, 2 no
  const int which = kernel == cluster_fwd_kernel_handle() ? 0 : 1;  // the two kernels asked about
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return false;
  }
  const int k = known[which][dev].load(std::memory_order_relaxed);
  if (k) return k == 1;
  bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
  cudaFuncAttributes fa{};
  ok = ok && cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.ptxVersion >= 90;
  if (ok) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(kClusterMax);
    cfg.blockDim = dim3(unsigned(threads));
    cudaLaunchAttribute attr[1] = {cluster_attr(kClusterMax)};
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
  }
  cudaGetLastError();  // a refused query leaves no error behind
  known[which][dev].store(ok ? 1 : 2, std::memory_order_relaxed);
  return ok;
}

}  // namespace

// Asked once per device, kernel and configuration. Allows the non-portable
// cluster size 16 and the dynamic shared memory first.
int resident_clusters(const void* kernel, int threads, int cs, int64_t smem) {
  // Kernel attributes are per device and per function, so each (device, kernel)
  // keeps the largest dynamic shared memory asked of it so far (a smaller plan
  // never lowers it under a larger one); after the first call per plan this is a
  // lookup, no cudaFuncSetAttribute per launch.
  struct Key {
    int dev;
    const void* fn;
    int threads, cs;
    int64_t smem;
    int n;
  };
  struct Attr {
    int dev;
    const void* fn;
    int64_t smem;
  };
  static std::mutex mu;
  static std::vector<Key> known;
  static std::vector<Attr> attrs;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const void* fn = kernel;
  std::lock_guard<std::mutex> lock(mu);
  for (const Key& k : known)
    if (k.dev == dev && k.fn == fn && k.threads == threads && k.cs == cs && k.smem == smem) return k.n;
  Attr* at = nullptr;
  for (Attr& x : attrs)
    if (x.dev == dev && x.fn == fn) at = &x;
  int n = 0, major = 0;
  cudaFuncAttributes fa{};
  bool ok = smem <= kStagedSmemMax && cs <= 16 &&
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9 &&
            cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.ptxVersion >= 90;
  if (ok && (at == nullptr || at->smem < smem)) {
    ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) == cudaSuccess &&
         cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
    if (ok) {
      if (at == nullptr)
        attrs.push_back(Attr{dev, fn, smem});
      else
        at->smem = smem;
    }
  }
  if (ok) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(unsigned(cs));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = size_t(smem);
    cudaLaunchAttribute attr[1] = {cluster_attr(cs)};
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) n = 0;
  }
  cudaGetLastError();  // a refused query leaves no error behind
  known.push_back(Key{dev, fn, threads, cs, smem, n});
  return n;
}

namespace {

// Staged plans: fill p and say whether the GPU runs it (else the older kernels).
bool plan_staged_rows(const SoftmaxArgs& a, const SoftmaxTuning& tu, Plan& p) {
  const int V = 16 / esize(a.dtype);
  const int64_t N = a.N;
  int K = 8;
  int64_t cs = std::max<int64_t>(2, pow2ceil(cdiv(N, int64_t(kSrThreads) * 8 * V)));
  if (tu.cluster > cs) {  // a larger cluster with half the registers per thread (2 blocks per SM)
    const int64_t cs4 =
        std::min<int64_t>(tu.cluster, std::max<int64_t>(2, pow2ceil(cdiv(N, int64_t(kSrThreads) * 4 * V))));
    if (cs4 > cs) {
      cs = cs4;
      K = 4;
    }
  }
  if (cs > 16) return false;
  p.kind = Kind::StagedRows;
  p.S = cs;
  p.ch = K;
  p.threads = int(std::max<int64_t>(128, pow2ceil(cdiv(N, cs * K * V))));
  if (p.threads > kSrThreads) return false;  // cs K V 512 >= N by the choice above; kept as a guard
  p.stages = std::max(2, tu.stages);         // the register slices need a copy in flight behind them
  while (p.stages > 2 && int64_t(p.stages) * K * p.threads * 16 > kStagedSmemMax) --p.stages;
  p.smem = int64_t(p.stages) * K * p.threads * 16;
  if (p.smem > kStagedSmemMax) return false;
  const void* k = staged_rows_kernel_handle(a.dtype, a.log, K);
  return k != nullptr && resident_clusters(k, p.threads, int(cs), p.smem) > 0;
}

// The slice a block holds is 512 KB / tu.cluster (64 KB at the default 8: three
// blocks per SM), so the cluster is 8 for a 512 KB row and grows with it to 16; the
// backward holds two slices (y and dy), so its cluster is twice as large.
bool plan_smem_rows(const SoftmaxArgs& a, const SoftmaxTuning& tu, bool bwd, Plan& p) {
  const int es = esize(a.dtype), V = 16 / es;
  const int64_t arrays = bwd ? 2 : 1;
  const int64_t slice = (int64_t(512) << 10) / tu.cluster;
  const int64_t cs = std::min<int64_t>(16, std::max<int64_t>(2, pow2ceil(cdiv(arrays * a.N * es, slice))));
  p.kind = Kind::SmemRows;
  p.S = cs;
  // The most specialised kernel the layout allows (and the knob): rows of whole
  // aligned vectors (vec_ok), inputs at the output's offset in 16 bytes (no shift),
  // or any (smem_rows_kernel).
  const bool whole = vec_ok(a, bwd);
  p.align = std::max(whole ? 0 : (same_misalign(a, bwd) ? 1 : 2), std::max(0, tu.smem_align - 1));
  // Rows of whole aligned vectors need N / V vectors each; else the output of a
  // row spans up to one vector more, and, shifted, a block's input slice up to one
  // more than its output.
  p.sv = cdiv(whole ? a.N / V : cdiv(a.N + V - 1, V), cs);
  p.sb = p.sv + (whole || p.align < 2 ? 0 : 1);
  p.smem = arrays * p.sb * 16;
  p.threads = kSmThreads;
  p.stages = 1;
  p.bulk = tu.rows == kRowsBulk;
  p.grid = tu.grid;
  if (p.smem > kStagedSmemMax) return false;
  const void* k = smem_rows_kernel_handle(a.dtype, a.log, p.bulk, bwd, p.align);
  return k != nullptr && resident_clusters(k, p.threads, int(cs), p.smem) > 0;
}

bool plan_staged_cols(const SoftmaxArgs& a, const SoftmaxTuning& tu, bool bwd, Plan& p) {
  const int64_t arrays = bwd ? 2 : 1;
  const int64_t rmax = bwd ? tu.col_rows_bwd : tu.col_rows_fwd;
  // rmax is a preference: the cluster stops at 16 blocks, the rows per thread grow.
  int64_t cs = std::min<int64_t>(16, std::max<int64_t>(2, pow2ceil(cdiv(a.N, kScTy * rmax))));
  int stages = tu.stages;
  auto bytes = [&](int64_t c, int sg) { return int64_t(sg) * arrays * cdiv(cdiv(a.N, c), kScTy) * kScThreads * 16; };
  // Too big for shared memory: fewer stages, then more blocks per tile.
  while (stages > 2 && bytes(cs, stages) > kStagedSmemMax) --stages;
  while (cs < 16 && bytes(cs, stages) > kStagedSmemMax) cs *= 2;
  if (cs > 16 || bytes(cs, stages) > kStagedSmemMax) return false;
  p.kind = Kind::StagedCols;
  p.S = cs;
  p.ch = int(cdiv(cdiv(a.N, cs), kScTy));  // R, rows per thread
  p.threads = kScThreads;
  p.stages = stages;
  p.grid = tu.grid;
  p.smem = bytes(cs, stages);
  const void* k = staged_cols_kernel_handle(a.dtype, a.log, bwd);
  return k != nullptr && resident_clusters(k, p.threads, int(cs), p.smem) > 0;
}

Plan make_plan(const SoftmaxArgs& a, SoftmaxAlgo algo, bool bwd) {
  Plan p{};
  const int es = esize(a.dtype), V = 16 / es;
  if (algo != SoftmaxAlgo::Auto) {
    p.kind = Kind::Looped;
    return p;
  }
  const SoftmaxTuning& tu = a.tune;
  if (a.inner > 1) {
    // 512 < N, whole 16-byte vectors across inner, at least half a 128-byte tile
    // used: staged column tiles (forward and backward), x / y and dy read once.
    if (tu.cols == kColsStaged && es <= 4 && a.N > int64_t(kIcTy) * kIcRows && a.inner % V == 0 && a.inner * es >= 64 &&
        al16(a.a) && al16(a.out) && (!bwd || al16(a.b))) {
      Plan q{};
      if (plan_staged_cols(a, tu, bwd, q)) return q;
    }
    p.kind = Kind::Inner;
    const int64_t full = std::min<int64_t>(32 / es, pow2ceil(a.inner));
    const int64_t arrays = bwd ? 2 : 1;
    // Narrower tiles read part of a 32-byte sector each; the neighbouring tiles
    // (adjacent blocks, resident together) use the rest of it from L2.
    p.threads = int(full);
    for (int64_t tc : {full, std::max<int64_t>(1, full / 2), std::max<int64_t>(1, full / 4)}) {
      const int64_t bytes = a.N * tc * es * arrays;
      if (bytes <= kInnerCacheBytes) {
        p.threads = int(tc);
        p.cache = true;
        p.smem = bytes;
        break;
      }
    }
    // Forward, 512 < N <= 4096, whole 16-byte vectors across inner, at least half
    // a 128-byte tile used: a cluster of 2-8 blocks per tile holds it in registers
    // (one read of x, whole cache lines) instead of narrow tiles in shared memory.
    if (!bwd && es <= 4 && a.N > int64_t(kIcTy) * kIcRows && a.N <= int64_t(kClusterMax) * kIcTy * kIcRows &&
        a.inner % V == 0 && a.inner * es >= 64 && al16(a.a) && al16(a.out) &&
        cluster_fwd_ok(inner_cluster_kernel_handle(), kIcThreads)) {
      p.kind = Kind::InnerCluster;
      p.S = pow2ceil(cdiv(a.N, int64_t(kIcTy) * kIcRows));
    }
    return p;
  }
  const int64_t rows = a.outer, N = a.N;
  if (N <= 32 * 4 * V) {
    p.kind = Kind::WarpRows;
    p.ch = N <= 32 * V ? 1 : (N <= 64 * V ? 2 : 4);
    // Short rows share a warp: one lane per 16-byte vector of the row.
    if (N <= 16 * V) p.lanes = int(pow2ceil(cdiv(N, V)));
    return p;
  }
  // Forward, rows up to 8 KB: still one warp per row, the row packed in
  // registers, no block barrier (the block path below syncs 6 times per row).
  if (!bwd && es <= 4 && N <= 32 * 16 * V) {
    p.kind = Kind::RowWarp;
    p.ch = N <= 32 * 8 * V ? 8 : 16;
    return p;
  }
  // Long rows, forward and backward: the row slices in shared memory, several
  // blocks per SM (rows=smem, rows=bulk); any row length, alignment and stride.
  if ((tu.rows == kRowsSmem || tu.rows == kRowsBulk) && N > 2048 * V && es <= 4) {
    Plan q{};
    if (plan_smem_rows(a, tu, bwd, q)) return q;
  }
  // Forward, long rows: staged, persistent clusters (rows=staged), x read once with
  // the next rows' copies in flight.
  if (!bwd && tu.rows == kRowsStaged && N > 2048 * V && es <= 4 && vec_ok(a, false)) {
    Plan q{};
    if (plan_staged_rows(a, tu, q)) return q;
  }
  // Forward, long rows: a cluster per row with one cluster barrier and two
  // blocks per SM (the backward takes the 1024-thread cluster kernel below when
  // the smem kernel is off or refused).
  if (!bwd && N > 2048 * V && es <= 4 && N <= int64_t(kClusterMax) * kClusterFwdThreads * kClusterFwdElems &&
      cluster_fwd_ok(cluster_fwd_kernel_handle(), kClusterFwdThreads)) {
    p.kind = Kind::ClusterFwd;
    p.S = std::max<int64_t>(2, pow2ceil(cdiv(N, int64_t(kClusterFwdThreads) * kClusterFwdElems)));
    p.threads = int(std::max<int64_t>(128, pow2ceil(cdiv(N, p.S * kClusterFwdElems))));
    return p;
  }
  // Too long for one block's registers: a cluster per row where the GPU has
  // clusters (float64 would spill at 16 doubles x 2 per thread), else split.
  if (N > 2048 * V && es <= 4 && N <= int64_t(kClusterMax) * 1024 * kClusterElems && cluster_ok(bwd)) {
    p.kind = Kind::ClusterRows;
    p.S = std::max<int64_t>(2, pow2ceil(cdiv(N, int64_t(1024) * kClusterElems)));
    p.threads = int(std::max<int64_t>(128, pow2ceil(cdiv(N, p.S * kClusterElems))));
    return p;
  }
  // Few long rows would leave most SMs idle with one block per row: split them.
  if (N > 2048 * V || (rows < 128 && N >= 4 * kSplitChunk)) {
    p.kind = Kind::Split;
    p.S = cdiv(N, kSplitChunk);
    return p;
  }
  p.kind = Kind::BlockRows;
  p.ch = cdiv(N, 2 * V) >= 128 ? 2 : 1;
  p.threads = int(std::min<int64_t>(1024, std::max<int64_t>(64, pow2ceil(cdiv(N, int64_t(V) * p.ch)))));
  return p;
}

// Launches plan `p`; a refused cluster launch falls back to the older kernels.
cudaError_t launch_plan(const SoftmaxArgs& a, const Plan& p, SoftmaxAlgo algo, void* workspace, cudaStream_t st,
                        bool bwd) {
  cudaError_t e = cudaSuccess;
  switch (p.kind) {
    case Kind::WarpRows:
    case Kind::RowWarp:
    case Kind::BlockRows:
    case Kind::Split:
      return launch_rows(a, p, workspace, st, bwd);
    case Kind::Inner:
      return launch_cols(a, p, st, bwd);
    case Kind::Looped:
      return launch_teaching(a, algo, st, bwd);
    case Kind::ClusterRows:
    case Kind::ClusterFwd:
    case Kind::StagedRows:
    case Kind::SmemRows:
      e = launch_cluster_rows(a, p, st, bwd);
      break;
    case Kind::InnerCluster:
    case Kind::StagedCols:
      e = launch_cols(a, p, st, bwd);
      break;
  }
  if (e == cudaSuccess) return cudaGetLastError();
  cudaGetLastError();  // refused (no room for the cluster): clear it and fall back
  if (p.kind == Kind::ClusterRows || p.kind == Kind::ClusterFwd) return launch_split(a, workspace, st, bwd);
  if (p.kind == Kind::InnerCluster) {  // its plan keeps the Inner plan's tile
    Plan q = p;
    q.kind = Kind::Inner;
    return launch_cols(a, q, st, bwd);
  }
  // The staged kernels: the plan with them turned off.
  SoftmaxArgs o = a;
  o.tune.rows = 1;
  o.tune.cols = 1;
  return launch_plan(o, make_plan(o, algo, bwd), algo, workspace, st, bwd);
}

LaunchStatus launch(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t st, bool bwd) {
  if (a.outer * a.N * a.inner == 0) return cudaSuccess;
  return static_cast<LaunchStatus>(launch_plan(a, make_plan(a, algo, bwd), algo, workspace, st, bwd));
}

}  // namespace
}  // namespace softmax_detail

using namespace softmax_detail;

int64_t softmax_workspace_bytes(const SoftmaxArgs& a, SoftmaxAlgo algo, bool backward) {
  if (a.outer * a.N * a.inner == 0) return 0;
  const Plan p = make_plan(a, algo, backward);
  // The cluster paths fall back to the split path when a launch is refused.
  if (p.kind != Kind::Split && p.kind != Kind::ClusterRows && p.kind != Kind::ClusterFwd &&
      p.kind != Kind::StagedRows && p.kind != Kind::SmemRows)
    return 0;
  const int64_t acc = a.dtype == DType::Float64 ? 8 : 4;
  return a.outer * cdiv(a.N, kSplitChunk) * acc * (backward ? 1 : 2);
}

namespace {
// The knob's value (its 1-based index in the knob table, which is the encoding
// SoftmaxTuning uses) or `fallback` when not overridden.
int knob_or(Knob k, int fallback) {
  const int v = knob(k);
  return v == 0 ? fallback : v;
}
}  // namespace

// The defaults are the fastest variants of benchmarks/results/softmax_sweep_h100.txt:
// long fp32 rows keep their slices in shared memory (rows=smem, a 512 KB row over a
// cluster of 8); column tiles go through the staged kernel one tile at a time
// (stages 1, several blocks per SM), 16 rows per thread forward and 8 backward.
// grid 1 (every cluster resident): with 4 per resident cluster, compute-sanitizer
// synccheck flags the column kernel's first block barrier (results/sanitizer_h100.txt).
SoftmaxTuning softmax_tuning() {
  SoftmaxTuning t;
  t.rows = knob_or(Knob::SoftmaxRows, kRowsSmem);
  t.cluster = knob_int(Knob::SoftmaxCluster, 8);
  t.stages = knob_int(Knob::SoftmaxStages, 1);  // the staged rows kernel takes at least 2
  t.cols = knob_or(Knob::SoftmaxCols, kColsStaged);
  t.col_rows_fwd = knob_int(Knob::SoftmaxColRowsFwd, 16);
  t.col_rows_bwd = knob_int(Knob::SoftmaxColRowsBwd, 8);
  t.grid = knob_int(Knob::SoftmaxGrid, 1);
  t.smem_align = knob_or(Knob::SoftmaxSmemAlign, 1);  // aligned: the layout decides
  return t;
}

LaunchStatus softmax_forward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream) {
  return launch(a, algo, workspace, stream, false);
}

LaunchStatus softmax_backward_cuda(const SoftmaxArgs& a, SoftmaxAlgo algo, void* workspace, cudaStream_t stream) {
  return launch(a, algo, workspace, stream, true);
}

}  // namespace gpu_puzzles
