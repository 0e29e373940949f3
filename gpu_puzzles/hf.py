"""Route a Hugging Face ``transformers`` model's compute through gpu_puzzles ops, in place.

    import gpu_puzzles.hf
    report = gpu_puzzles.hf.patch(model)          # everything it can take
    report = gpu_puzzles.hf.patch(model, attention=False)   # attention left to SDPA
    print(report)                                 # what was swapped, what was left and why

Modules are patched by swapping their class for a subclass whose ``forward`` calls our op
(``module.__class__ = ...``), so every Parameter stays the very same object: optimizer
state, tied weights (GPT-2's ``lm_head.weight is wte.weight``) and ``state_dict`` keys are
untouched, and a patched model loads a stock checkpoint and saves one stock can load.

Families and what they get:
- GPT-2 (``model_type`` "gpt2"): token and position embeddings (``embedding``); ln_1 + c_attn
  and ln_2 + c_fc (``fused_layernorm_linear``, Conv1D's ``weight.t()`` taken as a view);
  ln_f (``layer_norm``); attention; the LM loss.
- Llama-style decoders (``_DECODERS``, 37 ``model_type``s: Llama, Mistral, Qwen2-3, OLMo 2-3,
  Phi-3, Granite, GLM-4, Hunyuan, ERNIE 4.5, Gemma 1-3, StarCoder2 and more, their MoE variants
  (StarCoder2's, StableLM's and Phi's LayerNorms: ``layer_norm``); Gemma's ``1 + weight``
  norms on float32 activations, its soft-capped attention stock, its final-logit soft-cap inside the
  fused LM head + loss;
  mixture-of-experts MLPs stock):
  token embedding; every RMSNorm (``rms_norm``): the layers' norms, final, and Qwen3's and
  OLMo 2's q/k norms; Phi-3's norms fused into the qkv_proj and gate_up_proj after them
  (``fused_rmsnorm_linear``), and the other families' norm before q/k/v into them under
  autocast with float32 weights (one GEMM over the weights' cast copies, concatenated in the
  cast); the gated MLP's act(gate) * up (``gated_act``: SwiGLU, Gemma's GeGLU); RoPE on q and
  k (``rotary``, Phi-3's partial rotary too); attention (GQA);
  the LM loss.
- Vision-language models whose language model (``model.model.language_model``) is one of the
  above (Gemma 3, PaliGemma, LLaVA, Mistral 3, ...), or Qwen2-VL's / Qwen2.5-VL's / Qwen3-VL's
  (Qwen2's / Qwen3's layout, multimodal RoPE stock): that language model as its family, and the
  loss; the vision tower keeps its own attention.
Attention goes through transformers' attention registry (implementation name
``"gpu_puzzles"``, masks built as for SDPA): a call our kernel cannot express (a padding
mask, attention dropout while training, Sq != Sk) is handed to SDPA; a model that soft-caps
attention logits keeps its own attention.
With ``attention=False`` a model on SDPA stays on SDPA's kernels, under the registry name
``"gpu_puzzles_sdpa"`` with the same masks: a causal mask without padding goes to SDPA as
``is_causal``, also under torch.compile (stock then builds a (B, 1, S, S) mask).
The loss reads the logits in their dtype (no float32 copy) through ``cross_entropy`` and
comes back in float32, as stock's.

However the model trains, the patched modules follow it: bf16 (or fp16) parameters; float32
parameters under ``torch.autocast`` (Trainer(bf16=True), accelerate, Lightning's bf16-mixed),
where each op applies its PyTorch counterpart's autocast rule (csrc/common/autocast.h);
gradient checkpointing (reentrant or not); DDP and FSDP2. On the CPU too, in any dtype.

``fused_loss=True`` (opt-in): in training with labels, the LM head and the loss run as one
``fused_linear_cross_entropy``, so the (batch, seq, vocab) logits are never stored; the
output's ``logits`` is then None. Evaluation, and calls without labels, return the logits
as stock does.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .ops.attention import TC_HEAD_DIMS

ATTENTION_NAME = "gpu_puzzles"
SDPA_ATTENTION_NAME = "gpu_puzzles_sdpa"  # patch(attention=False): SDPA with our mask function
_GPT2 = ("gpt2",)


@dataclasses.dataclass(frozen=True)
class _Decoder:
    """A Llama-style decoder family (``model.model.layers[i]``, ``model.model.norm``,
    ``embed_tokens``, attention through transformers' interface) and where its RMSNorms sit."""

    layer_norms: tuple  # each decoder layer's norms
    attn_norms: tuple = ()  # norms inside ``self_attn`` (q/k norms)
    # (norm, module, linears): a layer norm whose only readers are these Linears of one module,
    # all called on the norm's output: fused into them (_NormFeeds)
    fuse: tuple = ()
    weight_offset: float = 0.0  # Gemma's RMSNorm scales by 1 + weight
    # Its apply_rotary_pos_emb: "half" (x * cos + rotate_half(x) * sin, partial rotary too), "half,
    # cast back" (the same, returned in q's and k's dtypes: OLMo 2/3) or None (another rule, e.g.
    # the interleaved tables of GLM and Helium: rotary stays stock).
    rope: Optional[str] = "half"
    mlp: str = "mlp"  # the layer's MLP (Granite MoE: block_sparse_moe)
    norm: str = "rms"  # its norms: "rms" (RMSNorm), or "layer" (nn.LayerNorm: layer_norm, not fused)
    final_norm: str = "norm"  # the decoder's last norm (Phi: final_layernorm)


_PRE = ("input_layernorm", "post_attention_layernorm")
# The norm before q/k/v fuses with them (under autocast, _fused_dtype): one GEMM for the GQA's
# narrow k/v and q. The MLP's gate/up stay apart: Llama-1B under autocast on an H200 stepped in
# 155.3 ms eager with q/k/v fused, 159.6 with gate/up fused too (the concatenation's copy, and
# the split's backward cat fused with SiLU's backward by inductor, cost more than they save).
_PRE_FUSE = (("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj")),)
_GATE_UP_FUSE = ("post_attention_layernorm", "mlp", ("gate_up_proj",))  # one Linear: fused in any dtype
_POST = ("post_attention_layernorm", "post_feedforward_layernorm")  # norms after attention and the MLP
_GEMMA2_NORMS = _PRE + ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# model_type -> its patch: every family gpu_puzzles.hf knows, in one place.
_DECODERS = {
    "llama": _Decoder(_PRE, fuse=_PRE_FUSE),
    "mistral": _Decoder(_PRE, fuse=_PRE_FUSE),
    "qwen2": _Decoder(_PRE, fuse=_PRE_FUSE),
    "qwen3": _Decoder(_PRE, ("q_norm", "k_norm"), fuse=_PRE_FUSE),  # per-head q/k RMSNorm before RoPE
    # Norms after attention and the MLP (and on q/k over all heads): none precedes a linear.
    "olmo2": _Decoder(_POST, ("q_norm", "k_norm"), rope="half, cast back"),
    "olmo3": _Decoder(_POST, ("q_norm", "k_norm"), rope="half, cast back"),
    "exaone4": _Decoder(_POST, ("q_norm", "k_norm")),
    # q/k/v and gate/up are one Linear each.
    "phi3": _Decoder(_PRE, fuse=(("input_layernorm", "self_attn", ("qkv_proj",)), _GATE_UP_FUSE)),
    # Llama's layout: Granite (its multipliers stay in the stock forwards), SmolLM3 (layers without
    # RoPE), Seed-OSS; Helium and ERNIE 4.5 with interleaved RoPE tables.
    "granite": _Decoder(_PRE, fuse=_PRE_FUSE),
    "smollm3": _Decoder(_PRE, fuse=_PRE_FUSE),
    "seed_oss": _Decoder(_PRE, fuse=_PRE_FUSE),
    "helium": _Decoder(_PRE, fuse=_PRE_FUSE, rope=None),
    "ernie4_5": _Decoder(_PRE, fuse=_PRE_FUSE, rope=None),
    # GLM: Phi-3's one gate_up projection, interleaved partial RoPE; GLM-4 adds norms after
    # attention and the MLP.
    "glm": _Decoder(_PRE, fuse=_PRE_FUSE + (_GATE_UP_FUSE,), rope=None),
    "glm4": _Decoder(_PRE + ("post_self_attn_layernorm", "post_mlp_layernorm"), fuse=_PRE_FUSE + (_GATE_UP_FUSE,),
                     rope=None),
    # Mixture-of-experts MLPs stay stock (the report says so); the rest as Llama's (Qwen3's q/k norms).
    "mixtral": _Decoder(_PRE, fuse=_PRE_FUSE),
    "qwen2_moe": _Decoder(_PRE, fuse=_PRE_FUSE),
    "qwen3_moe": _Decoder(_PRE, ("q_norm", "k_norm"), fuse=_PRE_FUSE),
    # Llama's layout: Ministral (sliding layers: SDPA), Arcee (its ReLU^2 MLP stays stock); Hunyuan's
    # per-head q/k norms under other names; OLMoE, Dots1, GLM-4.5 (q/k norms optional) and Granite MoE
    # (its MoE block under another name) with Qwen3-MoE's or Mixtral's layout; ERNIE 4.5 MoE's RoPE
    # interleaved; FlexOlmo as OLMo 2; Apertus's norms under other names (its xIELU MLP stays stock).
    "ministral": _Decoder(_PRE, fuse=_PRE_FUSE),
    "arcee": _Decoder(_PRE, fuse=_PRE_FUSE),
    "hunyuan_v1_dense": _Decoder(_PRE, ("query_layernorm", "key_layernorm"), fuse=_PRE_FUSE),
    "hunyuan_v1_moe": _Decoder(_PRE, ("query_layernorm", "key_layernorm"), fuse=_PRE_FUSE),
    "olmoe": _Decoder(_PRE, ("q_norm", "k_norm"), fuse=_PRE_FUSE),
    "dots1": _Decoder(_PRE, ("q_norm", "k_norm"), fuse=_PRE_FUSE),
    "glm4_moe": _Decoder(_PRE, ("q_norm", "k_norm"), fuse=_PRE_FUSE),
    "granitemoe": _Decoder(_PRE, fuse=_PRE_FUSE, mlp="block_sparse_moe"),
    "granitemoeshared": _Decoder(_PRE, fuse=_PRE_FUSE, mlp="block_sparse_moe"),
    "ernie4_5_moe": _Decoder(_PRE, fuse=_PRE_FUSE, rope=None),
    "flex_olmo": _Decoder(_POST, ("q_norm", "k_norm"), rope="half, cast back"),
    "apertus": _Decoder(("attention_layernorm", "feedforward_layernorm"), ("q_norm", "k_norm"),
                        fuse=(("attention_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj")),)),
    # LayerNorm decoders in Llama's layout (their norms layer_norm, not fused): StarCoder2 (a GELU
    # MLP, stock), StableLM (partial RoPE; its optional per-head q/k LayerNorms stay stock).
    "starcoder2": _Decoder(_PRE, norm="layer"),
    "stablelm": _Decoder(_PRE, norm="layer"),
    # Phi (1, 1.5, 2): one LayerNorm a layer, read by attention and the MLP in parallel.
    "phi": _Decoder(("input_layernorm",), norm="layer", final_norm="final_layernorm"),
    # (1 + weight) RMSNorm; its embedding scaled by sqrt(hidden) (its own module: stays stock).
    "gemma": _Decoder(_PRE, fuse=_PRE_FUSE, weight_offset=1.0),
    # Gemma 2 and 3: a norm after attention and around the MLP too; Gemma 3's q/k norms. Their
    # sliding-window layers' attention goes to SDPA (the mask), soft-capping stays stock (below).
    "gemma2": _Decoder(_GEMMA2_NORMS, fuse=_PRE_FUSE, weight_offset=1.0),
    "gemma3_text": _Decoder(_GEMMA2_NORMS, ("q_norm", "k_norm"), fuse=_PRE_FUSE, weight_offset=1.0),
    # VaultGemma: Gemma 2 with a norm before attention and one before the MLP only.
    "vaultgemma": _Decoder(("input_layernorm", "pre_feedforward_layernorm"), fuse=_PRE_FUSE, weight_offset=1.0),
}


