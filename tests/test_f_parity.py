"""Each public function of gpu_puzzles against its torch.nn.functional counterpart, over the
argument combinations F accepts (by position and by keyword, None weights, dims, reductions,
ignore_index, eps defaults, >2-D cross-entropy), in float64 on the CPU against F's own answer;
arguments we refuse raise an error naming them. Fresh random inputs, never zeros."""
import inspect

import pytest
import torch
import torch.nn.functional as F

import gpu_puzzles as gp

D = torch.float64


def _randn(*shape, seed, scale=1.0, dtype=D, grad=False):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_(grad)


def _close(a, b, what, **tol):
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}", **tol)


def _same_grads(ours, ref, inputs, what):
    """Values and the gradients of every input that requires one (a random cotangent)."""
    _close(ours, ref, what)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return
    g = _randn(*ref.shape, seed=99, dtype=ref.dtype)
    ga = torch.autograd.grad(ours, leaves, g)
    gb = torch.autograd.grad(ref, leaves, g, retain_graph=True)  # a test may compare ref again
    for i, (a, b) in enumerate(zip(ga, gb)):
        _close(a, b, f"{what}: grad {i}")


def _raises_naming(call, name, exc=(TypeError, ValueError, RuntimeError)):
    with pytest.raises(exc) as e:
        call()
    assert name in str(e.value), f"the error does not name {name!r}: {e.value}"
    assert "tensor(" not in str(e.value), f"the error prints a tensor: {e.value}"


def test_every_public_function_has_a_case():
    covered = {"softmax", "log_softmax", "layer_norm", "fused_layernorm_linear", "rms_norm", "fused_rmsnorm_linear",
               "cross_entropy", "fused_linear_cross_entropy", "embedding", "conv1d", "attention", "gated_act",
               "rotary"}
    functions = {n for n in gp.__all__ if inspect.isfunction(getattr(gp, n)) and n != "build_info"}
    assert functions == covered, f"not compared with F: {functions - covered}; gone: {covered - functions}"


# ---- gated_act: F's activation times up, as transformers' MLPs write it -------------------

@pytest.mark.parametrize("activation,ref", [("silu", F.silu), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh")),
                                            ("gelu", F.gelu)])
def test_gated_act(activation, ref):
    g, u = _randn(3, 7, seed=11, scale=3, grad=True), _randn(3, 7, seed=12, grad=True)
    _same_grads(gp.gated_act(g, u, activation), ref(g) * u, [g, u], f"gated_act {activation}")
    _same_grads(gp.gated_act(gate=g, up=u, activation=activation), ref(g) * u, [g, u], f"gated_act {activation} kw")
    if activation == "silu":  # the default
        _same_grads(gp.gated_act(g, u), F.silu(g) * u, [g, u], "gated_act default")


# ---- rotary: no F counterpart; transformers' apply_rotary_pos_emb, written in torch ops -----

def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


@pytest.mark.parametrize("R", [8, 4])  # full, and partial rotary (the rest passed through)
def test_rotary(R):
    q, k = _randn(2, 3, 5, 8, seed=13, grad=True), _randn(2, 1, 5, 8, seed=14, grad=True)
    cos, sin = _randn(2, 1, 5, R, seed=15), _randn(2, 1, 5, R, seed=16)

    def ref(x):
        r = x[..., :R] * cos + _rotate_half(x[..., :R]) * sin
        return torch.cat((r, x[..., R:]), dim=-1)

    # each output from its own call: the two share one graph, which a gradient frees
    _same_grads(gp.rotary(q, k, cos, sin)[0], ref(q), [q], f"rotary q R={R}")
    _same_grads(gp.rotary(q, k, cos, sin)[1], ref(k), [k], f"rotary k R={R}")
    _same_grads(gp.rotary(q=q, k=k, cos=cos, sin=sin)[0], ref(q), [q], f"rotary q kw R={R}")


# ---- softmax, log_softmax ------------------------------------------------------------

