"""attention cases: ours (fused) vs SDPA eager vs torch.compile(SDPA) vs ours unfused (the
curriculum's chain), forward and forward+backward, in TFLOP/s; plus peak extra memory
(``peak_memory(device)``, not part of the timed rows).

Labels: "ours", "eager" (F.scaled_dot_product_attention), "compile" (torch.compile of it),
"ours unfused" (skipped where its O(S^2) buffers would not fit in free memory).

Layouts: "contiguous" (B, H, S, D) tensors, or "qkv views": q, k, v as a model hands them over,
split out of one fused (B, S, 3 H D) projection and transposed to (B, H, S, D) (strides
(S 3HD, D, 3HD, 1)), with grad_out in the layout the model's out.transpose(1, 2).reshape(...)
gives back; every implementation gets the same views.

GQA rows ("GQA ..." cases, :func:`gqa_cases`): k and v with Hkv < H heads, Llama's layout (separate
q, k, v projections (B, S, heads, D) transposed to (B, heads, S, D)); "eager" and "compile" are
SDPA with enable_gqa=True, ours gp.attention(..., enable_gqa=True).

FLOPs (as FlashAttention counts them): forward 4*B*H*Sq*Sk*D (H the query heads), half when causal;
backward 2.5x the forward (the backward rows are derived as fwd+bwd minus fwd, see bench/__main__.py).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

import gpu_puzzles as gp

from .common import Case, backward_fn, peak_memory_rows

OP = "attention"


def sdpa(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def fwd_flops(B, H, Sq, Sk, D, causal):
    f = 4 * B * H * Sq * Sk * D
    return f // 2 if causal else f


def unfused_bytes(B, H, Sq, Sk, dtype, backward):
    """Rough peak of the chain: the (Sq, Sk) scores and probabilities (and their gradients)."""
    esize = torch.tensor([], dtype=dtype).element_size()
    return B * H * Sq * Sk * esize * (5 if backward else 2)


def _unfused_fits(device, B, H, Sq, Sk, dtype, backward):
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return unfused_bytes(B, H, Sq, Sk, dtype, backward) < 0.7 * free


def impls(device, causal, B, H, Sq, Sk, dtype, backward, compile_=True, unfused=True):
    out = {"ours": lambda q, k, v: gp.attention(q, k, v, causal=causal),
           "eager": lambda q, k, v: sdpa(q, k, v, causal)}
    if compile_:
        out["compile"] = torch.compile(lambda q, k, v: sdpa(q, k, v, causal), dynamic=False)
    if unfused and _unfused_fits(device, B, H, Sq, Sk, dtype, backward):
        out["ours unfused"] = lambda q, k, v: gp.attention(q, k, v, causal=causal, algorithm="unfused")
    return out


# ---- which forward kernel ran (tests and benchmarks/attention_sweep.py) -----------------
# The kernels are told apart by their demangled names in the profiler; the labels are the
# values of the attention_fwd knob, with the warps for "mma".
_SM90 = re.compile(r"attn_fwd_sm90<.*?Sm90FwdCfg<[^<>]*?,\s*\d+,\s*\d+,\s*(\d+)>")  # D, BN, warpgroups
_TC = re.compile(r"attn_fwd_mma<[^<>]*?,\s*\d+,\s*(\d+)>")  # T, D, warps
# D, BN, stages, consumers, overlap, pingpong
_WS = re.compile(r"attn_fwd_ws_sm90<.*?WsFwdCfg<[^<>]*?,\s*\d+,\s*\d+,\s*\d+,\s*(\d+),\s*(true|false),\s*(true|false)>")


def forward_kernel(name):
    """The label of the attention forward kernel with demangled name ``name``: "wgmma" / "wgmma3"
    (the sm_90a kernel with 2 / 3 warpgroups), "ws" / "ws2" / "ws3" (the warp-specialised sm_90a
    kernel; ws2: its consumers' GEMMs overlap their softmax; ws3: and the consumers take turns),
    "ws192" (ws3 with three consumers, 192 query rows a CTA),
    "mma_r32", "mma/w4" / "mma/w8", "simt"; None for any other kernel."""
    m = _WS.search(name)
    if m:
        if m.group(1) == "3":
            return "ws192"
        return "ws3" if m.group(3) == "true" else "ws2" if m.group(2) == "true" else "ws"
    m = _SM90.search(name)
    if m:
        return "wgmma3" if m.group(1) == "3" else "wgmma"
    if "attn_fwd_mma_r32<" in name:
        return "mma_r32"
    m = _TC.search(name)
    if m:
        return f"mma/w{m.group(1)}"
    if "attn_fwd_simt<" in name:
        return "simt"
    return None


def backward_kernel(name):
    """The label of the attention backward kernel with demangled name ``name`` (its dK/dV
    kernel, where there are two): "wgmma" (the warp-specialised sm_90a kernel), "mma" (the
    two-pass mma.sync kernels), "simt"; None for any other kernel."""
    if "attn_bwd_ws_sm90<" in name:
        return "wgmma"
    if "attn_bwd_dkdv_mma<" in name:
        return "mma"
    if "attn_bwd_dkdv_simt<" in name:
        return "simt"
    return None


def _kernels(fn, label):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        return None
    return [k for k in map(label, names) if k is not None]


def forward_kernels(fn):
    """The labels (:func:`forward_kernel`) of the attention forward kernels that ``fn()`` launches,
    in order, from torch.profiler; None where the profiler records no CUDA kernels at all (as
    under compute-sanitizer, which holds the profiling interface)."""
    return _kernels(fn, forward_kernel)


def backward_kernels(fn):
    """As :func:`forward_kernels`, the labels (:func:`backward_kernel`) of the backward kernels."""
    return _kernels(fn, backward_kernel)


def inputs(B, H, Sq, Sk, D, dtype, device, grad=False, layout="contiguous"):
    if layout == "qkv views":
        assert Sq == Sk, "one fused projection gives q, k and v the same length"
        qkv = torch.randn(B, Sq, 3 * H * D, device=device, dtype=dtype, requires_grad=grad)
        return tuple(t.view(B, Sq, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
    q = torch.randn(B, H, Sq, D, device=device, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, H, Sk, D, device=device, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, H, Sk, D, device=device, dtype=dtype, requires_grad=grad)
    return q, k, v


def grad_out(B, H, Sq, D, dtype, device, layout="contiguous"):
    if layout == "qkv views":
        return torch.randn(B, Sq, H, D, device=device, dtype=dtype).transpose(1, 2)
    return torch.randn(B, H, Sq, D, device=device, dtype=dtype)


def cases(device, shapes, dtype=torch.bfloat16, compile_=True, unfused=True, layout="contiguous", prefix=""):
    """shapes: (B, H, Sq, Sk, D, causal); layout: "contiguous" or "qkv views" (module docstring)."""
    dname = str(dtype).replace("torch.", "")
    out = []
    for (B, H, Sq, Sk, D, causal) in shapes:
        name = f"{prefix}({B},{H},{Sq},{Sk},{D}){' causal' if causal else ''}"
        flops = fwd_flops(B, H, Sq, Sk, D, causal)
        params = dict(B=B, H=H, Sq=Sq, Sk=Sk, D=D, causal=causal, dtype=dname, bwd_flops=int(2.5 * flops),
                      layout=layout)
        out.append(Case(OP, name, "fwd",
                        lambda B=B, H=H, Sq=Sq, Sk=Sk, D=D: inputs(B, H, Sq, Sk, D, dtype, device, layout=layout),
                        impls(device, causal, B, H, Sq, Sk, dtype, False, compile_, unfused), flops=flops,
                        params=params))

        def make(B=B, H=H, Sq=Sq, Sk=Sk, D=D):
            return (*inputs(B, H, Sq, Sk, D, dtype, device, grad=True, layout=layout),
                    grad_out(B, H, Sq, D, dtype, device, layout))

        bwd = {k: backward_fn(f, 3)
               for k, f in impls(device, causal, B, H, Sq, Sk, dtype, True, compile_, unfused).items()}
        out.append(Case(OP, name, "fwd+bwd", make, bwd, flops=int(3.5 * flops), params=params))
    return out


# ---- grouped k/v heads --------------------------------------------------------------

def gqa_inputs(B, H, Hkv, S, D, dtype, device, grad=False):
    """q (B, H, S, D), k and v (B, Hkv, S, D), each a (B, S, heads, D) tensor transposed (a Llama
    model's separate projections viewed per head)."""
    mk = lambda h: torch.randn(B, S, h, D, device=device, dtype=dtype, requires_grad=grad)  # noqa: E731
    return tuple(t.transpose(1, 2) for t in (mk(H), mk(Hkv), mk(Hkv)))


def gqa_cases(device, shapes, dtype=torch.bfloat16, compile_=True, prefix="GQA "):
    """shapes: (B, H, Hkv, S, D, causal); ours and SDPA (enable_gqa=True), forward and fwd+bwd."""
    dname = str(dtype).replace("torch.", "")
    out = []
    for (B, H, Hkv, S, D, causal) in shapes:
        name = f"{prefix}({B},{H},{Hkv},{S},{D}){' causal' if causal else ''}"
        flops = fwd_flops(B, H, S, S, D, causal)
        params = dict(B=B, H=H, Hkv=Hkv, Sq=S, Sk=S, D=D, causal=causal, dtype=dname, bwd_flops=int(2.5 * flops),
                      layout="llama views")

        def fns(causal=causal):
            f = {"ours": lambda q, k, v: gp.attention(q, k, v, causal=causal, enable_gqa=True),
                 "eager": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)}
            if compile_:
                f["compile"] = torch.compile(f["eager"], dynamic=False)
            return f

        out.append(Case(OP, name, "fwd", lambda B=B, H=H, Hkv=Hkv, S=S, D=D: gqa_inputs(B, H, Hkv, S, D, dtype, device),
                        fns(), flops=flops, params=params))

        def make(B=B, H=H, Hkv=Hkv, S=S, D=D):
            return (*gqa_inputs(B, H, Hkv, S, D, dtype, device, grad=True),
                    torch.randn(B, S, H, D, device=device, dtype=dtype).transpose(1, 2))

        out.append(Case(OP, name, "fwd+bwd", make, {k: backward_fn(f, 3) for k, f in fns().items()},
                        flops=int(3.5 * flops), params=params))
    return out


# Llama-style attention (32 query heads, 8 kv heads), causal: the shape at D = 64, and D = 128;
# Gemma-2-2B's (8 / 4 heads of 256), which our tensor-core kernels do not take (the SIMT kernels run it).
GQA_BENCH_SHAPES = [(4, 32, 8, 2048, 64, True), (1, 32, 8, 4096, 128, True), (4, 8, 4, 2048, 256, True)]


BENCH_SHAPES = [(4, 32, 4096, 4096, 128, False), (4, 32, 4096, 4096, 128, True), (8, 16, 2048, 2048, 64, False)]
# The other rows of the attention issue's table (causal at D = 64, a short and a long sequence at
# D = 128), without the unfused path.
TABLE_SHAPES = [(8, 16, 2048, 2048, 64, True), (2, 16, 1024, 1024, 128, True), (1, 32, 16384, 16384, 128, True)]

# GPT-2 124M's attention, batch 8 x 1024, causal: q/k/v as the model hands them over (views of its
# fused projection) and the same shape contiguous beside it.
GPT2_SHAPE = (8, 12, 1024, 1024, 64, True)


# The CPU shapes: the tour's small case and a GPT-2 layer's causal attention at S=256.
CPU_SHAPES = [(1, 4, 256, 256, 64, False), (2, 12, 256, 256, 64, True)]


# CUDA rows: the implementations take turns in this many rounds and each row is the median of
# all its calls, so that no implementation is timed alone right after the rows before it (see
# docs/benchmarks.md, "How we time").
BENCH_ROUNDS = 5


def bench_cases(device):
    if device.type == "cpu":
        return cases(device, CPU_SHAPES, dtype=torch.float32, compile_=False, unfused=False)
    out = (cases(device, BENCH_SHAPES)
           + cases(device, TABLE_SHAPES, unfused=False)
           + cases(device, [GPT2_SHAPE], unfused=False, layout="qkv views", prefix="GPT-2 qkv views ")
           + cases(device, [GPT2_SHAPE], unfused=False, prefix="GPT-2 contiguous ")
           + gqa_cases(device, GQA_BENCH_SHAPES))
    for c in out:
        c.rounds, c.pooled = BENCH_ROUNDS, True
    return out


def tour_cases(device):
    if device.type == "cuda":
        return cases(device, [(4, 32, 4096, 4096, 128, False)], unfused=False)
    return cases(device, [(2, 12, 256, 256, 64, True)], dtype=torch.float32, compile_=False, unfused=False)


def peak_memory(device, shapes=BENCH_SHAPES, dtype=torch.bfloat16, compile_=False):
    """Peak memory above the live inputs (MiB) of one forward and one forward+backward per implementation."""
    if device.type != "cuda":
        return []
    rows = []
    for (B, H, Sq, Sk, D, causal) in shapes:
        for backward in (False, True):
            fns = impls(device, causal, B, H, Sq, Sk, dtype, backward, compile_)
            if backward:
                fns = {label: backward_fn(f, 3) for label, f in fns.items()}

            def make(B=B, H=H, Sq=Sq, Sk=Sk, D=D, backward=backward):
                args = (*inputs(B, H, Sq, Sk, D, dtype, device, grad=backward),)
                return args + ((torch.randn(B, H, Sq, D, device=device, dtype=dtype),) if backward else ())

            rows += peak_memory_rows(fns, make, device, op=OP,
                                     case=f"({B},{H},{Sq},{Sk},{D}){' causal' if causal else ''}",
                                     direction="fwd+bwd" if backward else "fwd", B=B, H=H, Sq=Sq, Sk=Sk, D=D,
                                     causal=causal, dtype=str(dtype).replace("torch.", ""))
    return rows


def tour_check(device):
    """Max error of ours (fused and unfused) vs a float64 reference, forward and gradients, fresh inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    for (B, H, Sq, Sk, D, causal) in ((2, 3, 77, 77, 64, False), (1, 4, 130, 130, 128, True),
                                      (2, 2, 33, 100, 80, True)):
        q, k, v = inputs(B, H, Sq, Sk, D, dtype, device, grad=True)
        g = torch.randn(B, H, Sq, D, device=device, dtype=dtype)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        y64 = sdpa(*leaves, causal)
        refs = torch.autograd.grad(y64, leaves, g.double())
        key = f"({B},{H},{Sq},{Sk},{D}){' causal' if causal else ''}"
        for label, algorithm in (("fused", "auto"), ("unfused", "unfused")):
            y = gp.attention(q, k, v, causal=causal, algorithm=algorithm)
            grads = torch.autograd.grad(y, (q, k, v), g)
            errs[f"fwd {label} {key}"] = (y.double() - y64).abs().max().item()
            errs[f"bwd {label} {key}"] = max((a.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
                                             for a, r in zip(grads, refs))
    return errs
