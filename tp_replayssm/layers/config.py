"""The geometry and options of one Kimi Delta Attention layer (global, unsharded): :class:`KDALayerConfig`.

A KDA layer maps ``hidden [.., hidden_size]`` to ``[.., hidden_size]`` through ``H`` q/k heads and ``HV`` value heads
of dims ``K`` and ``V`` (flash-linear-attention's ``KimiDeltaAttention``; Kimi-Linear's checkpoints use the same
parameters under other names, :mod:`tp_replayssm.layers.weights`). The config is read from an FLA layer's attributes
(:meth:`KDALayerConfig.from_fla`) or from a Kimi-Linear model config (:meth:`KDALayerConfig.from_kimi_config`); the
parameter shapes it implies are checked against the weights when a layer is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..tp.heads import KDAHeads

__all__ = ["KDALayerConfig"]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class KDALayerConfig:
    """One KDA layer, unsharded.

    ``hidden_size``; ``num_heads`` ``H`` (q/k heads) and ``num_v_heads`` ``HV`` (``HV % H == 0``); ``head_k_dim``
    ``K`` and ``head_v_dim`` ``V``; ``gate_rank`` ``R``: the inner width of the low-rank forget-gate and output-gate
    projections (``f_proj.0``/``g_proj.0`` are ``[R, hidden]``; FLA uses ``R = V``, Kimi-Linear ``R = head_dim``);
    ``conv_size`` ``W`` of the short convolutions (0: none, the projections only pass through SiLU);
    ``conv_bias``: the convolutions have a bias; ``gate_bias``: the output gate's second projection has a bias (FLA:
    yes, Kimi-Linear: no); ``norm_eps`` of the gated RMSNorm; ``lower_bound``: the bounded forget gate
    ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` instead of ``-exp(A_log) * softplus(f + dt_bias)``;
    ``safe_gate``: FLA's hint that the gate lies in ``[lower_bound, 0)`` (only passed on to FLA's prefill kernel).
    """

    hidden_size: int
    num_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    gate_rank: int
    conv_size: int = 4
    conv_bias: bool = False
    gate_bias: bool = True
    norm_eps: float = 1e-5
    lower_bound: float | None = None
    safe_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_v_heads", "head_k_dim", "head_v_dim", "gate_rank"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"KDALayerConfig: `{name}` must be a positive int; got {value!r} ({self})")
        if not _is_int(self.conv_size) or self.conv_size < 0 or self.conv_size == 1:
            raise ValueError(f"KDALayerConfig: `conv_size` must be 0 (no short convolution) or an int >= 2; got "
                             f"{self.conv_size!r} ({self})")
        if self.num_v_heads % self.num_heads != 0:
            raise ValueError(f"KDALayerConfig: `num_v_heads` must be a multiple of `num_heads`; got HV="
                             f"{self.num_v_heads}, H={self.num_heads} ({self})")
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"KDALayerConfig: `norm_eps` must be a positive float; got {self.norm_eps!r} ({self})")
        if self.lower_bound is not None and not (isinstance(self.lower_bound, (int, float)) and self.lower_bound < 0):
            raise ValueError(f"KDALayerConfig: `lower_bound` must be None or a negative float; got "
                             f"{self.lower_bound!r} ({self})")
        if self.safe_gate and self.lower_bound is None:
            raise ValueError(f"KDALayerConfig: `safe_gate=True` needs a `lower_bound` ({self})")

    @property
    def heads(self) -> KDAHeads:
        """The layer's heads as the pool sees them: ``KDAHeads(H, HV, K, V)``."""
        return KDAHeads(self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim)

    @classmethod
    def from_fla(cls, fla_layer: Any) -> KDALayerConfig:
        """The config of an ``fla.layers.KimiDeltaAttention`` (flash-linear-attention 0.6.0), read from its attributes.

        Refuses what the pool's decode does not compute: ``allow_neg_eigval`` (``beta = 2 * sigmoid(b)``), an output
        norm other than FLA's sigmoid-gated RMSNorm with a weight, a short convolution other than SiLU."""
        where = "KDALayerConfig.from_fla"
        try:
            attrs = {n: getattr(fla_layer, n) for n in (
                "hidden_size", "num_heads", "num_v_heads", "head_k_dim", "head_v_dim", "use_short_conv", "conv_size",
                "conv_bias", "allow_neg_eigval", "lower_bound", "o_norm", "f_proj", "g_proj")}
        except AttributeError as exc:
            raise ValueError(f"{where}: `fla_layer` must be an fla.layers.KimiDeltaAttention (flash-linear-attention "
                             f"0.6.0); got {type(fla_layer).__name__} without {exc.name!r}") from None
        if attrs["allow_neg_eigval"]:
            raise ValueError(f"{where}: allow_neg_eigval=True (beta = 2 * sigmoid(b)) is not supported: the pool's "
                             "decode computes beta = sigmoid(b)")
        norm = attrs["o_norm"]
        if getattr(norm, "activation", "sigmoid") != "sigmoid" or getattr(norm, "weight", None) is None:
            raise ValueError(f"{where}: the output norm must be FLA's FusedRMSNormGated with activation='sigmoid' and "
                             f"a weight; got {norm!r}")
        if attrs["use_short_conv"]:
            act = getattr(getattr(fla_layer, "q_conv1d", None), "activation", "silu")
            if act not in ("silu", "swish"):
                raise ValueError(f"{where}: the short convolutions must use SiLU; got activation={act!r}")
        return cls(hidden_size=int(attrs["hidden_size"]), num_heads=int(attrs["num_heads"]),
                   num_v_heads=int(attrs["num_v_heads"]), head_k_dim=int(attrs["head_k_dim"]),
                   head_v_dim=int(attrs["head_v_dim"]), gate_rank=int(attrs["f_proj"][0].weight.shape[0]),
                   conv_size=int(attrs["conv_size"]) if attrs["use_short_conv"] else 0,
                   conv_bias=bool(attrs["conv_bias"]) if attrs["use_short_conv"] else False,
                   gate_bias=attrs["g_proj"][1].bias is not None, norm_eps=float(norm.eps),
                   lower_bound=None if attrs["lower_bound"] is None else float(attrs["lower_bound"]),
                   safe_gate=bool(getattr(fla_layer, "safe_gate", False)))

    @classmethod
    def from_kimi_config(cls, config: Mapping[str, Any] | Any) -> KDALayerConfig:
        """The KDA layer of a Kimi-Linear model config (a mapping or an object with the same fields):
        ``hidden_size``, ``rms_norm_eps`` and ``linear_attn_config`` = ``{num_heads, head_dim,
        short_conv_kernel_size}`` (plus optional ``num_v_heads`` and ``gate_lower_bound``). Kimi-Linear's layers have
        ``H = HV``, ``K = V = R = head_dim``, no conv bias and no output-gate bias. A full-rank output gate
        (``use_full_rank_gate``) is refused."""
        get = (lambda c, k, d=None: c.get(k, d)) if isinstance(config, Mapping) else \
            (lambda c, k, d=None: getattr(c, k, d))
        lin = get(config, "linear_attn_config")
        if lin is None:
            raise ValueError("KDALayerConfig.from_kimi_config: the config has no `linear_attn_config`")
        lget = (lambda k, d=None: lin.get(k, d)) if isinstance(lin, Mapping) else (lambda k, d=None: getattr(lin, k, d))
        if lget("use_full_rank_gate", False):
            raise ValueError("KDALayerConfig.from_kimi_config: use_full_rank_gate=True is not supported (the output "
                             "gate is the low-rank g_a_proj/g_b_proj pair)")
        H, D = lget("num_heads"), lget("head_dim")
        lb = lget("gate_lower_bound")
        return cls(hidden_size=get(config, "hidden_size"), num_heads=H, num_v_heads=lget("num_v_heads", H),
                   head_k_dim=D, head_v_dim=D, gate_rank=D, conv_size=lget("short_conv_kernel_size", 4),
                   conv_bias=False, gate_bias=False, norm_eps=float(get(config, "rms_norm_eps", 1e-6)),
                   lower_bound=None if lb is None else float(lb))
