"""The benchmark harness (gpu_puzzles/bench/common.py): output bytes and the output ring
that keeps recent results alive so timed calls write fresh memory (CPU logic only)."""
import math

import pytest
import torch

from gpu_puzzles.bench import common
from gpu_puzzles.bench.common import OutputRing, output_bytes, time_ms


def test_output_bytes_nested_none_and_shared_storage():
    a = torch.zeros(10, dtype=torch.float32)
    b = torch.zeros(3, 4, dtype=torch.float64)
    assert output_bytes(None) == 0
    assert output_bytes(a) == 40
    assert output_bytes((a, None, [b, {"k": None}])) == 40 + 96
    # two views of one buffer keep 40 bytes alive, not 80
    assert output_bytes((a[:5], a[5:])) == 40
    assert output_bytes(((None,), ())) == 0


@pytest.mark.parametrize("per_call,want", [(0, 0), (-1, 0), (1000, 3), (999, 4), (3001, 1), (1, 256)])
def test_ring_size(per_call, want):
    # k results of together >= 3x L2 (here 1000 bytes), capped at 256; none for no output
    assert OutputRing(per_call, l2_bytes=1000).k == want


def test_ring_keeps_last_k_and_drops_older():
    ring = OutputRing(100, l2_bytes=100)  # k = 3
    assert ring.k == 3
    outs = [torch.full((4,), float(i)) for i in range(7)]
    for i, o in enumerate(outs):
        ring.keep((o, None))
        live = ring.live()
        expect = outs[max(0, i - 2):i + 1]
        assert [t[0].data_ptr() for t in live] == [o.data_ptr() for o in expect]
        assert all(not t[0].requires_grad for t in live)
    ring.clear()
    assert ring.live() == []


def test_ring_disabled_keeps_nothing():
    ring = OutputRing(0)
    ring.keep(torch.ones(3))
    assert ring.k == 0 and ring.live() == []


def test_ring_does_not_keep_autograd_graphs():
    x = torch.ones(5, requires_grad=True)
    ring = OutputRing(20, l2_bytes=20)
    ring.keep(x * 2)
    (kept,) = ring.live()[0]
    assert kept.grad_fn is None and not kept.requires_grad


def _recording_fn(ptrs, k):
    def fn(x):
        out = x + 1  # 1024 float32 = 4 KiB
        ptrs.append(out.data_ptr())  # an int: the history itself keeps nothing alive
        return out
    return fn


def test_time_ms_outputs_stay_alive(monkeypatch):
    # With a 4 KiB "L2" and 4 KiB outputs, k = 3: each call's output must not land on the
    # memory of the previous 3 results, which the ring keeps allocated.
    monkeypatch.setattr(common, "L2_BYTES", 4096)
    ptrs = []
    ms = time_ms(_recording_fn(ptrs, 3), [(torch.zeros(1024),)], torch.device("cpu"), warmup=2, rep=12,
                 keep_outputs=True)
    assert ms >= 0 and math.isfinite(ms)
    assert len(ptrs) == 4 + 12  # the warm-up fills the ring (k + 1 calls) before timing
    for i, p in enumerate(ptrs):
        assert p not in ptrs[max(0, i - 3):i], f"call {i} reused a kept result's memory"


def test_time_ms_default_no_ring_on_cpu():
    calls = []
    time_ms(lambda: calls.append(1) or torch.ones(4), [()], torch.device("cpu"), warmup=2, rep=3)
    assert len(calls) == 2 + 3  # no ring warm-up on the CPU by default


def test_time_ms_fn_returning_none(monkeypatch):
    monkeypatch.setattr(common, "L2_BYTES", 4096)
    assert time_ms(lambda: None, [()], torch.device("cpu"), warmup=1, rep=2, keep_outputs=True) >= 0