# Vision-language models: the language model inside (``model.model.language_model``) is patched
# when its model_type is a family above or one of these; the vision tower stays stock.
_VLM_TEXT = {
    # Qwen2-VL / Qwen2.5-VL: Qwen2's layout; multimodal RoPE (3-D positions): rotary stays stock.
    "qwen2_vl_text": _Decoder(_PRE, fuse=_PRE_FUSE, rope=None),
    "qwen2_5_vl_text": _Decoder(_PRE, fuse=_PRE_FUSE, rope=None),
    "qwen3_vl_text": _Decoder(_PRE, ("q_norm", "k_norm"), fuse=_PRE_FUSE, rope=None),  # and Qwen3's q/k norms
}


def _vlm_text(model: nn.Module) -> Optional[tuple]:
    """(language model, its family) of a vision-language model gpu_puzzles knows, else None."""
    text = getattr(getattr(model, "model", None), "language_model", None)
    kind = getattr(getattr(text, "config", None), "model_type", None)
    family = _DECODERS.get(kind) or _VLM_TEXT.get(kind)
    if family is None or not hasattr(text, "layers") or not hasattr(model, "lm_head"):
        return None
    return text, family


@dataclasses.dataclass
class PatchReport:
    """``swapped``: module path -> the op it now runs; ``left``: what stays stock -> why."""
    model_type: str
    swapped: Dict[str, str] = dataclasses.field(default_factory=dict)
    left: Dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"gpu_puzzles.hf.patch({self.model_type}): {len(self.swapped)} swapped, {len(self.left)} left stock"]
        lines += [f"  {k}: {v}" for k, v in self.swapped.items()]
        lines += [f"  (stock) {k}: {v}" for k, v in self.left.items()]
        return "\n".join(lines)


# ---- patched module classes ------------------------------------------------------------
# Each subclasses the module it replaces, so isinstance checks and attributes keep working.

_SUBCLASSES: Dict[tuple, type] = {}


def _swap(module: nn.Module, mixin: type) -> None:
    base = type(module)
    key = (base, mixin)
    cls = _SUBCLASSES.get(key)
    if cls is None:
        name = f"GP{mixin.__name__.strip('_')}_{base.__module__.replace('.', '_')}_{base.__name__}"
        # Module-level and named, so a pickled patched model finds its class again.
        cls = type(name, (mixin, base), {"__module__": __name__, "_gp_base": base})
        globals()[name] = cls
        _SUBCLASSES[key] = cls
    module.__class__ = cls
    _register_outputs(module)


