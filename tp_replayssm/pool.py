"""The per-rank KDA ReplaySSM state pool (SPEC section 3).

One :class:`ReplaySSMStatePool` per rank holds, for every layer, the rank's shard of the decode state
of ``num_slots`` requests. Like a vLLM block pool it is one allocation per tensor kind, laid out
``[layers, slots, ...]`` so that a layer is a view, plus a host-side free list:

=============  ===================================  ===============  ===============================
tensor         shape                                dtype            meaning
=============  ===================================  ===============  ===============================
``checkpoint`` ``[NL, S, HV_l, V, K]``              ``state_dtype``  the checkpoint ``S0`` (V before K)
``d_cache``    ``[NL, S, HV_l, L, V]``              ``cache_dtype``  ring of deltas
``k_cache``    ``[NL, S, H_l, L, K]``               ``cache_dtype``  ring of keys (one per q/k head)
``g_cache``    ``[NL, S, HV_l, L, K]``              fp32             ring of log-gates
``cursors``    ``[S + 1]``                          int32            ring cursor per slot, shared by
                                                                     all layers; entry ``S`` is a
                                                                     scratch entry padding rows hit
=============  ===================================  ===============  ===============================

With ``ring_layout="predecayed"`` the rings use the pre-decayed layout of
:func:`tp_replayssm.ops.replayssm_decode_predecayed` instead: ``g_cache`` holds the cumulative gates ``G_j``
since the last flush and ``k_cache`` is ``[NL, S, HV_l, L, K]``, the keys ``k_j * exp(-G_j)`` per value head,
so a decode step needs no scan over the ring and no exp per ring entry (on the H200 3-35% faster at every
shape timed: benchmarks/RESULTS.md, fourteenth and fifteenth sessions). Any gate, any ``lower_bound``: a value
head whose cumulative gate would pass -75 folds its ring into its checkpoint that step (a rebase: one
checkpoint write, the cursor moves on), which cannot happen under ``(L-1) * |lower_bound| <= 75``. It needs a
bf16 or fp32 cache and costs, under GQA, ``r`` times the SPEC's k ring; ``read_state``, ``load_state`` and
``alloc`` follow the layout.

The pool owns the cursors: :meth:`decode` hands the op the whole cursor table, which the kernel reads
by slot (no gather); :meth:`advance`, once per model step after every layer decoded, moves them
on the device (flushed -> 0, else +1) without a host sync, so a whole step is CUDA-graph capturable.
Everything runs on ``pool.device`` whatever the current CUDA device is. Checks that need a
device-to-host sync (slot ranges, allocation, duplicates, cursor range) run only in debug mode
(``debug=True`` or ``TP_REPLAYSSM_DEBUG=1``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from . import cursor_kernel, ops, placement
from ._validation import CACHE_DTYPES, STATE_DTYPES, check_predecayed_layout
from .heads import HeadShard, KDAHeads, shard_heads
from .memory import PoolMemory, pool_memory
from .reference import replay_predecayed_ring, replay_ring

__all__ = ["LayerViews", "PoolExhaustedError", "ReplaySSMStatePool"]

logger = logging.getLogger(__name__)

DEBUG_ENV = "TP_REPLAYSSM_DEBUG"
RING_LAYOUTS = ("spec", "predecayed")


class PoolExhaustedError(RuntimeError):
    """``alloc(n)`` asked for more slots than are free; nothing was allocated."""


class LayerViews(NamedTuple):
    """One layer's views into the pool: ``checkpoint [S, HV_l, V, K]``, ``d_cache [S, HV_l, L, V]``,
    ``k_cache [S, H_l, L, K]`` (``[S, HV_l, L, K]`` in the pre-decayed layout), ``g_cache [S, HV_l, L, K]``
    (the op's ``initial_state`` and rings; a pre-decayed pool's go to ``ops.replayssm_decode_predecayed``,
    not to the SPEC op)."""

    checkpoint: torch.Tensor
    d_cache: torch.Tensor
    k_cache: torch.Tensor
    g_cache: torch.Tensor


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class ReplaySSMStatePool:
    """Per-rank decode state of ``num_slots`` requests over ``num_layers`` KDA layers.

    ``heads`` is the GLOBAL geometry; the pool holds rank ``tp_rank`` of ``tp_size``'s shard
    (``pool.shard``, ``pool.local_heads``). ``tp_rank``/``tp_size`` default to ``group``'s rank and
    size, else ``0``/``1``; ``device`` defaults to the current CUDA device, else the CPU. With a
    ``group`` construction is collective (the placement check of SPEC section 4). ``ring_layout``:
    ``"spec"`` (SPEC section 3) or ``"predecayed"`` (module docstring). ``debug``: the checks that sync with
    the device (module docstring).
    """

    def __init__(
        self,
        heads: KDAHeads,
        *,
        num_layers: int,
        num_slots: int,
        ring_length: int,
        state_dtype: torch.dtype = torch.float32,
        cache_dtype: torch.dtype = torch.bfloat16,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        group: object | None = None,
        device: torch.device | str | int | None = None,
        debug: bool | None = None,
        ring_layout: str = "spec",
    ) -> None:
        if not isinstance(heads, KDAHeads):
            raise ValueError(f"ReplaySSMStatePool: `heads` must be a tp_replayssm.KDAHeads; got {type(heads).__name__}")
        for name, value in (("num_layers", num_layers), ("num_slots", num_slots), ("ring_length", ring_length)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"ReplaySSMStatePool: `{name}` must be a positive int; got {value!r}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"ReplaySSMStatePool: `state_dtype` must be one of {list(STATE_DTYPES)}; got {state_dtype!r}")
        if cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"ReplaySSMStatePool: `cache_dtype` must be one of {list(CACHE_DTYPES)}; got {cache_dtype!r}")
        if ring_layout not in RING_LAYOUTS:
            raise ValueError(f"ReplaySSMStatePool: `ring_layout` must be one of {list(RING_LAYOUTS)}; got {ring_layout!r}")
        if ring_layout == "predecayed":
            check_predecayed_layout(cache_dtype, "ReplaySSMStatePool")
        if group is not None:
            import torch.distributed as dist

            tp_rank = dist.get_rank(group) if tp_rank is None else tp_rank
            tp_size = dist.get_world_size(group) if tp_size is None else tp_size
        tp_rank = 0 if tp_rank is None else tp_rank
        tp_size = 1 if tp_size is None else tp_size

        self.heads = heads
        self.shard: HeadShard = shard_heads(heads, tp_size, tp_rank)
        self.local_heads: KDAHeads = self.shard.local
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.num_layers, self.num_slots, self.ring_length = num_layers, num_slots, ring_length
        self.state_dtype, self.cache_dtype = state_dtype, cache_dtype
        self.ring_layout = ring_layout
        self.device = _resolve_device(device)
        self.debug = os.environ.get(DEBUG_ENV, "0") == "1" if debug is None else bool(debug)

        NL, S, L = num_layers, num_slots, ring_length
        HV, H, K, V = (self.local_heads.num_v_heads, self.local_heads.num_q_heads, self.local_heads.key_dim,
                       self.local_heads.value_dim)
        with self._guard():
            kw = {"device": self.device}
            self.checkpoint = torch.zeros(NL, S, HV, V, K, dtype=state_dtype, **kw)
            self.d_cache = torch.zeros(NL, S, HV, L, V, dtype=cache_dtype, **kw)
            self.k_cache = torch.zeros(NL, S, HV if self.predecayed else H, L, K, dtype=cache_dtype, **kw)
            self.g_cache = torch.zeros(NL, S, HV, L, K, dtype=torch.float32, **kw)
            self.cursors = torch.zeros(S + 1, dtype=torch.int32, **kw)

        self._views = [LayerViews(self.checkpoint[i], self.d_cache[i], self.k_cache[i], self.g_cache[i])
                       for i in range(NL)]
        self._free: collections.deque[int] = collections.deque(range(S))
        self._allocated = bytearray(S)  # 1 = handed out
        self._layer_checked = [False] * NL
        self.memory: PoolMemory = pool_memory(
            heads, tp_size=tp_size, num_layers=NL, num_slots=S, ring_length=L, state_dtype=state_dtype,
            cache_dtype=cache_dtype, keys_per_value_head=self.predecayed)
        self.fingerprint = placement.PoolFingerprint(
            num_q_heads=heads.num_q_heads, num_v_heads=heads.num_v_heads, key_dim=heads.key_dim,
            value_dim=heads.value_dim, tp_size=tp_size, tp_rank=tp_rank, num_layers=NL, num_slots=S,
            ring_length=L, state_dtype=str(state_dtype), cache_dtype=str(cache_dtype), ring_layout=ring_layout)
        self._check_placement(self._pool_tensors(), "ReplaySSMStatePool.__init__")
        logger.info("ReplaySSMStatePool rank %d/%d on %s: local heads H=%d HV=%d K=%d V=%d, L=%d, %s ring layout; %s",
                    tp_rank, tp_size, self.device, H, HV, K, V, L, ring_layout, self.memory.describe())

    # ---- views and bookkeeping ------------------------------------------------------------------

    def layer(self, layer: int) -> LayerViews:
        """The views of one layer (validated index)."""
        self._check_layer(layer, "layer")
        return self._views[layer]

    @property
    def predecayed(self) -> bool:
        """The rings use the pre-decayed layout (``ring_layout="predecayed"``; module docstring)."""
        return self.ring_layout == "predecayed"

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return self.num_slots - len(self._free)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._allocated[slot])

    def allocated_slots(self) -> list[int]:
        """Ids currently handed out, ascending (host-side, no sync)."""
        return [i for i in range(self.num_slots) if self._allocated[i]]

    def __repr__(self) -> str:
        return (f"ReplaySSMStatePool(rank={self.tp_rank}/{self.tp_size}, device={self.device}, layers={self.num_layers}, "
                f"slots={self.num_slots} ({self.num_free} free), L={self.ring_length}, local={self.local_heads}, "
                f"state={self.state_dtype}, cache={self.cache_dtype}, ring_layout={self.ring_layout!r}, "
                f"debug={self.debug})")

    # ---- allocation -----------------------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor:
        """Hand out ``n`` slots: int32 ids ``[n]`` on ``pool.device``. Each new slot's checkpoint and rings
        are zeroed in every layer and its cursor set to 0 (device ops, no sync). Raises
        :class:`PoolExhaustedError` (allocating nothing) when fewer than ``n`` slots are free."""
        if not _is_int(n) or n < 0:
            raise ValueError(f"ReplaySSMStatePool.alloc: `n` must be a non-negative int; got {n!r}")
        if n > len(self._free):
            raise PoolExhaustedError(
                f"ReplaySSMStatePool.alloc: asked for {n} slots but only {len(self._free)} of "
                f"{self.num_slots} are free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._allocated[i] = 1
        with self._guard():
            out = torch.tensor(ids, dtype=torch.int32, device=self.device)
            if n:
                idx = out.long()
                for t in (self.checkpoint, self.d_cache, self.k_cache, self.g_cache):
                    t.index_fill_(1, idx, 0)
                self.cursors.index_fill_(0, idx, 0)
        return out

    def free(self, slots: torch.Tensor | Sequence[int] | int) -> None:
        """Return slots to the pool. A double free, an id out of ``[0, num_slots)`` or never handed out,
        or the same id twice in one call raises ``ValueError`` and frees nothing. (A CUDA tensor of ids
        is read back to the host; pass a list to avoid that sync.)"""
        ids = self._host_ids(slots, "free")
        seen: set[int] = set()
        bad_range, not_alloc, dup = [], [], []
        for i in ids:
            if not 0 <= i < self.num_slots:
                bad_range.append(i)
            elif i in seen:
                dup.append(i)
            elif not self._allocated[i]:
                not_alloc.append(i)
            seen.add(i)
        if bad_range or not_alloc or dup:
            parts = []
            if bad_range:
                parts.append(f"ids out of range [0, {self.num_slots}): {bad_range}")
            if not_alloc:
                parts.append(f"ids not allocated (double free or never handed out): {not_alloc}")
            if dup:
                parts.append(f"ids given more than once: {dup}")
            raise ValueError(f"ReplaySSMStatePool.free: nothing freed; {'; '.join(parts)}")
        for i in ids:
            self._allocated[i] = 0
            self._free.append(i)

    # ---- state in / out -------------------------------------------------------------------------

    def load_state(self, layer: int, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Set ``layer``'s checkpoint of ``slots [n]`` to ``states [n, HV_l, V, K]`` (cast to the state
        dtype) and empty that layer's ring of those slots: its d/k/g entries are zeroed so replaying
        entries ``j < cursor`` is the identity. The shared cursor (and the other layers) are untouched."""
        self._check_layer(layer, "load_state")
        self._check_ids(slots, "load_state", (torch.int32, torch.int64))
        n = slots.shape[0]
        HV, V, K = self.local_heads.num_v_heads, self.local_heads.value_dim, self.local_heads.key_dim
        if not isinstance(states, torch.Tensor):
            raise ValueError(f"ReplaySSMStatePool.load_state: `states` must be a torch.Tensor; got {type(states).__name__}")
        if tuple(states.shape) != (n, HV, V, K):
            raise ValueError(f"ReplaySSMStatePool.load_state: `states` must have shape [n, HV_l, V, K] = "
                             f"{[n, HV, V, K]}; got {list(states.shape)}")
        if not states.dtype.is_floating_point:
            raise ValueError(f"ReplaySSMStatePool.load_state: `states` must have a floating dtype "
                             f"(cast to {self.state_dtype}); got {states.dtype}")
        if states.device != self.device:
            raise ValueError(f"ReplaySSMStatePool.load_state: `states` must be on {self.device}; got {states.device}")
        if self.debug:
            self._debug_check_slots(slots, "load_state", allow_padding=False, unique=True)
        with self._guard():
            idx = slots.long()
            self.checkpoint[layer].index_copy_(0, idx, states.to(self.state_dtype))
            for ring in (self.d_cache, self.k_cache, self.g_cache):
                ring[layer].index_fill_(0, idx, 0)

    def read_state(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The current state ``[n, HV_l, V, K]`` fp32 of ``slots [n]`` in ``layer``: checkpoint plus the
        replayed ring entries ``j < cursor`` (in the pool's ring layout). Changes nothing."""
        self._check_layer(layer, "read_state")
        self._check_ids(slots, "read_state", (torch.int32, torch.int64))
        if self.debug:
            self._debug_check_slots(slots, "read_state", allow_padding=False, unique=False)
        with self._guard():
            idx = slots.long()
            S0, d, k, g, cursor = (t.index_select(0, idx) for t in (*self._views[layer], self.cursors))
            if self.predecayed:
                return replay_predecayed_ring(S0, d, k, g, cursor)
            return replay_ring(S0, d, k.repeat_interleave(self.local_heads.group, dim=1), g, cursor)

    # ---- the decode step ------------------------------------------------------------------------

    def decode(
        self,
        layer: int,
        mixed_qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        slots: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm_in_kernel: bool = True,
        lower_bound: float | None = None,
        force_flush: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        advance: bool = False,
    ) -> torch.Tensor:
        """One decode token per row of this rank's LOCAL inputs (see :class:`~tp_replayssm.heads.HeadShard`):
        ``mixed_qkv [B, 2*H_l*K + HV_l*V]``, ``a [B, HV_l*K]`` or ``[B, HV_l, K]``, ``b [B, HV_l]``,
        ``A_log [HV_l]``, ``dt_bias [HV_l*K]`` or ``[HV_l, K]``, ``slots [B]`` int32 (``< 0`` = padding),
        ``force_flush [B]`` int32 or None. Returns ``out [B, 1, HV_l, V]`` (allocated in
        ``mixed_qkv.dtype`` when None). Does not move the cursors: call :meth:`advance` once per step, or pass
        ``advance=True`` to the step's LAST decode, which then moves them in the same launch, as
        ``advance(slots, force_flush)`` right after it would (one kernel less per step: 0.1-0.8 us less up
        to B = 128 on the H200, -3.8% to +1.2% at B = 512; padding rows leave the scratch entry alone).
        Later decodes of the same step would read moved cursors."""
        self._check_layer(layer, "decode")
        with self._guard():
            if out is None and isinstance(mixed_qkv, torch.Tensor) and mixed_qkv.dim() >= 1:
                out = torch.empty(mixed_qkv.shape[0], 1, self.local_heads.num_v_heads, self.local_heads.value_dim,
                                  dtype=mixed_qkv.dtype, device=self.device)
            views = self._views[layer]
            if not self._layer_checked[layer]:
                inputs = {"mixed_qkv": mixed_qkv, "a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias,
                          "slots": slots, "force_flush": force_flush, "out": out}
                tensors = dict(zip(("checkpoint", "d_cache", "k_cache", "g_cache"), views))
                tensors["cursors"] = self.cursors
                tensors.update({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
                self._check_placement(tensors, f"ReplaySSMStatePool.decode(layer={layer})")
                self._layer_checked[layer] = True
            self._check_ids(slots, "decode", (torch.int32,))
            if self.debug:
                self._debug_check_slots(slots, "decode", allow_padding=True, unique=True)
            ops.decode_with_cursor_table(
                mixed_qkv, a, b, A_log, dt_bias, scale, views.checkpoint, views.d_cache, views.k_cache,
                views.g_cache, out, slots, self.cursors, force_flush=force_flush,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lower_bound=lower_bound, predecayed=self.predecayed,
                advance=bool(advance),
            )
        return out

    def advance(self, slots: torch.Tensor, force_flush: torch.Tensor | None = None) -> None:
        """Move the cursors once per model step, after every layer's :meth:`decode` of the step, with the
        same ``slots [B]`` int32 and ``force_flush [B]`` int32 (or None) the step decoded with: a slot
        that flushed (cursor ``L-1`` or ``force_flush != 0``) goes to 0, any other to ``cursor + 1``.
        Padding rows (``slots < 0``) write the scratch entry; a slot listed twice gets one value (0 if
        any of its rows flushed). No host sync, CUDA-graph capturable: on CUDA one kernel launch
        (:mod:`tp_replayssm.cursor_kernel`), elsewhere a few torch ops."""
        self._check_ids(slots, "advance", (torch.int32,))
        B = slots.shape[0]
        if force_flush is not None:
            if not isinstance(force_flush, torch.Tensor) or tuple(force_flush.shape) != (B,) \
                    or force_flush.dtype != torch.int32 or force_flush.device != self.device:
                raise ValueError(
                    f"ReplaySSMStatePool.advance: `force_flush` must be None or an int32 tensor [B] = [{B}] on "
                    f"{self.device}; got {_describe(force_flush)}")
        if self.debug:
            self._debug_check_slots(slots, "advance", allow_padding=True, unique=False)
        with self._guard():
            cursor_kernel.advance(self.cursors, slots, force_flush, self.ring_length)

    # ---- placement ------------------------------------------------------------------------------

    def verify_placement(self) -> None:
        """The collective placement check of SPEC section 4 over every pool tensor (collective when the
        pool has a group: every rank must call it)."""
        self._check_placement(self._pool_tensors(), "ReplaySSMStatePool.verify_placement()")

    def _pool_tensors(self) -> dict[str, torch.Tensor]:
        return {"checkpoint": self.checkpoint, "d_cache": self.d_cache, "k_cache": self.k_cache,
                "g_cache": self.g_cache, "cursors": self.cursors}

    def _check_placement(self, tensors: dict[str, torch.Tensor], context: str) -> None:
        placement.collective_placement_check(
            group=self.group, expected_device=self.device, require_current_device=(self.group is not None),
            fingerprint=self.fingerprint, tensors=tensors, context=context)

    def _guard(self) -> contextlib.AbstractContextManager:
        """Make ``pool.device`` current for the ops run inside (a no-op off CUDA)."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    # ---- validation -----------------------------------------------------------------------------

    def _check_layer(self, layer: int, where: str) -> None:
        if not _is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"ReplaySSMStatePool.{where}: `layer` must be an int in [0, num_layers={self.num_layers}); "
                             f"got {layer!r}")

    def _check_ids(self, slots: object, where: str, dtypes: tuple[torch.dtype, ...]) -> None:
        """Metadata checks of a slot-id tensor (no sync)."""
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in dtypes \
                or slots.device != self.device:
            names = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"ReplaySSMStatePool.{where}: `slots` must be a 1-D {names} tensor on {self.device}; "
                             f"got {_describe(slots)}")

    def _host_ids(self, slots: object, where: str) -> list[int]:
        if _is_int(slots):
            return [slots]
        if isinstance(slots, torch.Tensor):
            if slots.dim() > 1 or slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
                raise ValueError(f"ReplaySSMStatePool.{where}: `slots` must be an int, a sequence of ints or a "
                                 f"0-/1-D integer tensor; got {_describe(slots)}")
            return [int(i) for i in slots.reshape(-1).tolist()]
        if isinstance(slots, Iterable) and not isinstance(slots, (str, bytes)):
            ids = list(slots)
            if all(_is_int(i) for i in ids):
                return ids
        raise ValueError(f"ReplaySSMStatePool.{where}: `slots` must be an int, a sequence of ints or a 0-/1-D "
                         f"integer tensor; got {slots!r}")

    def _debug_check_slots(self, slots: torch.Tensor, where: str, *, allow_padding: bool, unique: bool) -> None:
        """Debug mode only (host sync): ids in range and allocated, optionally unique, cursors in [0, L-1]."""
        ids = [int(i) for i in slots.tolist()]
        live = [i for i in ids if i >= 0] if allow_padding else ids
        problems = []
        bad = [i for i in live if not self.is_allocated(i)]
        if bad:
            problems.append(f"slots out of range [0, {self.num_slots}) or not allocated: {bad}")
        if unique:
            dups = sorted({i for i in live if live.count(i) > 1})
            if dups:
                problems.append(f"slots given more than once in one batch: {dups}")
        ok = [i for i in live if self.is_allocated(i)]
        if ok:
            cur = self.cursors[torch.tensor(ok, dtype=torch.long, device=self.device)].tolist()
            off = {i: c for i, c in zip(ok, cur) if not 0 <= c <= self.ring_length - 1}
            if off:
                problems.append(f"cursors outside [0, L-1 = {self.ring_length - 1}]: {off}")
        if problems:
            raise ValueError(f"ReplaySSMStatePool.{where} (debug check): {'; '.join(problems)}")


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor shape {list(t.shape)} dtype {t.dtype} device {t.device}"
    return f"{type(t).__name__} {t!r}"
