"""Racecheck's cuBLAS reports without gpu_puzzles: plain torch.mm only.

    compute-sanitizer --tool racecheck python3 tools/cublas_racecheck_repro.py

Runs the GEMMs of the fused LayerNorm+Linear backward in tests/test_reliability.py
(test_backward_bit_identical_when_deterministic: x (1536, 5, 24), W (16, 24)), i.e. the
weight gradient dy^T @ xn and the input gradient dy @ W, with deterministic algorithms on
and off, in float32 and bfloat16. This package is not imported, so any hazard racecheck
prints here is inside cuBLAS (unfiltered runs of our suite report hazards in the same
nvjet_* kernels).
"""
import torch

torch.manual_seed(0)
M, H, N = 1536 * 5, 24, 16
for det in (True, False):
    torch.use_deterministic_algorithms(det)
    for dtype in (torch.float32, torch.bfloat16):
        xn = torch.randn(M, H, device="cuda", dtype=dtype)
        dy = torch.randn(M, N, device="cuda", dtype=dtype)
        W = torch.randn(N, H, device="cuda", dtype=dtype)
        dW = torch.mm(dy.t(), xn)  # (N, H): the long-K reduction that cuBLAS splits
        dxn = torch.mm(dy, W)
        y = torch.mm(xn, W.t())
        torch.cuda.synchronize()
        print(f"deterministic={det} {dtype}: dW {tuple(dW.shape)} sum {dW.double().sum().item():.4g}, "
              f"dxn {tuple(dxn.shape)}, y {tuple(y.shape)}", flush=True)
print(f"torch {torch.__version__}, cuBLAS {torch.backends.cuda.preferred_blas_library()}, "
      f"{torch.cuda.get_device_name()}")