@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,dim", [((7,), 0), ((3, 5), -1), ((3, 5), 0), ((2, 3, 4), 1), ((2, 3, 4), -3), ((), 0)])
def test_softmax(name, shape, dim):
    ours, ref = getattr(gp, name), getattr(F, name)
    x = _randn(*shape, seed=1, scale=3, grad=True)
    _same_grads(ours(x, dim), ref(x, dim), [x], f"{name} positional dim")
    _same_grads(ours(x, dim=dim), ref(x, dim=dim), [x], f"{name} dim=")
    # dtype=: x cast first, as F's.
    x32 = _randn(*shape, seed=2, scale=3, dtype=torch.float32)
    y = ours(x32, dim, dtype=D)
    assert y.dtype == D
    _close(y, ref(x32, dim, dtype=D), f"{name} dtype=")


def test_softmax_default_dim_is_last():
    # F.softmax without dim picks one by rank (deprecated); ours is documented as -1.
    x = _randn(3, 4, 5, seed=3)
    _close(gp.softmax(x), F.softmax(x, -1), "softmax()")
    _close(gp.log_softmax(x), F.log_softmax(x, -1), "log_softmax()")


# ---- layer_norm, fused_layernorm_linear ---------------------------------------------

def _ln_args(H, seed):
    return _randn(H, seed=seed, scale=0.5, grad=True) + 1, _randn(H, seed=seed + 1, grad=True)


@pytest.mark.parametrize("with_w,with_b", [(True, True), (True, False), (False, True), (False, False)])
def test_layer_norm(with_w, with_b):
    x = _randn(2, 3, 16, seed=4, scale=2, grad=True) + 3
    w, b = _ln_args(16, 5)
    w, b = (w if with_w else None), (b if with_b else None)
    ins = [x, w, b]
    _same_grads(gp.layer_norm(x, w, b), F.layer_norm(x, (16,), w, b), ins, "default eps")
    _same_grads(gp.layer_norm(x, w, b, 1e-2), F.layer_norm(x, (16,), w, b, 1e-2), ins, "eps by position")
    _same_grads(gp.layer_norm(x, weight=w, bias=b, eps=1e-2), F.layer_norm(x, (16,), weight=w, bias=b, eps=1e-2),
                ins, "keywords")


def test_layer_norm_default_eps_is_fs():
    # Rows of tiny variance: eps decides the answer.
    x = _randn(4, 8, seed=6, scale=1e-4)
    _close(gp.layer_norm(x), F.layer_norm(x, (8,)), "layer_norm(x)")


def test_layer_norm_refuses_a_normalized_shape():
    x = _randn(2, 8, seed=7)
    w, b = _ln_args(8, 8)
    _raises_naming(lambda: gp.layer_norm(x, (8,), w, b), "normalized_shape", TypeError)
    _raises_naming(lambda: gp.layer_norm(x, [8]), "weight", TypeError)


