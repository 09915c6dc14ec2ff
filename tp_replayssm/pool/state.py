"""Setting and reading the state of a pool's slots: ``load_state`` and ``read_state``.

Both sync with the device anyway (they take or return whole states), so both first report earlier bad calls
(``pool.check()``) and then check their own slot ids on the host: an id out of range or not allocated (and, for
``load_state``, one given twice) raises :class:`~tp_replayssm.errors.SlotError` before anything is read or written.
``read_state`` replays the ring in the pool's layout (:mod:`tp_replayssm.reference`), so it is always the true
state; ``load_state`` sets the checkpoint and zeroes the layer's ring entries, so that replaying the entries
``j < cursor`` is the identity whatever the shared cursor is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..reference import replay_predecayed_ring, replay_ring
from ..validation import describe
from .agreement import same_call_on_every_rank, shape_of
from .slots import check_ids, refuse_bad_ids

if TYPE_CHECKING:
    from .pool import ReplaySSMStatePool

__all__ = ["load_state", "read_conv_state", "read_state"]


def load_state(pool: ReplaySSMStatePool, layer: int, slots: torch.Tensor, states: torch.Tensor,
               conv_states: torch.Tensor | None = None) -> None:
    """:meth:`ReplaySSMStatePool.load_state`."""
    where = "ReplaySSMStatePool.load_state"
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        same_call_on_every_rank(pool, where, layer=layer, slots=slots, states=shape_of(states),
                                conv_states=shape_of(conv_states))
    pool._check_layer(layer, "load_state")
    check_ids(slots, where, pool.device, (torch.int32, torch.int64))
    n = slots.shape[0]
    HV, V, K = pool.local_heads.num_v_heads, pool.local_heads.value_dim, pool.local_heads.key_dim
    if not isinstance(states, torch.Tensor):
        raise ValueError(f"{where}: `states` must be a torch.Tensor; got {describe(states)}")
    if tuple(states.shape) != (n, HV, V, K):
        raise ValueError(f"{where}: `states` must have shape [n, HV_l, V, K] = {[n, HV, V, K]}; got "
                         f"{list(states.shape)}")
    if not states.dtype.is_floating_point:
        raise ValueError(f"{where}: `states` must have a floating dtype (cast to {pool.state_dtype}); got "
                         f"{states.dtype}")
    if states.device != pool.device:
        raise ValueError(f"{where}: `states` must be on {pool.device}; got {states.device}")
    if conv_states is not None:
        if pool.conv_state is None:
            raise ValueError(f"{where}: `conv_states` given but this pool holds no conv state (conv_kernel_size=0)")
        D, W1 = pool.conv_channels, pool.conv_kernel_size - 1
        if not isinstance(conv_states, torch.Tensor) or tuple(conv_states.shape) != (n, D, W1) \
                or not conv_states.dtype.is_floating_point or conv_states.device != pool.device:
            raise ValueError(f"{where}: `conv_states` must be a floating tensor [n, D, W-1] = {[n, D, W1]} on "
                             f"{pool.device}; got {describe(conv_states)}")
    _check_slots(pool, slots, where, unique=True, write=True)
    idx = slots.long()
    views = pool.layer(layer)
    if conv_states is not None:
        pool.conv_state[layer].index_copy_(0, idx, conv_states.to(pool.conv_dtype))
    views.checkpoint.index_copy_(0, idx, states.to(pool.state_dtype))
    for ring in (views.d_cache, views.k_cache, views.g_cache):
        ring.index_fill_(0, idx, 0)


def read_state(pool: ReplaySSMStatePool, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """:meth:`ReplaySSMStatePool.read_state`."""
    where = "ReplaySSMStatePool.read_state"
    if pool.debug:
        same_call_on_every_rank(pool, where, layer=layer, slots=slots)
    pool._check_layer(layer, "read_state")
    check_ids(slots, where, pool.device, (torch.int32, torch.int64))
    _check_slots(pool, slots, where, unique=False)
    idx = slots.long()
    S0, d, k, g, cursor = (t.index_select(0, idx) for t in (*pool.layer(layer), pool.cursors))
    if pool.predecayed:
        return replay_predecayed_ring(S0, d, k, g, cursor)
    return replay_ring(S0, d, k.repeat_interleave(pool.local_heads.group, dim=1), g, cursor)


def _check_slots(pool: ReplaySSMStatePool, slots: torch.Tensor, where: str, *, unique: bool,
                 write: bool = False) -> None:
    """``pool.check()`` first, then the ids on the host: allocated, (``unique``) named once, and (``write``) not
    in the open verify step, whose slots wait for its commit (reads see their committed state)."""
    pool.check()
    refuse_bad_ids(pool, [int(i) for i in slots.tolist()], where, unique=unique, writes=write)


def read_conv_state(pool: ReplaySSMStatePool, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """:meth:`ReplaySSMStatePool.read_conv_state`."""
    where = "ReplaySSMStatePool.read_conv_state"
    if pool.debug:
        same_call_on_every_rank(pool, where, layer=layer, slots=slots)
    pool._check_layer(layer, "read_conv_state")
    if pool.conv_state is None:
        raise ValueError(f"{where}: this pool holds no conv state (built with conv_kernel_size=0)")
    check_ids(slots, where, pool.device, (torch.int32, torch.int64))
    _check_slots(pool, slots, where, unique=False)
    return pool.conv_state[layer].index_select(0, slots.long())
