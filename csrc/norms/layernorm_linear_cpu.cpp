// LayerNorm and fused LayerNorm+Linear CPU kernels (the parts around the GEMMs),
// compiled once per SIMD level (common/cpu_isa.h). Rows are contiguous (M, H);
// every pass is a Vectorized loop over one row, which stays in L1 between passes.
// Compute type S: float (float32 and, through row scratch, float16 / bfloat16) or
// double (float64); the statistics and folded vectors are S arrays. RMS (template flag):
// the LayerNorm kernels with the mean forced to zero and no beta (rms_norm).
#include <ATen/Parallel.h>

#include <cmath>

#include "common/cpu_vec.h"
#include "norms/layernorm_linear.h"

namespace gpu_puzzles {
namespace GP_CPU_NS {
namespace {

using namespace vec_loops;

// Mean and rstd of one row, as the CUDA kernels compute them: sum x - x[0] (the
// shift keeps the partial sums small for large-mean rows), then a corrected second
// pass e = sum(x - mu1), which fixes mu1's rounding when x[0] is far out.
// RMS: rstd = 1 / sqrt(mean(x^2) + eps), mean untouched.
template <typename S, bool RMS>
void row_stats(const S* x, int64_t H, double eps, S* mean, S& rstd) {
  using V = Vectorized<S>;
  if constexpr (RMS) {
    const double q = vsum<S>(
        H,
        [&](int64_t i) {
          const V v = V::loadu(x + i);
          return v * v;
        },
        [&](int64_t i) { return x[i] * x[i]; });
    rstd = static_cast<S>(1.0 / std::sqrt(q / H + eps));
    return;
  }
  const S pivot = x[0];
  const V vp(pivot);
  const double s = vsum<S>(H, [&](int64_t i) { return V::loadu(x + i) - vp; }, [&](int64_t i) { return x[i] - pivot; });
  const S mu1 = pivot + static_cast<S>(s / H);
  const V vm(mu1);
  double e, q;
  vsum2<S>(
      H, e, q,
      [&](int64_t i, V& a, V& b) {
        const V d = V::loadu(x + i) - vm;
        a += d;
        b = at::vec::fmadd(d, d, b);
      },
      [&](int64_t i, double& a, double& b) {
        const double d = static_cast<double>(x[i] - mu1);
        a += d;
        b += d * d;
      });
  const double de = e / H;
  *mean = static_cast<S>(mu1 + de);
  rstd = static_cast<S>(1.0 / std::sqrt(std::max(q / H - de * de, 0.0) + eps));
}

// y = (x - mean) * rstd * g + b (RMS: x * rstd * g)
template <typename S, bool RMS = false>
void row_apply(const S* x, const S* g, const S* b, S mean, S rstd, S* y, int64_t H) {
  using V = Vectorized<S>;
  const V vm(mean), vr(rstd);
  if constexpr (RMS) {
    vfor<S>(
        H, [&](int64_t i) { (V::loadu(x + i) * vr * V::loadu(g + i)).store(y + i); },
        [&](int64_t i) { y[i] = x[i] * rstd * g[i]; });
    return;
  }
  vfor<S>(
      H, [&](int64_t i) { at::vec::fmadd((V::loadu(x + i) - vm) * vr, V::loadu(g + i), V::loadu(b + i)).store(y + i); },
      [&](int64_t i) { y[i] = (x[i] - mean) * rstd * g[i] + b[i]; });
}

// gamma / beta (H) as S: the storage itself, or one converted copy for the reduced types.
template <typename T, typename S>
struct Params {
  RowIn<T, S> g, b;
  const S *gp = nullptr, *bp = nullptr;
  Params(const void* gamma, const void* beta, int64_t H) : g(H), b(H) {
    if (gamma) gp = g.get(static_cast<const T*>(gamma));
    if (beta) bp = b.get(static_cast<const T*>(beta));
  }
};

template <typename T, bool RMS>
void ln_forward(const void* x_, const void* gamma, const void* beta, void* y_, void* mean_, void* rstd_, int64_t M,
                int64_t H, double eps, bool stats_given) {
  using S = compute_t<T>;
  const T* x = static_cast<const T*>(x_);
  T* y = static_cast<T*>(y_);
  S *mean = static_cast<S*>(mean_), *rstd = static_cast<S*>(rstd_);
  const Params<T, S> prm(y ? gamma : nullptr, y ? beta : nullptr, H);
  at::parallel_for(0, M, grain_rows(H), [&](int64_t lo, int64_t hi) {
    RowIn<T, S> xin(H);
    RowOut<T, S> yout(H);
    for (int64_t m = lo; m < hi; ++m) {
      const S* xr = xin.get(x + m * H);
      if (!stats_given) row_stats<S, RMS>(xr, H, eps, RMS ? nullptr : mean + m, rstd[m]);
      if (y) {
        row_apply<S, RMS>(xr, prm.gp, prm.bp, RMS ? S(0) : mean[m], rstd[m], yout.get(y + m * H), H);
        yout.put();
      }
    }
  });
}

// dx per row; dgamma / dbeta as per-block partial sums over fixed blocks of rows
// (the blocks do not depend on the thread count), added in block order: deterministic.
// RMS: mean = 0, no dbeta (mean_, db_ unused).
template <typename T, bool RMS>
void ln_backward(const void* dy_, const void* x_, const void* gamma, const void* mean_, const void* rstd_, void* dx_,
                 void* dg_, void* db_, int64_t M, int64_t H) {
  using S = compute_t<T>;
  using V = Vectorized<S>;
  const T *dy = static_cast<const T*>(dy_), *x = static_cast<const T*>(x_);
  const S *mean = static_cast<const S*>(mean_), *rstd = static_cast<const S*>(rstd_);
  T* dx = static_cast<T*>(dx_);
  const Params<T, S> prm(gamma, nullptr, H);
  const S* g = prm.gp;
  const int64_t rows = std::max<int64_t>(16, (M + 127) / 128), blocks = (M + rows - 1) / rows;
  std::vector<S> part(static_cast<size_t>(2 * blocks * H));
  at::parallel_for(0, blocks, grain_rows(rows * H), [&](int64_t lo, int64_t hi) {
    RowIn<T, S> xin(H), dyin(H);
    RowOut<T, S> dxout(H);
    for (int64_t blk = lo; blk < hi; ++blk) {
      S* pg = part.data() + 2 * blk * H;
      S* pb = pg + H;
      std::fill(pg, pg + 2 * H, S(0));
      for (int64_t m = blk * rows; m < std::min(M, (blk + 1) * rows); ++m) {
        const S* xr = xin.get(x + m * H);
        const S* d = dyin.get(dy + m * H);
        const S mu = RMS ? S(0) : mean[m], rs = rstd[m];
        const V vmu(mu), vrs(rs);
        // s1 = sum(dy g), s2 = sum(dy g xhat); the dgamma / dbeta partials in the same pass.
        double s1, s2;
        vsum2<S>(
            H, s1, s2,
            [&](int64_t i, V& a, V& b) {
              const V dv = V::loadu(d + i), xh = (V::loadu(xr + i) - vmu) * vrs, gd = dv * V::loadu(g + i);
              if constexpr (!RMS) a += gd;
              b = at::vec::fmadd(gd, xh, b);
              at::vec::fmadd(dv, xh, V::loadu(pg + i)).store(pg + i);
              if constexpr (!RMS) (V::loadu(pb + i) + dv).store(pb + i);
            },
            [&](int64_t i, double& a, double& b) {
              const S xh = (xr[i] - mu) * rs, gd = d[i] * g[i];
              if constexpr (!RMS) a += gd;
              b += gd * xh;
              pg[i] += d[i] * xh;
              if constexpr (!RMS) pb[i] += d[i];
            });
        const S m1 = static_cast<S>(s1 / H), m2 = static_cast<S>(s2 / H);
        const V vm1(m1), vm2(m2);
        S* o = dxout.get(dx + m * H);
        vfor<S>(
            H,
            [&](int64_t i) {
              const V xh = (V::loadu(xr + i) - vmu) * vrs;
              (vrs * (V::loadu(d + i) * V::loadu(g + i) - vm1 - xh * vm2)).store(o + i);
            },
            [&](int64_t i) { o[i] = rs * (d[i] * g[i] - m1 - (xr[i] - mu) * rs * m2); });
        dxout.put();
      }
    }
  });
  // Sum the block partials (in block order) into dgamma / dbeta.
  RowOut<T, S> dgo(H), dbo(H);
  S *dg = dgo.get(static_cast<T*>(dg_)), *db = RMS ? nullptr : dbo.get(static_cast<T*>(db_));
  std::copy(part.begin(), part.begin() + H, dg);  // block 0: dgamma then dbeta
  if (!RMS) std::copy(part.begin() + H, part.begin() + 2 * H, db);
  for (int64_t blk = 1; blk < blocks; ++blk) {
    const S* pg = part.data() + 2 * blk * H;
    vfor<S>(
        H, [&](int64_t i) { (V::loadu(dg + i) + V::loadu(pg + i)).store(dg + i); }, [&](int64_t i) { dg[i] += pg[i]; });
    if constexpr (!RMS)
      vfor<S>(
          H, [&](int64_t i) { (V::loadu(db + i) + V::loadu(pg + H + i)).store(db + i); },
          [&](int64_t i) { db[i] += pg[H + i]; });
  }
  dgo.put();
  if (!RMS) dbo.put();
}

// Per output row n: wc = W*g - mean(W*g) (stored in T), r = sum(wc as stored),
// bp = W @ beta + b.
template <typename T>
void fold(const void* W_, const void* gamma, const void* beta, const void* b_, void* wc_, void* r_, void* bp_,
          int64_t N, int64_t H) {
  using S = compute_t<T>;
  using V = Vectorized<S>;
  const T *W = static_cast<const T*>(W_), *b = static_cast<const T*>(b_);
  T* wc = static_cast<T*>(wc_);
  S *r = static_cast<S*>(r_), *bp = static_cast<S*>(bp_);
  const Params<T, S> prm(gamma, beta, H);
  const S *g = prm.gp, *be = prm.bp;
  at::parallel_for(0, N, grain_rows(H), [&](int64_t lo, int64_t hi) {
    RowIn<T, S> win(H), stored(H);
    RowOut<T, S> wout(H);
    for (int64_t n = lo; n < hi; ++n) {
      const S* w = win.get(W + n * H);
      double sg, sb;
      vsum2<S>(
          H, sg, sb,
          [&](int64_t i, V& a, V& c) {
            const V wv = V::loadu(w + i);
            a = at::vec::fmadd(wv, V::loadu(g + i), a);
            c = at::vec::fmadd(wv, V::loadu(be + i), c);
          },
          [&](int64_t i, double& a, double& c) {
            a += static_cast<double>(w[i] * g[i]);
            c += static_cast<double>(w[i] * be[i]);
          });
      const S mw = static_cast<S>(sg / H);
      const V vmw(mw);
      S* o = wout.get(wc + n * H);
      vfor<S>(
          H, [&](int64_t i) { (V::loadu(w + i) * V::loadu(g + i) - vmw).store(o + i); },
          [&](int64_t i) { o[i] = w[i] * g[i] - mw; });
      wout.put();
      const S* v = stored.get(wc + n * H);  // the centred row as stored (rounded to T)
      r[n] = static_cast<S>(vsum<S>(H, [&](int64_t i) { return V::loadu(v + i); }, [&](int64_t i) { return v[i]; }));
      bp[n] = static_cast<S>(sb + (b ? static_cast<double>(b[n]) : 0.0));
    }
  });
}

// In place on z = x @ wc^T: y = rstd * (z - mean * r) + bp; rows with |mean| * rstd >
// kLayerNormLinearMaxMeanRatio are recomputed normalise-first (rare; plain loops).
template <typename T>
void epilogue(void* z_, const void* x_, const void* gamma, const void* beta, const void* W_, const void* b_,
              const void* mean_, const void* rstd_, const void* r_, const void* bp_, int64_t M, int64_t N, int64_t H) {
  using S = compute_t<T>;
  using V = Vectorized<S>;
  T* z = static_cast<T*>(z_);
  const T *x = static_cast<const T*>(x_), *W = static_cast<const T*>(W_), *b = static_cast<const T*>(b_);
  const S *mean = static_cast<const S*>(mean_), *rstd = static_cast<const S*>(rstd_);
  const S *r = static_cast<const S*>(r_), *bp = static_cast<const S*>(bp_);
  const Params<T, S> prm(gamma, beta, H);
  at::parallel_for(0, M, grain_rows(N), [&](int64_t lo, int64_t hi) {
    RowIn<T, S> zin(N), xin(H);
    RowOut<T, S> zout(N);
    std::vector<S> xn(H);
    for (int64_t m = lo; m < hi; ++m) {
      const S mu = mean[m], rs = rstd[m];
      S* o = zout.get(z + m * N);
      if (std::abs(mu) * rs > S(kLayerNormLinearMaxMeanRatio)) {
        row_apply<S>(xin.get(x + m * H), prm.gp, prm.bp, mu, rs, xn.data(), H);
        for (int64_t n = 0; n < N; ++n) {
          double acc = b ? static_cast<double>(b[n]) : 0.0;
          for (int64_t h = 0; h < H; ++h) acc += static_cast<double>(xn[h]) * static_cast<double>(W[n * H + h]);
          o[n] = static_cast<S>(acc);
        }
      } else {
        const S* zi = zin.get(z + m * N);
        const V vrs(rs), vmr(-mu * rs);
        vfor<S>(
            N,
            [&](int64_t i) {
              at::vec::fmadd(vrs, V::loadu(zi + i), at::vec::fmadd(vmr, V::loadu(r + i), V::loadu(bp + i)))
                  .store(o + i);
            },
            [&](int64_t i) { o[i] = rs * zi[i] - mu * rs * r[i] + bp[i]; });
      }
      zout.put();
    }
  });
}

}  // namespace

void layer_norm_forward_cpu(const void* x, const void* gamma, const void* beta, void* y, void* mean, void* rstd,
                            int64_t M, int64_t H, double eps, DType dtype, bool stats_given, Norm norm) {
  dispatch_dtype(dtype, [&](auto t) {
    if (norm == Norm::kRms)
      ln_forward<decltype(t), true>(x, gamma, beta, y, mean, rstd, M, H, eps, stats_given);
    else
      ln_forward<decltype(t), false>(x, gamma, beta, y, mean, rstd, M, H, eps, stats_given);
  });
}

void layer_norm_backward_cpu(const void* dy, const void* x, const void* gamma, const void* mean, const void* rstd,
                             void* dx, void* dgamma, void* dbeta, int64_t M, int64_t H, DType dtype, Norm norm) {
  dispatch_dtype(dtype, [&](auto t) {
    if (norm == Norm::kRms)
      ln_backward<decltype(t), true>(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, M, H);
    else
      ln_backward<decltype(t), false>(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, M, H);
  });
}

void layernorm_linear_fold_weight_cpu(const void* W, const void* gamma, const void* beta, const void* b, void* wc,
                                      void* r, void* bp, int64_t N, int64_t H, DType dtype) {
  dispatch_dtype(dtype, [&](auto t) { fold<decltype(t)>(W, gamma, beta, b, wc, r, bp, N, H); });
}

void layernorm_linear_epilogue_cpu(void* z, const void* x, const void* gamma, const void* beta, const void* W,
                                   const void* b, const void* mean, const void* rstd, const void* r, const void* bp,
                                   int64_t M, int64_t N, int64_t H, DType dtype) {
  dispatch_dtype(dtype, [&](auto t) { epilogue<decltype(t)>(z, x, gamma, beta, W, b, mean, rstd, r, bp, M, N, H); });
}

}  // namespace GP_CPU_NS
}  // namespace gpu_puzzles
