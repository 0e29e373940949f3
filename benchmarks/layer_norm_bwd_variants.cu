// LayerNorm backward (rows per step, threads per row, cache hints), statistics-only and
// column-sum (db) variants, bf16, at the LayerNorm+Linear issue shapes. Build as
// layer_norm_fwd_variants.cu; results in benchmarks/results/layer_norm_variants_h100.txt.
#include "layer_norm_variants.cuh"

// LN backward: R rows per iteration (their loads all issued before any reduction).
template <int T, int C, int R, int HINT>
__global__ void __launch_bounds__(T) lnb(const bf* __restrict__ dy, const bf* __restrict__ x, const bf* __restrict__ gamma,
    const float* __restrict__ mean, const float* __restrict__ rstd, bf* __restrict__ dx, float* __restrict__ part, int M, int H) {
  constexpr int NW = T / 32;
  __shared__ float sh[2 * R * 32];
  float pg[C][8], pb[C][8];
#pragma unroll
  for (int k = 0; k < C; ++k) for (int i = 0; i < 8; ++i) { pg[k][i] = 0; pb[k][i] = 0; }
  for (int r0 = blockIdx.x * R; r0 < M; r0 += gridDim.x * R) {
    uint4 xq[R][C], dq[R][C];
    float mu[R], rs[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int row = min(r0 + j, M - 1);
      mu[j] = mean[row]; rs[j] = rstd[row];
#pragma unroll
      for (int k = 0; k < C; ++k) {
        const size_t off = (size_t)row * H + (threadIdx.x + k * T) * 8;
        xq[j][k] = ld16<HINT>(x + off);
        dq[j][k] = ld16<HINT>(dy + off);
      }
    }
    float s[2 * R];
#pragma unroll
    for (int j = 0; j < 2 * R; ++j) s[j] = 0;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const bool live = r0 + j < M;
#pragma unroll
      for (int k = 0; k < C; ++k) {
        float xf[8], df[8], gf[8];
        unpack(xq[j][k], xf); unpack(dq[j][k], df);
        unpack(__ldg(reinterpret_cast<const uint4*>(gamma) + threadIdx.x + k * T), gf);
        for (int i = 0; i < 8; ++i) {
          const float xh = (xf[i] - mu[j]) * rs[j], d = df[i];
          s[2*j] += d * gf[i]; s[2*j+1] += d * gf[i] * xh;
          if (live) { pg[k][i] += d * xh; pb[k][i] += d; }
        }
      }
    }
    bsum<NW, 2 * R>(s, sh);
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (r0 + j >= M) break;
      const float m1 = s[2*j] / H, m2 = s[2*j+1] / H;
#pragma unroll
      for (int k = 0; k < C; ++k) {
        float xf[8], df[8], gf[8], o[8];
        unpack(xq[j][k], xf); unpack(dq[j][k], df);
        unpack(__ldg(reinterpret_cast<const uint4*>(gamma) + threadIdx.x + k * T), gf);
        for (int i = 0; i < 8; ++i) { const float xh = (xf[i] - mu[j]) * rs[j]; o[i] = rs[j] * (df[i] * gf[i] - m1 - xh * m2); }
        const size_t off = (size_t)(r0 + j) * H + (threadIdx.x + k * T) * 8;
        st16<HINT>(dx + off, pack(o));
      }
    }
  }
  float* pgr = part + (size_t)blockIdx.x * H; float* pbr = part + ((size_t)gridDim.x + blockIdx.x) * H;
#pragma unroll
  for (int k = 0; k < C; ++k) for (int i = 0; i < 8; ++i) { pgr[(threadIdx.x + k * T) * 8 + i] = pg[k][i]; pbr[(threadIdx.x + k * T) * 8 + i] = pb[k][i]; }
}

