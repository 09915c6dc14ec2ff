"""The per-rank KDA ReplaySSM state pool.

One :class:`ReplaySSMStatePool` per rank holds, for every layer, the rank's shard of the decode state of
``num_slots`` requests. Like a vLLM block pool it is one allocation per tensor kind, laid out ``[layers, slots, ...]``
so that a layer is a view, plus a host-side free list (:mod:`.slots`):

=============  ===============================  ===============  ==================================================
tensor         shape                            dtype            meaning
=============  ===============================  ===============  ==================================================
``checkpoint`` ``[NL, S, HV_l, V, K]``          ``state_dtype``  the checkpoint ``S0`` (V before K)
``d_cache``    ``[NL, S, HV_l, L, V]``          ``cache_dtype``  ring of deltas
``k_cache``    ``[NL, S, HV_l or H_l, L, K]``   ``cache_dtype``  ring of keys: pre-decayed, one per value head; or,
                                                                 in the sglang layout, one per q/k head
``g_cache``    ``[NL, S, HV_l, L, K]``          fp32             ring of cumulative (pre-decayed) or per-step gates
``cursors``    ``[S + 1]``                      int32            ring cursor per slot, shared by all layers; entry
                                                                 ``S`` is a scratch entry padding rows use
=============  ===============================  ===============  ==================================================

The ring layouts (``ring_layout``) are described in docs/contract.md. The default, ``"predecayed"``, is the fastest
(no scan over the ring and no exp per entry on a decode step); ``"sglang"`` is the layout SGLang's kernels use. Both
keep every method's meaning, and ``read_state`` is always the true state.

The pool owns the cursors: :meth:`decode` hands the kernel the whole cursor table, which it reads by slot;
:meth:`advance`, once per model step after every layer decoded, moves them on the device (flushed -> 0, else +1)
without a host sync, so a whole step can be captured in a CUDA graph. Everything runs on ``pool.device`` whatever
the current CUDA device is.

Slot safety: a row of any call that takes slots whose slot is out of range, not allocated (a free slot's cursor is
``FREE_CURSOR``), or repeated within the call is treated as a padding row by the kernels themselves, with no host
sync (zero output; no byte of any slot changes), and recorded in ``slot_errors``; :meth:`check` raises the record
as a :class:`~tp_replayssm.errors.SlotError`. Debug mode (``debug=True`` or ``TP_REPLAYSSM_DEBUG=1``) checks every
call's slots on the host first and raises at the call.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..errors import SlotError
from ..kernels.guard import ERROR_WORDS, FREE_CURSOR, SlotGuard, call_code, describe_record
from ..tp import placement
from ..tp.heads import HeadShard, KDAHeads
from . import checks, conv, lifecycle, spec, state, step
from .memory import PoolMemory, pool_memory
from .shard import StateShard
from .agreement import debug_from_env
from .slots import SlotTable, debug_check, is_int

if TYPE_CHECKING:
    from ..kernels.conv_plan import ConvPlan
    from ..kernels.plan import DecodePlan
    from ..kernels.verify_plan import VerifyPlan

__all__ = ["LayerViews", "ReplaySSMStatePool"]

logger = logging.getLogger(__name__)

_SERIALS = itertools.count()


class LayerViews(NamedTuple):
    """One layer's views into the pool: ``checkpoint [S, HV_l, V, K]``, ``d_cache [S, HV_l, L, V]``, ``k_cache
    [S, HV_l, L, K]`` (``[S, H_l, L, K]`` in the sglang layout), ``g_cache [S, HV_l, L, K]``: the op's
    ``initial_state`` and rings."""

    checkpoint: torch.Tensor
    d_cache: torch.Tensor
    k_cache: torch.Tensor
    g_cache: torch.Tensor


class ReplaySSMStatePool:
    """Per-rank decode state of ``num_slots`` requests over ``num_layers`` KDA layers.

    ``heads`` is the GLOBAL geometry; the pool holds rank ``tp_rank`` of ``tp_size``'s shard (``pool.shard``,
    ``pool.local_heads``). ``tp_rank``/``tp_size`` default to ``group``'s rank and size, else ``0``/``1``;
    ``device`` defaults to the rank's current device (the current CUDA device, else the CPU). With a ``group``,
    construction is collective (the ranks' argument checks, then the placement check: an argument one rank refuses
    raises the same ``PlacementError`` on every rank). ``ring_layout``: ``"predecayed"`` (default) or ``"sglang"``.
    ``debug`` (a bool; None: ``TP_REPLAYSSM_DEBUG``): the checks that sync with the device, and with a group the ranks'
    comparison of every call (:mod:`tp_replayssm.pool.agreement`).
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
        ring_layout: str = "predecayed",
        conv_kernel_size: int = 0,
        conv_dtype: torch.dtype | None = None,
    ) -> None:
        where = "ReplaySSMStatePool"
        try:
            conv_dtype, tp_rank, tp_size, shard, pool_device = step.check_pool_args(
                heads, num_layers=num_layers, num_slots=num_slots, ring_length=ring_length, state_dtype=state_dtype,
                cache_dtype=cache_dtype, ring_layout=ring_layout, conv_kernel_size=conv_kernel_size,
                conv_dtype=conv_dtype, tp_rank=tp_rank, tp_size=tp_size, group=group, device=device, debug=debug)
            debug_mode = debug_from_env(where) if debug is None else debug
        except ValueError as exc:  # with a group every rank raises it: none is left waiting in its placement check
            checks.arguments_on_every_rank(group, str(exc), where)
            raise
        checks.arguments_on_every_rank(group, None, where)

        self.heads = heads
        self.shard: HeadShard = shard
        self.local_heads: KDAHeads = self.shard.local
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.num_layers, self.num_slots, self.ring_length = num_layers, num_slots, ring_length
        self.state_dtype, self.cache_dtype = state_dtype, cache_dtype
        self.ring_layout = ring_layout
        self.conv_kernel_size, self.conv_dtype = conv_kernel_size, conv_dtype
        self.conv_channels = self.local_heads.qkv_width  # D: the conv runs over mixed_qkv's columns
        self.device = pool_device
        self.serial = next(_SERIALS)  # this process's pools in the order built (debug mode compares it across ranks)
        self.debug = debug_mode

        NL, S, L = num_layers, num_slots, ring_length
        HV, H, K, V = (self.local_heads.num_v_heads, self.local_heads.num_q_heads, self.local_heads.key_dim,
                       self.local_heads.value_dim)
        kw = {"device": self.device}
        self.checkpoint = torch.zeros(NL, S, HV, V, K, dtype=state_dtype, **kw)
        self.d_cache = torch.zeros(NL, S, HV, L, V, dtype=cache_dtype, **kw)
        self.k_cache = torch.zeros(NL, S, HV if self.predecayed else H, L, K, dtype=cache_dtype, **kw)
        self.g_cache = torch.zeros(NL, S, HV, L, K, dtype=torch.float32, **kw)
        # a free slot's cursor is FREE_CURSOR (slot safety: the kernels refuse rows of free slots); S is the scratch
        self.cursors = torch.full((S + 1,), FREE_CURSOR, dtype=torch.int32, **kw)
        self.cursors[S] = 0
        # the last W-1 pre-conv inputs per layer and slot, oldest first; slot S is a scratch window (pool.conv)
        self.conv_state = (torch.zeros(NL, S + 1, self.conv_channels, conv_kernel_size - 1, dtype=conv_dtype, **kw)
                           if conv_kernel_size else None)
        self.slot_errors = torch.zeros(ERROR_WORDS, dtype=torch.int32, **kw)  # the record pool.check() reads
        self._codes: dict[tuple[str, int | None], torch.Tensor] = {}

        self._views = [LayerViews(self.checkpoint[i], self.d_cache[i], self.k_cache[i], self.g_cache[i])
                       for i in range(NL)]
        self._slots = SlotTable(S)
        self._layer_checked = [False] * NL
        self.memory: PoolMemory = pool_memory(
            heads, tp_size=tp_size, num_layers=NL, num_slots=S, ring_length=L, state_dtype=state_dtype,
            cache_dtype=cache_dtype, ring_layout=ring_layout, conv_kernel_size=conv_kernel_size, conv_dtype=conv_dtype)
        self.fingerprint = placement.PoolFingerprint(
            num_q_heads=heads.num_q_heads, num_v_heads=heads.num_v_heads, key_dim=heads.key_dim,
            value_dim=heads.value_dim, tp_size=tp_size, tp_rank=tp_rank, num_layers=NL, num_slots=S,
            ring_length=L, state_dtype=str(state_dtype), cache_dtype=str(cache_dtype), ring_layout=ring_layout,
            conv_kernel_size=conv_kernel_size, conv_dtype=str(conv_dtype) if conv_kernel_size else "")
        self._check_placement(self._pool_tensors(), f"{where}.__init__")
        logger.info("ReplaySSMStatePool rank %d/%d on %s: local heads H=%d HV=%d K=%d V=%d, L=%d, %s ring layout; %s",
                    tp_rank, tp_size, self.device, H, HV, K, V, L, ring_layout, self.memory.describe())

    # ---- views and bookkeeping ------------------------------------------------------------------

    def layer(self, layer: int) -> LayerViews:
        """The views of one layer (validated index)."""
        self._check_layer(layer, "layer")
        return self._views[layer]

    @property
    def predecayed(self) -> bool:
        """The rings use the pre-decayed layout (``ring_layout="predecayed"``)."""
        return self.ring_layout == "predecayed"

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def num_allocated(self) -> int:
        return self.num_slots - self._slots.num_free

    def is_allocated(self, slot: int) -> bool:
        return self._slots.is_allocated(slot)

    def allocated_slots(self) -> list[int]:
        """Ids currently handed out, ascending (host-side, no sync)."""
        return self._slots.allocated()

    def __repr__(self) -> str:
        return (f"ReplaySSMStatePool(rank={self.tp_rank}/{self.tp_size}, device={self.device}, layers={self.num_layers}, "
                f"slots={self.num_slots} ({self.num_free} free), L={self.ring_length}, local={self.local_heads}, "
                f"state={self.state_dtype}, cache={self.cache_dtype}, ring_layout={self.ring_layout!r}, "
                f"debug={self.debug})")

    # ---- allocation -----------------------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor:
        """Hand out ``n`` slots: int32 ids ``[n]`` on ``pool.device``. Each new slot's checkpoint and rings are zeroed
        in every layer and its cursor set to 0 (device ops, no sync). Raises :class:`PoolExhaustedError` (allocating
        nothing) when fewer than ``n`` slots are free. While a verify step is open, a free slot that it names waits
        for the commit (the step's slots are read back: a sync)."""
        return lifecycle.alloc(self, n)

    def free(self, slots: torch.Tensor | Sequence[int] | int) -> None:
        """Return slots to the pool. A double free, an id out of ``[0, num_slots)`` or never handed out, the same id
        twice in one call, or a slot of the open verify step (until its commit; ``SlotError``) raises ``ValueError``
        and frees nothing. (A CUDA tensor of ids is read back to the host; pass a list to avoid that sync. While a
        verify step is open its slots are read back too.)"""
        lifecycle.free(self, slots)

    # ---- slot safety ----------------------------------------------------------------------------

    def guard(self, method: str, layer: int | None = None) -> SlotGuard:
        """The error record and this call's code, for a kernel that takes slots (one code tensor per call kind)."""
        key = (method, layer)
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = torch.tensor([call_code(method, layer)], dtype=torch.int32, device=self.device)
        return SlotGuard(self.slot_errors, code)

    def check(self) -> None:
        """Raise :class:`SlotError` for the first call since the last check that named a bad slot (out of range,
        not allocated, or repeated within the call), naming its method, layer, rows and slot ids, and why as far as
        the host can tell now (``SlotTable.diagnose``); then clear the record. The kernels treated those rows as
        padding rows (zero output, nothing written). Syncs with the device (it reads the record back)."""
        message = describe_record(self.slot_errors.tolist(), self._slots.diagnose)
        if message is not None:
            self.slot_errors.zero_()
            raise SlotError(message)

    # ---- state in / out -------------------------------------------------------------------------

    def load_state(self, layer: int, slots: torch.Tensor, states: torch.Tensor,
                   conv_states: torch.Tensor | None = None) -> None:
        """Set ``layer``'s checkpoint of ``slots [n]`` to ``states [n, HV_l, V, K]`` (cast to the state dtype) and
        empty that layer's ring of those slots; ``conv_states [n, D, W-1]`` (oldest first) sets their conv windows
        (None leaves them). The shared cursor (and the other layers) are untouched."""
        state.load_state(self, layer, slots, states, conv_states)

    def read_state(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The current state ``[n, HV_l, V, K]`` fp32 of ``slots [n]`` in ``layer``: checkpoint plus the replayed
        ring entries ``j < cursor``. Changes nothing. (Between a step's verify and its commit, a slot whose committed
        ring that verify folded reads its checkpoint: :func:`tp_replayssm.pool.spec.read_state_in_flight`.)"""
        return spec.read_state_in_flight(self, layer, slots, state.read_state(self, layer, slots))

    def read_conv_state(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The conv windows ``[n, D, W-1]`` (oldest first, ``conv_dtype``) of ``slots [n]`` in ``layer``. Changes
        nothing."""
        return state.read_conv_state(self, layer, slots)

    # ---- a request's life: fork, export, import (pool.lifecycle) ----------------------------------

    def fork(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Make every layer's checkpoint, ring, cursor and conv window of slots ``dst [n]`` those of ``src [n]``
        (int32 on ``pool.device``), byte for byte: no flush, and the two evolve independently afterwards. A pair
        with ``dst < 0`` is padding; a pair whose ``src`` or ``dst`` is out of range or not allocated, whose ``dst``
        is named again in the call (as a ``dst`` or a ``src``, ``dst == src`` included), or whose ``src`` is a
        ``dst`` of the call, is refused, changes nothing and is recorded for :meth:`check` (one ``src`` may feed
        several pairs). One
        kernel launch on CUDA (:mod:`tp_replayssm.kernels.fork`), no host sync, CUDA-graph capturable
        (:mod:`tp_replayssm.pool.lifecycle`)."""
        lifecycle.fork(self, src, dst)

    def export_state(self, slots: torch.Tensor | Sequence[int], *, device: torch.device | str | None = "cpu",
                     non_blocking: bool = False) -> StateShard:
        """The materialized state of ``slots [n]`` on this rank as a :class:`StateShard`: fp32 ``states [NL, n,
        HV_l, V, K]`` (what :meth:`read_state` gives, every layer), conv windows, global head ranges and this
        pool's metadata, on ``device`` (None: ``pool.device``; CPU: pinned when the pool is on CUDA).
        ``non_blocking``: the copy runs asynchronously; ``shard.wait()`` blocks until it is done. Changes nothing;
        reports earlier bad calls (:meth:`check`) and checks ``slots`` on the host first."""
        return lifecycle.export_state(self, slots, device, non_blocking)

    def import_state(self, slots: torch.Tensor | Sequence[int], shards: StateShard | Iterable[StateShard]) -> None:
        """Set allocated ``slots [n]`` from ``shards`` (exported by pools of any tp size, together covering this
        rank's value heads and, with conv state, its q/k heads): checkpoints cast to the state dtype, conv windows
        to the conv dtype, rings emptied, cursors 0. A shard that does not match (heads, layers, dims, requests,
        conv kernel) or heads left uncovered raise ``ValueError`` naming both sides before anything is written."""
        lifecycle.import_state(self, slots, shards)

    # ---- the short convolution ------------------------------------------------------------------

    def conv_update(self, layer: int, x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, *,
                    bias: torch.Tensor | None = None, activation: str | None = "silu",
                    plan: ConvPlan | None = None) -> torch.Tensor:
        """The causal depthwise convolution of ``x [B, D]`` or ``[B, T, D]`` (pre-conv, this rank's channels) with
        ``weight [D, W]`` and ``bias [D]``, continuing each row's window and leaving the last ``W-1`` inputs in it;
        returns ``y`` of ``x``'s shape and dtype (:mod:`tp_replayssm.pool.conv`). Padding rows (slot < 0) get
        zeros and change nothing; so do bad rows (recorded for :meth:`check`). No host sync. ``plan``: a kernel
        launch plan instead of the library's (:func:`tp_replayssm.kernels.conv.plan_conv`; benchmarks, tests)."""
        return conv.checked_conv_update(self, layer, x, weight, slots, bias, activation, plan)

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
        conv_weight: torch.Tensor | None = None,
        conv_bias: torch.Tensor | None = None,
        plan: DecodePlan | None = None,
        conv_plan: ConvPlan | None = None,
    ) -> torch.Tensor:
        """One decode token per row of this rank's LOCAL inputs (:class:`~tp_replayssm.tp.heads.HeadShard` slices
        global ones): ``mixed_qkv [B, 2*H_l*K + HV_l*V]``, ``a [B, HV_l*K]`` or ``[B, HV_l, K]``, ``b [B, HV_l]``,
        ``A_log [HV_l]``, ``dt_bias [HV_l*K]`` or ``[HV_l, K]``, ``slots [B]`` int32 (``< 0`` = padding),
        ``force_flush [B]`` int32 or None. Returns ``out [B, 1, HV_l, V]`` (allocated in ``mixed_qkv.dtype`` when
        None). Does not move the cursors: call :meth:`advance` once per step, or pass ``advance=True`` to the step's
        LAST decode, which then moves them in the same launch, as ``advance(slots, force_flush)`` right after it
        would. With ``conv_weight [D, W]`` (and ``conv_bias [D]``), ``mixed_qkv`` is pre-conv: the pool's conv (with
        SiLU) runs first and advances the rows' windows (:meth:`conv_update`): fused into the decode launch where the
        plan fuses it (the library's from 256 (row, value head) pairs), else in a launch of its own; docs/conv.md.
        ``plan`` replaces the library's launch plan, ``conv_plan`` the conv launch's (benchmarks, tests)."""
        return step.decode(self, layer, mixed_qkv, a, b, A_log, dt_bias, slots, scale=scale,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lower_bound=lower_bound,
                           force_flush=force_flush, out=out, advance=advance, conv_weight=conv_weight,
                           conv_bias=conv_bias, plan=plan, conv_plan=conv_plan)

    def advance(self, slots: torch.Tensor, force_flush: torch.Tensor | None = None) -> None:
        """Move the cursors once per model step, after every layer's :meth:`decode` of the step, with the same
        ``slots [B]`` int32 and ``force_flush [B]`` int32 (or None) the step decoded with: a slot that flushed (cursor
        ``L-1`` or ``force_flush != 0``) goes to 0, any other to ``cursor + 1``. Padding rows (``slots < 0``) change
        nothing; so do bad rows (a slot out of range, free, or named twice), which are recorded for :meth:`check`.
        No host sync, CUDA-graph capturable: on CUDA one kernel launch (:mod:`tp_replayssm.kernels.cursor`),
        elsewhere a few torch ops."""
        step.advance(self, slots, force_flush)

    # ---- speculative decoding: verify, then commit (pool/spec.py, docs/spec.md) -------------------

    def verify(self, layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, slots: torch.Tensor, *, parents: torch.Tensor | None = None,
               scale: float | None = None, use_qk_l2norm_in_kernel: bool = True, lower_bound: float | None = None,
               conv_weight: torch.Tensor | None = None, conv_bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, plan: VerifyPlan | None = None) -> torch.Tensor:
        """``T`` draft tokens per row of this rank's LOCAL inputs, ``1 <= T <= ring_length - 1``: ``mixed_qkv
        [B, T, 2*H_l*K + HV_l*V]``, ``a [B, T, HV_l*K]`` or ``[B, T, HV_l, K]``, ``b [B, T, HV_l]``, ``A_log``,
        ``dt_bias`` as for :meth:`decode`, ``slots [B]`` int32 (``< 0`` = padding). Returns ``out [B, T, HV_l, V]``:
        output ``t`` is what :meth:`decode` would give for draft ``t`` after the row's committed state and the drafts
        before it (a chain), or its ancestors (``parents [B, T]`` int32, ``-1 <= parents[b, t] < t``, -1 = the
        committed state). Writes the drafts' ring entries beyond the committed cursor; the committed state stays what
        every reader sees until :meth:`commit` (docs/spec.md: the fold when the drafts do not fit). With
        ``conv_weight [D, W]`` (``conv_bias [D]``) ``mixed_qkv`` is pre-conv: the conv runs over the drafts along their
        ancestors, and the window moves at commit. Every layer's verify of a step takes the same slots, ``T`` and
        ``parents``. ``plan``: another launch of the verify kernel
        (:func:`tp_replayssm.kernels.verify_plan.plan_verify`), checked against the call. No host sync."""
        return spec.verify(self, layer, mixed_qkv, a, b, A_log, dt_bias, slots, parents=parents, scale=scale,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lower_bound=lower_bound,
                           conv_weight=conv_weight, conv_bias=conv_bias, out=out, plan=plan)

    def commit(self, slots: torch.Tensor, num_accepted: torch.Tensor, *, path: torch.Tensor | None = None) -> None:
        """Once per model step, after every layer's :meth:`verify`, with the step's ``slots [B]``: each row's state in
        every layer (checkpoint, ring, cursor, conv window) becomes the state after its first ``num_accepted[b]``
        drafts (``[B]`` int32 on the device, ``0..T``), or after the tree nodes ``path[b, :num_accepted[b]]`` (``path
        [B, T]`` int32, root first, each the parent of the next). Padding rows change nothing; a bad slot, or a
        ``num_accepted`` / ``path`` that is not valid for its row, is recorded for :meth:`check` (such a row takes no
        draft). No host sync, CUDA-graph capturable."""
        spec.commit(self, slots, num_accepted, path)

    # ---- placement ------------------------------------------------------------------------------

    def verify_placement(self) -> None:
        """The collective placement check over every pool tensor (collective when the pool has a group: every rank
        must call it), then :meth:`check` on every rank, whose results are exchanged too: a ``SlotError`` on any rank
        is raised on every rank, naming the ranks and their records, so no rank goes on to a collective its peers
        have left (:func:`tp_replayssm.pool.checks.verify_placement`)."""
        checks.verify_placement(self)

    def _pool_tensors(self) -> dict[str, torch.Tensor]:
        return {"checkpoint": self.checkpoint, "d_cache": self.d_cache, "k_cache": self.k_cache,
                "g_cache": self.g_cache, "cursors": self.cursors, "slot_errors": self.slot_errors,
                **({"conv_state": self.conv_state} if self.conv_state is not None else {})}

    def _check_placement(self, tensors: dict[str, torch.Tensor], context: str) -> None:
        """:func:`tp_replayssm.pool.checks.check_placement`."""
        checks.check_placement(self, tensors, context)

    # ---- validation -----------------------------------------------------------------------------

    def _check_layer(self, layer: int, where: str) -> None:
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"ReplaySSMStatePool.{where}: `layer` must be an int in [0, num_layers={self.num_layers}); "
                             f"got {layer!r}")

    def _debug_check(self, slots: torch.Tensor, where: str, *, allow_padding: bool, unique: bool,
                     in_step: bool = False) -> None:
        """Debug mode only (host sync): :func:`tp_replayssm.pool.slots.debug_check`."""
        debug_check(self, slots, where, allow_padding=allow_padding, unique=unique, in_step=in_step)
