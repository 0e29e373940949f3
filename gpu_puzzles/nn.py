"""nn.Module wrappers around the functional ops."""
import math
from typing import Optional

import torch
from torch import nn

from . import ops
from .ops.layernorm_linear import _EPS as _LN_EPS
from .ops.layernorm_linear import ALGORITHMS as _LN_ALGORITHMS


class Conv1d(nn.Module):
    """Depthwise 1D convolution over (B, C, L) or (C, L) inputs; output as long as the input.

    ``Conv1d(channels=C, kernel_size=K)``: one K-tap filter per channel, weight ``(C, K)``.
    The sizes are keyword-only: ``nn.Conv1d(4096, 4)`` reads as (in_channels, out_channels)
    where this module has one channel count and a kernel size. Initialised like
    ``torch.nn.Conv1d(C, C, K, groups=C)``: uniform in +-1/sqrt(K) for weight and bias.
    """

    def __init__(self, *args: object, channels: Optional[int] = None, kernel_size: Optional[int] = None,
                 bias: bool = True, causal: bool = False, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        # *args only to say why a positional call is refused (Python's own message would not).
        if args or channels is None or kernel_size is None:
            raise TypeError(f"Conv1d: pass channels= and kernel_size= by keyword (got {len(args)} positional "
                            f"argument{'' if len(args) == 1 else 's'}): this depthwise conv has one channel count "
                            f"and a kernel size, not nn.Conv1d's (in_channels, out_channels, kernel_size)")
        if channels < 1 or kernel_size < 1:
            raise ValueError(f"Conv1d: channels and kernel_size must be >= 1, got {channels}, {kernel_size}")
        factory = {"device": device, "dtype": dtype}
        self.channels, self.kernel_size, self.causal = channels, kernel_size, causal
        self.weight = nn.Parameter(torch.empty(channels, kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(channels, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.conv1d(x, self.weight, self.bias, causal=self.causal)

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}, "
                f"causal={self.causal}")


class Embedding(nn.Module):
    """Lookup table ``(num_embeddings, embedding_dim)``; see :func:`gpu_puzzles.embedding`.

    ``algorithm="auto"`` (the coalesced kernel) or ``"2d"`` (the seed's 2D grid). Initialised
    like ``torch.nn.Embedding``: N(0, 1), with the ``padding_idx`` row zeroed.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None, *,
                 algorithm: str = "auto",
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if num_embeddings < 0 or embedding_dim < 0:
            raise ValueError(f"Embedding: num_embeddings and embedding_dim must be >= 0, got "
                             f"{num_embeddings}, {embedding_dim}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"Embedding: padding_idx must be within [-{num_embeddings}, {num_embeddings}), "
                                 f"got {padding_idx}")
            padding_idx = padding_idx % num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.algorithm = padding_idx, algorithm
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return ops.embedding(indices, self.weight, self.padding_idx, algorithm=self.algorithm)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s + f", algorithm={self.algorithm!r}"


class Softmax(nn.Module):
    """Softmax over ``dim`` (like ``torch.nn.Softmax``, but ``dim`` defaults to -1);
    ``algorithm`` as in :func:`gpu_puzzles.softmax`."""

    _fn = staticmethod(ops.softmax)

    def __init__(self, dim: int = -1, *, algorithm: str = "auto"):
        super().__init__()
        self.dim, self.algorithm = dim, algorithm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x, self.dim, algorithm=self.algorithm)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, algorithm={self.algorithm!r}"


class LogSoftmax(Softmax):
    """Log-softmax over ``dim`` (like ``torch.nn.LogSoftmax``, but ``dim`` defaults to -1)."""

    _fn = staticmethod(ops.log_softmax)


class LayerNormLinear(nn.Module):
    """``Linear(LayerNorm(x))`` through :func:`gpu_puzzles.fused_layernorm_linear` with its
    ``algorithm``: ``"auto"`` the fused op (the normalised activation is never written),
    ``"unfused"`` our LayerNorm then ``F.linear``, ``"naive"`` the curriculum kernel (forward only).

    Parameters match ``nn.LayerNorm(in_features)`` (``ln_weight``, ``ln_bias``, initialised to
    ones/zeros) and ``nn.Linear(in_features, out_features)`` (``weight``, ``bias``, Kaiming-uniform).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, eps: float = _LN_EPS,
                 algorithm: str = "auto", device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"LayerNormLinear: in_features and out_features must be >= 1, got "
                             f"{in_features}, {out_features}")
        if algorithm not in _LN_ALGORITHMS:
            raise ValueError(f"LayerNormLinear: algorithm must be one of {_LN_ALGORITHMS}, got {algorithm!r}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.eps, self.algorithm = in_features, out_features, eps, algorithm
        self.ln_weight = nn.Parameter(torch.empty(in_features, **factory))
        self.ln_bias = nn.Parameter(torch.empty(in_features, **factory))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.ln_weight)
        nn.init.zeros_(self.ln_bias)
        # Same as nn.Linear.reset_parameters.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_modules(cls, layer_norm: nn.LayerNorm, linear: nn.Linear, algorithm: str = "auto") -> "LayerNormLinear":
        """Copy the parameters of an existing ``nn.LayerNorm`` + ``nn.Linear`` pair."""
        if not isinstance(layer_norm, nn.LayerNorm) or not isinstance(linear, nn.Linear):
            raise TypeError("LayerNormLinear.from_modules: expects (nn.LayerNorm, nn.Linear), got "
                            f"({type(layer_norm).__name__}, {type(linear).__name__})")
        shape = tuple(layer_norm.normalized_shape)
        if len(shape) != 1 or shape[0] != linear.in_features:
            raise ValueError(f"LayerNormLinear.from_modules: layer_norm normalises {shape} but linear has "
                             f"in_features={linear.in_features}; need normalized_shape == ({linear.in_features},)")
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, eps=layer_norm.eps,
                algorithm=algorithm, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            if layer_norm.weight is not None:
                m.ln_weight.copy_(layer_norm.weight)
            if getattr(layer_norm, "bias", None) is not None:
                m.ln_bias.copy_(layer_norm.bias)
            m.weight.copy_(w)
            if linear.bias is not None:
                m.bias.copy_(linear.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fused_layernorm_linear(x, self.ln_weight, self.ln_bias, self.weight, self.bias, eps=self.eps,
                                          algorithm=self.algorithm)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, eps={self.eps}, "
                f"algorithm={self.algorithm!r}")


def _norm_eps(norm: nn.Module) -> Optional[float]:
    """eps of an RMSNorm-like module: transformers' ``variance_epsilon`` or torch's ``eps``;
    ``None`` (torch's default) is kept: the ops read it as ``F.rms_norm`` does."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return None if eps is None else float(eps)


def _norm_weight(norm: nn.Module, who: str) -> torch.Tensor:
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        raise TypeError(f"{who}: the norm module needs a 1-D .weight (an RMSNorm with elementwise_affine), "
                        f"got {type(norm).__name__}")
    return w


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension through :func:`gpu_puzzles.rms_norm`; ``weight``
    initialised to ones, as ``torch.nn.RMSNorm(hidden)`` and transformers' ``LlamaRMSNorm``.
    ``eps=None`` as ``torch.nn.RMSNorm``'s: the epsilon of the statistics' dtype."""

    def __init__(self, hidden: int, eps: Optional[float] = None, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        if hidden < 1:
            raise ValueError(f"RMSNorm: hidden must be >= 1, got {hidden}")
        self.hidden, self.eps = hidden, eps
        self.weight = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))

    @classmethod
    def from_module(cls, norm: nn.Module) -> "RMSNorm":
        """Wrap an existing RMSNorm-like module (``.weight`` and ``.variance_epsilon`` or ``.eps``),
        sharing its very weight Parameter (no copy)."""
        w = _norm_weight(norm, "RMSNorm.from_module")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.hidden, m.eps = w.shape[0], _norm_eps(norm)
        m.weight = w
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}"