def _register_outputs(module: nn.Module) -> None:
    """Newer transformers find what a model records (hidden states, attentions, a MoE's router
    logits: ``output_hidden_states=True`` and the like) by its class's name, registered when the
    model is built: a swapped class is registered too, else those outputs would silently be
    missing (and a MoE's router loss an int)."""
    if not hasattr(module, "_can_record_outputs"):
        return
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # older transformers read the class attribute, which the subclass inherits
        return
    _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


class _Embedding:
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return ops.embedding(input, self.weight, padding_idx=self.padding_idx)


class _ScaledEmbedding:
    """Gemma's embedding: the lookup times sqrt(hidden) in the weight's dtype, as its forward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return ops.embedding(input, self.weight, padding_idx=self.padding_idx) * self.embed_scale.to(self.weight.dtype)


# Embeddings whose forward is the lookup times their embed_scale buffer (read from their source).
_SCALED_EMBEDDINGS = ("GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding")


class _LayerNorm:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, eps=self.eps)


def _rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's output: ``rms_norm`` where x and the weight share a dtype.
    transformers' RMSNorm returns weight * x_normed in the promoted dtype of the two, rms_norm
    x's: they agree when the dtypes do (under autocast too: no rule for either). A float32
    weight kept beside bf16 activations runs the stock module, and so does Gemma's ``1 + weight``
    scale on half activations (stock forms it in float32; in x's dtype it would round)."""
    if not _scale_ok(norm, x):
        return norm._gp_base.forward(norm, x)
    return ops.rms_norm(x, _norm_weight(norm), eps=_rms_eps(norm))