// Stats only: mean/rstd. MODE 0 two reductions, 1 one reduction + exact fallback.
template <int T, int C, int MODE, int HINT>
__global__ void __launch_bounds__(T) st(const bf* __restrict__ x, float* mean, float* rstd, int M, int H, float eps) {
  constexpr int NW = T / 32;
  __shared__ float sh[64];
  const int row = blockIdx.x;
  const bf* xr = x + (size_t)row * H;
  float v[C][8];
  const float pivot = __bfloat162float(xr[0]);
#pragma unroll
  for (int k = 0; k < C; ++k) unpack(ld16<HINT>(xr + (threadIdx.x + k * T) * 8), v[k]);
  float a[2] = {0, 0};
  float mu, var;
  if (MODE == 0) {
    for (int k = 0; k < C; ++k) for (int i = 0; i < 8; ++i) a[0] += v[k][i] - pivot;
    bsum<NW, 2>(a, sh);
    mu = pivot + a[0] / H;
    float b[2] = {0, 0};
    for (int k = 0; k < C; ++k) for (int i = 0; i < 8; ++i) { float d = v[k][i] - mu; b[0] += d * d; }
    bsum<NW, 2>(b, sh);
    var = b[0] / H;
  } else {
    for (int k = 0; k < C; ++k) for (int i = 0; i < 8; ++i) { float d = v[k][i] - pivot; a[0] += d; a[1] += d * d; }
    bsum<NW, 2>(a, sh);
    const float dm = a[0] / H;
    var = a[1] / H - dm * dm;
    mu = pivot + dm;
    if (dm * dm > 16.f * var) {
      float b[2] = {0, 0};
      for (int k = 0; k < C; ++k) for (int i = 0; i < 8; ++i) { float d = v[k][i] - mu; b[0] += d * d; }
      bsum<NW, 2>(b, sh);
      var = b[0] / H;
    }
  }
  if (threadIdx.x == 0) { mean[row] = mu; rstd[row] = rsqrtf(fmaxf(var, 0.f) + eps); }
}

// Column sums of dy (M x N) -> partials [GY][N]; block (TX, TY); thread owns one 8-column vector.
template <int TX, int TY, int U>
__global__ void __launch_bounds__(TX * TY) colsum(const bf* __restrict__ dy, float* __restrict__ part, int M, int N, int rows_per) {
  __shared__ float sh[TY][TX * 8 + 4];
  const int cv = blockIdx.x * TX + threadIdx.x;
  const int r0 = blockIdx.y * rows_per, r1 = min(M, r0 + rows_per);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int r = r0 + threadIdx.y;
  for (; r + (U - 1) * TY < r1; r += U * TY) {
    uint4 q[U];
#pragma unroll
    for (int u = 0; u < U; ++u) q[u] = ld16<1>(dy + (size_t)(r + u * TY) * N + cv * 8);
#pragma unroll
    for (int u = 0; u < U; ++u) { float f[8]; unpack(q[u], f); for (int i = 0; i < 8; ++i) acc[i] += f[i]; }
  }
  for (; r < r1; r += TY) { float f[8]; unpack(ld16<1>(dy + (size_t)r * N + cv * 8), f); for (int i = 0; i < 8; ++i) acc[i] += f[i]; }
  for (int i = 0; i < 8; ++i) sh[threadIdx.y][threadIdx.x * 8 + i] = acc[i];
  __syncthreads();
  for (int c = threadIdx.y * TX + threadIdx.x; c < TX * 8; c += TX * TY) {
    float s = 0;
    for (int y = 0; y < TY; ++y) s += sh[y][c];
    part[(size_t)blockIdx.y * N + blockIdx.x * TX * 8 + c] = s;
  }
}
__global__ void colsum_fin(const float* part, bf* out, int G, int N) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= N) return;
  float s = 0;
  for (int g = 0; g < G; ++g) s += part[(size_t)g * N + c];
  out[c] = __float2bfloat16(s);
}

