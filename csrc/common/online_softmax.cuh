// The online-softmax step (running max m and running sum l per query row, FlashAttention)
// on an mma.sync / wgmma accumulator fragment, shared by the attention forward kernels.
// Both fragments hold a row's values in the 4 lanes of a quad, as n-tiles of 8 columns
// with 4 values per lane each: values 2h and 2h + 1 of every n-tile belong to row half h
// (mma.sync m16n8: rows g and g + 8; wgmma 64xN: the same per 16-row slab).
#pragma once
#include <cuda_runtime.h>

#include <cmath>

#include "common/device.cuh"

namespace gpu_puzzles {

// 2^x with one MUFU.EX2: flushes subnormal results to 0 (probabilities below 2^-126 of
// the row max) and skips exp2f's subnormal-range fix-up; 2^-inf = 0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <bool kFtz>
__device__ __forceinline__ float online_exp2(float x) {
  if constexpr (kFtz) {
    return exp2_ftz(x);
  } else {
    return exp2f(x);
  }
}

// One key tile for row half h: s(nt, e) are the tile's NS n-tiles of log2-domain scores
// (masked ones -inf), o(dt, e) the NO n-tiles of the output accumulator; m is the
// running max (log2 domain), l this lane's partial running sum. On return s holds the
// unnormalised probabilities 2^(s - m), and o and l are rescaled to the new max.
// kFtz: exp2_ftz instead of exp2f. kPairs: an n-tile's two values are added to each other,
// then to the sum (the mma.sync kernels), else one at a time (the wgmma kernel); the same
// to rounding, kept per kernel so that each compiles to the code it was validated with.
// kUnscaled: s holds the scores before scaling by scale_log2 > 0; the row max is taken on
// them and scaled once (the same m: rounding is monotonic), and each exponent
// s scale_log2 - m is one FFMA instead of an FMUL before the max and an FADD after it.
template <bool kFtz, bool kPairs, int NS, int NO, bool kUnscaled = false, class S, class O>
__device__ __forceinline__ void online_softmax_step(S&& s, O&& o, float& m, float& l, int h, float scale_log2 = 1.f) {
  float mx = kUnscaled ? -INFINITY : m;
#pragma unroll
  for (int nt = 0; nt < NS; ++nt) mx = fmaxf(mx, fmaxf(s(nt, 2 * h), s(nt, 2 * h + 1)));
  mx = quad_max(mx);
  if constexpr (kUnscaled) mx = fmaxf(m, mx * scale_log2);
  const float base = mx == -INFINITY ? 0.f : mx;    // row still fully masked
  const float alpha = online_exp2<kFtz>(m - base);  // old max -inf -> 0
  m = mx;
  const auto exponent = [&](float x) { return kUnscaled ? fmaf(x, scale_log2, -base) : x - base; };
  float sum = 0.f;
#pragma unroll
  for (int nt = 0; nt < NS; ++nt) {
    s(nt, 2 * h) = online_exp2<kFtz>(exponent(s(nt, 2 * h)));
    if constexpr (!kPairs) sum += s(nt, 2 * h);
    s(nt, 2 * h + 1) = online_exp2<kFtz>(exponent(s(nt, 2 * h + 1)));
    if constexpr (kPairs) {
      sum += s(nt, 2 * h) + s(nt, 2 * h + 1);
    } else {
      sum += s(nt, 2 * h + 1);
    }
  }
  l = l * alpha + sum;
#pragma unroll
  for (int dt = 0; dt < NO; ++dt) {
    o(dt, 2 * h) *= alpha;
    o(dt, 2 * h + 1) *= alpha;
  }
}

}  // namespace gpu_puzzles
