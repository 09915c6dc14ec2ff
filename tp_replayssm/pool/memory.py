"""Memory accounting of the per-rank state pool.

:func:`pool_memory` gives the bytes one rank's :class:`~tp_replayssm.ReplaySSMStatePool` holds for a
config (bytes per slot and layer for the checkpoint and each ring, per slot over all layers, per
layer, total); :func:`slots_that_fit` answers "how many slots fit in N bytes on one rank".

Layout accounted for (``HV_l``/``H_l`` = the rank's local heads, ``NL`` layers, ``S`` slots, ring
length ``L``): checkpoint ``[NL, S, HV_l, V, K]`` state dtype, d ring ``[NL, S, HV_l, L, V]`` and
k ring ``[NL, S, HV_l, L, K]`` cache dtype (one per value head, the pre-decayed layout; ``[NL, S, H_l, L, K]``,
one per q/k head, in the sglang layout), g ring ``[NL, S, HV_l, L, K]`` fp32, cursors ``[S + 1]`` int32 (one per slot shared by all layers,
plus one scratch entry that padding rows write to).
"""

from __future__ import annotations

import dataclasses

import torch

from ..tp.heads import KDAHeads, shard_heads
from ..kernels.guard import ERROR_WORDS

__all__ = ["PoolMemory", "pool_memory", "slots_that_fit"]

CURSOR_BYTES = torch.tensor([], dtype=torch.int32).element_size()
RECORD_BYTES = ERROR_WORDS * CURSOR_BYTES
_GIB = float(1 << 30)
_MIB = float(1 << 20)


@dataclasses.dataclass(frozen=True)
class PoolMemory:
    """Bytes of one rank's pool. ``*_per_slot_layer``: one slot in one layer; ``per_slot``: one slot
    over every layer plus its cursor; ``per_layer``: every slot of one layer; ``total``: everything
    the pool allocates (the scratch cursor and conv window, and the slot-error record, included)."""

    num_layers: int
    num_slots: int
    checkpoint_per_slot_layer: int
    d_ring_per_slot_layer: int
    k_ring_per_slot_layer: int
    g_ring_per_slot_layer: int
    cursor_per_slot: int
    conv_per_slot_layer: int = 0  # the conv window (conv_kernel_size > 0)
    record_bytes: int = 0  # the slot-error record

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"PoolMemory: `{f.name}` must be a non-negative int; got {value!r}")

    @property
    def per_slot_layer(self) -> int:
        """Checkpoint, three rings and conv window of one slot in one layer."""
        return (self.checkpoint_per_slot_layer + self.d_ring_per_slot_layer + self.k_ring_per_slot_layer
                + self.g_ring_per_slot_layer + self.conv_per_slot_layer)

    @property
    def ring_per_slot_layer(self) -> int:
        return self.d_ring_per_slot_layer + self.k_ring_per_slot_layer + self.g_ring_per_slot_layer

    @property
    def per_slot(self) -> int:
        """One slot over every layer, plus its cursor."""
        return self.num_layers * self.per_slot_layer + self.cursor_per_slot

    @property
    def per_layer(self) -> int:
        """Every slot of one layer (checkpoint + rings; cursors are shared and not counted here)."""
        return self.num_slots * self.per_slot_layer

    @property
    def cursors(self) -> int:
        """The cursor tensor: one per slot plus the scratch entry."""
        return (self.num_slots + 1) * self.cursor_per_slot

    @property
    def total(self) -> int:
        """Every slot of every layer, the cursors, the scratch conv windows and the slot-error record."""
        return self.num_layers * (self.per_layer + self.conv_per_slot_layer) + self.cursors + self.record_bytes

    def describe(self) -> str:
        """One human-readable line (for the log)."""
        return (
            f"{self.total / _GIB:.3f} GiB total = {self.num_layers} layers x {self.num_slots} slots x "
            f"{self.per_slot_layer} B (checkpoint {self.checkpoint_per_slot_layer} B, rings d "
            f"{self.d_ring_per_slot_layer} B + k {self.k_ring_per_slot_layer} B + g "
            f"{self.g_ring_per_slot_layer} B{f', conv window {self.conv_per_slot_layer} B' if self.conv_per_slot_layer else ''}) "
            f"+ cursors {self.cursors} B; per slot {self.per_slot} B, "
            f"per layer {self.per_layer / _MIB:.2f} MiB"
        )


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def pool_memory(heads: KDAHeads, *, tp_size: int, num_layers: int, num_slots: int, ring_length: int,
                state_dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype = torch.bfloat16,
                ring_layout: str = "predecayed", conv_kernel_size: int = 0,
                conv_dtype: torch.dtype | None = None, where: str = "pool_memory") -> PoolMemory:
    """The :class:`PoolMemory` of one rank's pool for this config (every rank's shard has the same size; errors start
    with ``where``)."""
    local = shard_heads(heads, tp_size, 0, where=where).local
    HV, H, K, V, L = local.num_v_heads, local.num_q_heads, local.key_dim, local.value_dim, ring_length
    cache = _element_size(cache_dtype)
    return PoolMemory(
        num_layers=num_layers,
        num_slots=num_slots,
        checkpoint_per_slot_layer=HV * V * K * _element_size(state_dtype),
        d_ring_per_slot_layer=HV * L * V * cache,
        k_ring_per_slot_layer=(HV if ring_layout == "predecayed" else H) * L * K * cache,
        g_ring_per_slot_layer=HV * L * K * _element_size(torch.float32),
        cursor_per_slot=CURSOR_BYTES,
        conv_per_slot_layer=(local.qkv_width * (conv_kernel_size - 1) * _element_size(conv_dtype or cache_dtype)
                             if conv_kernel_size else 0),
        record_bytes=RECORD_BYTES,
    )


def slots_that_fit(heads: KDAHeads, *, tp_size: int, num_layers: int, ring_length: int,
                   state_dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype = torch.bfloat16,
                   budget_bytes: int, ring_layout: str = "predecayed", conv_kernel_size: int = 0,
                   conv_dtype: torch.dtype | None = None) -> int:
    """The largest ``num_slots`` whose pool (``pool_memory(...).total``) fits in ``budget_bytes`` on one
    rank; 0 when not even one slot fits. E.g. ``budget_bytes=int(40 * 2**30)`` for 40 GiB."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
        raise ValueError(f"slots_that_fit: `budget_bytes` must be a non-negative int; got {budget_bytes!r}")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"slots_that_fit: `num_layers` must be a positive int; got {num_layers!r}")
    if not isinstance(ring_length, int) or ring_length < 1:
        raise ValueError(f"slots_that_fit: `ring_length` must be a positive int; got {ring_length!r}")
    unit = pool_memory(heads, tp_size=tp_size, num_layers=num_layers, num_slots=0, ring_length=ring_length,
                       state_dtype=state_dtype, cache_dtype=cache_dtype, ring_layout=ring_layout,
                       conv_kernel_size=conv_kernel_size, conv_dtype=conv_dtype, where="slots_that_fit")
    fixed = unit.total  # the scratch cursor and conv windows, the slot-error record
    if budget_bytes < fixed:
        return 0
    return (budget_bytes - fixed) // unit.per_slot