def _scale_ok(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether our kernels can apply ``norm``'s scale on x exactly as stock does."""
    offset = getattr(norm, "_gp_offset", 0.0)
    return x.dtype == norm.weight.dtype and (not offset or x.dtype in (torch.float32, torch.float64))


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """The scale of ``norm``: its weight, or Gemma's ``1 + weight`` (``_gp_offset``)."""
    offset = getattr(norm, "_gp_offset", 0.0)
    return norm.weight + offset if offset else norm.weight


class _RMSNorm:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(self, x)


class _Deferred:
    """A norm whose work moved into the module that consumes its output (``_NormFeeds``,
    ``_NormConv1D``): the block still calls it, and it hands its input on unchanged, while the
    modules the fusion spans are where patch() found them (``_intact``). Once one is replaced
    (PEFT's LoRA wraps q_proj, v_proj or c_attn after patch(): its adapter would read the input
    un-normalised), the norm runs here again and its readers run plain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _intact(self):
            return x
        return self._gp_alone(self, x)


def _intact(module: nn.Module) -> bool:
    """Whether every (parent, name, module) of the fusion ``module`` takes part in is in place."""
    return all(getattr(parent, name, None) is m for parent, name, m in module._gp_span)


def _set_span(span: tuple, *modules: nn.Module) -> None:
    for m in modules:
        object.__setattr__(m, "_gp_span", span)  # not registered: the modules would appear twice


class _NormFeeds:
    """A module (``self_attn``, ``mlp``) whose Linears ``_gp_linears`` all read the deferred
    RMSNorm ``_gp_norm`` of its input: it runs the norm itself, and where it can, the norm and
    the Linears as one ``fused_rmsnorm_linear`` over their weights concatenated (one GEMM, the
    normalised activation written once in the GEMM's dtype, one dX in the backward), whose
    column blocks it feeds to the Linears (``_Fed``) while its own forward runs."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not _intact(self):  # the deferred norm ran (_Deferred): its output came in
            return super().forward(*args, **kwargs)
        x = args[0] if args else kwargs["hidden_states"]
        norm, lins = self._gp_norm, self._gp_linears
        dt = _fused_dtype(x, norm, lins)
        if dt is None:
            xn = _rms(norm, x)
            args, kwargs = ((xn,) + args[1:], kwargs) if args else (args, {**kwargs, "hidden_states": xn})
            return super().forward(*args, **kwargs)
        w = lins[0].weight if len(lins) == 1 else _cast_cat(dt, [lin.weight for lin in lins])
        b = None
        if lins[0].bias is not None:
            b = lins[0].bias if len(lins) == 1 else _cast_cat(dt, [lin.bias for lin in lins])
        y = ops.fused_rmsnorm_linear(x, _norm_weight(norm), w, b, _rms_eps(norm))
        # One split (its backward one cat), not a slice per Linear (a full-size zero gradient each).
        parts = y.split([lin.out_features for lin in lins], -1) if len(lins) > 1 else (y,)
        for lin, part in zip(lins, parts):
            lin._gp_feed = (x, part)
        try:
            return super().forward(*args, **kwargs)
        finally:
            for lin in lins:
                lin._gp_feed = None


class _CastCat(torch.autograd.Function):
    """torch.cat of tensors into another dtype in one pass (cat's copy casts), as autocast's
    casts of each would; the gradient split and cast back to each input's dtype."""

    @staticmethod
    def forward(ctx: Any, dtype: torch.dtype, *ts: torch.Tensor) -> torch.Tensor:
        ctx.parts = [(t.shape[0], t.dtype) for t in ts]
        out = ts[0].new_empty((sum(t.shape[0] for t in ts),) + ts[0].shape[1:], dtype=dtype)
        return torch.cat(ts, out=out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grads = grad.split([n for n, _ in ctx.parts])
        return (None,) + tuple(g.to(dt) for g, (_, dt) in zip(grads, ctx.parts))


def _cast_cat(dtype: torch.dtype, ts: list) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.cat([t.to(dtype) for t in ts])  # inductor fuses the casts into the cat
    return _CastCat.apply(dtype, *ts)


def _fused_dtype(x: torch.Tensor, norm: nn.Module, lins: tuple) -> Optional[torch.dtype]:
    """The dtype of the fused GEMM's operands, or None where the norm and the Linears run apart.
    One Linear: fused wherever the op takes the dtypes (under autocast, as the op's autocast rule
    has it). Several: only under autocast with weights of another dtype, whose cast copies the
    concatenation replaces; in the weights' own dtype, concatenating would copy them every step."""
    dev = x.device.type
    if not _scale_ok(norm, x):
        return None
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev) and x.dtype != torch.float64:
        dt = torch.get_autocast_dtype(dev)
        if len(lins) == 1 or all(lin.weight.dtype != dt for lin in lins):
            return dt
        return None
    return x.dtype if len(lins) == 1 and lins[0].weight.dtype == x.dtype else None


class _Fed:
    """An nn.Linear of a ``_NormFeeds`` module: while that module fuses, its output is fed in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feed = self._gp_feed
        if feed is None:
            return super().forward(x)
        if feed[0] is not x:
            raise RuntimeError("gpu_puzzles.hf: a Linear fused with the RMSNorm before it was called on another "
                               "input than the norm's (the model's forward differs from the one patched)")
        return feed[1]


class _NormConv1D:
    """GPT-2's Conv1D (weight (in, out)) with the LayerNorm before it fused in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _intact(self):  # the deferred norm ran (_Deferred): its output came in
            return super().forward(x)
        ln = self._gp_norm
        return ops.fused_layernorm_linear(x, ln.weight, ln.bias, self.weight.t(), self.bias, eps=ln.eps)


def _gated_act_name(act: Any) -> Optional[str]:
    """gated_act's name for a transformers activation module, or None for one it does not take."""
    from transformers import activations as acts
    kind = type(act)
    if kind in (nn.SiLU, acts.SiLUActivation):
        return "silu"
    return {acts.GELUTanh: "gelu_tanh", acts.GELUActivation: "gelu"}.get(kind)


# (projections, activation attribute): Llama-style MLPs; Phi-3's one gate_up projection.
_GATED_MLPS = ((("gate_proj", "up_proj"), "act_fn"), (("gate_up_proj",), "activation_fn"))


class _GatedMLP:
    """A gated MLP, ``down(act(gate(x)) * up(x))`` (Phi-3: gate and up the halves of one
    projection), whose middle runs as one ``gated_act``. The projections are called as the
    module finds them (PEFT's LoRA may wrap them after patch()). Under torch.compile the
    product stays stock: inductor fuses it into one kernel each way, a little faster than ours
    (H200, Llama-3-8B's width: 0.165 / 0.176 ms forward, 0.276 / 0.293 backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gp_halves:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype != up.dtype or torch.compiler.is_compiling():
            return self.down_proj(getattr(self, self._gp_act_attr)(gate) * up)
        return self.down_proj(ops.gated_act(gate, up, self._gp_act))


def _patch_mlp(mlp: nn.Module, where: str, report: PatchReport) -> None:
    for projections, act_attr in _GATED_MLPS:
        if all(isinstance(getattr(mlp, n, None), nn.Module) for n in projections + ("down_proj",)):
            name = _gated_act_name(getattr(mlp, act_attr, None))
            if name is None:
                report.left[where] = (f"activation {type(getattr(mlp, act_attr, None)).__name__}: gated_act takes "
                                      "silu, gelu_tanh and gelu")
                return
            mlp._gp_halves, mlp._gp_act, mlp._gp_act_attr = len(projections) == 1, name, act_attr
            _swap(mlp, _GatedMLP)
            report.swapped[where] = f"gated_act ({name}; compiled: stock, fused by inductor)"
            return
    if hasattr(mlp, "experts"):
        report.left[where] = "mixture of experts: its router and experts run stock"
        return
    report.left[where] = "not a gated MLP gpu_puzzles knows (gate_proj/up_proj/down_proj or gate_up_proj/down_proj)"


# ---- rotary position embedding ---------------------------------------------------------
# transformers' attention forwards call their modeling module's apply_rotary_pos_emb by name.
# patch() replaces that function once per module with _rope_fn's wrapper, which runs our
# ``rotary`` only inside the forward of an attention module it patched (_Rotary counts them
# in, per thread): other models of the family in the process keep the stock function's path.

class _RopeDepth(threading.local):
    depth = 0


_ROPE = _RopeDepth()


class _Rotary:
    """An attention module whose RoPE runs ``rotary`` in eager. Under torch.compile it stays
    stock: inductor fuses it with its neighbours."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return super().forward(*args, **kwargs)
        _ROPE.depth += 1
        try:
            return super().forward(*args, **kwargs)
        finally:
            _ROPE.depth -= 1


def _rope_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotary`` takes these as the stock function would (dtypes it reads, no
    gradient to the tables); otherwise the stock function runs."""
    if q.dtype != k.dtype or cos.dtype != sin.dtype or not (q.device == k.device == cos.device == sin.device):
        return False
    if cos.dtype != q.dtype and not (cos.dtype == torch.float32 and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False
    return q.dim() <= 4 and k.dim() <= 4 and q.shape[-1] == k.shape[-1] and q.device.type in ("cpu", "cuda")


def _rope_fn(stock: Callable, cast_back: bool) -> Callable:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple:
        if torch.compiler.is_compiling() or not _ROPE.depth or not _rope_ok(q, k, cos, sin):
            return stock(q, k, cos, sin, unsqueeze_dim)
        oq, ok = ops.rotary(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
        return (oq.to(q.dtype), ok.to(k.dtype)) if cast_back else (oq, ok)

    apply_rotary_pos_emb._gp_stock = stock
    return apply_rotary_pos_emb


def _rope_module(stock: nn.Module, fn: Callable) -> nn.Module:
    """``fn`` as a fresh instance of ``stock``'s type with ``fn`` as its own forward. With the
    `kernels` package (a dependency of newer transformers) a modeling module's
    apply_rotary_pos_emb is such an nn.Module, and each model holds private copies that pickle by
    name: loading rebuilds one as ``type(<the modeling module's attribute>)()``. A plain function
    there made every pickled Llama-family model, stock or patched, fail to load in a patched
    process ("function() missing required argument"); a subclass carrying our forward would have
    given the rebuilt copies our forward, which calls the stock one, which dispatches to them."""
    new = type(stock)()
    new.forward = fn  # nn.Module.__call__ calls the instance's forward; the type's stays stock
    new._gp_stock = stock
    return new


def _patch_rotary(attn: nn.Module, where: str, family: _Decoder, report: PatchReport) -> None:
    import inspect
    import sys

    origin = next(c for c in type(attn).__mro__ if c.__module__ != __name__)
    mod = sys.modules.get(origin.__module__)
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    if fn is None:
        report.left[where] = f"no apply_rotary_pos_emb in {origin.__module__}"
        return
    if not hasattr(fn, "_gp_stock"):
        # With the `kernels` package installed, transformers wraps it in an nn.Module (hub kernels).
        if list(inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn).parameters) != [
                "q", "k", "cos", "sin", "unsqueeze_dim"]:
            report.left[where] = f"{origin.__module__}.apply_rotary_pos_emb has a signature rotary does not know"
            return
        new = _rope_fn(fn, family.rope == "half, cast back")
        mod.apply_rotary_pos_emb = _rope_module(fn, new) if isinstance(fn, nn.Module) else new
    _swap(attn, _Rotary)
    report.swapped[where] = "rotary (compiled: stock, fused by inductor)"


def _rms_eps(norm: nn.Module) -> Optional[float]:
    """The norm's eps; None (torch.nn.RMSNorm's default) is read by rms_norm as F.rms_norm does."""
    for name in ("variance_epsilon", "eps"):
        eps = getattr(norm, name, None)
        if eps is not None:
            return float(eps)
    return None


def _defer_into(norm: nn.Module, consumer: nn.Module, mixin: type, span: tuple, alone: Callable) -> None:
    """Moves ``norm``'s work into ``consumer`` (swapped to ``mixin``) while the modules of ``span``
    are in place; ``alone(norm, x)`` is the norm's own forward once they are not."""
    # The consumer refers to the norm without registering it as a child: registered twice,
    # its Parameters would appear twice in state_dict.
    object.__setattr__(consumer, "_gp_norm", norm)
    object.__setattr__(norm, "_gp_alone", alone)
    _set_span(span, norm, consumer)
    _swap(norm, _Deferred)
    _swap(consumer, mixin)


# ---- attention through the registry ----------------------------------------------------

def _kernels_take(query: torch.Tensor) -> bool:
    """Whether our fast kernels take this head dim: on CUDA, others (Gemma's 256) would run the
    portable SIMT kernels, and SDPA's flash kernels run those calls instead."""
    return not query.is_cuda or query.shape[-1] in TC_HEAD_DIMS


def _attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                       is_causal: Optional[bool] = None, **kwargs: Any) -> tuple:
    """transformers' attention interface: q (B, H, Sq, D), k/v (B, Hkv, Sk, D) -> ((B, Sq, H, D), None)."""
    if kwargs.get("softcap") is not None:
        # SDPA, the fallback, would ignore it; patch() leaves a soft-capping model's attention stock.
        raise NotImplementedError("gpu_puzzles.hf attention: soft-capping (softcap=...) is not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    fits = (attention_mask is None and dropout == 0.0
            and kwargs.get("position_bias") is None and query.shape[2] == key.shape[2]
            and query.shape[-1] == value.shape[-1])
    ours = fits and _kernels_take(query)
    if not ours:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool \
                and attention_mask.dim() == 4 and query.shape[2] == key.shape[2]:
            seq = _packed_ids(kwargs.get("position_ids"), query.shape[2])
            if seq is not None:  # a sliding window's or padding's mask: the sequences kept apart as well
                attention_mask = attention_mask & (seq[:, None, :, None] == seq[:, None, None, :])
        elif fits and causal:
            seq = _packed_ids(kwargs.get("position_ids"), query.shape[2])
            if seq is not None:  # packed rows without a mask: stock's packed mask
                return _sdpa_forward(module, query, key, value, _packed_causal_mask(seq), dropout=dropout,
                                     scaling=scaling, is_causal=False, **kwargs)
        return _sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)
    gqa = key.shape[1] != query.shape[1]
    if causal and torch.compiler.is_compiling():
        seq = _packed_ids(None, query.shape[2])
        if seq is not None:  # traced with position_ids given: stock's packed mask, to SDPA
            return _sdpa_forward(module, query, key, value, _packed_causal_mask(seq), dropout=dropout,
                                 scaling=scaling, is_causal=False, **kwargs)
    bounds = _packed_bounds(kwargs.get("position_ids"), query.shape[2]) if causal else None
    if bounds is not None:
        return _attention_per_sequence(query, key, value, bounds, scaling, gqa), None
    out = ops.attention(query, key, value, scale=scaling, causal=bool(causal), enable_gqa=gqa)
    # out has q's memory order: for q viewed out of a (B, S, H*D) projection this is a view.
    return out.transpose(1, 2), None