template <class F> float timeit(F launch, int R = 50) {
  for (int i = 0; i < 8; ++i) launch(i);
  CK(cudaDeviceSynchronize());
  return event_median_ms(launch, R);
}
void fill(bf* p, size_t n, uint32_t seed, float scale, float offset_every7) {
  std::vector<uint16_t> h(n); uint32_t s = seed;
  for (size_t i = 0; i < n; ++i) { s = s * 1664525u + 1013904223u; float f = ((s >> 8) * (1.f / 16777216.f) - 0.5f) * scale + offset_every7; bf b = __float2bfloat16(f); memcpy(&h[i], &b, 2); }
  CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
}
std::vector<float> dl(const bf* p, size_t n) { std::vector<uint16_t> h(n); CK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost)); std::vector<float> f(n); for (size_t i = 0; i < n; ++i) { bf b; memcpy(&b, &h[i], 2); f[i] = __bfloat162float(b); } return f; }
std::vector<float> dlf(const float* p, size_t n) { std::vector<float> f(n); CK(cudaMemcpy(f.data(), p, n * 4, cudaMemcpyDeviceToHost)); return f; }
double maxdiff(const std::vector<float>& a, const std::vector<float>& b) { double m = 0; for (size_t i = 0; i < a.size(); ++i) m = std::max(m, (double)fabsf(a[i] - b[i])); return m; }

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int NS = 3;
  // spin
  { bf* a; CK(cudaMalloc(&a, 1 << 30)); for (int i = 0; i < 400; ++i) CK(cudaMemsetAsync(a, i, 1 << 30)); CK(cudaDeviceSynchronize()); CK(cudaFree(a)); }
  for (int shape = 0; shape < 2; ++shape) {
    const int M = shape == 0 ? 8192 : 16384, H = shape == 0 ? 4096 : 1024, N = 4096;
    const size_t n = (size_t)M * H;
    printf("=== M=%d H=%d (bwd, stats) ; db over M x N=%d\n", M, H, N);
    bf *x[NS], *dy[NS], *dx[NS + 1], *g; float *mean, *rstd, *part;
    for (int i = 0; i < NS; ++i) { CK(cudaMalloc(&x[i], n * 2)); CK(cudaMalloc(&dy[i], n * 2)); fill(x[i], n, 7 + i, 3.f, 0.5f); fill(dy[i], n, 99 + i, 2.f, 0.f); }
    for (int i = 0; i <= NS; ++i) CK(cudaMalloc(&dx[i], n * 2));
    CK(cudaMalloc(&g, H * 2)); fill(g, H, 5, 0.2f, 1.f);
    CK(cudaMalloc(&mean, M * 4)); CK(cudaMalloc(&rstd, M * 4));
    CK(cudaMalloc(&part, (size_t)2 * 4096 * H * 4));
    // stats
    auto stats_run = [&](auto kern, int T, const char* name, std::vector<float>* ref) {
      float ms = timeit([&](int i) { kern<<<M, T>>>(x[i % NS], mean, rstd, M, H, 1e-5f); });
      kern<<<M, T>>>(x[0], mean, rstd, M, H, 1e-5f); CK(cudaDeviceSynchronize());
      auto m = dlf(mean, M), r = dlf(rstd, M); m.insert(m.end(), r.begin(), r.end());
      double d = ref && !ref->empty() ? maxdiff(m, *ref) : 0; if (ref && ref->empty()) *ref = m;
      printf("stats %-22s %.4f ms %5.0f GB/s diff %.3g\n", name, ms, n * 2 / (ms * 1e-3) / 1e9, d);
    };
    std::vector<float> sref;
    if (H == 4096) {
      stats_run(st<128, 4, 0, 0>, 128, "128x4 mode0 (current)", &sref);
      stats_run(st<128, 4, 1, 0>, 128, "128x4 mode1", &sref);
      stats_run(st<128, 4, 1, 1>, 128, "128x4 mode1 hint", &sref);
      stats_run(st<256, 2, 1, 1>, 256, "256x2 mode1 hint", &sref);
      stats_run(st<64, 8, 1, 1>, 64, "64x8 mode1 hint", &sref);
      stats_run(st<512, 1, 1, 1>, 512, "512x1 mode1 hint", &sref);
    } else {
      stats_run(st<128, 1, 0, 0>, 128, "128x1 mode0", &sref);
      stats_run(st<128, 1, 1, 1>, 128, "128x1 mode1 hint", &sref);
      stats_run(st<64, 2, 1, 1>, 64, "64x2 mode1 hint", &sref);
      stats_run(st<32, 4, 1, 1>, 32, "32x4 mode1 hint", &sref);
    }
    // backward
    std::vector<float> dref, pref;
    auto bwd_run = [&](auto kern, int T, int R, const char* name, int per_sm_cap) {
      int per_sm = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, T, 0));
      per_sm = std::min(per_sm, per_sm_cap);
      int G = std::min(per_sm * sms, std::max(sms, (M + 15) / 16 / R));
      float ms = timeit([&](int i) { kern<<<G, T>>>(dy[i % NS], x[i % NS], g, mean, rstd, dx[i % (NS + 1)], part, M, H); });
      kern<<<G, T>>>(dy[0], x[0], g, mean, rstd, dx[0], part, M, H); CK(cudaDeviceSynchronize());
      auto d = dl(dx[0], n);
      // column sums of partials -> compare
      auto p = dlf(part, (size_t)2 * G * H); std::vector<float> pc(2 * H, 0.f);
      for (int j = 0; j < 2; ++j) for (int b = 0; b < G; ++b) for (int c = 0; c < H; ++c) pc[j * H + c] += p[((size_t)j * G + b) * H + c];
      double dd = 0, pd = 0;
      if (dref.empty()) { dref = d; pref = pc; } else { dd = maxdiff(d, dref); pd = maxdiff(pc, pref); }
      printf("bwd %-26s per_sm %d grid %4d  %.4f ms %5.0f GB/s diff dx %.3g dgb %.3g\n", name, per_sm, G, ms, 3.0 * n * 2 / (ms * 1e-3) / 1e9, dd, pd);
    };
    if (H == 4096) {
      bwd_run(lnb<128, 4, 1, 0>, 128, 1, "128x4 R1 (current-like)", 99);
      bwd_run(lnb<128, 4, 1, 1>, 128, 1, "128x4 R1 hint", 99);
      bwd_run(lnb<128, 4, 2, 0>, 128, 2, "128x4 R2", 99);
      bwd_run(lnb<128, 4, 2, 1>, 128, 2, "128x4 R2 hint", 99);
      bwd_run(lnb<256, 2, 1, 1>, 256, 1, "256x2 R1 hint", 99);
      bwd_run(lnb<256, 2, 2, 1>, 256, 2, "256x2 R2 hint", 99);
      bwd_run(lnb<512, 1, 2, 1>, 512, 2, "512x1 R2 hint", 99);
      bwd_run(lnb<512, 1, 4, 1>, 512, 4, "512x1 R4 hint", 99);
      bwd_run(lnb<256, 2, 4, 1>, 256, 4, "256x2 R4 hint", 99);
    } else {
      bwd_run(lnb<128, 1, 1, 0>, 128, 1, "128x1 R1", 99);
      bwd_run(lnb<128, 1, 2, 1>, 128, 2, "128x1 R2 hint", 99);
      bwd_run(lnb<128, 1, 4, 1>, 128, 4, "128x1 R4 hint", 99);
      bwd_run(lnb<64, 2, 2, 1>, 64, 2, "64x2 R2 hint", 99);
      bwd_run(lnb<64, 2, 4, 1>, 64, 4, "64x2 R4 hint", 99);
      bwd_run(lnb<32, 4, 4, 1>, 32, 4, "32x4 R4 hint", 99);
    }
    for (int i = 0; i < NS; ++i) { CK(cudaFree(x[i])); }
    for (int i = 0; i <= NS; ++i) CK(cudaFree(dx[i]));
    // db: column sums of dy (M x N); reuse dy buffers? need M*N: allocate
    const size_t nn = (size_t)M * N;
    bf* d2[NS]; for (int i = 0; i < NS; ++i) { CK(cudaFree(dy[i])); CK(cudaMalloc(&d2[i], nn * 2)); fill(d2[i], nn, 31 + i, 2.f, 0.f); }
    bf* db; CK(cudaMalloc(&db, N * 2));
    std::vector<float> dbref;
    auto db_run = [&](auto kern, int TX, int TY, int GY, const char* name) {
      const int rows_per = (M + GY - 1) / GY;
      dim3 grid(N / 8 / TX, GY), blk(TX, TY);
      float ms = timeit([&](int i) { kern<<<grid, blk>>>(d2[i % NS], part, M, N, rows_per); colsum_fin<<<N / 256, 256>>>(part, db, GY, N); });
      kern<<<grid, blk>>>(d2[0], part, M, N, rows_per); colsum_fin<<<N / 256, 256>>>(part, db, GY, N); CK(cudaDeviceSynchronize());
      auto v = dl(db, N); double d = 0; if (dbref.empty()) dbref = v; else d = maxdiff(v, dbref);
      printf("db %-28s grid %dx%d  %.4f ms %5.0f GB/s diff %.3g\n", name, grid.x, grid.y, ms, nn * 2 / (ms * 1e-3) / 1e9, d);
    };
    db_run(colsum<64, 4, 8>, 64, 4, 64, "64x4 U8 GY64");
    db_run(colsum<64, 4, 8>, 64, 4, 128, "64x4 U8 GY128");
    db_run(colsum<64, 4, 4>, 64, 4, 128, "64x4 U4 GY128");
    db_run(colsum<32, 8, 4>, 32, 8, 128, "32x8 U4 GY128");
    db_run(colsum<64, 4, 8>, 64, 4, 256, "64x4 U8 GY256");
    db_run(colsum<128, 2, 8>, 128, 2, 128, "128x2 U8 GY128");
    for (int i = 0; i < NS; ++i) CK(cudaFree(d2[i]));
    CK(cudaFree(db)); CK(cudaFree(g)); CK(cudaFree(mean)); CK(cudaFree(rstd)); CK(cudaFree(part));
  }
  return 0;
}
