// Measured and not taken (benchmarks/experiments/README.md): the fused backward's dW = dy^T xn through
// cuBLASLt with and without the BGRADB epilogue (which would also give db = dy's column sums), against
// cublasGemmEx (what at::mm runs), bf16, at the issue's shapes; the heuristic's top 8 algorithms each.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o bgradb cublaslt_bgradb.cu -lcublasLt -lcublas
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
#include <cmath>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(e_), __LINE__); exit(1);} } while (0)
#define LK(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { printf("cublas %d line %d\n", (int)s_, __LINE__); exit(1);} } while (0)
using bf = __nv_bfloat16;
__global__ void spin(long long ns) { const long long t0 = clock64(); while (clock64() - t0 < ns) {} }
template <class F> float timeit(F launch, int R = 30) {
  for (int i = 0; i < 4; ++i) launch();
  CK(cudaDeviceSynchronize());
  std::vector<float> t; cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < R; ++i) { spin<<<1,1>>>(40000); cudaEventRecord(a); launch(); cudaEventRecord(b); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); t.push_back(ms); }
  std::sort(t.begin(), t.end()); return t[R / 2];
}
bf* upload(std::vector<float>& h) { std::vector<bf> b(h.size()); for (size_t i=0;i<h.size();++i){ b[i]=__float2bfloat16(h[i]); h[i]=__bfloat162float(b[i]);} bf* d; CK(cudaMalloc(&d, b.size()*2)); CK(cudaMemcpy(d,b.data(),b.size()*2,cudaMemcpyHostToDevice)); return d; }
int main() {
  cublasLtHandle_t lt; LK(cublasLtCreate(&lt));
  cublasHandle_t hb; LK(cublasCreate(&hb));
  size_t wsz = 32 << 20; void* ws; CK(cudaMalloc(&ws, wsz));
  LK(cublasSetWorkspace(hb, ws, wsz));
  int shapes[2][3] = {{8192, 4096, 4096}, {16384, 1024, 4096}};
  for (auto& s : shapes) {
    const int M = s[0], H = s[1], N = s[2];
    std::mt19937 rng(1); std::normal_distribution<float> nd;
    std::vector<float> hdy((size_t)M*N), hxn((size_t)M*H);
    for (auto& v : hdy) v = nd(rng); for (auto& v : hxn) v = nd(rng);
    bf* dy = upload(hdy); bf* xn = upload(hxn);
    bf* dW; CK(cudaMalloc(&dW, (size_t)N*H*2));
    void* db; CK(cudaMalloc(&db, N*4));
    std::vector<double> ref(N, 0.0);
    for (int m = 0; m < M; ++m) for (int n = 0; n < N; ++n) ref[n] += hdy[(size_t)m*N+n];
    float one = 1.f, zero = 0.f;
    float tg = timeit([&]{ LK(cublasGemmEx(hb, CUBLAS_OP_N, CUBLAS_OP_T, H, N, M, &one, xn, CUDA_R_16BF, H, dy, CUDA_R_16BF, N, &zero, dW, CUDA_R_16BF, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)); });
    printf("=== M=%d H=%d N=%d: cublasGemmEx dW %.4f ms\n", M, H, N, tg);
    for (int variant = 0; variant < 3; ++variant) {  // 0 plain, 1 BGRADB bf16 bias, 2 BGRADB fp32 bias
      cublasLtMatmulDesc_t op; LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_T;
      LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
      LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
      if (variant) {
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BGRADB;
        LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
        LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &db, sizeof db));
        cudaDataType_t bt = variant == 2 ? CUDA_R_32F : CUDA_R_16BF;
        LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
      }
      cublasLtMatrixLayout_t la, lb, ld;
      LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, H, M, H));
      LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, N, M, N));
      LK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, H, N, H));
      cublasLtMatmulPreference_t pref; LK(cublasLtMatmulPreferenceCreate(&pref));
      LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz));
      cublasLtMatmulHeuristicResult_t res[8]; int nres = 0;
      cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 8, res, &nres);
      printf("variant %d: heuristic status %d, %d algos\n", variant, (int)st, nres);
      for (int i = 0; i < nres; ++i) {
        CK(cudaMemset(db, 0xff, N*4));
        auto run = [&]{ LK(cublasLtMatmul(lt, op, &one, xn, la, dy, lb, &zero, dW, ld, dW, ld, &res[i].algo, ws, wsz, 0)); };
        run(); CK(cudaDeviceSynchronize());
        double err = 0;
        if (variant) {
          std::vector<float> h(N);
          if (variant == 2) CK(cudaMemcpy(h.data(), db, N*4, cudaMemcpyDeviceToHost));
          else { std::vector<bf> hb2(N); CK(cudaMemcpy(hb2.data(), db, N*2, cudaMemcpyDeviceToHost)); for (int n=0;n<N;++n) h[n]=__bfloat162float(hb2[n]); }
          for (int n = 0; n < N; ++n) err = std::max(err, std::fabs(h[n]-ref[n]) / (std::fabs(ref[n]) + 1.0));
        }
        float t = timeit(run);
        printf("  algo %d: %.4f ms ws %zu, db max rel err %.3g\n", i, t, res[i].workspaceSize, err);
      }
    }
    // dW check of plain vs GemmEx for a few entries skipped; timing only.
    CK(cudaFree(dy)); CK(cudaFree(xn)); CK(cudaFree(dW)); CK(cudaFree(db));
  }
  return 0;
}
