// attention CPU kernels: a blocked (flash-style) forward and backward on the
// contiguous (BH, S, D) layout of attention.h, and the unfused chain's
// transpose_last2 and matmul. Every matrix product is a library GEMM on a block
// (at::cpu::addmm_out: the CPU kernel directly, no dispatcher round trip), and so
// is the exp of a block of scores (at::cpu::exp_); the rest of the row math
// (mask, online softmax) is plain loops the compiler vectorises.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/exp_cpu_dispatch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention/attention.h"

namespace gpu_puzzles {
namespace {

// Keys per block: a (query block x kKBlock) block of scores and one of their
// gradients stay in L2.
constexpr int64_t kKBlock = 512;

// Query rows per block, the same in the forward and the backward so that both
// compute every score with the same GEMM shapes, bit for bit: the backward's
// exp(S - lse) then matches the forward's normalisation even where float32
// cannot hold the scores well. 128 (fewer, larger GEMMs; the dK and dV GEMMs sum
// over the block), 64 when causal (less of the diagonal block computed and
// masked), halved down to 32 while there would be fewer than 8 tasks. It
// depends on the shapes only, never on the thread count.
int64_t query_block(int64_t BH, int64_t Sq, bool causal) {
  int64_t qb = causal ? 64 : 128;
  while (qb > 32 && BH * ((Sq + qb - 1) / qb) < 8) qb /= 2;
  return qb;
}

template <typename T>
constexpr at::ScalarType scalar_type_of() {
  return c10::CppTypeToScalarType<T>::value;
}

// A (rows x cols) view of row-major memory with leading dim ld; transposed, the
// (cols x rows) view of the same memory (the GEMM reads it transposed, no copy).
template <typename T>
at::Tensor mat(const T* p, int64_t rows, int64_t cols, int64_t ld, bool transposed = false) {
  const auto opts = at::TensorOptions().dtype(scalar_type_of<T>());
  if (transposed) return at::from_blob(const_cast<T*>(p), {cols, rows}, {1, ld}, opts);
  return at::from_blob(const_cast<T*>(p), {rows, cols}, {ld, 1}, opts);
}

// c = alpha * a @ b + beta * c (beta 0: c's old contents are ignored, NaN included).
void gemm(at::Tensor c, const at::Tensor& a, const at::Tensor& b, double alpha, double beta) {
  at::cpu::addmm_out(c, c, a, b, beta, alpha);
}

// max of x[0, n) (n >= 1), in independent lanes: no single dependency chain (GCC,
// under its default -ftrapping-math, keeps the float compares scalar all the same).
template <typename T>
T row_max(const T* x, int64_t n) {
  constexpr int L = 16;
  T lanes[L];
  for (int l = 0; l < L; ++l) lanes[l] = x[0];
  int64_t j = 0;
  for (; j + L <= n; j += L)
    for (int l = 0; l < L; ++l) lanes[l] = lanes[l] < x[j + l] ? x[j + l] : lanes[l];
  T m = x[0];
  for (int l = 0; l < L; ++l) m = std::max(m, lanes[l]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// sum of x[0, n), in independent lanes: vectorised, and more accurate than one running sum.
template <typename T>
T row_sum(const T* x, int64_t n) {
  constexpr int L = 16;
  T lanes[L] = {};
  int64_t j = 0;
  for (; j + L <= n; j += L)
    for (int l = 0; l < L; ++l) lanes[l] += x[j + l];
  T s = T(0);
  for (; j < n; ++j) s += x[j];
  for (int l = 0; l < L; ++l) s += lanes[l];
  return s;
}

// x[j] -= shift for the first nv of a row of n, -inf (exp gives 0) for the rest.
template <typename T>
void shift_and_mask(T* x, int64_t nv, int64_t n, T shift) {
  nv = std::max<int64_t>(nv, 0);
  for (int64_t j = 0; j < nv; ++j) x[j] -= shift;
  std::fill(x + nv, x + n, -std::numeric_limits<T>::infinity());
}

// exp in place on a contiguous block: ATen's kernel, which runs at the CPU's own
// SIMD width (picked at run time), where this file is built for the baseline ISA.
void exp_inplace(at::Tensor x) { at::cpu::exp_(x); }

// Keys of the block [j0, j0 + n) that query i sees: all n, or those with j <= i
// when causal (SDPA's top-left mask); can be <= 0.
inline int64_t visible_in_block(int64_t i, int64_t j0, int64_t n, bool causal) {
  return causal ? std::min(n, i + 1 - j0) : n;
}

// Keys any query of the rows [i0, i1) sees: [0, kend).
inline int64_t keys_for_rows(int64_t i1, int64_t Sk, bool causal) { return causal ? std::min(Sk, i1) : Sk; }

template <typename T>
void fwd_kernel(const T* q, const T* k, const T* v, T* o, T* lse, int64_t BH, int64_t G, int64_t Sq, int64_t Sk,
                int64_t D, int64_t Dv, double scale, bool causal) {
  const int64_t qblk = query_block(BH, Sq, causal);
  const int64_t nqb = (Sq + qblk - 1) / qblk;
  const int64_t kb_max = std::min(Sk, kKBlock);
  at::parallel_for(0, BH * nqb, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> s(qblk * kb_max), mx(qblk), sum(qblk), alpha(qblk);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nqb, i0 = (t % nqb) * qblk, m = std::min(qblk, Sq - i0);
      const T* qb = q + (bh * Sq + i0) * D;
      const T* kbh = k + (bh / G) * Sk * D;  // the kv head of query head bh (attention.h)
      const T* vbh = v + (bh / G) * Sk * Dv;
      T* ob = o + (bh * Sq + i0) * Dv;
      const at::Tensor o_blk = mat(ob, m, Dv, Dv), q_blk = mat(qb, m, D, D);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<T>::infinity());
      std::fill(sum.begin(), sum.end(), T(0));
      const int64_t kend = keys_for_rows(i0 + m, Sk, causal);
      for (int64_t j0 = 0; j0 < kend; j0 += kKBlock) {
        const int64_t n = std::min(kKBlock, kend - j0);
        const at::Tensor s_blk = mat(s.data(), m, n, n);
        gemm(s_blk, q_blk, mat(kbh + j0 * D, n, D, D, true), scale, 0.0);
        for (int64_t r = 0; r < m; ++r) {
          T* sr = s.data() + r * n;
          const int64_t nv = visible_in_block(i0 + r, j0, n, causal);
          alpha[r] = T(1);
          if (nv > 0) {  // else the whole block is above the diagonal for this row
            const T new_mx = std::max(mx[r], row_max(sr, nv));
            alpha[r] = std::exp(mx[r] - new_mx);  // 0 on the first block (mx = -inf)
            mx[r] = new_mx;
          }
          shift_and_mask(sr, nv, n, mx[r]);
        }
        exp_inplace(s_blk);
        for (int64_t r = 0; r < m; ++r) sum[r] = sum[r] * alpha[r] + row_sum(s.data() + r * n, n);
        if (j0 > 0) {  // rescale the rows' partial outputs to the new maxima
          for (int64_t r = 0; r < m; ++r)
            if (alpha[r] != T(1))
              for (int64_t d = 0; d < Dv; ++d) ob[r * Dv + d] *= alpha[r];
        }
        gemm(o_blk, s_blk, mat(vbh + j0 * Dv, n, Dv, Dv), 1.0, j0 > 0 ? 1.0 : 0.0);
      }
      for (int64_t r = 0; r < m; ++r) {
        const T inv = T(1) / sum[r];
        for (int64_t d = 0; d < Dv; ++d) ob[r * Dv + d] *= inv;
        lse[bh * Sq + i0 + r] = mx[r] + std::log(sum[r]);
      }
    }
  });
}

// Backward from the saved lse, recomputing P block by block (never stored):
//   P = exp(scale Q K^T - lse), dV += P^T dO, dP = dO V^T, delta_i = dO_i . O_i,
//   dS = P (dP - delta), dQ = scale dS K, dK += scale dS^T Q.
// One task per (batch, kv head): it runs the G query heads of its group in order, so its
// dK and dV rows are written by it alone and summed over the group in a fixed order.
template <typename T>
void bwd_kernel(const T* dout, const T* q, const T* k, const T* v, const T* o, const T* lse, T* dq, T* dk, T* dv,
                int64_t BH, int64_t G, int64_t Sq, int64_t Sk, int64_t D, int64_t Dv, double scale, bool causal) {
  const int64_t qblk = query_block(BH, Sq, causal);
  const int64_t kb_max = std::min(Sk, kKBlock);
  at::parallel_for(0, BH / G, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> p(qblk * kb_max), dp(qblk * kb_max), delta(Sq);
    for (int64_t bhk = begin; bhk < end; ++bhk) {
      const T* kh = k + bhk * Sk * D;
      const T* vh = v + bhk * Sk * Dv;
      T* dkh = dk + bhk * Sk * D;
      T* dvh = dv + bhk * Sk * Dv;
      std::fill(dkh, dkh + Sk * D, T(0));
      std::fill(dvh, dvh + Sk * Dv, T(0));
      for (int64_t bh = bhk * G; bh < (bhk + 1) * G; ++bh) {
        const T* qh = q + bh * Sq * D;
        const T* gh = dout + bh * Sq * Dv;
        const T* oh = o + bh * Sq * Dv;
        const T* lh = lse + bh * Sq;
        T* dqh = dq + bh * Sq * D;
        for (int64_t i = 0; i < Sq; ++i) {
          T acc = T(0);
          for (int64_t d = 0; d < Dv; ++d) acc += gh[i * Dv + d] * oh[i * Dv + d];
          delta[i] = acc;
        }
        for (int64_t i0 = 0; i0 < Sq; i0 += qblk) {  // the forward's blocks
          const int64_t m = std::min(qblk, Sq - i0);
          const at::Tensor q_blk = mat(qh + i0 * D, m, D, D), g_blk = mat(gh + i0 * Dv, m, Dv, Dv);
          const at::Tensor dq_blk = mat(dqh + i0 * D, m, D, D);
          const int64_t kend = keys_for_rows(i0 + m, Sk, causal);
          for (int64_t j0 = 0; j0 < kend; j0 += kKBlock) {
            const int64_t n = std::min(kKBlock, kend - j0);
            const at::Tensor p_blk = mat(p.data(), m, n, n), dp_blk = mat(dp.data(), m, n, n);
            gemm(p_blk, q_blk, mat(kh + j0 * D, n, D, D, true), scale, 0.0);
            gemm(dp_blk, g_blk, mat(vh + j0 * Dv, n, Dv, Dv, true), 1.0, 0.0);
            for (int64_t r = 0; r < m; ++r)
              shift_and_mask(p.data() + r * n, visible_in_block(i0 + r, j0, n, causal), n, lh[i0 + r]);
            exp_inplace(p_blk);
            for (int64_t r = 0; r < m; ++r) {
              const T* pr = p.data() + r * n;
              T* dpr = dp.data() + r * n;
              const T dl = delta[i0 + r];
              for (int64_t j = 0; j < n; ++j) dpr[j] = pr[j] * (dpr[j] - dl);  // 0 where masked
            }
            gemm(mat(dvh + j0 * Dv, n, Dv, Dv), mat(p.data(), m, n, n, true), g_blk, 1.0, 1.0);
            gemm(dq_blk, dp_blk, mat(kh + j0 * D, n, D, D), scale, j0 > 0 ? 1.0 : 0.0);
            gemm(mat(dkh + j0 * D, n, D, D), mat(dp.data(), m, n, n, true), q_blk, scale, 1.0);
          }
        }
      }
    }
  });
}

}  // namespace

void attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                       double scale, bool causal) {
  const int64_t BH = q.size(0), Sq = q.size(1), Sk = k.size(1), D = q.size(2), Dv = v.size(2);
  if (BH * Sq == 0) return;
  const int64_t G = BH / k.size(0);  // query heads per kv head
  if (Sk == 0) {                     // no visible key: zero output, lse = -inf
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_fwd_cpu", [&] {
    fwd_kernel<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                         out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), BH, G, Sq, Sk, D, Dv, scale, causal);
  });
}

void attention_bwd_cpu(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& o, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                       double scale, bool causal) {
  const int64_t BH = q.size(0), Sq = q.size(1), Sk = k.size(1), D = q.size(2), Dv = v.size(2);
  if (BH * Sq == 0 || Sk == 0) {  // every gradient is zero
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return;
  }
  const int64_t G = BH / k.size(0);  // query heads per kv head
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_bwd_cpu", [&] {
    bwd_kernel<scalar_t>(dout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                         v.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                         dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), BH, G, Sq, Sk, D,
                         Dv, scale, causal);
  });
}

void transpose_last2_cpu_kernel(const at::Tensor& x, at::Tensor& out) {
  // x (B, M, N) contiguous -> out (B, N, M): ATen's copy does the blocked transpose.
  out.view({-1, x.size(-1), x.size(-2)}).copy_(x.view({-1, x.size(-2), x.size(-1)}).transpose(1, 2));
}

void matmul_cpu_kernel(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, double alpha, bool causal) {
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1), B = c.numel() / (M * N);  // c is not empty
  at::Tensor c3 = c.view({B, M, N});
  at::cpu::baddbmm_out(c3, c3, a.view({B, M, K}), b.view({B, K, N}), 0.0, alpha);
  if (!causal) return;
  // SDPA's top-left mask: c[m, n] = -inf where n > m.
  const int64_t rows = c3.size(0) * M;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.scalar_type(), "matmul_cpu_mask", [&] {
    scalar_t* cp = c3.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, N)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        std::fill(cp + r * N + std::min(N, r % M + 1), cp + (r + 1) * N, -std::numeric_limits<scalar_t>::infinity());
    });
  });
}

}  // namespace gpu_puzzles