def test_run_case_rounds_start_one_implementation_later():
    # Each round starts one implementation later, so none always runs right after the same one;
    # every implementation still gets its calls in every round.
    order = []

    def impl(label):
        return lambda x: order.append(label) or x + 1

    case = common.Case("op", "case", "fwd", lambda: (torch.ones(4),), {k: impl(k) for k in "abc"})
    rows = common.run_case(case, torch.device("cpu"), 0.0, rep=6, warmup=1, rounds=3)
    assert [r["impl"] for r in rows] == ["a", "b", "c"] and all(r["ms"] >= 0 for r in rows)
    per_turn = len(order) // 9  # a turn: its warm-up (every input set once) and 6 // 3 timed calls
    assert per_turn >= 2 and len(order) == 9 * per_turn
    turns = [order[i:i + per_turn] for i in range(0, len(order), per_turn)]
    assert all(len(set(t)) == 1 for t in turns)
    firsts = [t[0] for t in turns]
    assert firsts == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_attention_bench_rows_take_turns(monkeypatch):
    from gpu_puzzles.bench import attention
    monkeypatch.setattr(attention, "_unfused_fits", lambda *a: False)  # asks the GPU for free memory
    cases = attention.bench_cases(torch.device("cuda"))  # builds no tensors: make() is lazy
    assert cases and all(c.rounds == attention.BENCH_ROUNDS and c.pooled for c in cases)