# ---- packed sequences ----------------------------------------------------------------
# Several sequences in one row (DataCollatorWithFlattening, TRL's padding_free): position_ids
# restart at each sequence and no attention mask is given. Stock builds a mask that keeps the
# sequences apart only without a KV cache (masking_utils skips the check when one exists,
# use_cache=True being the config default), and otherwise attends across them. The patched
# model applies stock's own check (masking_utils' find_packed_sequence_indices: one device
# sync; packed rows one more, for their bounds) once per forward (_PackedScope) and runs the
# attention calls that reach our kernel without a mask one sequence at a time. Without a
# cache, stock's mask sends them to SDPA (above), which keeps them apart as well.

# (position_ids, its version, per-row bounds) of the latest packed forwards, newest last. The
# references keep those tensors' memory from being reused, so a data pointer found here is
# the very tensor (or a view of it: gradient checkpointing's recompute detaches its inputs).
_PACKED: list = []
_PACKED_KEEP = 8


def _sequence_ids(position_ids: torch.Tensor, batch: int) -> Optional[torch.Tensor]:
    """Each token's sequence number (B, S) by stock's own rule (masking_utils), or None where no
    row holds two sequences (eager only: one sync; traced, always the ids)."""
    from transformers.masking_utils import find_packed_sequence_indices
    return find_packed_sequence_indices(position_ids.expand(batch, -1))


def _sequences(position_ids: torch.Tensor, batch: int) -> Optional[tuple]:
    """(per row [0, start of each later sequence..., S], the sequence ids on the device), or None."""
    ids = _sequence_ids(position_ids, batch)
    if ids is None:
        return None
    host = ids.cpu()
    S = host.shape[1]
    bounds = [[0] + [i + 1 for i in (row[1:] != row[:-1]).nonzero().flatten().tolist()] + [S] for row in host]
    return bounds, ids


def _packed(position_ids: Optional[torch.Tensor], S: int) -> Optional[tuple]:
    if position_ids is None or not _PACKED or torch.compiler.is_compiling():
        return None
    for t, version, found in reversed(_PACKED):
        if t.data_ptr() == position_ids.data_ptr() and t.shape[-1] == position_ids.shape[-1] == S and \
                position_ids._version == version:
            return found
    return None


def _packed_bounds(position_ids: Optional[torch.Tensor], S: int) -> Optional[list]:
    found = _packed(position_ids, S)
    return None if found is None else found[0]


def _packed_ids(position_ids: Optional[torch.Tensor], S: int) -> Optional[torch.Tensor]:
    if torch.compiler.is_compiling():
        seq = _TRACED_SEQ[0]
        return seq if seq is not None and seq.shape[-1] == S else None
    found = _packed(position_ids, S)
    return None if found is None else found[1]


def _packed_causal_mask(seq: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) bool: causal within each packed sequence, from the sequence ids (B, S)."""
    S = seq.shape[-1]
    tril = torch.ones(S, S, dtype=torch.bool, device=seq.device).tril()
    return tril & (seq[:, None, :, None] == seq[:, None, None, :])


def _attention_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list,
                            scale: Optional[float], gqa: bool) -> torch.Tensor:
    """Causal attention within each packed sequence: our kernel per sequence (a varlen kernel
    is the fast path still to come)."""
    rows = []
    for b, cuts in enumerate(bounds):
        parts = [ops.attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], scale=scale,
                               causal=True, enable_gqa=gqa) for s, e in zip(cuts[:-1], cuts[1:])]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)).transpose(1, 2)


class _PackedScope:
    """A decoder's base model (``model.model``): finds packed rows in the position_ids it is
    given, where stock would look for them (no attention mask, nothing in the cache yet)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        pos = kwargs.get("position_ids")
        if pos is not None and kwargs.get("attention_mask") is None and len(args) <= 1 and pos.dim() == 2 \
                and pos.shape[-1] > 1:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            ref = args[0] if args else kwargs.get("input_ids")
            ref = ref if ref is not None else kwargs.get("inputs_embeds")
            if cache is None and ref is not None and torch.compiler.is_compiling():
                # Traced, no sync: every call given position_ids gets their sequence ids (the
                # attention then runs SDPA with stock's packed mask, as stock's traced model does).
                _TRACED_SEQ[0] = _sequence_ids(pos, ref.shape[0])
                try:
                    return super().forward(*args, **kwargs)
                finally:
                    _TRACED_SEQ[0] = None
            if (cache is None or cache.get_seq_length() == 0) and ref is not None:
                found = _sequences(pos, ref.shape[0])
                if found is not None:
                    _PACKED.append((pos, pos._version, found))
                    del _PACKED[:-_PACKED_KEEP]
        return super().forward(*args, **kwargs)


# The sequence ids while a traced base model's forward runs (a list: dynamo graph-breaks on a
# dict mutated before transformers' signature binding reads a mappingproxy).
_TRACED_SEQ: list = [None]


# transformers' SDPA attention and mask, the fallbacks: looked up once, when the registry entry is made.
_sdpa_forward = None
_sdpa_mask = None
_sdpa_mask_signature = None
_causal_mask_function = None


def _mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """SDPA's mask, except that a plain causal mask without padding is None (our kernel's
    ``causal=True``) under torch.compile too: ``sdpa_mask`` cannot tell, while tracing, that
    no padding mask was given, so it builds the (B, 1, S, S) mask and attention goes to SDPA."""
    a = _sdpa_mask_signature.bind(*args, **kwargs)
    a.apply_defaults()
    a = a.arguments
    q_len, kv_len, q_off = a.get("q_length"), a.get("kv_length"), a.get("q_offset", 0)
    if (a.get("attention_mask") is None and a.get("local_size") is None
            and a.get("mask_function") is _causal_mask_function and a.get("allow_is_causal_skip", False)
            and isinstance(q_len, int) and q_len == kv_len and isinstance(q_off, int) and q_off == 0
            and a.get("kv_offset", 0) == 0):
        return None
    return _sdpa_mask(*args, **kwargs)


