"""The pool's every-step calls, :func:`decode` (one token per row of a layer) and :func:`advance` (the cursors, once
per model step), and the constructor's argument checks (:func:`check_pool_args`).
:class:`~tp_replayssm.pool.pool.ReplaySSMStatePool` delegates here; the arguments and what they mean are its
methods' docstrings."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kernels import cursor
from ..kernels.launch import run_decode
from ..kernels.guard import FREE_CURSOR
from ..tp.devices import resolve_device
from ..tp.heads import HeadShard, KDAHeads, shard_heads
from ..validation import CACHE_DTYPES, RING_LAYOUTS, STATE_DTYPES, DecodeCall, check_ring_layout, describe
from . import conv
from .agreement import same_call_on_every_rank, shape_of, slot_ids
from .slots import check_ids, is_int

if TYPE_CHECKING:
    from ..kernels.conv_plan import ConvPlan
    from ..kernels.plan import DecodePlan
    from .pool import ReplaySSMStatePool

__all__ = ["advance", "check_pool_args", "decode"]


def decode(pool: ReplaySSMStatePool, layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           A_log: torch.Tensor, dt_bias: torch.Tensor, slots: torch.Tensor, *, scale: float | None,
           use_qk_l2norm_in_kernel: bool, lower_bound: float | None, force_flush: torch.Tensor | None,
           out: torch.Tensor | None, advance: bool, conv_weight: torch.Tensor | None, conv_bias: torch.Tensor | None,
           plan: DecodePlan | None, conv_plan: ConvPlan | None) -> torch.Tensor:
    """:meth:`ReplaySSMStatePool.decode`: placement (first call of each layer), slot ids, debug checks, then the
    decode launch, with the pool's conv before it (fused or in a launch of its own) when ``conv_weight`` is given."""
    where = f"ReplaySSMStatePool.decode(layer={layer})"
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        same_call_on_every_rank(pool, where, mixed_qkv=shape_of(mixed_qkv), slots=slot_ids(slots),
                                force_flush=force_flush, advance=bool(advance),
                                conv=conv_weight is not None, scale=scale, lower_bound=lower_bound,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    pool._check_layer(layer, "decode")
    if out is None and isinstance(mixed_qkv, torch.Tensor) and mixed_qkv.dim() >= 1:
        out = torch.empty(mixed_qkv.shape[0], 1, pool.local_heads.num_v_heads, pool.local_heads.value_dim,
                          dtype=mixed_qkv.dtype, device=pool.device)
    views = pool._views[layer]
    if not pool._layer_checked[layer]:
        inputs = {"mixed_qkv": mixed_qkv, "a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias, "slots": slots,
                  "force_flush": force_flush, "out": out}
        tensors = {**views._asdict(), "cursors": pool.cursors}
        tensors.update({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        pool._check_placement(tensors, where)
        pool._layer_checked[layer] = True
    check_ids(slots, where, pool.device, (torch.int32,))
    if pool.debug:
        pool._debug_check(slots, where, allow_padding=True, unique=True)
    call = DecodeCall(mixed_qkv, a, b, A_log, dt_bias, scale, *views, out, slots, pool.cursors, force_flush,
                      use_qk_l2norm_in_kernel, lower_bound)
    if conv_weight is not None:  # every check first (the conv moves the windows), then the conv and the decode
        conv.decode_with_conv(pool, layer, call, conv_weight, conv_bias, advance=bool(advance), plan=plan,
                              conv_plan=conv_plan, guard=pool.guard("decode", layer), where=where)
        return out
    if conv_bias is not None or conv_plan is not None:
        raise ValueError(f"{where}: `{'conv_bias' if conv_bias is not None else 'conv_plan'}` given without "
                         f"`conv_weight`")
    run_decode(call, ring_layout=pool.ring_layout, cursor_table=True, advance=bool(advance), plan=plan,
               guard=pool.guard("decode", layer), where=where, num_q_heads=pool.local_heads.num_q_heads)
    return out


def advance(pool: ReplaySSMStatePool, slots: torch.Tensor, force_flush: torch.Tensor | None) -> None:
    """:meth:`ReplaySSMStatePool.advance`: argument checks, then the cursor kernel (or its torch form)."""
    where = "ReplaySSMStatePool.advance"
    if pool.debug:
        same_call_on_every_rank(pool, where, slots=slot_ids(slots), force_flush=force_flush)
    check_ids(slots, where, pool.device, (torch.int32,))
    B = slots.shape[0]
    if force_flush is not None:
        if not isinstance(force_flush, torch.Tensor) or tuple(force_flush.shape) != (B,) \
                or force_flush.dtype != torch.int32 or force_flush.device != pool.device:
            raise ValueError(f"{where}: `force_flush` must be None or an int32 tensor [B] = [{B}] on "
                             f"{pool.device}; got {describe(force_flush)}")
    if pool.debug:
        pool._debug_check(slots, where, allow_padding=True, unique=True)  # (a repeat is a bad row: kernels/cursor.py)
    cursor.advance(pool.cursors, slots, force_flush, pool.ring_length, pool.guard("advance"))


def check_pool_args(heads: KDAHeads, *, num_layers: int, num_slots: int, ring_length: int, state_dtype: torch.dtype,
                    cache_dtype: torch.dtype, ring_layout: str, conv_kernel_size: int, conv_dtype: torch.dtype | None,
                    tp_rank: int | None, tp_size: int | None, group: object | None, device: object = None,
                    debug: object = None) -> tuple[torch.dtype, int, int, HeadShard, torch.device]:
    """The pool constructor's arguments checked (``ValueError`` naming the argument, the expected and the actual
    value); returns ``(conv_dtype, tp_rank, tp_size, shard, device)`` resolved (the cache dtype, the group's rank
    and size, the rank's shard of the heads, the pool's device)."""
    where = "ReplaySSMStatePool"
    if not isinstance(heads, KDAHeads):
        raise ValueError(f"{where}: `heads` must be a tp_replayssm.KDAHeads; got {type(heads).__name__}")
    for name, value in (("num_layers", num_layers), ("num_slots", num_slots), ("ring_length", ring_length)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{where}: `{name}` must be a positive int; got {value!r}")
    if ring_length >= FREE_CURSOR:
        raise ValueError(f"{where}: `ring_length` must be below {FREE_CURSOR} (a free slot's cursor); got "
                         f"{ring_length}")
    if not is_int(conv_kernel_size) or conv_kernel_size < 0:
        raise ValueError(f"{where}: `conv_kernel_size` must be a non-negative int (0: no conv state); got "
                         f"{conv_kernel_size!r}")
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{where}: `state_dtype` must be one of {list(STATE_DTYPES)}; got {state_dtype!r}")
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"{where}: `cache_dtype` must be one of {list(CACHE_DTYPES)}; got {cache_dtype!r}")
    conv_dtype = cache_dtype if conv_dtype is None else conv_dtype
    if conv_dtype not in CACHE_DTYPES:
        raise ValueError(f"{where}: `conv_dtype` must be None or one of {list(CACHE_DTYPES)}; got {conv_dtype!r}")
    if ring_layout not in RING_LAYOUTS:
        raise ValueError(f"{where}: `ring_layout` must be one of {list(RING_LAYOUTS)}; got {ring_layout!r}")
    check_ring_layout(ring_layout, cache_dtype, f"{where} (ring_layout={ring_layout!r}; an fp16 cache needs "
                                                "ring_layout='sglang')")
    if debug is not None and not isinstance(debug, bool):  # (a string such as "false" would read as true)
        raise ValueError(f"{where}: `debug` must be a bool or None (None: TP_REPLAYSSM_DEBUG); got {debug!r}")
    if group is not None:
        import torch.distributed as dist

        tp_rank = dist.get_rank(group) if tp_rank is None else tp_rank
        tp_size = dist.get_world_size(group) if tp_size is None else tp_size
    tp_rank = 0 if tp_rank is None else tp_rank
    tp_size = 1 if tp_size is None else tp_size
    shard = shard_heads(heads, tp_size, tp_rank, where=where)
    return conv_dtype, tp_rank, tp_size, shard, resolve_device(device, where)