@pytest.mark.parametrize("with_ln", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_layernorm_linear(with_ln, with_bias):
    x = _randn(3, 5, 16, seed=9, grad=True) + 1
    lw, lb = _ln_args(16, 10) if with_ln else (None, None)
    W, b = _randn(12, 16, seed=12, scale=0.3, grad=True), (_randn(12, seed=13, grad=True) if with_bias else None)
    ins = [x, lw, lb, W, b]

    def ref(eps=1e-5):
        return F.linear(F.layer_norm(x, (16,), lw, lb, eps), W, b)

    _same_grads(gp.fused_layernorm_linear(x, lw, lb, W, b), ref(), ins, "default eps")
    _same_grads(gp.fused_layernorm_linear(x, lw, lb, W, b, 1e-2), ref(1e-2), ins, "eps by position")
    _same_grads(gp.fused_layernorm_linear(x, lw, lb, W, b, eps=1e-2), ref(1e-2), ins, "eps=")
    _raises_naming(lambda: gp.fused_layernorm_linear(x, (16,), lb, W, b), "ln_weight", TypeError)


# ---- rms_norm, fused_rmsnorm_linear -------------------------------------------------

@pytest.mark.parametrize("with_w", [True, False])
def test_rms_norm(with_w):
    x = _randn(2, 3, 16, seed=14, grad=True)
    w = _randn(16, seed=15, grad=True) if with_w else None
    ins = [x, w]
    _same_grads(gp.rms_norm(x, w), F.rms_norm(x, (16,), w), ins, "default eps")
    _same_grads(gp.rms_norm(x, w, 1e-2), F.rms_norm(x, (16,), w, 1e-2), ins, "eps by position")
    _same_grads(gp.rms_norm(x, weight=w, eps=None), F.rms_norm(x, (16,), weight=w, eps=None), ins, "eps=None")
    _same_grads(gp.rms_norm(x, eps=1e-2), F.rms_norm(x, (16,), eps=1e-2), [x], "no weight, eps=")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_default_eps_is_fs(dtype):
    # Rows of mean square ~1e-14 (float64) / ~1e-10: Llama's 1e-6 or the half dtype's own eps
    # would give other numbers than F's default (the statistics' dtype's eps).
    x = _randn(4, 32, seed=16, scale=1e-7 if dtype == torch.float64 else 1e-5, dtype=dtype)
    w = _randn(32, seed=17, dtype=dtype)
    tol = {} if dtype in (torch.float64, torch.float32) else {"rtol": 2e-2, "atol": 2e-2}
    _close(gp.rms_norm(x, w).double(), F.rms_norm(x, (32,), w).double(), f"rms_norm {dtype}", **tol)
    _close(gp.rms_norm(x).double(), F.rms_norm(x, (32,)).double(), f"rms_norm {dtype} no weight", **tol)


def test_rms_norm_refuses_a_normalized_shape():
    x = _randn(2, 8, seed=18)
    _raises_naming(lambda: gp.rms_norm(x, (8,)), "normalized_shape", TypeError)
    _raises_naming(lambda: gp.fused_rmsnorm_linear(x, [8], _randn(4, 8, seed=19)), "norm_weight", TypeError)


@pytest.mark.parametrize("with_nw", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_rmsnorm_linear(with_nw, with_bias):
    x = _randn(3, 5, 16, seed=20, scale=1e-7, grad=True)  # eps matters at this scale
    nw = _randn(16, seed=21, grad=True) if with_nw else None
    W, b = _randn(12, 16, seed=22, scale=0.3, grad=True), (_randn(12, seed=23, grad=True) if with_bias else None)
    ins = [x, nw, W, b]

    def ref(eps=None):
        return F.linear(F.rms_norm(x, (16,), nw, eps), W, b)

    _same_grads(gp.fused_rmsnorm_linear(x, nw, W, b), ref(), ins, "default eps")
    _same_grads(gp.fused_rmsnorm_linear(x, nw, W, b, 1e-2), ref(1e-2), ins, "eps by position")
    _same_grads(gp.fused_rmsnorm_linear(x, nw, W, linear_bias=b, eps=1e-12), ref(1e-12), ins, "keywords")


# ---- cross_entropy ----------------------------------------------------------------------

C = 7
CE_SHAPES = [((C,), ()), ((5, C), (5,)), ((2, C, 6), (2, 6)), ((2, C, 3, 4), (2, 3, 4))]


def _ce_inputs(shape, tshape, ignore_index, seed):
    x = _randn(*shape, seed=seed, scale=2, grad=True)
    g = torch.Generator().manual_seed(seed + 1)
    t = torch.randint(0, C, tshape, generator=g)
    if t.dim() and t.numel() > 2:
        t.view(-1)[::3] = ignore_index  # some ignored
    return x, t


@pytest.mark.parametrize("shape,tshape", CE_SHAPES, ids=lambda s: str(tuple(s)))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_cross_entropy(shape, tshape, reduction, weighted, label_smoothing, ignore_index):
    x, t = _ce_inputs(shape, tshape, ignore_index, seed=30)
    w = _randn(C, seed=32).abs() + 0.1 if weighted else None
    ref = F.cross_entropy(x, t, w, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    ours = gp.cross_entropy(x, t, w, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    assert ours.shape == ref.shape
    _same_grads(ours, ref, [x], "keywords")
    # F's positional order: input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing.
    pos = gp.cross_entropy(x, t, w, None, ignore_index, None, reduction, label_smoothing)
    _close(pos, ref, "by position")


def test_cross_entropy_classes_on_dim_1():
    # The case: (2, 50, 50) logits, (2, 50) targets; classes-last would give another loss.
    x = _randn(2, 50, 50, seed=33, scale=2)
    t = torch.randint(0, 50, (2, 50), generator=torch.Generator().manual_seed(34))
    _close(gp.cross_entropy(x, t), F.cross_entropy(x, t), "3-D")
    assert not torch.allclose(gp.cross_entropy(x, t), F.cross_entropy(x.transpose(1, 2), t))


def test_cross_entropy_legacy_reduction_arguments():
    x, t = _ce_inputs((5, C), (5,), -100, seed=35)
    with pytest.warns(UserWarning):
        ref = F.cross_entropy(x, t, size_average=False)
    with pytest.warns(UserWarning):
        _close(gp.cross_entropy(x, t, size_average=False), ref, "size_average=False")
    with pytest.warns(UserWarning):
        ref = F.cross_entropy(x, t, reduce=False)
    with pytest.warns(UserWarning):
        _close(gp.cross_entropy(x, t, reduce=False), ref, "reduce=False")


def test_cross_entropy_all_ignored_mean_is_nan_as_fs():
    x = _randn(4, C, seed=36)
    t = torch.full((4,), -100)
    w = _randn(C, seed=37).abs()
    for kw in ({}, {"weight": w}, {"label_smoothing": 0.1}):
        assert torch.isnan(F.cross_entropy(x, t, **kw)) and torch.isnan(gp.cross_entropy(x, t, **kw)), kw


def test_cross_entropy_refusals_name_the_argument():
    x, t = _ce_inputs((4, C), (4,), -100, seed=38)
    # Class probabilities (a float target of the input's shape), which F also takes: refused.
    _raises_naming(lambda: gp.cross_entropy(x, torch.softmax(_randn(4, C, seed=39), -1)), "target")
    _raises_naming(lambda: gp.cross_entropy(x, t, _randn(C + 1, seed=40)), "weight", ValueError)
    _raises_naming(lambda: gp.cross_entropy(x, t, _randn(C, seed=40).long()), "weight", ValueError)
    # The old order (ignore_index third) lands on weight: a TypeError naming it, not a pybind error.
    _raises_naming(lambda: gp.cross_entropy(x, t, -100), "weight", TypeError)
    _raises_naming(lambda: gp.cross_entropy(x, t, reduction="avg"), "reduction")
    _raises_naming(lambda: gp.cross_entropy(x, t, label_smoothing=0.1, reduction="avg"), "reduction", ValueError)
    _raises_naming(lambda: gp.cross_entropy(x, t, label_smoothing=1.5), "label_smoothing", ValueError)
    x3 = _randn(2, C, 5, seed=41)
    _raises_naming(lambda: gp.cross_entropy(x3, torch.zeros(2, C, dtype=torch.long)), "target", ValueError)


# ---- fused_linear_cross_entropy -----------------------------------------------------

@pytest.mark.parametrize("lead", [(6,), (2, 3)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("ignore_index", [-100, 1])
def test_fused_linear_cross_entropy(lead, reduction, with_bias, ignore_index):
    h = _randn(*lead, 8, seed=42, grad=True)
    W, b = _randn(C, 8, seed=43, grad=True), (_randn(C, seed=44, grad=True) if with_bias else None)
    t = torch.randint(0, C, lead, generator=torch.Generator().manual_seed(45))
    t.view(-1)[::4] = ignore_index
    # One row per sample: the classes are W's rows, never dim 1 of hidden.
    ref = F.cross_entropy(F.linear(h, W, b).reshape(-1, C), t.reshape(-1), ignore_index=ignore_index,
                          reduction=reduction)
    ins = [h, W, b]
    _same_grads(gp.fused_linear_cross_entropy(h, W, t, b, ignore_index, reduction), ref, ins, "by position")
    _same_grads(gp.fused_linear_cross_entropy(h, W, t, bias=b, ignore_index=ignore_index, reduction=reduction),
                ref, ins, "keywords")


def test_fused_linear_cross_entropy_refusals():
    h, W = _randn(4, 8, seed=46), _randn(C, 8, seed=47)
    t = torch.randint(0, C, (4,), generator=torch.Generator().manual_seed(48))
    _raises_naming(lambda: gp.fused_linear_cross_entropy(h, W, t, reduction="none"), "reduction")
    _raises_naming(lambda: gp.fused_linear_cross_entropy(h, W, t, label_smoothing=0.1), "label_smoothing", TypeError)


# ---- embedding ------------------------------------------------------------------------

@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_embedding(padding_idx):
    w = _randn(10, 4, seed=50, grad=True)
    i = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(51))
    i[0, :3] = torch.tensor([3, 9, 3])  # the padding rows, repeated
    _same_grads(gp.embedding(i, w, padding_idx), F.embedding(i, w, padding_idx), [w], "by position")
    _same_grads(gp.embedding(i, w, padding_idx=padding_idx), F.embedding(i, w, padding_idx=padding_idx), [w],
                "padding_idx=")


def test_embedding_refusals():
    w = _randn(10, 4, seed=52)
    i = torch.tensor([1, 2])
    for kw in ("max_norm", "scale_grad_by_freq", "sparse"):
        _raises_naming(lambda: gp.embedding(i, w, **{kw: 1.0}), kw, TypeError)


# ---- conv1d (depthwise; F.conv1d with groups=C on the input padded at one end) ---------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 11), (3, 11)])
def test_conv1d(causal, with_bias, shape):
    C_, K = shape[-2], 4
    x = _randn(*shape, seed=53, grad=True)
    w, b = _randn(C_, K, seed=54, grad=True), (_randn(C_, seed=55, grad=True) if with_bias else None)
    pad = (K - 1, 0) if causal else (0, K - 1)
    ref = F.conv1d(F.pad(x, pad), w.unsqueeze(1), b, groups=C_)
    _same_grads(gp.conv1d(x, w, b, causal=causal), ref, [x, w, b], "conv1d")


# ---- attention (F.scaled_dot_product_attention) -------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("sq", [5, 3])
def test_attention(causal, scale, gqa, sq):
    q = _randn(2, 4, sq, 8, seed=56, grad=True)
    k, v = (_randn(2, 2 if gqa else 4, 5, 8, seed=s, grad=True) for s in (57, 58))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    ins = [q, k, v]
    _same_grads(gp.attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa), ref, ins, "SDPA keywords")
    _same_grads(gp.attention(q, k, v, causal=causal, scale=scale, enable_gqa=gqa), ref, ins, "causal=")
    _close(gp.attention(q, k, v, None, 0.0, causal, scale, gqa), ref, "SDPA's positional order")


def test_attention_refusals():
    q, k, v = (_randn(1, 2, 4, 8, seed=s) for s in (59, 60, 61))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    _raises_naming(lambda: gp.attention(q, k, v, mask), "attn_mask", ValueError)
    _raises_naming(lambda: gp.attention(q, k, v, attn_mask=mask), "attn_mask", ValueError)
    _raises_naming(lambda: gp.attention(q, k, v, dropout_p=0.1), "dropout_p", ValueError)
