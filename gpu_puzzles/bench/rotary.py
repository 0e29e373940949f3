"""rotary cases: q and k of real attention layers rotated as transformers hands them over
((B, H, S, D) views of the projections' outputs, cos and sin (B, 1, S, D)), and the tour's
checks."""
from __future__ import annotations

import functools

import torch

import gpu_puzzles as gp

from .common import Case

OP = "rotary"


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def reference(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb after its unsqueeze (partial rotary as Phi-3's and
    GPT-NeoX's: the first cos.shape[-1] elements rotated, the rest passed through)."""
    R = cos.shape[-1]

    def one(x):
        r = x[..., :R] * cos + rotate_half(x[..., :R]) * sin
        return r if R == x.shape[-1] else torch.cat((r, x[..., R:]), dim=-1)

    return one(q), one(k)


def cos_sin(B, S, R, device, dtype=torch.float32, base=10000.0, positions=None):
    """transformers' default RoPE tables: (B, 1, S, R), the two halves equal; random
    positions unless given, so every batch row differs."""
    inv = 1.0 / (base ** (torch.arange(0, R, 2, device=device, dtype=torch.float32) / R))
    pos = positions if positions is not None else torch.randint(0, 4 * S, (B, S), device=device)
    freqs = pos[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def _heads(x, H):
    """(B, S, H * D) -> the (B, H, S, D) view attention layers make of a projection."""
    B, S, _ = x.shape
    return x.view(B, S, H, -1).transpose(1, 2)


def _inputs(B, S, H, Hkv, D, dtype, cs_dtype, device, grad=False):
    q = torch.randn(B, S, H * D, device=device, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, S, Hkv * D, device=device, dtype=dtype, requires_grad=grad)
    cos, sin = cos_sin(B, S, D, device, cs_dtype)
    return q, k, cos, sin


def _fwd(f, H, Hkv):
    return lambda q, k, cos, sin: f(_heads(q, H), _heads(k, Hkv), cos, sin)


def _fwd_bwd(f, H, Hkv):
    def run(q, k, cos, sin, gq, gk):
        oq, ok = f(_heads(q, H), _heads(k, Hkv), cos, sin)
        return torch.autograd.grad((oq, ok), (q, k), (gq, gk))
    return run


# (label, B, S, H, Hkv, D): the bench's Llama-1B step (4 x 2048), Llama-3-8B at 8k tokens,
# Qwen3-1.7B's heads.
SHAPES = [("Llama-1B", 4, 2048, 32, 8, 64), ("Llama-3-8B", 1, 8192, 32, 8, 128), ("Qwen3-1.7B", 4, 2048, 16, 8, 128)]


def cases(device, shapes, dtype=torch.bfloat16, cs_dtypes=(torch.bfloat16, torch.float32), compile_=True):
    out = []
    for label, B, S, H, Hkv, D in shapes:
        for cs in cs_dtypes:
            esize = torch.tensor([], dtype=dtype).element_size()
            osize = torch.tensor([], dtype=torch.promote_types(dtype, cs)).element_size()
            n = B * S * (H + Hkv) * D
            impls = {"ours": gp.rotary, "eager": reference}
            if compile_:
                impls["compile"] = torch.compile(reference, dynamic=False)
            regime = "cos fp32 (autocast)" if cs != dtype else "cos in q's dtype"
            params = dict(B=B, S=S, H=H, Hkv=Hkv, D=D, dtype=str(dtype).replace("torch.", ""),
                          cos_dtype=str(cs).replace("torch.", ""))
            name = f"{label} ({B},{H}/{Hkv},{S},{D}) {regime}"
            # q and k read, the outputs written (cos and sin are 1/H of that, cached)
            out.append(Case(OP, name, "fwd", functools.partial(_inputs, B, S, H, Hkv, D, dtype, cs, device),
                            {k: _fwd(f, H, Hkv) for k, f in impls.items()}, bytes=n * (esize + osize),
                            params=params))

            def make(B=B, S=S, H=H, Hkv=Hkv, D=D, cs=cs):
                q, k, cos, sin = _inputs(B, S, H, Hkv, D, dtype, cs, device, grad=True)
                od = torch.promote_types(dtype, cs)
                gq = torch.randn(B, H, S, D, device=device, dtype=od)
                return q, k, cos, sin, gq, torch.randn(B, Hkv, S, D, device=device, dtype=od)
            out.append(Case(OP, name, "fwd+bwd", make, {k: _fwd_bwd(f, H, Hkv) for k, f in impls.items()},
                            bytes=2 * n * (esize + osize), params=params))
    return out


CPU_SHAPES = [("small", 2, 256, 8, 2, 64)]


def bench_cases(device):
    if device.type == "cpu":
        return cases(device, CPU_SHAPES, dtype=torch.float32, cs_dtypes=(torch.float32,), compile_=False)
    return cases(device, SHAPES)


def tour_cases(device):
    if device.type == "cuda":
        return cases(device, SHAPES[:1], cs_dtypes=(torch.bfloat16,))
    return cases(device, CPU_SHAPES, dtype=torch.float32, cs_dtypes=(torch.float32,), compile_=False)


def tour_check(device):
    """Max error of ours vs a float64 reference, forward and gradients, on fresh inputs."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errs = {}
    for cs in dict.fromkeys((dtype, torch.float32)):  # one pass where q is float32
        q, k, cos, sin = _inputs(2, 300, 4, 2, 64, dtype, cs, device, grad=True)
        oq, ok = gp.rotary(_heads(q, 4), _heads(k, 2), cos, sin)
        gq, gk = torch.randn_like(oq), torch.randn_like(ok)
        dq, dk = torch.autograd.grad((oq, ok), (q, k), (gq, gk))
        q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
        rq, rk = reference(_heads(q64, 4), _heads(k64, 2), cos.double(), sin.double())
        dq64, dk64 = torch.autograd.grad((rq, rk), (q64, k64), (gq.double(), gk.double()))
        tag = "cos fp32" if cs != dtype else "cos same"
        errs[f"fwd {tag}"] = max((a.double() - b).abs().max().item() for a, b in ((oq, rq), (ok, rk)))
        errs[f"bwd {tag}"] = max((a.double() - b).abs().max().item() for a, b in ((dq, dq64), (dk, dk64)))
    return errs