class RMSNormLinear(nn.Module):
    """``Linear(RMSNorm(x))`` through :func:`gpu_puzzles.fused_rmsnorm_linear` (the normalised
    activation is not kept for the backward). Parameters: ``norm_weight`` (ones), ``weight``
    and ``bias`` as ``nn.Linear(in_features, out_features, bias)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, eps: Optional[float] = None,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"RMSNormLinear: in_features and out_features must be >= 1, got "
                             f"{in_features}, {out_features}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self.norm_weight = nn.Parameter(torch.ones(in_features, **factory))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as nn.Linear
        if self.bias is not None:
            bound = 1.0 / math.sqrt(in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_modules(cls, norm: nn.Module, linear: nn.Linear) -> "RMSNormLinear":
        """Fuse an RMSNorm-like module (``.weight`` and ``.variance_epsilon`` or ``.eps``: transformers'
        ``LlamaRMSNorm``, ``torch.nn.RMSNorm``) and the ``nn.Linear`` after it, keeping their very
        Parameters (no copies: training the fused module trains the originals)."""
        who = "RMSNormLinear.from_modules"
        w = _norm_weight(norm, who)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{who}: expects an nn.Linear after the norm, got {type(linear).__name__}")
        if w.shape[0] != linear.in_features:
            raise ValueError(f"{who}: the norm's weight has shape {tuple(w.shape)} but linear has "
                             f"in_features={linear.in_features}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features, m.eps = linear.in_features, linear.out_features, _norm_eps(norm)
        m.norm_weight, m.weight, m.bias = w, linear.weight, linear.bias
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fused_rmsnorm_linear(x, self.norm_weight, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, eps={self.eps}"


class Attention(nn.Module):
    """Multi-head self-attention: ``out_proj(attention(split_heads(qkv(x))))``.

    ``x`` is ``(B, S, embed_dim)`` or ``(S, embed_dim)``. One ``nn.Linear(embed_dim, 3 *
    embed_dim)`` makes q, k and v (in that order along its output), each split into
    ``num_heads`` heads of ``embed_dim // num_heads``; the heads go through
    :func:`gpu_puzzles.attention` with scale ``1/sqrt(head_dim)`` and ``algorithm``
    (``"auto"``: fused, ``"unfused"``: the curriculum's chain), then ``out_proj``.
    ``causal`` masks future keys as SDPA's ``is_causal``. ``num_kv_heads`` (default
    ``num_heads``, dividing it): grouped-query attention, k and v with that many heads of
    ``head_dim`` each (the projection's output is then ``(num_heads + 2 * num_kv_heads) *
    head_dim``: q, k, v in that order), each shared by ``num_heads // num_kv_heads`` query
    heads without being repeated.
    """

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, causal: bool = False,
                 algorithm: str = "auto", device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
                 num_kv_heads: Optional[int] = None):
        super().__init__()
        if embed_dim < 1 or num_heads < 1 or embed_dim % num_heads:
            raise ValueError(f"Attention: embed_dim ({embed_dim}) must be a positive multiple of num_heads "
                             f"({num_heads})")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"Attention: num_kv_heads ({num_kv_heads}) must be a positive divisor of num_heads "
                             f"({num_heads})")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.causal, self.algorithm = embed_dim, num_heads, causal, algorithm
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in (2, 3) or x.shape[-1] != self.embed_dim:
            raise ValueError(f"Attention: x must be (B, S, {self.embed_dim}) or (S, {self.embed_dim}), "
                             f"got shape {tuple(x.shape)}")
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)
        B, S, _ = x.shape
        if self.num_kv_heads == self.num_heads:
            qkv = self.qkv(x).view(B, S, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)  # (B, H, S, Dh) each
        else:  # strided views of the projection, read in place by the op
            H, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
            q, k, v = self.qkv(x).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
            q = q.view(B, S, H, Dh).transpose(1, 2)
            k = k.view(B, S, Hkv, Dh).transpose(1, 2)
            v = v.view(B, S, Hkv, Dh).transpose(1, 2)
        o = ops.attention(q, k, v, causal=self.causal, enable_gqa=self.num_kv_heads != self.num_heads,
                          algorithm=self.algorithm)
        o = self.out_proj(o.transpose(1, 2).reshape(B, S, self.embed_dim))
        return o.squeeze(0) if unbatched else o

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        return (f"{self.embed_dim}, num_heads={self.num_heads}{kv}, bias={self.qkv.bias is not None}, "
                f"causal={self.causal}, algorithm={self.algorithm!r}")


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` (same arguments: ``weight``, ``ignore_index``,
    ``reduction``, ``label_smoothing``; classes on dim 1 of ``(N, C, ...)`` input) on
    :func:`gpu_puzzles.cross_entropy`. Class-probability targets are not supported."""

    def __init__(self, weight: Optional[torch.Tensor] = None, size_average: Optional[bool] = None,
                 ignore_index: int = -100, reduce: Optional[bool] = None, reduction: str = "mean",
                 label_smoothing: float = 0.0):
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        if self.reduction not in ("mean", "sum", "none"):
            raise ValueError(f"CrossEntropyLoss: reduction must be 'mean', 'sum' or 'none', got {self.reduction!r}")

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ops.cross_entropy(input, target, self.weight, None, self.ignore_index, None, self.reduction,
                                 self.label_smoothing)
