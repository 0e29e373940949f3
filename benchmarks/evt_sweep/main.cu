// Tile/cluster sweep of the LayerNorm+Linear EVT GEMM (see cfg.cu) against cuBLAS at the
// issue shapes: build.sh CUTLASS_ROOT OUT (CUTLASS_ROOT holds include/ and tools/util/include/),
// then run OUT on an H100. Results: benchmarks/results/lnlinear_evt_sweep_h100.txt.
#include "../harness.cuh"
#include <cublas_v2.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstring>
#define NCFG 10
typedef int (*Fn)(int, int, int, const void*, const void*, const float*, const float*, const float*, const float*, void*, void*, int, cudaStream_t, size_t*);
#define DECL(i) extern "C" int run_cfg_##i(int, int, int, const void*, const void*, const float*, const float*, const float*, const float*, void*, void*, int, cudaStream_t, size_t*);
DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5) DECL(6) DECL(7) DECL(8) DECL(9)
static Fn fns[NCFG] = {run_cfg_0, run_cfg_1, run_cfg_2, run_cfg_3, run_cfg_4, run_cfg_5, run_cfg_6, run_cfg_7, run_cfg_8, run_cfg_9};
static const char* names[NCFG] = {"128x256 2x1 coop (Big)", "128x128 1x2 ping (Small)", "256x128 1x2 coop", "256x128 2x1 coop",
  "128x256 1x2 coop", "128x128 2x1 ping", "128x256 1x1 coop", "64x256 1x2 ping", "128x128 1x2 coop", "256x128 1x1 coop"};
template <class F> float timeit(F f, int R = 40) {
  for (int i = 0; i < 10; ++i) f(i);
  CK(cudaDeviceSynchronize());
  return event_median_ms(f, R);
}
int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cublasHandle_t h; cublasCreate(&h);
  int shapes[3][3] = {{8192, 4096, 4096}, {16384, 1024, 4096}, {16384, 4096, 512}};
  { void* a; CK(cudaMalloc(&a, 1 << 30)); for (int i = 0; i < 300; ++i) CK(cudaMemsetAsync(a, i, 1 << 30)); CK(cudaDeviceSynchronize()); CK(cudaFree(a)); }
  for (auto& sh : shapes) {
    const int M = sh[0], K = sh[1], N = sh[2];
    printf("=== M=%d K(H)=%d N=%d\n", M, K, N);
    void *x[2], *wc, *y[3], *ws; float *mean, *rstd, *r, *bp;
    for (int i = 0; i < 2; ++i) { CK(cudaMalloc(&x[i], (size_t)M * K * 2)); fillb(x[i], (size_t)M * K, 3 + i, 4.f); }
    CK(cudaMalloc(&wc, (size_t)N * K * 2)); fillb(wc, (size_t)N * K, 11, 0.05f);
    for (int i = 0; i < 3; ++i) CK(cudaMalloc(&y[i], (size_t)M * N * 2));
    CK(cudaMalloc(&mean, M * 4)); CK(cudaMalloc(&rstd, M * 4)); CK(cudaMalloc(&r, N * 4)); CK(cudaMalloc(&bp, N * 4));
    fillf(mean, M, 5, 0.2f, 0.f); fillf(rstd, M, 6, 0.5f, 1.f); fillf(r, N, 7, 0.01f, 0.f); fillf(bp, N, 8, 0.2f, 0.f);
    CK(cudaMalloc(&ws, 64 << 20));
    // cuBLAS plain GEMM for reference speed: y = x @ wc^T (column-major: y^T = wc * x^T)
    float alpha = 1, beta = 0;
    float tb = timeit([&](int i) { cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, wc, CUDA_R_16BF, K, x[i % 2], CUDA_R_16BF, K, &beta, y[i % 3], CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT); });
    printf("cuBLAS plain                 %.4f ms  %.0f TFLOP/s\n", tb, 2.0 * M * N * K / (tb * 1e-3) / 1e12);
    std::vector<__nv_bfloat16> ref, out((size_t)M * N);
    for (int c = 0; c < NCFG; ++c) {
      size_t need = 0; fns[c](M, N, K, x[0], wc, mean, rstd, r, bp, y[0], nullptr, sms, 0, &need);
      if (need > (64u << 20)) { printf("%s: ws too big\n", names[c]); continue; }
      int st = fns[c](M, N, K, x[0], wc, mean, rstd, r, bp, y[0], ws, sms, 0, nullptr);
      if (st) { printf("%-28s status %d\n", names[c], st); continue; }
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(out.data(), y[0], (size_t)M * N * 2, cudaMemcpyDeviceToHost));
      double d = 0; if (ref.empty()) ref = out; else for (size_t i = 0; i < out.size(); ++i) d = std::max(d, (double)fabsf(__bfloat162float(out[i]) - __bfloat162float(ref[i])));
      float t = timeit([&](int i) { fns[c](M, N, K, x[i % 2], wc, mean, rstd, r, bp, y[i % 3], ws, sms, 0, nullptr); });
      printf("%-28s %.4f ms  %.0f TFLOP/s  vs cuBLAS %.3f  maxdiff vs cfg0 %.3g\n", names[c], t, 2.0 * M * N * K / (t * 1e-3) / 1e12, t / tb, d);
    }
    for (int i = 0; i < 2; ++i) cudaFree(x[i]);
    for (int i = 0; i < 3; ++i) cudaFree(y[i]);
    cudaFree(wc); cudaFree(mean); cudaFree(rstd); cudaFree(r); cudaFree(bp); cudaFree(ws);
  }
}