def _register_attention() -> None:
    global _sdpa_forward, _sdpa_mask, _sdpa_mask_signature, _causal_mask_function
    import inspect

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
    _sdpa_forward, _sdpa_mask, _causal_mask_function = sdpa_attention_forward, sdpa_mask, causal_mask_function
    _sdpa_mask_signature = inspect.signature(sdpa_mask)
    AttentionInterface.register(ATTENTION_NAME, _attention_forward)
    # Masks as for SDPA (None when causal without padding): without a registered mask
    # function transformers would pass no mask at all, and a padding mask would be lost.
    AttentionMaskInterface.register(ATTENTION_NAME, _mask)
    AttentionInterface.register(SDPA_ATTENTION_NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(SDPA_ATTENTION_NAME, _mask)


def _set_sdpa_mask(model: nn.Module, report: "PatchReport") -> None:
    """attention=False: SDPA's kernels as stock, under a registry entry whose mask is ``_mask``,
    so that a causal mask without padding reaches SDPA as ``is_causal`` under torch.compile
    too (traced, stock builds the (B, 1, S, S) mask: SDPA then takes a masked kernel, and for
    GQA transformers repeats k and v). Only a model on stock SDPA is moved."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        report.left["attention"] = "attention=False, and the model does not run transformers' SDPA attention"
        return
    _use_attention(model, SDPA_ATTENTION_NAME)
    report.left["attention"] = (f"attention=False: SDPA (registry '{SDPA_ATTENTION_NAME}': a causal mask without "
                                "padding is passed as is_causal, also under torch.compile)")


def _use_attention(model: nn.Module, name: str) -> None:
    """Registers our entries and switches the model to the one called ``name``."""
    _register_attention()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers
        model.config._attn_implementation = name


def _head_dim(config: Any) -> Optional[int]:
    d = getattr(config, "head_dim", None)
    if d is None and getattr(config, "num_attention_heads", None):
        d = getattr(config, "hidden_size", 0) // config.num_attention_heads
    return d


def _set_attention(model: nn.Module, report: "PatchReport", dropout_attr: str, note: str) -> None:
    _use_attention(model, ATTENTION_NAME)
    # What _attention_forward hands to SDPA, call by call.
    report.swapped["attention"] = (f"attention (registry '{ATTENTION_NAME}'{note}); SDPA runs calls with a padding "
                                   "mask or Sq != Sk (generation with a KV cache)")
    d = _head_dim(model.config)
    if d is not None and d not in TC_HEAD_DIMS:
        report.swapped["attention"] += (f"; on CUDA SDPA runs every call: head_dim {d} (our tensor-core kernels take "
                                        f"{' and '.join(map(str, TC_HEAD_DIMS))})")
    p = getattr(model.config, dropout_attr, 0.0)
    if p:
        report.left["attention while training"] = (f"{dropout_attr}={p}: dropout in attention is not supported "
                                                   "(SDPA runs it)")


# ---- the loss ------------------------------------------------------------------------

def _causal_loss(loss_of: Callable[[torch.Tensor, str], torch.Tensor], labels: Optional[torch.Tensor],
                 shift_labels: Optional[torch.Tensor], num_items_in_batch: Optional[Any], ignore_index: int,
                 device: torch.device) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` around ``loss_of(targets, reduction)``: the labels
    shifted one to the left (unless given shifted), the mean, or the sum over
    ``num_items_in_batch`` (gradient accumulation)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(device)
    if num_items_in_batch is None:
        return loss_of(targets, "mean")
    loss = loss_of(targets, "sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _loss_dtype(t: torch.Tensor) -> torch.dtype:
    """Stock's loss dtype: ``ForCausalLMLoss`` upcasts the logits to float32 first."""
    return torch.promote_types(t.dtype, torch.float32)


def causal_lm_loss(logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int,
                   num_items_in_batch: Optional[Any] = None, ignore_index: int = -100,
                   shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on ``cross_entropy``: the logits are read in their
    dtype (stock upcasts the whole (B, S, V) tensor to float32 first), fp32 math inside, and
    the loss comes back in float32, as stock's."""
    logits = logits.reshape(-1, vocab_size)
    dt = _loss_dtype(logits)
    return _causal_loss(lambda t, r: ops.cross_entropy(logits, t, ignore_index=ignore_index, reduction=r,
                                                       loss_dtype=dt),
                        labels, shift_labels, num_items_in_batch, ignore_index, logits.device)


def _fused_lm_loss(hidden: torch.Tensor, lm_head: nn.Linear, labels: Optional[torch.Tensor],
                   shift_labels: Optional[torch.Tensor] = None, num_items_in_batch: Optional[Any] = None,
                   ignore_index: int = -100, softcap: Optional[float] = None,
                   logits_scaling: Optional[float] = None) -> torch.Tensor:
    """``causal_lm_loss(lm_head(hidden), labels)`` through ``fused_linear_cross_entropy``;
    ``softcap``: the logits soft-capped first (Gemma 2's ``final_logit_softcapping``);
    ``logits_scaling``: the logits divided by it first (Granite's), as the hidden state is:
    the head is linear."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if logits_scaling is not None:
        h = h / logits_scaling
    bias = getattr(lm_head, "bias", None)
    dt = _loss_dtype(h)
    return _causal_loss(lambda t, r: ops.fused_linear_cross_entropy(h, lm_head.weight, t, bias,
                                                                    ignore_index=ignore_index, reduction=r,
                                                                    loss_dtype=dt, softcap=softcap),
                        labels, shift_labels, num_items_in_batch, ignore_index, hidden.device)


def _head_transform(config: Any) -> tuple:
    """What a family's forward does to the LM head's logits before the loss: (final-logit
    soft-cap, divisor), each None where it does nothing (Gemma 2's cap; Granite's scaling)."""
    scaling = getattr(config, "logits_scaling", None)
    return getattr(config, "final_logit_softcapping", None), None if scaling in (None, 1) else scaling


def _fused_loss_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A causal LM's forward (set on the instance by ``patch(fused_loss=True)``): in training
    with labels, the base model, then the LM head and the loss fused; otherwise the stock
    forward, also where the stock loss adds a mixture of experts' router loss
    (``output_router_logits``). Arguments are named as the stock forward names them
    (``_gp_forward_params``)."""
    bound = dict(zip(self._gp_forward_params, args))
    bound.update(kwargs)
    labels, keep = bound.get("labels"), bound.get("logits_to_keep", 0)
    router = bound.get("output_router_logits")
    if router is None:
        router = getattr(self.config, "output_router_logits", False)
    if (labels is None or not self.training or not (isinstance(keep, int) and keep == 0)
            or bound.get("return_dict") is False or router):
        return type(self).forward(self, *args, **kwargs)
    # The stock forward hands the base model every argument but these two (loss kwargs too).
    inner = {k: v for k, v in bound.items() if k not in ("labels", "logits_to_keep")}
    out = getattr(self, self.base_model_prefix)(**inner)
    loss = _fused_lm_loss(out.last_hidden_state, self.lm_head, labels, bound.get("shift_labels"),
                          bound.get("num_items_in_batch"), bound.get("ignore_index", -100),
                          *_head_transform(self.config))
    # The base model's outputs under the output class's names (the cache is `past_key_values`
    # or, in newer transformers, `cache`; a MoE's router_logits); no logits, no router loss.
    fields = dict(loss=loss, logits=None)
    for name in self._gp_output_cls.__dataclass_fields__:
        if name not in fields and name != "aux_loss":
            fields[name] = getattr(out, name, None)
    return self._gp_output_cls(**fields)


def _set_fused_loss(model: nn.Module, report: PatchReport, output_cls: type) -> None:
    import inspect
    if not hasattr(model, "lm_head") or not isinstance(model.lm_head, nn.Linear):
        report.left["lm_head+loss"] = "no nn.Linear LM head (not a *ForCausalLM model)"
        return
    params = inspect.signature(type(model).forward).parameters.values()
    names = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)[1:]  # not self
    object.__setattr__(model, "_gp_forward_params", names)
    object.__setattr__(model, "_gp_output_cls", output_cls)
    # On the instance, not by a class swap: save_pretrained records the class name.
    object.__setattr__(model, "forward", _fused_loss_forward.__get__(model))
    notes = ["training with labels: the logits are never stored, outputs.logits is None"]
    cap, scaling = _head_transform(model.config)
    if cap is not None:
        notes.append(f"final_logit_softcapping={cap} inside the op")
    if scaling is not None:
        notes.append(f"logits_scaling={scaling} applied to the hidden state")
    if hasattr(model.config, "router_aux_loss_coef"):
        notes.append("the stock forward with output_router_logits, whose router loss it adds")
    report.swapped["lm_head+loss"] = f"fused_linear_cross_entropy ({'; '.join(notes)})"


# ---- the families --------------------------------------------------------------------

def _embedding_ok(emb: nn.Module) -> Optional[str]:
    if not isinstance(emb, nn.Embedding):
        return f"not an nn.Embedding ({type(emb).__name__})"
    if type(emb).forward is not nn.Embedding.forward and not _scaled(emb):
        return f"{type(emb).__name__} computes more than nn.Embedding's lookup: stock"
    if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
        return "max_norm / scale_grad_by_freq / sparse are not supported by gpu_puzzles.embedding"
    return None


def _scaled(emb: nn.Module) -> bool:
    return type(emb).__name__ in _SCALED_EMBEDDINGS and isinstance(getattr(emb, "embed_scale", None), torch.Tensor)


def _patch_embedding(emb: nn.Module, name: str, report: PatchReport) -> None:
    why = _embedding_ok(emb)
    if why:
        report.left[name] = why
    elif _scaled(emb):
        _swap(emb, _ScaledEmbedding)
        report.swapped[name] = "embedding (times its embed_scale, as stock)"
    else:
        _swap(emb, _Embedding)
        report.swapped[name] = "embedding"


def _patch_gpt2(model: nn.Module, report: PatchReport, embeddings: bool, norms: bool, attention: bool, loss: bool,
                fused_loss: bool) -> None:
    from transformers.pytorch_utils import Conv1D
    base = getattr(model, "transformer", model)
    if embeddings:
        _patch_embedding(base.wte, "transformer.wte", report)
        _patch_embedding(base.wpe, "transformer.wpe", report)
    if norms:
        for i, block in enumerate(base.h):
            for ln_name, lin_owner, lin_name in (("ln_1", block.attn, "c_attn"), ("ln_2", block.mlp, "c_fc")):
                ln, lin = getattr(block, ln_name), getattr(lin_owner, lin_name)
                where = f"transformer.h.{i}.{ln_name}+{'attn' if lin_name == 'c_attn' else 'mlp'}.{lin_name}"
                if type(ln) is not nn.LayerNorm or ln.weight is None or ln.bias is None or type(lin) is not Conv1D:
                    report.left[where] = "not an affine nn.LayerNorm followed by a Conv1D"
                    continue
                owner_name = "attn" if lin_name == "c_attn" else "mlp"
                _defer_into(ln, lin, _NormConv1D, ((block, owner_name, lin_owner), (lin_owner, lin_name, lin)),
                            _LayerNorm.forward)
                report.swapped[where] = "fused_layernorm_linear"
        if type(base.ln_f) is nn.LayerNorm and base.ln_f.weight is not None and base.ln_f.bias is not None:
            _swap(base.ln_f, _LayerNorm)
            report.swapped["transformer.ln_f"] = "layer_norm"
        else:
            report.left["transformer.ln_f"] = "not an affine nn.LayerNorm"
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
    _patch_attention_and_loss(model, report, attention, loss, fused_loss, "attn_pdrop", "",
                              CausalLMOutputWithCrossAttentions)
    _scope_packed(base, report)


def _scope_packed(base: nn.Module, report: PatchReport) -> None:
    """Where our attention runs: packed rows found once per forward of the base model."""
    if report.swapped.get("attention", "").startswith("attention"):
        _swap(base, _PackedScope)
        report.swapped["attention"] += "; packed rows (position_ids restarting, no mask) one sequence at a time"


def _half_offset(family: _Decoder, act: Optional[torch.Tensor]) -> Optional[str]:
    """Why a family's norms run stock on these activations, if they do (``_scale_ok``)."""
    if family.weight_offset and isinstance(act, torch.Tensor) and act.dtype in (torch.float16, torch.bfloat16):
        return (f"1 + weight scale beside {act.dtype} activations: stock forms it in float32, so the stock "
                "RMSNorm runs")
    return None


def _fuse_norms(layer: nn.Module, prefix: str, family: _Decoder, act: Optional[torch.Tensor],
                report: PatchReport) -> set:
    """The family's norm + Linears groups of one layer, fused where they can be (an RMSNorm with
    a 1-D weight, plain nn.Linears, biases on all or none); the names of the norms fused."""
    fused = set()
    for norm_name, owner_name, lin_names in family.fuse:
        norm, owner = getattr(layer, norm_name), getattr(layer, owner_name)
        lins = tuple(getattr(owner, n, None) for n in lin_names)
        w = getattr(norm, "weight", None)
        if (not isinstance(w, torch.Tensor) or w.dim() != 1 or any(type(lin) is not nn.Linear for lin in lins)
                or len({lin.bias is None for lin in lins}) != 1):
            continue  # the norm runs alone (rms_norm), the Linears stock
        norm._gp_offset = family.weight_offset
        object.__setattr__(owner, "_gp_linears", lins)
        for lin in lins:
            lin._gp_feed = None
            _swap(lin, _Fed)
        span = ((layer, owner_name, owner),) + tuple((owner, n, lin) for n, lin in zip(lin_names, lins))
        _defer_into(norm, owner, _NormFeeds, span, _rms)
        where = f"{prefix}.{norm_name}+{owner_name}.{'/'.join(lin_names)}"
        fused.add(norm_name)
        why = _half_offset(family, act)
        if why:
            report.left[where] = why
            continue
        report.swapped[where] = ("fused_rmsnorm_linear" if len(lins) == 1 else
                                 "rms_norm (under autocast with weights of another dtype: fused_rmsnorm_linear "
                                 "over the weights' cast copies concatenated; in their own dtype concatenating "
                                 "would copy them every step)")
    return fused


def _patch_decoder(model: nn.Module, report: PatchReport, family: _Decoder, embeddings: bool, norms: bool,
                   attention: bool, loss: bool, fused_loss: bool, mlp: bool, rotary: bool,
                   base: Optional[nn.Module] = None, prefix: str = "model") -> None:
    """``base``: the decoder (``model.model``, or a VLM's ``model.model.language_model`` at
    ``prefix``); ``model``: what holds the LM head and the loss."""
    vlm = base is not None
    base = base if vlm else getattr(model, "model", model)
    if embeddings:
        _patch_embedding(base.embed_tokens, f"{prefix}.embed_tokens", report)
    if rotary and family.rope is None:
        report.left["rotary"] = (f"{report.model_type}'s RoPE is not rotate_half's (interleaved or multimodal "
                                 "tables): stock")
    elif rotary:
        for i, layer in enumerate(base.layers):
            _patch_rotary(layer.self_attn, f"{prefix}.layers.{i}.self_attn.rotary", family, report)
    if mlp:  # before the norms: a norm fused into the MLP (Phi-3) wraps this swap (_NormFeeds)
        for i, layer in enumerate(base.layers):
            _patch_mlp(getattr(layer, family.mlp), f"{prefix}.layers.{i}.{family.mlp}", report)
    if norms:
        act = getattr(getattr(base, "embed_tokens", None), "weight", None)  # the activations' dtype
        norms_found = []
        for i, layer in enumerate(base.layers):
            fused = _fuse_norms(layer, f"{prefix}.layers.{i}", family, act, report)
            norms_found += [(f"{prefix}.layers.{i}.{n}", getattr(layer, n)) for n in family.layer_norms
                            if n not in fused]
            norms_found += [(f"{prefix}.layers.{i}.self_attn.{n}", getattr(layer.self_attn, n))
                            for n in family.attn_norms if hasattr(layer.self_attn, n)]  # GLM-4.5's are optional
        norms_found.append((f"{prefix}.{family.final_norm}", getattr(base, family.final_norm)))
        for where, norm in norms_found:
            if norm is None:  # StableLM's parallel blocks have no norm after attention
                continue
            if family.norm == "layer":
                if type(norm) is not nn.LayerNorm or norm.weight is None or norm.weight.dim() != 1:
                    report.left[where] = "not an nn.LayerNorm over the last dim with a weight"
                    continue
                _swap(norm, _LayerNorm)
                report.swapped[where] = "layer_norm"
                continue
            w = getattr(norm, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1:
                report.left[where] = "no 1-D weight: not an RMSNorm gpu_puzzles knows"
                continue
            norm._gp_offset = family.weight_offset
            _swap(norm, _RMSNorm)
            why = _half_offset(family, act)
            if why:
                report.left[where] = why
            elif isinstance(act, torch.Tensor) and act.dtype != w.dtype:
                # _rms runs stock for such a pair; it takes rms_norm once they agree.
                report.left[where] = (f"weight {w.dtype} beside {act.dtype} activations: transformers returns the "
                                      "promoted dtype, rms_norm x's, so the stock RMSNorm runs")
            else:
                report.swapped[where] = "rms_norm"
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    if vlm and loss and fused_loss:
        report.left["lm_head+loss"] = "vision-language model: the fused LM head + loss is not wired to its forward"
        fused_loss = False
    output_cls = MoeCausalLMOutputWithPast if hasattr(model.config, "router_aux_loss_coef") else CausalLMOutputWithPast
    _patch_attention_and_loss(model, report, attention, loss, fused_loss, "attention_dropout", ", GQA",
                              output_cls, attn_model=base if vlm else None)
    _scope_packed(base, report)


def _patch_attention_and_loss(model: nn.Module, report: PatchReport, attention: bool, loss: bool, fused_loss: bool,
                              dropout_attr: str, note: str, output_cls: type,
                              attn_model: Optional[nn.Module] = None) -> None:
    """What every family shares: attention through the registry (or SDPA's kernels with our mask),
    the loss, and with ``fused_loss`` the LM head fused with it (``output_cls``: the model's output).
    ``attn_model``: whose attention is switched (a VLM's language model: its vision tower keeps its own)."""
    loss_model, model = model, attn_model if attn_model is not None else model
    config = getattr(model, "config", None)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        # Neither our kernels nor SDPA soft-cap: the model keeps its own (eager) attention.
        report.left["attention"] = (f"attn_logit_softcapping={config.attn_logit_softcapping}: soft-capped attention "
                                    "is not supported yet (the model's own attention runs)")
    elif attention:
        _set_attention(model, report, dropout_attr, note)
    else:
        _set_sdpa_mask(model, report)
    if loss:
        _set_loss(loss_model, report)
    if loss and fused_loss:
        _set_fused_loss(loss_model, report, output_cls)


def _set_loss(model: nn.Module, report: PatchReport) -> None:
    if not hasattr(model, "lm_head"):
        report.left["loss"] = "no LM head (not a *ForCausalLM model)"
        return
    model.loss_function = causal_lm_loss
    report.swapped["loss"] = "cross_entropy (ForCausalLMLoss)"


def _wrapped(model: nn.Module) -> Optional[nn.Module]:
    """The model inside a wrapper that hides its config: PEFT's (PeftModel.get_base_model), DDP's
    or DataParallel's (``.module``, as accelerate's ``prepare`` returns it); else None."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    get = getattr(model, "get_base_model", None)
    if not callable(get) or getattr(model, "peft_config", None) is None:
        return None
    inner = get()
    return inner if isinstance(inner, nn.Module) and inner is not model else None


def patch(model: nn.Module, *, embeddings: bool = True, norms: bool = True, attention: bool = True,
          loss: bool = True, fused_loss: bool = False, mlp: bool = True, rotary: bool = True) -> PatchReport:
    """Route ``model``'s compute through gpu_puzzles ops in place; returns a :class:`PatchReport`.

    ``embeddings``, ``norms`` (norms and the norm+linear fusions), ``attention``, ``loss``,
    ``mlp`` (a decoder's gated MLP: ``gated_act``) and ``rotary`` (a decoder's RoPE in eager;
    compiled, inductor fuses stock's) pick what is patched. ``fused_loss`` (with
    ``loss``): in training with labels, the LM head and the loss run fused and
    ``outputs.logits`` is None (the logits are never stored).
    An architecture it does not know is left untouched (the report says so). Patching a
    model twice is a no-op for what is already patched. A PEFT model (LoRA applied first) and a
    DDP / DataParallel wrapper are patched inside (parameters stay the same objects, so the
    wrapper's hooks keep working); LoRA adapters keep reading what their layers read.
    """
    inner = _wrapped(model)
    if inner is not None:  # LoRA applied first, or DDP's wrapper: the transformers model inside is patched
        return patch(inner, embeddings=embeddings, norms=norms, attention=attention, loss=loss,
                     fused_loss=fused_loss, mlp=mlp, rotary=rotary)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or type(model).__name__
    report = PatchReport(model_type)
    if getattr(model, "_gp_patched", None) is not None:
        report.left["model"] = "already patched by gpu_puzzles.hf.patch"
        return report
    if model_type in _GPT2:
        _patch_gpt2(model, report, embeddings, norms, attention, loss, fused_loss)
    elif model_type in _DECODERS:
        _patch_decoder(model, report, _DECODERS[model_type], embeddings, norms, attention, loss, fused_loss, mlp,
                       rotary)
    elif (vlm := _vlm_text(model)) is not None:
        text, family = vlm
        _patch_decoder(model, report, family, embeddings, norms, attention, loss, fused_loss, mlp, rotary,
                       base=text, prefix="model.language_model")
    else:
        report.left["model"] = (f"architecture '{model_type}' is not one gpu_puzzles.hf knows "
                                f"(known: {', '.join(_GPT2 + tuple(_DECODERS) + tuple(_VLM_TEXT))}, and "
                                "vision-language models whose language model is one of them)")
        return report
    object.__setattr__(model, "_gp_patched", report)
    return report


__all__ = ["patch", "PatchReport", "causal_lm_loss", "ATTENTION_NAME", "SDPA_ATTENTION_NAME"]
