"""gpu_puzzles.hf.patch on random-init transformers models built from configs (never downloaded):
logits, loss and every gradient against the stock model, the very Parameters kept, what the
report says, our ops counted under the profiler, torch.compile(fullgraph=True)."""
import collections
import copy
import io
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import DEVICES, HAS_CUDA  # noqa: E402

import gpu_puzzles.hf as hf  # noqa: E402
from gpu_puzzles.bench import model as model_bench  # noqa: E402

FAMILIES = ["gpt2", "llama", "qwen3"]  # gpu_puzzles.bench.model.MODELS, shrunk


def _pair(name, device="cpu", dtype=torch.float32, **which):
    stock = model_bench.build(name, device, dtype=dtype, small=True)
    ours = copy.deepcopy(stock)
    report = hf.patch(ours, **which)
    return stock, ours, report


def _op_counts(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name.split("::", 1)[1] for e in prof.events() if e.name.startswith("gpu_puzzles::"))


def _step(model, ids, **kw):
    out = model(input_ids=ids, labels=ids, **kw)
    out.loss.backward()
    return out


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", FAMILIES)
def test_patched_matches_stock_fp32(name):
    stock, ours, report = _pair(name)
    ids = model_bench.batch(name, "cpu", small=True)
    a, b = _step(stock, ids), _step(ours, ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    ga, gb = _grads(stock), _grads(ours)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert gb[n] is not None, n
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    assert "attention" in report.swapped and "loss" in report.swapped


@pytest.mark.parametrize("name", FAMILIES)
def test_patch_keeps_parameters_and_state_dict(name):
    stock = model_bench.build(name, "cpu", dtype=torch.float32, small=True)
    ids_before = {n: id(p) for n, p in stock.named_parameters()}
    keys_before = list(stock.state_dict())
    opt = torch.optim.AdamW(stock.parameters())
    hf.patch(stock)
    assert {n: id(p) for n, p in stock.named_parameters()} == ids_before
    assert list(stock.state_dict()) == keys_before
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], stock.parameters()))
    if name == "gpt2":
        assert stock.lm_head.weight is stock.transformer.wte.weight  # tied weights stay tied
    # A stock checkpoint loads into the patched model and back.
    fresh = model_bench.build(name, "cpu", dtype=torch.float32, small=True, seed=5)
    stock.load_state_dict(fresh.state_dict())
    buf = io.BytesIO()
    torch.save(stock.state_dict(), buf)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    ids = model_bench.batch(name, "cpu", small=True)
    torch.testing.assert_close(stock(input_ids=ids).logits, fresh(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_our_ops_run(name):
    _, ours, _ = _pair(name)
    ids = model_bench.batch(name, "cpu", small=True)
    counts = _op_counts(lambda: _step(ours, ids))
    layers = 2
    assert counts["attention"] == layers and counts["attention_backward"] == layers
    assert counts["cross_entropy"] == 1 and counts["cross_entropy_backward"] == 1
    if name == "gpt2":
        assert counts["fused_layernorm_linear"] == 2 * layers and counts["layer_norm"] == 1
        assert counts["embedding"] == 2
    else:
        qk_norms = 2 * layers if name == "qwen3" else 0
        assert counts["rms_norm"] == 2 * layers + 1 + qk_norms and counts["embedding"] == 1
        assert counts["rotary"] == layers and counts["rotary_backward"] == layers, counts


def test_rotary_only_in_patched_models():
    """The family's apply_rotary_pos_emb is replaced module-wide, but runs ``rotary`` only inside a
    model patched with it (the default): an unpatched Llama in the same process, and one patched
    with rotary=False, keep the stock function's path and its numbers."""
    stock, ours, report = _pair("llama")
    _, no_rope, report_no = _pair("llama", rotary=False)
    assert report.swapped["model.layers.0.self_attn.rotary"].startswith("rotary")
    assert not any("rotary" in k for k in report_no.swapped)
    ids = model_bench.batch("llama", "cpu", small=True)
    assert _op_counts(lambda: _step(stock, ids))["rotary"] == 0
    assert _op_counts(lambda: _step(no_rope, ids))["rotary"] == 0
    counts = _op_counts(lambda: _step(ours, ids))
    assert counts["rotary"] == 2 and counts["rotary_backward"] == 2, counts
    for m in (stock, ours, no_rope):
        m.zero_grad()
    a, b, c = _step(stock, ids), _step(ours, ids), _step(no_rope, ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c.logits, a.logits, rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_pickled_models_load_in_a_patched_process():
    """torch.save / torch.load of whole models where hf.patch has replaced a family's
    apply_rotary_pos_emb: a patched model, and a stock one pickled before any patch, load and give
    their logits and our ops (with transformers' `kernels` dependency the function is an nn.Module
    that pickles by name, and once failed to load: "function() missing required argument")."""
    stock = model_bench.build("llama", "cpu", dtype=torch.float32, small=True, seed=11)
    before = io.BytesIO()
    torch.save(stock, before)
    ours = copy.deepcopy(stock)
    hf.patch(ours)
    after = io.BytesIO()
    torch.save(ours, after)
    ids = model_bench.batch("llama", "cpu", small=True)
    for buf, ref, rotary_calls in ((before, stock, 0), (after, ours, 2)):
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
        assert type(back) is type(ref)
        assert _op_counts(lambda: _step(back, ids))["rotary"] == rotary_calls
        torch.testing.assert_close(back(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)


def _packed(seed=0):
    """Two rows, each several sequences packed (position_ids restarting), as
    DataCollatorWithFlattening hands them over, and the sequences on their own."""
    g = torch.Generator().manual_seed(seed)
    rows = [[5, 9, 7], [21]]  # the second row holds one sequence: nothing to keep apart there
    docs = [[torch.randint(0, 200, (1, n), generator=g) for n in row] for row in rows]
    ids = torch.cat([torch.cat(d, 1) for d in docs], 0)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    return ids, pos, docs


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
@pytest.mark.parametrize("ckpt", [None, "nonreentrant"], ids=["no_ckpt", "ckpt"])
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_rows_kept_apart(name, ckpt, use_cache):
    """Packed rows: each sequence's logits and every gradient as if it ran alone, with a KV cache
    too (stock then attends across the sequences: masking_utils looks for packing only without
    one). Our kernel runs them one sequence at a time (no mask: cache) or SDPA with stock's mask."""
    _, ours, report = _pair(name)
    assert "packed rows" in report.swapped["attention"]
    if ckpt:
        ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _assert_packed_apart(ours, use_cache)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
def test_packed_rows_kept_apart_in_a_sliding_window(use_cache):
    """A sliding window narrower than the sequences (its mask: SDPA): the packed sequences kept
    apart in the mask as well (stock, with a cache, lets the window reach across them)."""
    ours = _decoder("mistral")
    ours.config.sliding_window = 4
    hf.patch(ours)
    _assert_packed_apart(ours, use_cache)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
def test_packed_rows_kept_apart_compiled(use_cache):
    """torch.compile(fullgraph=True): given position_ids (no mask), the attention runs SDPA with
    stock's packed mask, built on the device without a sync (stock's traced model builds it only
    without a cache); logits and gradients as eager's per-sequence run."""
    _, ours, _ = _pair("llama")
    ids, pos, _ = _packed()
    eager = copy.deepcopy(ours)
    a = eager(input_ids=ids, position_ids=pos, use_cache=use_cache).logits
    torch._dynamo.reset()
    b = torch.compile(ours, fullgraph=True)(input_ids=ids, position_ids=pos, use_cache=use_cache).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    ct = torch.randn(a.shape, generator=torch.Generator().manual_seed(2))
    (a * ct).sum().backward()
    (b * ct).sum().backward()
    for (n, p), q in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
def test_head_dims_our_kernels_do_not_take_go_to_sdpa(monkeypatch, use_cache):
    """On CUDA a head dim our tensor-core kernels do not take (Gemma's 256) goes to SDPA, not to
    the SIMT kernels (the rule, _kernels_take, is forced here on the CPU): no call of ours,
    stock's logits and gradients, and packed rows still kept apart (SDPA with the packed mask)."""
    monkeypatch.setattr(hf, "_kernels_take", lambda q: False)
    stock, ours, _ = _pair("llama")
    ids = model_bench.batch("llama", "cpu", small=True)
    counts = _op_counts(lambda: _step(ours, ids))
    assert counts["attention"] == 0 and counts["attention_backward"] == 0, counts
    for m in (stock, ours):
        m.zero_grad()
    a, b = _step(stock, ids), _step(ours, ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    ours.zero_grad()
    _assert_packed_apart(ours, use_cache)


def test_head_dim_report():
    """The report says where SDPA runs every CUDA call: a head dim our kernels do not take."""
    for d, said in ((64, False), (128, False), (256, True), (16, True)):
        m = model_bench.build("llama", "cpu", small=True)
        m.config.head_dim = d  # read by the report only
        assert ("on CUDA SDPA runs every call: head_dim" in hf.patch(m).swapped["attention"]) == said, d


def _assert_packed_apart(ours, use_cache):
    ids, pos, docs = _packed()
    out = ours(input_ids=ids, position_ids=pos, use_cache=use_cache).logits
    ct = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * ct).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    alone, at = [], 0
    for r, row in enumerate(docs):
        at = 0
        for d in row:
            o = ours(input_ids=d, use_cache=use_cache).logits
            (o * ct[r:r + 1, at:at + d.shape[1]]).sum().backward()
            alone.append(o)
            at += d.shape[1]
    want = torch.cat([torch.cat(alone[:3], 1), alone[3]], 0)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for n, p in ours.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{n}: {m}")


def test_packed_rows_counted_once_per_forward():
    """Found once per forward (one device sync, as stock's own check), not per layer; a plain
    forward (position_ids of the model's own making) finds nothing and keeps the dense kernel."""
    _, ours, _ = _pair("llama")
    ids, pos, _ = _packed()
    with torch.no_grad():
        counts = _op_counts(lambda: ours(input_ids=ids, position_ids=pos, use_cache=True))
        assert counts["attention"] == 2 * 4, counts  # row 0: three sequences, row 1: one; 2 layers
        counts = _op_counts(lambda: ours(input_ids=ids, use_cache=True))
        assert counts["attention"] == 2, counts


def test_attention_false_leaves_sdpa():
    _, ours, report = _pair("gpt2", attention=False)
    assert "attention" not in report.swapped
    ids = model_bench.batch("gpt2", "cpu", small=True)
    counts = _op_counts(lambda: _step(ours, ids))
    assert counts["attention"] == 0 and counts["fused_layernorm_linear"] > 0


def _sdpa_masks_traced(model, ids):
    """The attn_mask argument of each SDPA call in the graph torch.compile captures."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids)
    calls = [n for g in graphs for n in g.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "") == "scaled_dot_product_attention"]
    return [n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) for n in calls]


@pytest.mark.parametrize("name", FAMILIES)
def test_attention_false_compiled_causal_without_mask(name):
    """attention=False under torch.compile: SDPA gets no (B, 1, S, S) mask for plain causal
    attention, where stock traced builds one (so the check can tell them apart)."""
    stock, ours, report = _pair(name, attention=False)
    assert "attention" not in report.swapped and hf.SDPA_ATTENTION_NAME in report.left["attention"]
    ids = model_bench.batch(name, "cpu", small=True)
    stock_masks, our_masks = _sdpa_masks_traced(stock, ids), _sdpa_masks_traced(ours, ids)
    assert len(our_masks) == len(stock_masks) == stock.config.num_hidden_layers
    assert all(m is not None for m in stock_masks)
    assert all(m is None for m in our_masks)
    # Eager: the same as stock, and a padding mask still reaches SDPA.
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits,
                               stock(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)


def test_attention_false_leaves_other_implementations():
    """attention=False on a model not on SDPA (here transformers' eager attention): nothing is
    re-registered, the report says why, and the model stays as stock."""
    stock = model_bench.build("gpt2", "cpu", dtype=torch.float32, small=True)
    stock.set_attn_implementation("eager")
    ours = copy.deepcopy(stock)
    report = hf.patch(ours, attention=False)
    assert ours.config._attn_implementation == "eager"
    assert "does not run transformers' SDPA attention" in report.left["attention"]
    ids = model_bench.batch("gpt2", "cpu", small=True)
    torch.testing.assert_close(ours(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_padding_mask_goes_to_sdpa():
    stock, ours, _ = _pair("gpt2")
    ids = model_bench.batch("gpt2", "cpu", small=True)
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0  # right padding on one row
    a = stock(input_ids=ids, attention_mask=mask).logits
    counts = _op_counts(lambda: ours(input_ids=ids, attention_mask=mask))
    b = ours(input_ids=ids, attention_mask=mask).logits
    assert counts["attention"] == 0  # the mask is not one our kernel takes: SDPA ran
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_unknown_architecture_left_alone():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4))
    before = [type(m) for m in model.modules()]
    report = hf.patch(model)
    assert not report.swapped and "model" in report.left and "not one gpu_puzzles.hf knows" in report.left["model"]
    assert [type(m) for m in model.modules()] == before


def test_patch_twice_is_a_no_op():
    _, ours, first = _pair("gpt2")
    again = hf.patch(ours)
    assert first.swapped and not again.swapped and "already patched" in again.left["model"]


def test_attention_dropout_reported():
    stock = model_bench.build("gpt2", "cpu", dtype=torch.float32, small=True)
    stock.config.attn_pdrop = 0.1
    report = hf.patch(stock)
    assert "attn_pdrop=0.1" in report.left["attention while training"]


@pytest.mark.parametrize("name", FAMILIES)
def test_compile_fullgraph(name):
    _, ours, _ = _pair(name, rotary=name != "gpt2")  # patched RoPE compiles as stock's (no graph break)
    ids = model_bench.batch(name, "cpu", small=True)
    eager = copy.deepcopy(ours)
    a = _step(eager, ids)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    b = _step(compiled, ids)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-5)
    for (n, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    # Traced, transformers builds a causal mask even without padding; ours must still run.
    counts = _op_counts(lambda: _step(compiled, ids))
    assert counts["attention"] == 2 and counts["attention_backward"] == 2, counts
    assert counts["cross_entropy"] == 1 and counts["rotary"] == 0, counts  # compiled, RoPE is inductor's


def test_compile_padding_mask_goes_to_sdpa():
    stock, ours, _ = _pair("llama")
    ids = model_bench.batch("llama", "cpu", small=True)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on one row
    a = stock(input_ids=ids, attention_mask=mask).logits
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    b = compiled(input_ids=ids, attention_mask=mask).logits
    counts = _op_counts(lambda: compiled(input_ids=ids, attention_mask=mask))
    assert counts["attention"] == 0 and counts["embedding"] == 1, counts  # ours still run beside SDPA
    keep = mask.bool()  # rows of padded query positions are arbitrary in both
    torch.testing.assert_close(b[keep], a[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("ckpt", [None, "nonreentrant"], ids=["no_ckpt", "ckpt"])
@pytest.mark.parametrize("fused_loss", [False, True], ids=["stock_loss", "fused_loss"])
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_autocast_as_close_as_stock(name, fused_loss, ckpt, dtype):
    """float32 parameters under autocast on the GPU (bf16 and fp16): as close to the float32
    model as stock under the same autocast, stock's dtypes, our ops running."""
    _amp_errors_within_stock(name, "cuda", dtype, ckpt, fused_loss)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fused_loss", [False, True], ids=["stock_loss", "fused_loss"])
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_bf16_as_close_as_stock(name, fused_loss):
    """bf16 on the GPU: ours is as close to the fp32 model as stock bf16 is (within 2x + a floor),
    also with the fused LM head + loss (which returns no logits)."""
    ref = model_bench.build(name, "cuda", dtype=torch.float32, small=True)
    stock = copy.deepcopy(ref).to(torch.bfloat16)
    ours = copy.deepcopy(stock)
    hf.patch(ours, fused_loss=fused_loss)
    ids = model_bench.batch(name, "cuda", small=True)
    outs = [_step(m, ids) for m in (ref, stock, ours)]
    err = lambda x, y: (x.float() - y.float()).abs().max().item()  # noqa: E731
    if fused_loss:
        assert outs[2].logits is None
    else:
        assert err(outs[2].logits, outs[0].logits) <= 2 * err(outs[1].logits, outs[0].logits) + 1e-2
    # The loss in float32, as stock's (it upcasts the logits; we read them as they are).
    loss0 = outs[0].loss.item()
    assert outs[2].loss.dtype == outs[1].loss.dtype == torch.float32
    assert abs(outs[2].loss.item() - loss0) <= 2 * abs(outs[1].loss.item() - loss0) + 1e-3
    for (n, g0), g1, g2 in zip(_grads(ref).items(), _grads(stock).values(), _grads(ours).values()):
        scale = g0.abs().max().item() + 1e-6
        assert err(g2, g0) <= 2 * err(g1, g0) + 2e-2 * scale, n
    if not fused_loss:
        counts = _op_counts(lambda: _step(ours, ids))
        assert counts["attention"] == 2 and counts["cross_entropy"] == 1


# ---- how users train: autocast, gradient checkpointing, Trainer ---------------------------

def _amp_step(model, ids, device, dtype):
    with torch.autocast(device, dtype=dtype):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def _amp_errors_within_stock(name, device, dtype, ckpt=None, fused_loss=False):
    """float32 parameters under autocast, as Trainer(bf16=True) runs them: stock and ours against
    the float32 model without autocast. Ours must be as close as stock (within 2x + a floor), with
    stock's loss dtype, every gradient in float32, and our ops running."""
    ref = model_bench.build(name, device, dtype=torch.float32, small=True)
    stock, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    for m in (ref, stock, ours):
        model_bench.grad_ckpt(m, ckpt)
        m.train()
    hf.patch(ours, fused_loss=fused_loss)
    ids = model_bench.batch(name, device, small=True)
    a = _step(ref, ids)
    b, c = _amp_step(stock, ids, device, dtype), _amp_step(ours, ids, device, dtype)
    assert c.loss.dtype == b.loss.dtype == torch.float32
    err = lambda x, y: (x.float() - y.float()).abs().max().item()  # noqa: E731
    assert abs(c.loss.item() - a.loss.item()) <= 2 * abs(b.loss.item() - a.loss.item()) + 2e-3
    if not fused_loss:
        assert c.logits.dtype == b.logits.dtype
        assert err(c.logits, a.logits) <= 2 * err(b.logits, a.logits) + 1e-2
    for (n, g0), g1, g2 in zip(_grads(ref).items(), _grads(stock).values(), _grads(ours).values()):
        assert g2 is not None and g2.dtype == torch.float32, n
        scale = g0.abs().max().item() + 1e-6
        assert err(g2, g0) <= 2 * err(g1, g0) + 2e-2 * scale, n
    # Under autocast an op with an autocast kernel may be recorded twice per call (the autocast
    # kernel, then the op below it, when that one casts): the backward ops count the calls.
    counts = _op_counts(lambda: _amp_step(ours, ids, device, dtype))
    assert counts["attention"] >= 2 and counts["attention_backward"] == 2, counts
    if fused_loss:
        assert counts["fused_linear_cross_entropy"] >= 1 and counts["cross_entropy"] == 0, counts
    else:
        assert counts["cross_entropy"] >= 1 and counts["cross_entropy_backward"] == 1, counts
    if name == "gpt2":
        assert counts["fused_layernorm_linear_backward"] == 4 and counts["layer_norm_backward"] == 1, counts
    else:  # each layer's norm before q/k/v fused with them (float32 weights cast); the others alone
        assert counts["fused_rmsnorm_linear_backward"] == 2 and counts["rms_norm_backward"] == 3, counts


@pytest.mark.parametrize("ckpt", [None, "reentrant", "nonreentrant"], ids=["no_ckpt", "reentrant", "nonreentrant"])
@pytest.mark.parametrize("name", FAMILIES)
def test_autocast_bf16_as_close_as_stock(name, ckpt):
    """The regime of Trainer(bf16=True), accelerate and Lightning's bf16-mixed, on the CPU (the
    same autocast kernels as on CUDA): float32 residual stream, bf16 GEMMs, RoPE's float32 q/k
    meeting a bf16 v; with and without gradient checkpointing."""
    _amp_errors_within_stock(name, "cpu", torch.bfloat16, ckpt)


@pytest.mark.parametrize("name", FAMILIES)
def test_autocast_bf16_fused_loss(name):
    _amp_errors_within_stock(name, "cpu", torch.bfloat16, fused_loss=True)


@pytest.mark.parametrize("name", FAMILIES)
def test_autocast_compiled_matches_eager(name):
    """fp32 parameters under autocast, torch.compile(fullgraph=True): eager's loss and gradients."""
    ref = model_bench.build(name, "cpu", dtype=torch.float32, small=True)
    hf.patch(ref)
    ids = model_bench.batch(name, "cpu", small=True)
    eager = copy.deepcopy(ref)
    a = _amp_step(eager, ids, "cpu", torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(ref, fullgraph=True)
    b = _amp_step(compiled, ids, "cpu", torch.bfloat16)
    assert b.loss.dtype == a.loss.dtype == torch.float32
    torch.testing.assert_close(b.loss, a.loss, rtol=2e-2, atol=2e-2)
    for (n, p), (_, q) in zip(eager.named_parameters(), ref.named_parameters()):
        scale = p.grad.abs().max().item() + 1e-6
        assert (q.grad - p.grad).abs().max().item() <= 5e-2 * scale, n
    counts = _op_counts(lambda: _amp_step(compiled, ids, "cpu", torch.bfloat16))
    assert counts["attention"] == 2 and counts["cross_entropy"] == 1, counts


def test_compiled_gated_mlp_left_to_inductor():
    """fp32 parameters under autocast: eager, the gated MLPs run gated_act; compiled, act(gate) * up
    runs stock (inductor fuses it into one kernel each way) while the norms stay ours. Compiled
    agrees with eager."""
    model = model_bench.build("qwen3", "cpu", dtype=torch.float32, small=True)
    hf.patch(model)
    ids = model_bench.batch("qwen3", "cpu", small=True)
    eager = copy.deepcopy(model)
    a = _amp_step(eager, ids, "cpu", torch.bfloat16)
    eager_counts = _op_counts(lambda: _amp_step(eager, ids, "cpu", torch.bfloat16))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    b = _amp_step(compiled, ids, "cpu", torch.bfloat16)
    torch.testing.assert_close(b.loss, a.loss, rtol=2e-2, atol=2e-2)
    counts = _op_counts(lambda: _amp_step(compiled, ids, "cpu", torch.bfloat16))
    layers = model.config.num_hidden_layers
    assert eager_counts["gated_act"] == layers and eager_counts["gated_act_backward"] == layers, eager_counts
    assert counts["gated_act"] == 0, counts
    # the post-attention and final norms alone, the input norm fused with q/k/v, in both (the q/k
    # norms see bf16 q/k beside float32 weights: stock)
    for c in (eager_counts, counts):
        assert c["rms_norm"] == layers + 1 and c["fused_rmsnorm_linear"] == layers, c
    assert counts["attention"] == layers and counts["cross_entropy"] == 1, counts


@pytest.mark.parametrize("name", FAMILIES)
def test_autocast_fp16_grad_scaler(name):
    """fp16 autocast with a GradScaler: no step is skipped where stock skips none (the scale stays
    at its first value), and the updated parameters agree with stock's to fp16's noise."""
    ref = model_bench.build(name, "cpu", dtype=torch.float32, small=True)
    stock, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    hf.patch(ours)
    ids = model_bench.batch(name, "cpu", small=True)
    scales = []
    for m in (stock, ours):
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(input_ids=ids, labels=ids).loss
            assert loss.dtype == torch.float32
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        scales.append(scaler.get_scale())
    assert scales[1] == scales[0] == 65536.0, scales
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        moved = (p - ref.state_dict()[n]).abs().max().item()
        assert (q - p).abs().max().item() <= 0.2 * moved + 1e-4, n


@pytest.mark.parametrize("name", FAMILIES)
def test_trainer_bf16_matches_stock(name, tmp_path):
    """transformers.Trainer(bf16=True) through accelerate, as a user starts it (float32 model,
    use_cpu here): the patched model trains, its losses follow stock's step by step."""
    pytest.importorskip("accelerate")
    ids = model_bench.batch(name, "cpu", small=True)
    data = [dict(input_ids=ids[i % 2], labels=ids[i % 2]) for i in range(8)]
    losses = []
    for patched in (False, True):
        model = model_bench.build(name, "cpu", dtype=torch.float32, small=True)
        if patched:
            hf.patch(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(patched)), bf16=True, use_cpu=True, per_device_train_batch_size=2,
            max_steps=4, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
            disable_tqdm=True, seed=0, data_seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(losses[0]) == len(losses[1]) == 4
    for a, b in zip(*losses):
        assert abs(a - b) <= 2e-2 * abs(a), losses


@pytest.mark.parametrize("name", FAMILIES)
def test_cpu_bf16_model(name):
    """A bf16 model on the CPU runs our ops (half inputs computed in float32 there), as close to
    the float32 model as stock bf16, with stock's float32 loss."""
    ref = model_bench.build(name, "cpu", dtype=torch.float32, small=True)
    stock = copy.deepcopy(ref).to(torch.bfloat16)
    ours = copy.deepcopy(stock)
    report = hf.patch(ours)
    ids = model_bench.batch(name, "cpu", small=True)
    a, b, c = (_step(m, ids) for m in (ref, stock, ours))
    err = lambda x, y: (x.float() - y.float()).abs().max().item()  # noqa: E731
    assert c.loss.dtype == b.loss.dtype == torch.float32
    assert err(c.logits, a.logits) <= 2 * err(b.logits, a.logits) + 1e-2
    for (n, g0), g1, g2 in zip(_grads(ref).items(), _grads(stock).values(), _grads(ours).values()):
        assert err(g2, g0) <= 2 * err(g1, g0) + 2e-2 * (g0.abs().max().item() + 1e-6), n
    _assert_report_runs(report, _op_counts(lambda: ours(input_ids=ids, labels=ids)), layers=2)


def _assert_report_runs(report, counts, layers):
    """Each op the report lists as swapped ran (once per module it names; attention once per
    layer), and no other op of ours did."""
    want = collections.Counter()
    for where, what in report.swapped.items():
        op = what.split(" ", 1)[0]
        want[op] += layers if where == "attention" else 1
    ran = collections.Counter({k: v for k, v in counts.items() if not k.endswith("_backward")})
    assert ran == want, f"report says {dict(want)}, ran {dict(ran)}\n{report}"


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_report_says_what_runs(name, dtype):
    # On the CPU in every dtype (half models run our ops there too, computed in float32).
    stock = model_bench.build(name, "cpu", dtype=torch.float32, small=True).to(dtype)
    report = hf.patch(stock)
    ids = model_bench.batch(name, "cpu", small=True)
    _assert_report_runs(report, _op_counts(lambda: stock(input_ids=ids, labels=ids)), layers=2)
    assert "SDPA runs calls with a padding mask" in report.swapped["attention"]


def test_report_rmsnorm_of_another_dtype_than_the_activations():
    # A float32 norm weight beside bf16 activations runs the stock RMSNorm (_RMSNorm.forward):
    # the report says so instead of counting it as swapped.
    model = model_bench.build("llama", "cpu", dtype=torch.bfloat16, small=True)
    model.model.norm.float()
    report = hf.patch(model)
    assert "model.norm" not in report.swapped and "stock RMSNorm runs" in report.left["model.norm"]
    assert report.swapped["model.layers.0.input_layernorm+self_attn.q_proj/k_proj/v_proj"].startswith("rms_norm ")
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    assert _op_counts(lambda: model.model.norm(x))["rms_norm"] == 0


# Llama-style families from their configs (tiny, random init). Per family: the config and model
# classes, config overrides; of a 2-layer model's float32 forward, the rms_norm calls (layers'
# norms, q/k norms, the final norm), the fused RMSNorm+Linear calls (Phi-3's norms before qkv_proj
# and gate_up_proj) and our attention's calls; under autocast bf16, the fused and the standalone
# norms' backward calls. Qwen3 is in FAMILIES (gpu_puzzles.bench.model's config), so every test
# above covers it.
# norms / fused / attention: our rms_norm, fused_rmsnorm_linear and attention calls in float32; amp_*:
# the backward calls of the two norm ops under autocast bf16; gated: gated_act calls (0: MoE MLPs).
_Fam = collections.namedtuple("_Fam", "config model overrides norms fused attention amp_fused amp_alone gated",
                              defaults=(2,))
DECODER_FAMILIES = {
    "mistral": _Fam("MistralConfig", "MistralForCausalLM", {}, 5, 0, 2, 2, 3),
    "qwen2": _Fam("Qwen2Config", "Qwen2ForCausalLM", {}, 5, 0, 2, 2, 3),
    "olmo2": _Fam("Olmo2Config", "Olmo2ForCausalLM", {}, 9, 0, 2, 0, 1),
    "phi3": _Fam("Phi3Config", "Phi3ForCausalLM", {}, 1, 4, 2, 4, 1),
    "gemma": _Fam("GemmaConfig", "GemmaForCausalLM", {}, 5, 0, 2, 2, 3),
    # Soft-capped attention (the default) stays the model's own; four norms a layer.
    "gemma2": _Fam("Gemma2Config", "Gemma2ForCausalLM", {}, 9, 0, 0, 2, 3),
    # A sliding-window layer (its mask: SDPA) and a global one (ours); q/k norms.
    "gemma3_text": _Fam("Gemma3TextConfig", "Gemma3ForCausalLM",
                        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
                        13, 0, 1, 2, 3),
    # Llama's layout (Granite's multipliers, SmolLM3, Seed-OSS with its residual dropout off; Helium's
    # and ERNIE 4.5's interleaved RoPE stays stock under rotary=True).
    "granite": _Fam("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                                          "attention_multiplier": 0.3, "logits_scaling": 2.0},
                    5, 0, 2, 2, 3),
    "smollm3": _Fam("SmolLM3Config", "SmolLM3ForCausalLM", {}, 5, 0, 2, 2, 3),
    "seed_oss": _Fam("SeedOssConfig", "SeedOssForCausalLM", {"residual_dropout": 0.0}, 5, 0, 2, 2, 3),
    "helium": _Fam("HeliumConfig", "HeliumForCausalLM", {"hidden_size": 256}, 5, 0, 2, 2, 3),
    "ernie4_5": _Fam("Ernie4_5Config", "Ernie4_5ForCausalLM", {}, 5, 0, 2, 2, 3),
    # GLM's gate_up_proj fuses with the norm before it in any dtype; GLM-4's two more norms a layer.
    "glm": _Fam("GlmConfig", "GlmForCausalLM", {}, 3, 2, 2, 4, 1),
    "glm4": _Fam("Glm4Config", "Glm4ForCausalLM", {}, 7, 2, 2, 4, 1),
    # OLMo 2's layout.
    "olmo3": _Fam("Olmo3Config", "Olmo3ForCausalLM", {}, 9, 0, 2, 0, 1),
    "exaone4": _Fam("Exaone4Config", "Exaone4ForCausalLM", {}, 9, 0, 2, 0, 1),
    # Mixture-of-experts MLPs stay stock.
    "mixtral": _Fam("MixtralConfig", "MixtralForCausalLM", {}, 5, 0, 2, 2, 3, 0),
    "qwen2_moe": _Fam("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {}, 5, 0, 2, 2, 3, 0),
    "qwen3_moe": _Fam("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {}, 9, 0, 2, 2, 3, 0),
    # Llama's layout: Ministral (one sliding layer: SDPA), Arcee and Apertus (non-gated MLPs stay stock),
    # Hunyuan's q/k norms; MoE: OLMoE, Dots1 and GLM-4.5 (a dense first layer), Granite MoE, ERNIE 4.5
    # MoE, FlexOlmo; VaultGemma (soft-capped attention: its own). Hunyuan's q/k norms come after RoPE, on
    # float32 q/k under autocast (ours runs them); FlexOlmo's read float32 too.
    "ministral": _Fam("MinistralConfig", "MinistralForCausalLM",
                      {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
                      5, 0, 1, 2, 3),
    "arcee": _Fam("ArceeConfig", "ArceeForCausalLM", {}, 5, 0, 2, 2, 3, 0),
    "apertus": _Fam("ApertusConfig", "ApertusForCausalLM", {}, 9, 0, 2, 2, 3, 0),
    "hunyuan_v1_dense": _Fam("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {}, 9, 0, 2, 2, 7),
    "hunyuan_v1_moe": _Fam("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {}, 9, 0, 2, 2, 7, 0),
    "olmoe": _Fam("OlmoeConfig", "OlmoeForCausalLM", {"hidden_size": 256}, 9, 0, 2, 2, 3, 0),
    "dots1": _Fam("Dots1Config", "Dots1ForCausalLM",
                  {"first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
                  9, 0, 2, 2, 3, 1),
    "glm4_moe": _Fam("Glm4MoeConfig", "Glm4MoeForCausalLM", {"use_qk_norm": True, "first_k_dense_replace": 1},
                     9, 0, 2, 2, 3, 1),
    "granitemoe": _Fam("GraniteMoeConfig", "GraniteMoeForCausalLM", {"logits_scaling": 2.0}, 5, 0, 2, 2, 3, 0),
    "granitemoeshared": _Fam("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", {}, 5, 0, 2, 2, 3, 0),
    "ernie4_5_moe": _Fam("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", {}, 5, 0, 2, 2, 3, 1),
    "flex_olmo": _Fam("FlexOlmoConfig", "FlexOlmoForCausalLM", {}, 9, 0, 2, 0, 3, 0),
    # LayerNorm decoders: StarCoder2 (a GELU MLP, stock), StableLM (partial RoPE, a gated MLP), Phi.
    "starcoder2": _Fam("Starcoder2Config", "Starcoder2ForCausalLM", {}, 5, 0, 2, 0, 5, 0),
    "stablelm": _Fam("StableLmConfig", "StableLmForCausalLM", {"hidden_size": 256}, 5, 0, 2, 0, 5),
    "phi": _Fam("PhiConfig", "PhiForCausalLM", {"hidden_size": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
                3, 0, 2, 0, 3, 0),
    "vaultgemma": _Fam("VaultGemmaConfig", "VaultGemmaForCausalLM",
                       {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
                       5, 0, 0, 2, 3),
}
_ROPE_STOCK = {f for f, d in hf._DECODERS.items() if d.rope is None}  # rotary=True leaves their RoPE stock


def _norm_op(family):
    """The op a family's norms run: rms_norm, or layer_norm (StarCoder2, StableLM)."""
    return "layer_norm" if hf._DECODERS[family].norm == "layer" else "rms_norm"


def _routed(name):
    """A mixture-of-experts parameter (router, experts, ERNIE's score bias): in bf16 the routing of a
    few tokens flips, stock's and ours alike, so its gradient is compared in float32 only."""
    return any(s in name for s in (".experts.", ".mlp.gate.", ".block_sparse_moe.", ".router."))


def _decoder(family, seed=0):
    fam = DECODER_FAMILIES[family]
    if not hasattr(transformers, fam.config):
        pytest.skip(f"this transformers has no {fam.config}")
    torch.manual_seed(seed)
    config = getattr(transformers, fam.config)(**{**model_bench._SMALL_DECODER, **fam.overrides},
                                               attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                                               pad_token_id=None)
    config._attn_implementation = "eager" if family in ("gemma2", "vaultgemma") else "sdpa"
    model = getattr(transformers, fam.model)(config).float()
    model.loss_type = "ForCausalLM"
    return model


@pytest.mark.parametrize("family", list(DECODER_FAMILIES))
def test_decoder_families(family):
    """Mistral, Qwen2 (q/k/v with biases), OLMo 2 (post-norms, q/k norms over all heads), Phi-3
    (fused qkv and gate/up projections) and Gemma 1-3 ((1 + weight) norms, soft-capping, sliding
    windows): logits, loss and every gradient as stock's in float32; every RMSNorm, attention
    where our kernel can take it, and the loss on our ops; the report names each norm it swapped."""
    stock = _decoder(family)
    ours = copy.deepcopy(stock)
    report = hf.patch(ours, rotary=True)  # the families' RoPE: Phi-3's partial, OLMo 2's cast back
    fam = DECODER_FAMILIES[family]
    assert report.model_type == family and f"model.{hf._DECODERS[family].final_norm}" in report.swapped
    assert ("attention" in report.swapped) == (fam.attention > 0), report
    ids = model_bench.batch("llama", "cpu", small=True)
    a, b = _step(stock, ids), _step(ours, ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    counts = _op_counts(lambda: ours(input_ids=ids, labels=ids))
    assert counts["attention"] == fam.attention and counts["cross_entropy"] == 1, counts
    norm = _norm_op(family)
    assert counts[norm] == fam.norms and counts["fused_rmsnorm_linear"] == fam.fused, counts
    assert sum(v.split(" ", 1)[0] == norm for v in report.swapped.values()) == fam.norms
    # A gated MLP: SwiGLU, or Gemma's GeGLU (Phi-3's gate and up: one projection's halves); else
    # mixture-of-experts (the last layer's) or a non-gated MLP (Arcee, Apertus), left stock.
    act = "gelu_tanh" if "gemma" in family else "silu"
    assert counts["gated_act"] == fam.gated, counts
    mlp = f"model.layers.1.{hf._DECODERS[family].mlp}"
    if fam.gated == 2:
        assert report.swapped[mlp].startswith(f"gated_act ({act}"), report
    else:
        assert report.left[mlp].startswith(("mixture of experts", "not a gated MLP")), report
    rope = 0 if family in _ROPE_STOCK else 2
    assert counts["rotary"] == rope and counts["rotary_backward"] == 0, counts  # (the profiled call is forward only)
    if fam.attention == 2:
        _assert_report_runs(report, counts, layers=2)


@pytest.mark.parametrize("family", list(DECODER_FAMILIES))
def test_decoder_families_fused_loss(family):
    """fused_loss=True: the loss and every gradient as stock's in training, for every family: Gemma
    2's final soft-cap inside the fused op, Granite's logits_scaling on the hidden state, MoE's
    without output_router_logits (the config default; with it, test_fused_loss_moe_router_loss)."""
    stock = _decoder(family)
    ours = copy.deepcopy(stock)
    report = hf.patch(ours, fused_loss=True)
    ids = model_bench.batch("llama", "cpu", small=True)
    a, b = _step(stock, ids), _step(ours, ids)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    assert "lm_head+loss" in report.swapped and "lm_head+loss" not in report.left, report
    assert b.logits is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(DECODER_FAMILIES))
def test_decoder_families_bf16_parameters(family, device):
    """bf16 parameters (our bench's regime), on the CPU and the GPU: logits and gradients as close to
    the float32 model as stock's bf16 ones."""
    ref = _decoder(family).to(device)
    stock = copy.deepcopy(ref).to(torch.bfloat16)
    ours = copy.deepcopy(stock)
    hf.patch(ours, rotary=True)
    ids = model_bench.batch("llama", device, small=True)
    a, b, c = _step(ref, ids), _step(stock, ids), _step(ours, ids)
    err = lambda x, y: (x.float() - y.float()).abs().max().item()  # noqa: E731
    assert err(c.logits, a.logits) <= 2 * err(b.logits, a.logits) + 1e-2
    for (n, g0), g1, g2 in zip(_grads(ref).items(), _grads(stock).values(), _grads(ours).values()):
        if _routed(n):
            continue  # bf16 routing moves a few tokens to other experts (as under autocast, below)
        assert g2 is not None and g2.dtype == torch.bfloat16, n
        assert err(g2, g0) <= 2 * err(g1, g0) + 2e-2 * (g0.abs().max().item() + 1e-6), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(DECODER_FAMILIES))
def test_decoder_families_autocast_bf16(family, device):
    """The newer families under autocast bf16 with float32 parameters (Trainer(bf16=True)'s regime),
    on the CPU and the GPU: loss, logits and gradients as close to the float32 model as stock's."""
    ref = _decoder(family).to(device)
    stock, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    hf.patch(ours, rotary=True)  # float32 tables with bf16 q/k (or float32 q/k after stock q/k norms)
    ids = model_bench.batch("llama", device, small=True)
    a = _step(ref, ids)
    b, c = _amp_step(stock, ids, device, torch.bfloat16), _amp_step(ours, ids, device, torch.bfloat16)
    assert c.loss.dtype == b.loss.dtype == torch.float32
    err = lambda x, y: (x.float() - y.float()).abs().max().item()  # noqa: E731
    assert abs(c.loss.item() - a.loss.item()) <= 2 * abs(b.loss.item() - a.loss.item()) + 2e-3
    assert err(c.logits, a.logits) <= 2 * err(b.logits, a.logits) + 1e-2
    for (n, g0), g1, g2 in zip(_grads(ref).items(), _grads(stock).values(), _grads(ours).values()):
        if _routed(n):
            continue  # routing is discrete: bf16 moves a few tokens to other experts (3 of 64 a layer, stock and
            # ours alike, on qwen3_moe); the float32 test above compares these gradients with stock's
        assert g2 is not None and g2.dtype == torch.float32, n
        # MoE: a flipped route moves the gradients upstream of the router too
        floor = 2e-2 if DECODER_FAMILIES[family].gated == 2 else 5e-2
        assert err(g2, g0) <= 2 * err(g1, g0) + floor * (g0.abs().max().item() + 1e-6), n
    # A norm whose input comes from a bf16 linear (q/k norms, OLMo 2's post-norms) meets its float32
    # weight in two dtypes: it runs stock (_RMSNorm), whose output dtype rule differs per family.
    # The norms on the float32 residual stream run ours; OLMo 2's post-norms read bf16 linears and
    # its q/k norms a bf16 q/k (stock runs them). Fused with the projections after them (the GEMM
    # in bf16, as stock's): Phi-3's norms before qkv_proj and gate_up_proj; Mistral's and Qwen2's
    # before q/k/v, their float32 weights cast and concatenated. (Llama, Qwen3: FAMILIES' tests.)
    counts = _op_counts(lambda: _amp_step(ours, ids, device, torch.bfloat16))
    fam = DECODER_FAMILIES[family]
    assert counts["attention_backward"] == fam.attention, counts
    assert counts[_norm_op(family) + "_backward"] == fam.amp_alone, counts
    assert counts["fused_rmsnorm_linear_backward"] == fam.amp_fused, counts
    assert counts["rotary_backward"] == (0 if family in _ROPE_STOCK else 2), counts


@pytest.mark.parametrize("family", ["olmo2", "phi3", "gemma", "gemma3_text", "granite", "glm4", "smollm3", "mixtral"])
def test_decoder_families_compile_fullgraph(family):
    """OLMo 2's q/k norms, Phi-3's and GLM-4's fused norm + projections, Granite's multipliers,
    SmolLM3's layers without RoPE and Mixtral's experts under torch.compile(fullgraph=True): no
    graph break, eager's loss."""
    model = _decoder(family)
    hf.patch(model)
    ids = model_bench.batch("llama", "cpu", small=True)
    eager = model(input_ids=ids, labels=ids).loss
    compiled = torch.compile(model, fullgraph=True)(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, ours_runs", [(8, False), (64, True)])
def test_sliding_window(window, ours_runs):
    """Mistral's sliding window: narrower than the sequence, its mask sends attention to SDPA;
    as wide as the sequence, it is plain causal attention and ours runs. Either way as stock."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=211,
                                        max_position_embeddings=64, attention_dropout=0.0, sliding_window=window,
                                        bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    stock = transformers.MistralForCausalLM(config).float()
    stock.loss_type = "ForCausalLM"
    ours = copy.deepcopy(stock)
    hf.patch(ours)
    ids = model_bench.batch("llama", "cpu", small=True)  # 32 tokens
    assert ids.shape[1] > 8
    a, b = _step(stock, ids), _step(ours, ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    counts = _op_counts(lambda: ours(input_ids=ids, labels=ids))
    assert counts["attention"] == (2 if ours_runs else 0), counts


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_loss_matches_stock(name):
    """patch(fused_loss=True): in training with labels the LM head and the loss are one fused op
    (logits not returned), with stock's loss and gradients; in eval the logits come back."""
    stock, ours, report = _pair(name, fused_loss=True)
    assert "lm_head+loss" in report.swapped
    ids = model_bench.batch(name, "cpu", small=True)
    stock.train()
    ours.train()
    a, b = _step(stock, ids), _step(ours, ids)
    assert b.logits is None
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    counts = _op_counts(lambda: ours(input_ids=ids, labels=ids))
    assert counts["fused_linear_cross_entropy"] == 1 and counts["cross_entropy"] == 0
    # Sum over the items instead of the mean (what Trainer passes with gradient accumulation).
    n_items = torch.tensor(float((ids[:, 1:] != -100).sum()))
    torch.testing.assert_close(ours(input_ids=ids, labels=ids, num_items_in_batch=n_items).loss,
                               stock(input_ids=ids, labels=ids, num_items_in_batch=n_items).loss, rtol=1e-6, atol=1e-6)
    # Labels already shifted by the caller (shift_labels), some ignored.
    shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[..., 1:].clone()
    shift[0, :3] = -100
    torch.testing.assert_close(ours(input_ids=ids, labels=ids, shift_labels=shift).loss,
                               stock(input_ids=ids, labels=ids, shift_labels=shift).loss, rtol=1e-6, atol=1e-6)
    # Evaluation and calls without labels: the stock forward, logits included.
    stock.eval()
    ours.eval()
    with torch.no_grad():
        e_a, e_b = stock(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
        torch.testing.assert_close(e_b.logits, e_a.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(e_b.loss, e_a.loss, rtol=1e-6, atol=1e-6)
        ours.train()
        torch.testing.assert_close(ours(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_fused_loss_keeps_model_class_and_compiles():
    stock, ours, _ = _pair("llama", fused_loss=True)
    assert type(ours) is type(stock)  # save_pretrained records the class name
    ids = model_bench.batch("llama", "cpu", small=True)
    ours.train()
    eager = copy.deepcopy(ours)
    a = _step(eager, ids)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    b = _step(compiled, ids)
    assert b.logits is None
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-5)
    for (n, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
def test_ddp_and_fsdp2_on_cpu(tmp_path):
    """benchmarks/train_distributed.py on two CPU processes (gloo, tiny models): DDP (bf16
    parameters, and float32 under autocast) and FSDP2 (per-block fully_shard with a bf16
    MixedPrecisionPolicy) train the patched models without an error, with stock's loss at every
    step (to bf16's noise)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "dist.json"
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(root, "benchmarks", "train_distributed.py"), "--small", "--steps", "3", "--warmup", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 12 and not [r for r in rows if "error" in r], rows
    for r in rows:
        assert r["loss_dtype"] == "float32" and len(r["losses"]) == 4
        if r["variant"] == "ours":
            assert r["max_loss_diff_vs_stock"] < 2e-2, r


def _vlm(kind):
    """Tiny random-init vision-language models: Gemma 3 (its language model a gemma3_text family,
    a sliding layer and a global one), Qwen2-VL and Qwen2.5-VL (multimodal RoPE), LLaVA, Mistral 3
    and PaliGemma (Llama, Mistral and Gemma language models)."""
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=300)
    torch.manual_seed(0)
    if kind == "gemma3":
        cfg = transformers.Gemma3Config(
            text_config=dict(text, head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=4),
            vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               image_size=32, patch_size=8),
            mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298)
        return transformers.Gemma3ForConditionalGeneration(cfg).float()
    small_vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                        patch_size=8)
    if kind == "llava":  # Llama text, CLIP vision
        cfg = transformers.LlavaConfig(text_config=dict(text, model_type="llama"), image_token_index=299,
                                       vision_config=dict(small_vision, model_type="clip_vision_model"))
        return transformers.LlavaForConditionalGeneration(cfg).float()
    if kind == "mistral3":  # Mistral text, Pixtral vision
        cfg = transformers.Mistral3Config(text_config=dict(text, model_type="mistral", head_dim=16),
                                          vision_config=dict(small_vision, model_type="pixtral", head_dim=16),
                                          image_token_index=299)
        return transformers.Mistral3ForConditionalGeneration(cfg).float()
    if kind == "paligemma":  # Gemma text, SigLIP vision
        cfg = transformers.PaliGemmaConfig(text_config=dict(text, model_type="gemma", head_dim=16),
                                           vision_config=dict(small_vision, model_type="siglip_vision_model"),
                                           image_token_index=299)
        return transformers.PaliGemmaForConditionalGeneration(cfg).float()
    text = dict(text, bos_token_id=0, eos_token_id=0,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
    if kind == "qwen3_vl":  # Qwen3's q/k norms, interleaved multimodal RoPE, deepstack visual features
        cfg = transformers.Qwen3VLConfig(
            text_config=dict(text, head_dim=16, rope_parameters=dict(text["rope_parameters"], mrope_interleaved=True)),
            vision_config=dict(hidden_size=32, depth=1, num_heads=2, intermediate_size=64, out_hidden_size=64,
                               deepstack_visual_indexes=[0]))
        return transformers.Qwen3VLForConditionalGeneration(cfg).float()
    if kind == "qwen2_vl":
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=dict(
            embed_dim=32, depth=1, num_heads=2, hidden_size=64, mlp_ratio=2))
        return transformers.Qwen2VLForConditionalGeneration(cfg).float()
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
        hidden_size=32, depth=1, num_heads=2, intermediate_size=64, out_hidden_size=64))
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg).float()


VLMS = ["gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "mistral3", "paligemma"]


@pytest.mark.parametrize("kind", VLMS)
def test_vision_language_models(kind):
    """A VLM's language model is patched (norms, MLP, attention, embedding; Gemma 3's RoPE too), its
    vision tower stays on its own attention; logits, loss and every gradient as stock's (Gemma 3
    with an image in the prompt: bidirectional image tokens, their mask to SDPA)."""
    stock = _vlm(kind)
    ours = copy.deepcopy(stock)
    report = hf.patch(ours, rotary=True, fused_loss=True)
    assert report.swapped["model.language_model.norm"] == "rms_norm" and report.swapped["loss"].startswith("cross")
    assert "vision-language" in report.left["lm_head+loss"]
    assert ours.config.text_config._attn_implementation == hf.ATTENTION_NAME
    assert ours.config.vision_config._attn_implementation == stock.config.vision_config._attn_implementation
    ids = torch.randint(1, 250, (1, 16), generator=torch.Generator().manual_seed(3))
    kw = {}
    if kind == "gemma3":
        ids[0, 3], ids[0, 4:8], ids[0, 8] = 297, 299, 298  # <boi>, four image tokens, <eoi>
        kw = dict(pixel_values=torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4)),
                  token_type_ids=(ids == 299).long())
    a, b = _step(stock, ids, **kw), _step(ours, ids, **kw)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        if p.grad is not None or q.grad is not None:
            # relative to the tensor's scale: the image projector's gradients reach ~2e3
            err, scale = (q.grad - p.grad).abs().max().item(), p.grad.abs().max().item()
            assert err <= 1e-5 * scale + 1e-6, f"{n}: {err:.2e} (scale {scale:.2e})"
    counts = _op_counts(lambda: ours(input_ids=ids, labels=ids))
    assert counts["rms_norm"] >= 5 and counts["gated_act"] == 2 and counts["attention"] >= 1, counts
    assert counts["rotary"] == (0 if kind.startswith("qwen") else 2), counts


@pytest.mark.parametrize("kind", VLMS)
def test_vision_language_models_autocast_bf16(kind):
    """Float32 parameters under autocast bf16: loss and every gradient as close to the float32
    model as stock's."""
    ref = _vlm(kind)
    stock, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    hf.patch(ours, rotary=True)
    ids = torch.randint(1, 250, (2, 16), generator=torch.Generator().manual_seed(3))
    a = _step(ref, ids)
    b, c = _amp_step(stock, ids, "cpu", torch.bfloat16), _amp_step(ours, ids, "cpu", torch.bfloat16)
    assert c.loss.dtype == torch.float32
    assert abs(c.loss.item() - a.loss.item()) <= 2 * abs(b.loss.item() - a.loss.item()) + 2e-3
    err = lambda x, y: (x.float() - y.float()).abs().max().item()  # noqa: E731
    for (n, g0), g1, g2 in zip(_grads(ref).items(), _grads(stock).values(), _grads(ours).values()):
        if g0 is None:
            continue
        assert err(g2, g0) <= 2 * err(g1, g0) + 2e-2 * (g0.abs().max().item() + 1e-6), n


def test_gemma_report():
    """Gemma's scaled embedding runs our lookup times its scale (as its forward); its (1 + weight)
    norms run ours on float32 activations and stock on bf16 ones (stock forms 1 + w in float32)."""
    report = hf.patch(_decoder("gemma"))
    assert report.swapped["model.embed_tokens"].startswith("embedding (times its embed_scale")
    assert report.swapped["model.norm"] .startswith("rms_norm")
    half = _decoder("gemma").to(torch.bfloat16)
    report = hf.patch(half)
    assert "model.norm" not in report.swapped and "1 + weight" in report.left["model.norm"]
    assert "1 + weight" in report.left["model.layers.0.input_layernorm+self_attn.q_proj/k_proj/v_proj"]
    ids = model_bench.batch("llama", "cpu", small=True)
    assert _op_counts(lambda: half(input_ids=ids))["rms_norm"] == 0


@pytest.mark.parametrize("family", list(DECODER_FAMILIES))
def test_decoder_families_fused_loss_autocast_bf16(family):
    """fused_loss=True under autocast bf16 with float32 parameters: the fused head's GEMMs in bf16 (as
    stock's lm_head there), Gemma 2's cap and Granite's scaling inside; loss and every gradient as
    close to the float32 model as stock's."""
    ref = _decoder(family)
    stock, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    hf.patch(ours, fused_loss=True)
    ids = model_bench.batch("llama", "cpu", small=True)
    a = _step(ref, ids)
    b, c = _amp_step(stock, ids, "cpu", torch.bfloat16), _amp_step(ours, ids, "cpu", torch.bfloat16)
    assert c.logits is None and c.loss.dtype == b.loss.dtype == torch.float32
    err = lambda x, y: (x.float() - y.float()).abs().max().item()  # noqa: E731
    assert abs(c.loss.item() - a.loss.item()) <= 2 * abs(b.loss.item() - a.loss.item()) + 2e-3
    for (n, g0), g1, g2 in zip(_grads(ref).items(), _grads(stock).values(), _grads(ours).values()):
        if _routed(n):
            continue  # bf16 routing moves a few tokens to other experts (as in the test above)
        assert err(g2, g0) <= 2 * err(g1, g0) + 2e-2 * (g0.abs().max().item() + 1e-6), n


@pytest.mark.parametrize("family", ["mistral", "olmo2", "mixtral", "qwen2_moe"])
def test_recorded_outputs_as_stock(family):
    """output_hidden_states (and a MoE's router logits, output_router_logits) come back from a
    patched model as from stock: newer transformers find what a model records by its class's
    name, and patch swaps the base model's class."""
    stock = _decoder(family)
    ours = copy.deepcopy(stock)
    hf.patch(ours)
    ids = model_bench.batch("llama", "cpu", small=True)
    kw = dict(output_hidden_states=True)
    if "router_aux_loss_coef" in stock.config:
        kw["output_router_logits"] = True
    with torch.no_grad():
        a, b = stock(input_ids=ids, **kw), ours(input_ids=ids, **kw)
    assert a.hidden_states is not None and len(b.hidden_states) == len(a.hidden_states)
    for x, y in zip(b.hidden_states, a.hidden_states):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    if "output_router_logits" in kw:
        assert b.router_logits is not None and len(b.router_logits) == len(a.router_logits)
        for x, y in zip(b.router_logits, a.router_logits):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.aux_loss, a.aux_loss)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_loss_moe_router_loss(family):
    """With output_router_logits (the call's or the config's), a MoE's stock loss adds the router's
    load-balancing loss: the fused forward hands such calls to the stock forward, whose outputs
    (loss, aux_loss, logits) ours then equal -- or whose error ours raises too (some transformers
    versions fail there on the CPU: the router logits are not collected, the router loss is an int)."""
    stock = _decoder(family)
    ours = copy.deepcopy(stock)
    hf.patch(ours, fused_loss=True)
    ids = model_bench.batch("llama", "cpu", small=True)
    for kw, cfg in (({"output_router_logits": True}, False), ({}, True)):
        stock.config.output_router_logits = ours.config.output_router_logits = cfg
        try:
            a = _step(stock, ids, **kw)
        except Exception as e:  # noqa: BLE001 -- stock's own failure, which ours must share
            with pytest.raises(type(e), match=re.escape(str(e))):
                _step(ours, ids, **kw)
            continue
        b = _step(ours, ids, **kw)
        assert a.aux_loss is not None and b.logits is not None
        torch.testing.assert_close(b.aux_loss, a.aux_loss)
        torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-5)
    stock.config.output_router_logits = ours.config.output_router_logits = False
    b = _step(ours, ids)
    assert b.logits is None and b.aux_loss is None and type(b).__name__ == "MoeCausalLMOutputWithPast"


@pytest.mark.parametrize("cap", [30.0, 0.5], ids=["cap30", "cap0.5"])
def test_gemma2_soft_capping(cap):
    """Gemma 2 soft-caps attention logits and final logits: its attention stays the model's own,
    and fused_loss=True soft-caps inside the fused LM head + loss: loss and every gradient as
    stock's (a cap of 0.5 saturates most logits, so a missing or misplaced cap would show)."""
    stock = _decoder("gemma2")
    stock.config.final_logit_softcapping = cap
    ours = copy.deepcopy(stock)
    report = hf.patch(ours, fused_loss=True)
    assert "attn_logit_softcapping" in report.left["attention"]
    assert f"final_logit_softcapping={cap}" in report.swapped["lm_head+loss"]
    ids = model_bench.batch("llama", "cpu", small=True)
    a, b = _step(stock, ids), _step(ours, ids)
    assert b.logits is None
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_norm_fed_module_runs_the_norm(autocast):
    """A Llama attention patched with the norm before it deferred into it: self_attn(x) is stock's
    self_attn(input_layernorm(x)), run apart (float32) or fused over q/k/v's weights cast and
    concatenated (autocast); a fed Linear called on another input than the norm's is an error."""
    stock = model_bench.build("llama", "cpu", dtype=torch.float32, small=True)
    ours = copy.deepcopy(stock)
    hf.patch(ours)
    s, o = stock.model.layers[0], ours.model.layers[0]
    x = torch.randn(2, 5, s.self_attn.q_proj.in_features, requires_grad=True)
    pe = stock.model.rotary_emb(x, torch.arange(5)[None])
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        a = s.self_attn(s.input_layernorm(x), position_embeddings=pe, attention_mask=None)[0]
        run = lambda: o.self_attn(o.input_layernorm(x), position_embeddings=pe, attention_mask=None)[0]  # noqa: E731
        b = run()
        counts = _op_counts(run)
    assert counts["fused_rmsnorm_linear" if autocast else "rms_norm"] == 1, counts
    torch.testing.assert_close(b, a, rtol=0 if not autocast else 2e-2, atol=1e-6 if not autocast else 2e-2)
    (ga,) = torch.autograd.grad(a.float().square().sum(), x)
    (gb,) = torch.autograd.grad(b.float().square().sum(), x)
    torch.testing.assert_close(gb, ga, rtol=5e-2, atol=5e-2 * ga.abs().max().item())
    o.self_attn.k_proj._gp_feed = (x, b)
    try:
        with pytest.raises(RuntimeError, match="called on another input"):
            o.self_attn.k_proj(x.detach().clone())
    finally:
        o.self_attn.k_proj._gp_feed = None


def test_cast_cat_gradients():
    # cat into bf16 in one pass; the gradient comes back split and in each input's dtype.
    ts = [torch.randn(n, 6, dtype=torch.float32, requires_grad=True) for n in (3, 1, 2)]
    out = hf._cast_cat(torch.bfloat16, ts)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.cat(ts).to(torch.bfloat16))
    g = torch.randn(6, 6, dtype=torch.bfloat16)
    grads = torch.autograd.grad(out, ts, g)
    for gi, ref in zip(grads, g.split([3, 1, 2])):
        assert gi.dtype == torch.float32 and torch.equal(gi, ref.float())


def test_attention_refuses_soft_capping():
    # SDPA (the fallback) would ignore softcap: a call with it is an error, never a silent wrong answer.
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="soft-capping"):
        hf._attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)


def test_bench_gemma2_config():
    # gpu_puzzles.bench.model's Gemma 2 config, shrunk: eager attention (soft-capped) in both, the
    # patched model's loss and gradients as stock's in float32.
    stock, ours, report = _pair("gemma2")
    assert stock.config._attn_implementation == "eager" and "attention" in report.left
    ids = model_bench.batch("gemma2", "cpu", small=True)
    a, b = _step(stock, ids), _step(ours, ids)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(stock.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("order", ["lora_after_patch", "lora_before_patch"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
@pytest.mark.parametrize("name, targets", [("llama", ["q_proj", "v_proj"]), ("llama", ["gate_proj", "up_proj"]),
                                           ("gpt2", ["c_attn"])])
def test_lora_and_patch(name, targets, autocast, order):
    """PEFT's LoRA applied after patch() wraps Linears that a norm was fused into: the adapter must
    read the normalised input (the fusion steps aside); applied before, patch() takes the PEFT
    model and patches the model inside. Either way loss and the adapters' gradients are
    stock + LoRA's."""
    peft = pytest.importorskip("peft")
    base = model_bench.build(name, "cpu", dtype=torch.float32, small=True)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    stock = peft.get_peft_model(copy.deepcopy(base), cfg)
    if order == "lora_after_patch":
        ours = copy.deepcopy(base)
        hf.patch(ours)
        ours = peft.get_peft_model(ours, cfg)
    else:
        ours = peft.get_peft_model(copy.deepcopy(base), cfg)
        report = hf.patch(ours)
        assert report.swapped and "model" not in report.left, report
        assert hf.patch(ours).left["model"].startswith("already patched")
    ours.load_state_dict(stock.state_dict())
    ids = model_bench.batch(name, "cpu", small=True)
    losses = []
    for model in (stock, ours):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    tol = 2e-3 if autocast else 1e-6
    torch.testing.assert_close(losses[1], losses[0], rtol=tol, atol=tol)
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (stock, ours)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=5e-2 if autocast else 1e-4, atol=(5e-2 if autocast else 1e-5)
                                   * g.abs().max().item(), msg=lambda m: f"{n}: {m}")


def test_patch_through_a_data_parallel_wrapper():
    """A model already wrapped (DataParallel here, DDP alike: accelerate's prepare returns one) is
    patched inside; loss and gradients as stock's."""
    stock = model_bench.build("llama", "cpu", dtype=torch.float32, small=True)
    wrapped = torch.nn.DataParallel(copy.deepcopy(stock))
    report = hf.patch(wrapped)
    assert report.swapped and "model" not in report.left, report
    assert getattr(wrapped.module, "_gp_patched", None) is report
    ids = model_bench.batch("llama", "cpu", small=True)
    counts = _op_counts(lambda: _step(wrapped.module, ids))
    assert counts["attention"] > 0 and counts["rms_norm"] > 0, counts
    wrapped.zero_grad()
    a, b = _step(stock, ids), wrapped(input_ids=ids, labels=ids)
    b.loss.backward()
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(stock.named_parameters(), wrapped.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


def _assert_same_tokens_but_near_ties(stock, prompt, want, got):
    """Greedy tokens under autocast bf16: ours are stock's up to the first that differs in a row, and
    there the float32 model's logits of the two tokens are closer than stock's own bf16 logit error
    at that step (a near-tie, which bf16 rounding decides either way); later tokens follow from it."""
    for r in range(want.shape[0]):
        diff = (want[r, prompt:] != got[r, prompt:]).nonzero()
        if len(diff) == 0:
            continue
        p = prompt + diff[0].item()
        with torch.no_grad():
            ref = stock(input_ids=want[r:r + 1, :p]).logits[0, -1].float()
            with torch.autocast("cpu", torch.bfloat16):
                amp = stock(input_ids=want[r:r + 1, :p]).logits[0, -1].float()
        gap = (ref[want[r, p]] - ref[got[r, p]]).abs().item()
        noise = (amp - ref).abs().max().item()
        assert gap <= 2 * noise, (r, p, gap, noise, want, got)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
@pytest.mark.parametrize("name", FAMILIES + ["gemma3_text"])
def test_generate_matches_stock(name, autocast):
    """Greedy generation with the KV cache (prefill on our kernels, each decode step Sq = 1 handed to
    SDPA): the patched model's tokens are stock's, eager and under autocast (the fused q/k/v path)."""
    if name in FAMILIES:
        stock = model_bench.build(name, "cpu", dtype=torch.float32, small=True)
    else:
        stock = _decoder(name)
    stock.eval()
    ours = copy.deepcopy(stock)
    hf.patch(ours)
    ids = model_bench.batch("llama", "cpu", small=True)[:, :12]
    outs = []
    for model in (stock, ours):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            outs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                       do_sample=False, pad_token_id=0))
    assert outs[0].shape == (ids.shape[0], ids.shape[1] + 8)
    if autocast:
        _assert_same_tokens_but_near_ties(stock, ids.shape[1], outs[0], outs[1])
    else:
        assert torch.equal(outs[1], outs[0]), (outs[0], outs[1])
    with torch.no_grad():  # the prefill ran on our kernel (once a layer; Gemma 3's sliding layer on SDPA)
        counts = _op_counts(lambda: ours.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                  max_new_tokens=2, do_sample=False, pad_token_id=0))
    assert counts["attention"] == (1 if name == "gemma3_text" else 2), counts
