"""Reading one rank's shard of a KDA layer's weights: slices only, never the full tensors.

A layer's parameters (global shapes; ``D = 2*H*K + HV*V``; FLA's names, Kimi-Linear's in brackets):

=========================================  ==================  =================================================
parameter                                  global shape        this rank's shard
=========================================  ==================  =================================================
``q_proj.weight``, ``k_proj.weight``       ``[H*K, hidden]``   rows of its q/k heads (column-parallel)
``v_proj.weight``                          ``[HV*V, hidden]``  rows of its value heads
``q/k/v_conv1d.weight`` (``.bias``)        ``[C, 1, W]``       rows of its heads, like the projection they follow
``f_proj.0.weight`` [``f_a_proj``]         ``[R, hidden]``     replicated (the low-rank first half)
``f_proj.1.weight`` [``f_b_proj``]         ``[HV*K, R]``       rows of its value heads
``b_proj.weight``                          ``[HV, hidden]``    rows of its value heads
``g_proj.0.weight`` [``g_a_proj``]         ``[R, hidden]``     replicated
``g_proj.1.weight`` (``.bias``) [``g_b``]  ``[HV*V, R]``       rows of its value heads
``A_log``                                  ``[HV]`` (Kimi:     its value heads
                                           ``[1, 1, HV, 1]``)
``dt_bias``                                ``[HV*K]``          its value heads' ``K``-blocks
``o_norm.weight``                          ``[V]``             replicated (one weight shared by every head)
``o_proj.weight``                          ``[hidden, HV*V]``  columns of its value heads (row-parallel)
=========================================  ==================  =================================================

The heads are the rank's :class:`~tp_replayssm.tp.heads.HeadShard` (the library's sharding rule; q/k heads
replicated when ``tp % H == 0``). A source is any mapping from names to tensors or lazy slices: each value needs
``shape`` (or ``get_shape()``, as safetensors' ``safe_open(...).get_slice(name)``) and ``value[a:b]`` /
``value[:, a:b]`` indexing; only those slices are read, so no rank materializes the full weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..tp.heads import HeadShard
from .config import KDALayerConfig

__all__ = ["FLA_NAMES", "KIMI_NAMES", "ShardWeights", "naming_of", "read_shard"]

# role -> parameter name (after the prefix)
FLA_NAMES = {
    "q": "q_proj.weight", "k": "k_proj.weight", "v": "v_proj.weight",
    "q_conv": "q_conv1d.weight", "k_conv": "k_conv1d.weight", "v_conv": "v_conv1d.weight",
    "q_conv_bias": "q_conv1d.bias", "k_conv_bias": "k_conv1d.bias", "v_conv_bias": "v_conv1d.bias",
    "f_a": "f_proj.0.weight", "f_b": "f_proj.1.weight", "b": "b_proj.weight",
    "g_a": "g_proj.0.weight", "g_b": "g_proj.1.weight", "g_b_bias": "g_proj.1.bias",
    "A_log": "A_log", "dt_bias": "dt_bias", "norm": "o_norm.weight", "o": "o_proj.weight",
}
KIMI_NAMES = {**FLA_NAMES, "f_a": "f_a_proj.weight", "f_b": "f_b_proj.weight", "g_a": "g_a_proj.weight",
              "g_b": "g_b_proj.weight", "g_b_bias": "g_b_proj.bias"}


@dataclasses.dataclass(frozen=True)
class ShardWeights:
    """One rank's slices, as read (the source's dtype and device). ``H_l``, ``HV_l``: the rank's local heads;
    ``D_l = 2*H_l*K + HV_l*V``.

    ``q``, ``k`` ``[H_l*K, hidden]``, ``v`` ``[HV_l*V, hidden]``; ``conv`` ``[D_l, W]`` (q, k, v channels in
    ``mixed_qkv``'s order; None without short convolutions), ``conv_bias`` ``[D_l]`` or None; ``b`` ``[HV_l, hidden]``;
    ``f_a``, ``g_a`` ``[R, hidden]``; ``f_b`` ``[HV_l*K, R]``; ``g_b`` ``[HV_l*V, R]``, ``g_b_bias`` ``[HV_l*V]`` or
    None; ``A_log`` ``[HV_l]``; ``dt_bias`` ``[HV_l*K]``; ``norm`` ``[V]``; ``o`` ``[hidden, HV_l*V]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    conv: torch.Tensor | None
    conv_bias: torch.Tensor | None
    b: torch.Tensor
    f_a: torch.Tensor
    f_b: torch.Tensor
    g_a: torch.Tensor
    g_b: torch.Tensor
    g_b_bias: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    o: torch.Tensor


def naming_of(tensors: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """FLA's names or Kimi-Linear's, by which forget-gate projection the source holds."""
    if prefix + KIMI_NAMES["f_a"] in tensors:
        return KIMI_NAMES
    if prefix + FLA_NAMES["f_a"] in tensors:
        return FLA_NAMES
    raise ValueError(f"KDA weights: neither {prefix + FLA_NAMES['f_a']!r} (FLA's names) nor "
                     f"{prefix + KIMI_NAMES['f_a']!r} (Kimi-Linear's) is in the source; its keys start "
                     f"{sorted(tensors)[:8]}")


def _shape(value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)
    if shape is None and hasattr(value, "get_shape"):
        shape = value.get_shape()
    if shape is None:
        raise ValueError(f"KDA weights: a source value must have `shape` or `get_shape()`; got {type(value).__name__}")
    return tuple(int(s) for s in shape)


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


class _Reader:
    """Reads named slices from a source, checking each global shape first (``ValueError`` naming the key)."""

    def __init__(self, tensors: Mapping[str, Any], names: dict[str, str], prefix: str) -> None:
        self.tensors, self.names, self.prefix = tensors, names, prefix

    def key(self, role: str) -> str:
        return self.prefix + self.names[role]

    def has(self, role: str) -> bool:
        return self.key(role) in self.tensors

    def source(self, role: str, shapes: tuple[tuple[int, ...], ...]) -> tuple[Any, tuple[int, ...]]:
        key = self.key(role)
        if key not in self.tensors:
            raise ValueError(f"KDA weights: `{key}` is missing from the source")
        value = self.tensors[key]
        shape = _shape(value)
        if shape not in shapes:
            want = " or ".join(str(list(s)) for s in shapes)
            raise ValueError(f"KDA weights: `{key}` must have shape {want}; got {list(shape)}")
        return value, shape

    def rows(self, role: str, shapes: tuple[tuple[int, ...], ...], start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the first dim."""
        value, _ = self.source(role, shapes)
        return _tensor(value[start:stop])

    def whole(self, role: str, shape: tuple[int, ...]) -> torch.Tensor:
        value, _ = self.source(role, (shape,))
        return _tensor(value[:])


def read_shard(tensors: Mapping[str, Any], config: KDALayerConfig, shard: HeadShard, *, prefix: str = "",
               names: dict[str, str] | None = None) -> ShardWeights:
    """This rank's :class:`ShardWeights` from ``tensors`` (module docstring): ``prefix`` goes before every name
    (e.g. ``"model.layers.0.self_attn."``), ``names`` is :data:`FLA_NAMES` or :data:`KIMI_NAMES` (None: detected).
    Every global shape is checked against ``config`` before a slice is read."""
    if shard.heads != config.heads:
        raise ValueError(f"KDA weights: the shard's heads {shard.heads} differ from the config's {config.heads}")
    names = naming_of(tensors, prefix) if names is None else names
    r = _Reader(tensors, names, prefix)
    c = config
    hid, H, HV, K, V, R, W = c.hidden_size, c.num_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, c.gate_rank, \
        c.conv_size
    q0, q1, v0, v1 = shard.q_head_start, shard.q_head_end, shard.v_head_start, shard.v_head_end
    qk_rows, v_rows = (q0 * K, q1 * K), (v0 * V, v1 * V)
    conv = conv_bias = None
    if W:
        parts, biases = [], []
        for role, n, (a, b) in (("q", H * K, qk_rows), ("k", H * K, qk_rows), ("v", HV * V, v_rows)):
            parts.append(r.rows(f"{role}_conv", ((n, 1, W), (n, W)), a, b).reshape(b - a, W))
            if c.conv_bias:
                biases.append(r.rows(f"{role}_conv_bias", ((n,),), a, b))
            elif r.has(f"{role}_conv_bias"):
                raise ValueError(f"KDA weights: `{r.key(role + '_conv_bias')}` is in the source but the config has "
                                 "conv_bias=False")
        conv = torch.cat(parts)
        conv_bias = torch.cat(biases) if biases else None
    if c.gate_bias:
        g_b_bias = r.rows("g_b_bias", ((HV * V,),), *v_rows)
    elif r.has("g_b_bias"):
        raise ValueError(f"KDA weights: `{r.key('g_b_bias')}` is in the source but the config has gate_bias=False")
    else:
        g_b_bias = None
    A_log, A_shape = r.source("A_log", ((HV,), (1, 1, HV, 1)))
    A_log = _tensor(A_log[v0:v1] if len(A_shape) == 1 else A_log[:, :, v0:v1, :]).reshape(v1 - v0)
    o_src, _ = r.source("o", ((hid, HV * V),))
    return ShardWeights(
        q=r.rows("q", ((H * K, hid),), *qk_rows), k=r.rows("k", ((H * K, hid),), *qk_rows),
        v=r.rows("v", ((HV * V, hid),), *v_rows), conv=conv, conv_bias=conv_bias,
        b=r.rows("b", ((HV, hid),), v0, v1), f_a=r.whole("f_a", (R, hid)),
        f_b=r.rows("f_b", ((HV * K, R),), v0 * K, v1 * K), g_a=r.whole("g_a", (R, hid)),
        g_b=r.rows("g_b", ((HV * V, R),), *v_rows), g_b_bias=g_b_bias, A_log=A_log,
        dt_bias=r.rows("dt_bias", ((HV * K,),), v0 * K, v1 * K), norm=r.whole("norm", (V,)),
        o=_tensor(o_src[:, v_rows[0]:v_rows[1]]))