def test_tour_speed_rows_name_our_main_implementation():
    # The tour's "ours" column: the impl "ours", else "ours fused" (LayerNorm+Linear), never blank
    # when either ran; fwd+bwd rows are left to `python -m gpu_puzzles.bench`.
    from gpu_puzzles.__main__ import speed_rows
    rows = [{"op": "a", "case": "c", "direction": "fwd", "impl": "ours", "ms": 1.0, "GB/s": 10.0},
            {"op": "a", "case": "c", "direction": "fwd", "impl": "eager", "ms": 2.0},
            {"op": "a", "case": "c", "direction": "fwd+bwd", "impl": "ours", "ms": 3.0},
            {"op": "b", "case": "c", "direction": "fwd", "impl": "ours fused", "ms": 0.5},
            {"op": "b", "case": "c", "direction": "fwd", "impl": "ours unfused", "ms": 0.8},
            {"op": "b", "case": "c", "direction": "fwd", "impl": "compile", "ms": 0.6},
            {"op": "e", "case": "c", "direction": "fwd", "impl": "eager", "ms": 1.0}]
    got = speed_rows(rows)
    assert got == [("a", "c", "fwd", "1.0000", "2.0000", "-", "2.00x", "-", "10"),
                   ("b", "c fused", "fwd", "0.5000", "-", "0.6000", "-", "1.20x", "-"),
                   ("e", "c", "fwd", "-", "1.0000", "-", "-", "-", "-")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_time_ms_backlog_times_device_work_only():
    # A host-heavy call (2 ms of host sleep) around 0.5 ms of GPU work: with the backlog
    # the event pair brackets the GPU work only; without it, a call that finds the GPU idle
    # also times the host's 2 ms. The host's own time per call is reported apart.
    import time
    dev = torch.device("cuda")
    cycles = int(0.5 * common._sleep_cycles_per_ms(dev))

    def call():
        time.sleep(0.002)
        torch.cuda._sleep(cycles)

    host = {}
    ms = time_ms(call, [()], dev, warmup=2, rep=10, keep_outputs=False, host=host)
    assert 0.35 < ms < 0.9, ms
    assert host["ms_per_call"] >= 2.0
    assert time_ms(call, [()], dev, warmup=2, rep=10, keep_outputs=False, backlog=False) > 1.5


def test_layernorm_linear_cases_make_their_own_shapes():
    # Each case's inputs have the shape its name and byte count describe (the layer_norm
    # case once built its rows from the last shape of the list).
    from gpu_puzzles.bench.layernorm_linear import cases
    cs = cases(torch.device("cpu"), [(4, 8, 16), (6, 32, 8)], dtype=torch.float32, compile_=False,
               ln_alone=[(5, 16)])
    ln = [c for c in cs if c.op == "layer_norm"]
    assert len(ln) == 1 and ln[0].make()[0].shape == (5, 16)
    assert ln[0].bytes == 2 * 5 * 16 * 4
    for c in cs:
        if c.op == "layer_norm":
            continue
        x, W = c.make()[0], c.make()[3]
        assert x.shape == (c.params["M"], c.params["H"]) and W.shape == (c.params["N"], c.params["H"])


def test_cpu_bench_runs_every_case_per_thread_count(monkeypatch, tmp_path):
    # `python -m gpu_puzzles.bench --device cpu`: each case once per thread count, fwd and
    # fwd+bwd rows with a time each, the thread count in the row and in the case's name.
    import json

    from gpu_puzzles.bench import embedding
    from gpu_puzzles.bench.__main__ import main
    monkeypatch.setattr(embedding, "CPU_SHAPES", [(64, 50, 16)])
    out = tmp_path / "b.json"
    assert main(["embedding", "--device", "cpu", "--rep", "2", "--threads", "1,2", "--json", str(out)]) == 0
    meta = json.loads(out.read_text())
    assert "fastest" in meta["timing"]
    got = {(r["threads"], r["direction"], r["impl"]) for r in meta["rows"]}
    assert got == {(n, d, i) for n in (1, 2) for d in ("fwd", "fwd+bwd") for i in ("ours", "2d", "eager")}
    assert all(r["ms"] > 0 and r["case"].endswith(f"[{r['threads']} thr]") for r in meta["rows"])


# Kernel names as the H100 profiles of the compiled GPT-2 step recorded them
# (benchmarks/results/model_compile_profile_h100.json), and the group each belongs to.
@pytest.mark.parametrize("name, group", [
    ("void gpu_puzzles::(anonymous namespace)::attn_bwd_dkdv_mma<__nv_bfloat16, 64>(gpu_puzzles::", "ours: attention"),
    ("void gpu_puzzles::(anonymous namespace)::ln_bwd_cached<__nv_bfloat16, 8, 1, 4, true, false",
     "ours: norm(+linear)"),
    ("void gpu_puzzles::(anonymous namespace)::layernorm_linear_colsum<__nv_bfloat16, 8>(__nv_bf",
     "ours: norm(+linear)"),
    ("void gpu_puzzles::(anonymous namespace)::ce_bwd_kernel<__nv_bfloat16>(gpu_puzzles::CeBwdAr",
     "ours: cross_entropy"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1",
     "SDPA (cuDNN / flash)"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*", "SDPA (cuDNN / flash)"),
    ("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_TNT", "GEMM (cuBLAS / CUTLASS)"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x6_nt_align8>",
     "GEMM (cuBLAS / CUTLASS)"),
    ("triton_per_fused_add_native_layer_norm_native_layer_norm_backward_view_10", "inductor: norm"),
    ("triton_red_fused__log_softmax__log_softmax_backward_data__to_copy_add_arange_clone_eq_expand", "inductor: loss"),
    ("triton_poi_fused_add_mul_pow_tanh_tanh_backward_view_7", "inductor: other"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>", "copies and fills"),
    ("Memcpy DtoD (Device -> Device)", "copies and fills"),
    ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::func_wrapper_t", "reductions"),
])
def test_model_bench_kernel_groups(name, group):
    from gpu_puzzles.bench.model import kernel_group
    assert kernel_group(name) == group


def test_model_bench_breakdown_idle_row(capsys):
    # The per-op table ends with the timed step and the GPU's idle time: step minus kernels.
    from gpu_puzzles.bench.model import print_breakdown
    rows = [dict(model="gpt2", mode="compile", variant=v, ms=ms,
                 profile=dict(kernel_ms=k, launches=600, groups={"GEMM (cuBLAS / CUTLASS)": 9.0}))
            for v, ms, k in (("stock", 24.25, 22.0), ("ours", 25.5, 21.75))]
    print_breakdown(rows)
    lines = {ln.split("│")[1].strip(): ln.split("│")[2:4] for ln in capsys.readouterr().out.splitlines()
             if ln.count("│") == 4}
    assert [c.strip() for c in lines["GPU idle (step - kernels)"]] == ["2.250", "3.750"]
    assert [c.strip() for c in lines["step (timed median)"]] == ["24.250", "25.500"]


def test_model_bench_graphed_mode_step_matches_eager(capsys):
    # reduce-overhead's step (a new CUDA-graph iteration marked, the loss copied out of the graph's
    # memory) trains as the eager step does: same losses over three steps of a patched tiny GPT-2.
    # On the CPU no graph is captured; the step's code path is the one the GPU runs.
    import gpu_puzzles.hf as hf
    from gpu_puzzles.bench import model as mb
    losses = {}
    for mode in ("eager", "reduce-overhead"):
        m = mb.build("gpt2", "cpu", dtype=torch.float32, small=True)
        hf.patch(m)
        step = mb._step_fn(m, torch.optim.AdamW(m.parameters(), lr=1e-3), mb.batch("gpt2", "cpu", small=True), mode)
        losses[mode] = [step().item() for _ in range(3)]
    assert losses["eager"][2] < losses["eager"][0]
    assert losses["reduce-overhead"] == pytest.approx(losses["eager"], rel=1e-4)
    with pytest.raises(ValueError, match="mode must be one of"):
        mb.run_model_mode("gpt2", ["stock"], "cudagraphs", "cpu")
    with pytest.raises(SystemExit):
        mb.main(["--modes", "eager,fast"])
    assert "--modes: unknown ['fast']" in capsys.readouterr().err


def test_peak_memory_rows_fresh_args_per_implementation(monkeypatch):
    # Each implementation is measured on its own fresh inputs, and every row carries the
    # shared fields, its label and its peak (peak_extra_mib needs CUDA: stubbed here).
    made, seen = [], []
    monkeypatch.setattr(common, "peak_extra_mib", lambda fn, args, device: seen.append(args) or 1.5 * len(seen))

    def make():
        made.append((torch.randn(3),))
        return made[-1]

    rows = common.peak_memory_rows({"a": None, "b": None}, make, torch.device("cpu"), op="x", M=4)
    assert rows == [{"op": "x", "M": 4, "impl": "a", "peak_extra_MiB": 1.5},
                    {"op": "x", "M": 4, "impl": "b", "peak_extra_MiB": 3.0}]
    assert len(made) == 2 and seen[0] is made[0] and seen[1] is made[1]


# Demangled names of the attention forward kernels (as torch.profiler reports them) and their
# labels, the attention_fwd knob's values.
_NS = "gpu_puzzles::(anonymous namespace)::"


@pytest.mark.parametrize("name, label", [
    (f"void {_NS}attn_fwd_sm90<{_NS}Sm90FwdCfg<cutlass::bfloat16_t, 128, 128, 2>, cutlass::bfloat16_t>(...)", "wgmma"),
    (f"void {_NS}attn_fwd_sm90<{_NS}Sm90FwdCfg<cutlass::half_t, 128, 64, 3>, cutlass::half_t>(...)", "wgmma3"),
    (f"void {_NS}attn_fwd_ws_sm90<{_NS}WsFwdCfg<cutlass::bfloat16_t, 128, 128, 2, 2, false, false>, "
     f"cutlass::bfloat16_t, cute::Copy_Atom<cute::Copy_Traits<cute::SM90_TMA_LOAD>>>(...)", "ws"),
    (f"void {_NS}attn_fwd_ws_sm90<{_NS}WsFwdCfg<cutlass::half_t, 64, 128, 2, 2, true, false>, cutlass::half_t>(...)",
     "ws2"),
    (f"void {_NS}attn_fwd_ws_sm90<{_NS}WsFwdCfg<cutlass::bfloat16_t, 64, 128, 2, 2, true, true>, "
     f"cutlass::bfloat16_t>(...)", "ws3"),
    (f"void {_NS}attn_fwd_ws_sm90<{_NS}WsFwdCfg<cutlass::bfloat16_t, 64, 128, 2, 3, true, true>, "
     f"cutlass::bfloat16_t>(...)", "ws192"),
    (f"void {_NS}attn_fwd_mma_r32<__nv_bfloat16, 128>(...)", "mma_r32"),
    (f"void {_NS}attn_fwd_mma<__nv_bfloat16, 64, 8>(...)", "mma/w8"),
    (f"void {_NS}attn_fwd_simt<float, 64>(...)", "simt"),
    (f"void {_NS}attn_bwd_dq_mma<__nv_bfloat16, 64>(...)", None),
])
def test_attention_forward_kernel_labels(name, label):
    from gpu_puzzles.bench.attention import forward_kernel
    assert forward_kernel(name) == label
