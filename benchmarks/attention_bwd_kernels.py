"""The attention backward alone: the two mma.sync passes and the wgmma kernel (knob
attention_bwd), against SDPA's backward, bf16, on the GPU.

Each case times `torch.ops.gpu_puzzles.attention_backward` with the backward forced to each kernel,
and `torch.autograd.grad` through one SDPA forward (its backward kernels only); CUDA-event medians
of 20 calls after 3 warm-ups. TFLOP/s count the backward as 2.5x the forward's 4 B H S^2 D (half
when causal).

    python benchmarks/attention_bwd_kernels.py [quick|full] [OUT.json]
"""
import json
import sys

import torch
import torch.nn.functional as F

import gpu_puzzles as gp

ops = torch.ops.gpu_puzzles


def time_ms(fn, it=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    es = [torch.cuda.Event(enable_timing=True) for _ in range(2 * it)]
    for i in range(it):
        es[2 * i].record()
        fn()
        es[2 * i + 1].record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in zip(es[::2], es[1::2]))[it // 2]


# (B, H, S, D, causal): the issue's square shapes, GPT-2's and a long causal one.
SHAPES = [(4, 32, 4096, 128, False), (4, 32, 4096, 128, True), (8, 16, 2048, 64, False), (8, 16, 2048, 64, True),
          (2, 16, 1024, 128, True), (8, 12, 1024, 64, True), (1, 32, 16384, 128, True)]
QUICK = SHAPES[:3] + SHAPES[5:6]


def main(argv):
    shapes = QUICK if argv and argv[0] == "quick" else SHAPES
    rows = []
    for B, H, S, D, causal in shapes:
        rows.append(_case(B, H, S, D, causal))
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            json.dump(rows, f, indent=1)


def _case(B, H, S, D, causal):
    """One shape: its tensors are freed when this returns, before the next shape's."""
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    out, lse = ops.attention(q.detach(), k.detach(), v.detach(), None, causal)
    flops = 4 * B * H * S * S * D * 2.5 * (0.5 if causal else 1)
    r = {"shape": [B, H, S, D], "causal": causal}
    for knob in ("mma", "wgmma"):
        with gp.tuning.override(attention_bwd=knob):
            r[knob] = time_ms(lambda: ops.attention_backward(g, q.detach(), k.detach(), v.detach(), out, lse,
                                                             None, causal))
    o2 = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    r["sdpa"] = time_ms(lambda: torch.autograd.grad(o2, (q, k, v), g, retain_graph=True))
    for key in ("mma", "wgmma", "sdpa"):
        r[key + "_tflops"] = flops / r[key] / 1e9
    r["wgmma_vs_sdpa"] = r["sdpa"] / r["wgmma"]
    print(f"{(B, H, S, D)} causal={causal}: mma {r['mma']:.3f} ms ({r['mma_tflops']:.0f}) "
          f"wgmma {r['wgmma']:.3f} ({r['wgmma_tflops']:.0f}) sdpa {r['sdpa']:.3f} ({r['sdpa_tflops']:.0f})  "
          f"wgmma/sdpa {r['wgmma_vs_sdpa']:.2f}x", flush=True)
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
