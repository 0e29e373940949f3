"""layer_norm 8192x4096 bf16 forward, ours vs F.layer_norm, timed three ways in a fresh
process: per-call CUDA events without and with the output ring (bench.common.time_ms), and
20 calls replayed from a CUDA graph (time_graph_ms), over 1, 2 and 4 rotating input sets.
Written because the full bench run's layer_norm rows disagreed with the tour's.

    python benchmarks/layer_norm_timing.py
"""
import torch
import torch.nn.functional as F

import gpu_puzzles as gp
from gpu_puzzles.bench.common import time_graph_ms, time_ms
from gpu_puzzles.bench.layernorm_linear import inputs

dev = torch.device("cuda")
M, H = 8192, 4096
for ns in (1, 2, 4):
    sets = [inputs(M, H, 1, torch.bfloat16, dev)[:3] for _ in range(ns)]
    for name, f in (("ours", gp.layer_norm), ("eager", lambda x, w, b: F.layer_norm(x, (H,), w, b))):
        a = time_ms(f, sets, dev, keep_outputs=False)
        b = time_ms(f, sets, dev)
        c = time_graph_ms(f, sets, dev)
        print(f"sets={ns} {name:6s} no-ring {a:.4f}  ring {b:.4f}  graph {c:.4f} ms  "
              f"(ring GB/s {2 * M * H * 2 / b / 1e6:.0f}, graph GB/s {2 * M * H * 2 / c / 1e6:.0f})")
