"""The decode kernel's arguments, built from a call: views only, no copies, each tagged with the input it views.

:func:`decode_kernel_args` returns a :class:`~tp_replayssm.kernels.direct.LaunchArgs`: the positional arguments of
:func:`tp_replayssm.kernels.decode.replayssm_decode_kernel` in its signature's order, and for each one the index (in
:data:`tp_replayssm.validation.CALL_TENSORS`) of the call tensor it is a view of. The direct launcher
(:mod:`tp_replayssm.kernels.direct`) replays a launch from that map; it is derived here, where each view is made.

Caches are passed as overlapping "row" views ``[span, last]`` with strides ``(1, 1)``: row ``r`` is the ``last``
contiguous elements starting at element ``r``, so the kernel addresses element ``[i, j, l, :]`` as row
``i*s0 + j*s1 + l*s2`` from the element strides it gets beside the view. Any strides with a contiguous last dim (a
layer slice of a ``[layers, S, ...]`` pool, padded rows) work without a copy.
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import NamedTuple

import torch

from .guard import SlotGuard
from ..spec_validation import VerifyCall
from ..validation import CALL_TENSORS, DecodeCall, DecodeDims
from .decode import replayssm_decode_kernel
from .direct import LaunchArgs, cache_strides, ordered_args
from .plan import DecodePlan

__all__ = ["CONV_INPUTS", "VECTORS_PER_LANE", "FusedConv", "decode_kernel_args", "no_flush", "rows_view", "state_args",
           "vector_tiles_view"]

# 16-byte vectors of a checkpoint row per thread in the append loop's vector tiles (docs/tuning.md, vector tiles)
VECTORS_PER_LANE = 4
_PARAMS = tuple(inspect.signature(replayssm_decode_kernel).parameters)
# the tensors of a fused conv, after the call's and the guard's among a launch's inputs
CONV_INPUTS = ("conv_state", "conv_weight", "conv_bias", "conv_counters")
_SOURCE = {name: i for i, name in enumerate((*CALL_TENSORS, "slot_errors", "call_code", *CONV_INPUTS))}


class FusedConv(NamedTuple):
    """The pool's conv that a decode launch runs itself (``DecodePlan.fused_conv``): ``conv_state [NL, S+1, D, W-1]``
    (its ``layer``), the taps ``weight [D, W]`` (any strides), ``bias [D]`` or None, ``counters [(S+1) * H]`` int32
    (zero between launches; mode 2 counts a q/k head's programs in them)."""

    conv_state: torch.Tensor
    layer: int
    weight: torch.Tensor
    bias: torch.Tensor | None
    counters: torch.Tensor

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The launch inputs :data:`CONV_INPUTS` (the weight again where there is no bias: never read)."""
        return self.conv_state, self.weight, self.weight if self.bias is None else self.bias, self.counters


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object over ``t``'s elements (same storage, offset, shape and strides)."""
    return t.as_strided(t.shape, t.stride(), t.storage_offset())


def rows_view(t: torch.Tensor, packed: bool = False) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The overlapping ``[span, last]`` view of a 4-D tensor with a contiguous last dim, and its outer strides.

    With ``packed``, where every outer stride is a multiple of ``last`` (the pool's own caches), the rows do not
    overlap: a ``[span / last, last]`` view with strides ``(last, 1)`` and the outer strides in rows. The kernel's
    addressing is the same (row ``i*s0 + j*s1 + l*s2``), but the view's element count is the tensor's extent, not
    ``last`` times it, so Helion can index it with int32 where every argument has fewer than 2^31 elements.

    Cached per tensor object (caches are the same tensors every step): the entry dies with the tensor and is rebuilt
    if its data pointer, shape or strides changed."""
    key = (id(t), packed)
    meta = (t.data_ptr(), t.shape, t.stride())
    hit = _ROWS_VIEWS.get(key)
    if hit is not None and hit[0]() is t and hit[1] == meta:
        return hit[2]
    s0, s1, s2, _ = t.stride()
    last = t.shape[3]
    unit = last if packed and all(s % last == 0 for s in (s0, s1, s2)) else 1
    s0, s1, s2 = s0 // unit, s1 // unit, s2 // unit
    span = sum((n - 1) * s for n, s in zip(t.shape[:3], (s0, s1, s2))) + 1
    # from a detached alias, so the cached view does not keep the key tensor alive
    view = t.detach().as_strided((span, last), (unit, 1), t.storage_offset()), (s0, s1, s2)
    _ROWS_VIEWS[key] = (weakref.ref(t, lambda _, key=key: _ROWS_VIEWS.pop(key, None)), meta, view)
    return view


# (id(tensor), packed) -> (weakref to it, (data_ptr, shape, strides), (rows view, outer strides))
_ROWS_VIEWS: dict[tuple[int, bool], tuple] = {}


def vector_tiles_view(rows: torch.Tensor, K: int, element_size: int) -> torch.Tensor:
    """A rows view ``[span, K]`` as ``[Ko, span, Ki, kv]``, the same elements: ``K = Ko*Ki*kv`` split into
    ``kv``-element vectors of 16 bytes of ``element_size`` (the checkpoint's), ``Ki = VECTORS_PER_LANE`` of them per
    thread. The kernel's vector tiles load ``[Ko, Vc, Ki, kv]`` blocks of it (docs/kernel_design.md)."""
    kv = math.gcd(K, 16 // element_size)
    ki = math.gcd(K // kv, VECTORS_PER_LANE)
    ko = K // kv // ki
    return rows.as_strided((ko, rows.shape[0], ki, kv), (ki * kv, 1, kv, 1), rows.storage_offset())


def state_args(call: DecodeCall | VerifyCall, HV: int, K: int, packed: bool = False
               ) -> tuple[dict[str, tuple[torch.Tensor, str]], dict[str, int]]:
    """The arguments the decode and verify kernels take alike, by kernel parameter name, each with the call input it
    views: ``A_log``, ``dt_bias2 [HV, K]`` and the checkpoint's and rings' row views (:func:`rows_view`, ``packed``
    as there); and the caches' strides in the views' rows (:func:`.direct.cache_strides`)."""
    dt_bias = call.dt_bias
    state_rows, st = rows_view(call.initial_state, packed)
    d_rows, dr = rows_view(call.d_cache, packed)
    k_rows, kr = rows_view(call.k_cache, packed)
    g_rows, gr = rows_view(call.g_cache, packed)
    tensors = {
        "A_log": (call.A_log, "A_log"),
        "dt_bias2": (dt_bias if dt_bias.dim() == 2 else dt_bias.as_strided((HV, K), (K, 1), dt_bias.storage_offset()),
                     "dt_bias"),
        "state_rows": (state_rows, "initial_state"),
        "d_rows": (d_rows, "d_cache"),
        "k_rows": (k_rows, "k_cache"),
        "g_rows": (g_rows, "g_cache"),
    }
    return tensors, cache_strides(st, dr, kr, gr)


def decode_kernel_args(call: DecodeCall, dims: DecodeDims, plan: DecodePlan, scale: float,
                       force_flush: torch.Tensor, guard: SlotGuard, conv: FusedConv | None = None) -> LaunchArgs:
    """The kernel's arguments for a validated call (``force_flush``: the call's, or zeros when it passed None;
    ``guard``: the pool's error record and call code, a spare pair for the op; ``conv``: the conv the launch fuses,
    with ``plan.fused_conv``). Sources index the launch's inputs: the call's tensors (:data:`CALL_TENSORS`), then
    ``guard.errors`` and ``guard.code``, then (with ``conv``) :data:`CONV_INPUTS`. Without a conv the conv arguments
    are views of the call's tensors that the kernel never reads."""
    B, H, HV, K, V = dims.batch, dims.num_q_heads, dims.num_v_heads, dims.key_dim, dims.value_dim
    mixed_qkv, a, out = call.mixed_qkv, call.a, call.out
    # one as_strided per view (a slice plus an unflatten costs twice the host time, which eager decode pays on
    # every call): q3/k3 [B, H, K] and v3 [B, HV, V] over mixed_qkv's columns, a3 [B, HV, K], out3 [B, HV, V]
    row, off = mixed_qkv.stride(0), mixed_qkv.storage_offset()
    common, strides = state_args(call, HV, K)
    state_rows, k_rows = common["state_rows"][0], common["k_rows"][0]
    size = call.initial_state.element_size()
    tensors = {  # name -> (value, the call tensor it views)
        **common,
        "q3": (mixed_qkv.as_strided((B, H, K), (row, K, 1), off), "mixed_qkv"),
        "k3": (mixed_qkv.as_strided((B, H, K), (row, K, 1), off + H * K), "mixed_qkv"),
        "v3": (mixed_qkv.as_strided((B, HV, V), (row, V, 1), off + 2 * H * K), "mixed_qkv"),
        "a3": (a if a.dim() == 3 else a.as_strided((B, HV, K), (a.stride(0), K, 1), a.storage_offset()), "a"),
        "b2": (call.b, "b"),
        "state_vecs": (vector_tiles_view(state_rows, K, size), "initial_state"),
        "k_vecs": (vector_tiles_view(k_rows, K, size), "k_cache"),  # split as the checkpoint (ak's tiles)
        "out3": (out.as_strided((B, HV, V), (out.stride(0), out.stride(2), 1), out.storage_offset()), "out"),
        "slots": (call.ssm_state_indices, "ssm_state_indices"),
        "write_pos": (call.write_pos, "write_pos"),
        "force_flush": (force_flush, "force_flush"),
        "slot_errors": (guard.errors, "slot_errors"),
        "call_code": (guard.code, "call_code"),
    }
    values = {"scale": scale, "num_slots": dims.num_slots,
              "lower_bound": 0.0 if call.lower_bound is None else float(call.lower_bound),
              **strides, **plan.constexprs()}
    tensors["vpost3"] = (tensors["out3"][0].as_strided((B, HV, V), tensors["out3"][0].stride(),
                                                       tensors["out3"][0].storage_offset()), "out")
    if conv is None:  # (aliases, each a tensor object of its own: the direct launcher maps every argument object to
        # one input, and an object passed twice makes the launch unrecordable)
        tensors.update(conv_rows=(_alias(state_rows), "initial_state"), conv_w=(_alias(call.A_log), "A_log"),
                       conv_b=(_alias(call.A_log), "A_log"), conv_counters=(_alias(guard.errors), "slot_errors"))
        values.update(cv_base=0, cv_s=0, conv_size=1, conv_width=1, conv_has_bias=False, cv_d=0, cw_d=0, cw_i=0)
    else:
        W = conv.weight.shape[1]
        rows, (sl, ss, sd) = rows_view(conv.conv_state)
        wt_d, wt_i = conv.weight.stride()
        span = (conv.weight.shape[0] - 1) * wt_d + (W - 1) * wt_i + 1
        tensors.update(conv_rows=(rows, "conv_state"), conv_w=(conv.weight.as_strided((span,), (1,)), "conv_weight"),
                       conv_b=(conv.weight if conv.bias is None else conv.bias, "conv_bias"),
                       conv_counters=(conv.counters.view(-1), "conv_counters"))
        values.update(cv_base=conv.layer * sl, cv_s=ss, conv_size=W, conv_width=1 << (W - 1).bit_length(),
                      conv_has_bias=conv.bias is not None, cv_d=sd, cw_d=wt_d, cw_i=wt_i)
    return ordered_args(_PARAMS, tensors, values, _SOURCE)


_ZERO_FLAGS: dict[tuple[torch.device, int], torch.Tensor] = {}


def no_flush(batch: int, device: torch.device) -> torch.Tensor:
    """A cached all-zero ``force_flush [batch]`` for callers that passed None (never written)."""
    key = (device, batch)
    t = _ZERO_FLAGS.get(key)
    if t is None:
        t = _ZERO_FLAGS[key] = torch.zeros(batch, dtype=torch.int32, device=device)
    return t
