// What the LayerNorm+Linear EVT epilogue costs over a plain one (H100 results:
// benchmarks/results/lnlinear_evt_epilogue_cost_h100.txt). At the issue's two shapes: cuBLAS's
// plain GEMM, the op's CUTLASS configuration with a plain epilogue, the op's EVT GEMM, and the
// EVT GEMM with null vectors (CUTLASS's broadcast nodes then load nothing), all four or only the
// per-column ones (r, bp) or only the per-row ones (mean, rstd). Six rounds, the
// variants alternating; each batch of 30 calls queued behind a GPU spin so the event pairs
// bracket device work only (back-to-back calls on an idle GPU drifted by up to 25 %).
// Build: build_epilogue_cost.sh CUTLASS_ROOT OUTBIN.
#include "../harness.cuh"
#include <cublas_v2.h>
#include <cmath>
typedef int (*Fn)(int, int, int, const void*, const void*, const float*, const float*, const float*, const float*, void*, void*, int, cudaStream_t);
extern "C" int run_v0(int, int, int, const void*, const void*, const float*, const float*, const float*, const float*, void*, void*, int, cudaStream_t);
extern "C" int run_v1(int, int, int, const void*, const void*, const float*, const float*, const float*, const float*, void*, void*, int, cudaStream_t);
extern "C" int run_v2(int, int, int, const void*, const void*, const float*, const float*, const float*, const float*, void*, void*, int, cudaStream_t);
extern "C" int run_v3(int, int, int, const void*, const void*, const float*, const float*, const float*, const float*, void*, void*, int, cudaStream_t);
__global__ void spin(long long cycles) { long long t0 = clock64(); while (clock64() - t0 < cycles) {} }
template <class F> float timeit(F f, int R = 30) {
  for (int i = 0; i < 3; ++i) f(i);
  spin<<<1, 1>>>(20LL * 1000 * 1000);  // ~10 ms: the calls below queue behind it
  return event_median_ms(f, R);
}
int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cublasHandle_t h; cublasCreate(&h);
  int shapes[2][3] = {{8192, 4096, 4096}, {16384, 1024, 4096}};
  for (auto& sh : shapes) {
    const int M = sh[0], K = sh[1], N = sh[2];
    const bool big = K >= 2048;
    Fn evt = big ? run_v0 : run_v2, plain = big ? run_v1 : run_v3;
    printf("=== M=%d K(H)=%d N=%d (%s)\n", M, K, N, big ? "Big" : "Small");
    const int NX = 4, NY = 4;
    void *x[NX], *wc, *y[NY], *ws; float *mean, *rstd, *r, *bp;
    for (int i = 0; i < NX; ++i) { CK(cudaMalloc(&x[i], (size_t)M * K * 2)); fillb(x[i], (size_t)M * K, 3 + i, 4.f); }
    CK(cudaMalloc(&wc, (size_t)N * K * 2)); fillb(wc, (size_t)N * K, 11, 0.05f);
    for (int i = 0; i < NY; ++i) CK(cudaMalloc(&y[i], (size_t)M * N * 2));
    CK(cudaMalloc(&mean, M * 4)); CK(cudaMalloc(&rstd, M * 4)); CK(cudaMalloc(&r, N * 4)); CK(cudaMalloc(&bp, N * 4));
    fillf(mean, M, 5, 0.2f, 0.f); fillf(rstd, M, 6, 0.5f, 1.f); fillf(r, N, 7, 0.01f, 0.f); fillf(bp, N, 8, 0.2f, 0.f);
    CK(cudaMalloc(&ws, 64 << 20));
    // correctness of the EVT against plain: y_evt = rstd*(z - mean*r) + bp
    CK((cudaError_t)evt(M, N, K, x[0], wc, mean, rstd, r, bp, y[0], ws, sms, 0) == cudaSuccess ? cudaSuccess : cudaErrorUnknown);
    int st = plain(M, N, K, x[0], wc, nullptr, nullptr, nullptr, nullptr, y[1], ws, sms, 0);
    if (st) { printf("plain status %d\n", st); return 1; }
    CK(cudaDeviceSynchronize());
    {
      std::vector<__nv_bfloat16> a((size_t)M * N), b((size_t)M * N); std::vector<float> hm(M), hr(M), hrr(N), hb(N);
      CK(cudaMemcpy(a.data(), y[0], a.size() * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), y[1], b.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hm.data(), mean, M * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hr.data(), rstd, M * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hrr.data(), r, N * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hb.data(), bp, N * 4, cudaMemcpyDeviceToHost));
      double d = 0, mx = 0;
      for (int i = 0; i < M; i += 97) for (int j = 0; j < N; ++j) {
        double z = __bfloat162float(b[(size_t)i * N + j]), e = hr[i] * (z - hm[i] * hrr[j]) + hb[j];
        d = std::max(d, fabs(e - (double)__bfloat162float(a[(size_t)i * N + j]))); mx = std::max(mx, fabs(e)); }
      printf("evt vs rstd*(plain - mean*r)+bp: max diff %.3g (max |y| %.3g)\n", d, mx);
    }
    float alpha = 1, beta = 0;
    const char* names[6] = {"cuBLAS plain", "CUTLASS plain epilogue", "EVT (vectors loaded)", "EVT (null vectors)",
                            "EVT (mean, rstd only)", "EVT (r, bp only)"};
    std::vector<std::vector<float>> t(6);
    for (int rnd = 0; rnd < 6; ++rnd) {
      t[0].push_back(timeit([&](int i) { cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, wc, CUDA_R_16BF, K, x[i % NX], CUDA_R_16BF, K, &beta, y[i % NY], CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT); }));
      t[1].push_back(timeit([&](int i) { plain(M, N, K, x[i % NX], wc, nullptr, nullptr, nullptr, nullptr, y[i % NY], ws, sms, 0); }));
      t[2].push_back(timeit([&](int i) { evt(M, N, K, x[i % NX], wc, mean, rstd, r, bp, y[i % NY], ws, sms, 0); }));
      t[3].push_back(timeit([&](int i) { evt(M, N, K, x[i % NX], wc, nullptr, nullptr, nullptr, nullptr, y[i % NY], ws, sms, 0); }));
      // per-row vectors (registers) or per-column ones (shared memory + a barrier) alone
      t[4].push_back(timeit([&](int i) { evt(M, N, K, x[i % NX], wc, mean, rstd, nullptr, nullptr, y[i % NY], ws, sms, 0); }));
      t[5].push_back(timeit([&](int i) { evt(M, N, K, x[i % NX], wc, nullptr, nullptr, r, bp, y[i % NY], ws, sms, 0); }));
    }
    CK(cudaGetLastError());
    for (int v = 0; v < 6; ++v) {
      printf("%-26s", names[v]);
      for (float f : t[v]) printf(" %.4f", f);
      std::vector<float> s = t[v]; std::sort(s.begin(), s.end());
      printf("   median %.4f ms  %.0f TFLOP/s\n", (s[2] + s[3]) / 2, 2.0 * M * N * K / ((s[2] + s[3]) / 2 * 1e-3) / 1e12);
    }
    for (int i = 0; i < NX; ++i) cudaFree(x[i]);
    for (int i = 0; i < NY; ++i) cudaFree(y[i]);
    cudaFree(wc); cudaFree(mean); cudaFree(rstd); cudaFree(r); cudaFree(bp); cudaFree(ws);
  }
  return 0;
}
