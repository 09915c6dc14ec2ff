"""Speculative decoding in the pool: ``verify`` (per layer), then ``commit`` (once per model step).

``pool.verify(layer, ...)`` computes, for ``T`` draft tokens per row, what ``decode`` would give for each draft after
the row's committed state and the drafts before it (a chain, or a tree through ``parents``), and writes the drafts'
ring entries beyond the committed cursor. ``pool.commit(slots, num_accepted, path=None)`` then moves every layer of
each row to its accepted drafts: the accepted entries into ring order, the cursor on, the conv window rolled. The
contract is in ``docs/spec.md``; the math in :mod:`tp_replayssm.reference_spec`; the kernels in
:mod:`tp_replayssm.kernels.verify` and :mod:`tp_replayssm.kernels.commit`.

The pool keeps, between the first verify of a step and its commit, the step's shape on the host (:class:`SpecStep`:
``B``, ``T``, whether it is a tree and its ``parents`` tensor, the layers that ran the conv) and, on the device, three
small tensors allocated at the first verify: ``spec_folded [NL, S + 1]`` int32 (layer ``l`` of slot ``s`` folded its
committed ring in this step's verify; cleared by commit), ``spec_counters [S + 1, HV_l + H_l]`` int32 (reader counts
the verify kernel uses, zero between launches) and, for verifies with the conv, ``spec_inputs [NL, B, T, D]`` (the
drafts' pre-conv inputs, which commit appends to the windows). Nothing here syncs with the device.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from ..kernels.commit import run_commit
from ..kernels.verify_launch import check_verify_plan, run_verify
from ..reference_spec import chain_parents, parents_valid, path_valid, tree_conv
from ..spec_validation import VerifyCall, validate_commit, validate_verify
from . import conv
from .agreement import same_call_on_every_rank, shape_of, slot_ids

if TYPE_CHECKING:
    from .pool import ReplaySSMStatePool

__all__ = ["SpecStep", "commit", "read_state_in_flight", "verify"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SpecStep:
    """The host's record of an open verify step (first verify to commit)."""

    batch: int
    drafts: int
    parents: torch.Tensor | None
    slots: torch.Tensor  # the first verify's (every verify of the step takes the same): in flight until the commit
    layers: set[int] = dataclasses.field(default_factory=set)  # the layers verified so far
    conv_layers: set[int] = dataclasses.field(default_factory=set)  # those that ran the conv


def _spec_tensors(pool: ReplaySSMStatePool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(spec_folded, spec_counters)``, allocated (zeroed) on the first call."""
    if getattr(pool, "spec_folded", None) is None:
        lh = pool.local_heads
        pool.spec_folded = torch.zeros(pool.num_layers, pool.num_slots + 1, dtype=torch.int32, device=pool.device)
        pool.spec_counters = torch.zeros(pool.num_slots + 1, lh.num_v_heads + lh.num_q_heads, dtype=torch.int32,
                                         device=pool.device)
    return pool.spec_folded, pool.spec_counters


def _staging(pool: ReplaySSMStatePool, batch: int, drafts: int) -> torch.Tensor:
    """``spec_inputs [NL, B, T, D]`` in the conv dtype (one buffer, reallocated when ``B`` or ``T`` changes)."""
    buf = getattr(pool, "spec_inputs", None)
    shape = (pool.num_layers, batch, drafts, pool.conv_channels)
    if buf is None or tuple(buf.shape) != shape:
        buf = pool.spec_inputs = torch.zeros(shape, dtype=pool.conv_dtype, device=pool.device)
        logger.info("ReplaySSMStatePool: %.1f MiB for the drafts' pre-conv inputs (B=%d, T=%d)",
                    buf.numel() * buf.element_size() / 2**20, batch, drafts)
    return buf


def verify(pool: ReplaySSMStatePool, layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           A_log: torch.Tensor, dt_bias: torch.Tensor, slots: torch.Tensor, *, parents: torch.Tensor | None,
           scale: float | None, use_qk_l2norm_in_kernel: bool, lower_bound: float | None,
           conv_weight: torch.Tensor | None, conv_bias: torch.Tensor | None, out: torch.Tensor | None,
           plan: object | None = None) -> torch.Tensor:
    """:meth:`ReplaySSMStatePool.verify`."""
    where = f"ReplaySSMStatePool.verify(layer={layer})"
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        same_call_on_every_rank(pool, where, mixed_qkv=shape_of(mixed_qkv), slots=slot_ids(slots),
                                parents=parents, conv=conv_weight is not None, scale=scale,
                                lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    pool._check_layer(layer, "verify")
    lh = pool.local_heads
    dims = validate_verify(mixed_qkv, a, b, A_log, dt_bias, slots, parents, out, scale, lower_bound,
                           num_q_heads=lh.num_q_heads, num_v_heads=lh.num_v_heads, key_dim=lh.key_dim,
                           value_dim=lh.value_dim, ring_length=pool.ring_length, num_slots=pool.num_slots,
                           device=pool.device, where=where, use_l2norm=use_qk_l2norm_in_kernel)
    B, T = dims.batch, dims.drafts
    if conv_weight is not None:
        conv.check_conv_args(pool, mixed_qkv, conv_weight, conv_bias, "silu", where, conv.DECODE_CONV_NAMES)
    elif conv_bias is not None:
        raise ValueError(f"{where}: `conv_bias` given without `conv_weight`")
    step = getattr(pool, "_spec_step", None)
    if step is not None and (step.batch, step.drafts, step.parents is None) != (B, T, parents is None):
        raise ValueError(f"{where}: every verify of a step must take the same rows and drafts: this step has B = "
                         f"{step.batch}, T = {step.drafts}, {'a chain' if step.parents is None else 'a tree'}; got "
                         f"B = {B}, T = {T}, {'a chain' if parents is None else 'a tree'} (call commit first)")
    if step is not None:
        if layer in step.layers:  # a second fold of a folded ring would count the committed entries twice
            raise ValueError(f"{where}: layer {layer} was verified already in this step (layers "
                             f"{sorted(step.layers)}); each layer is verified once, then commit")
        _same_as_step(step.slots, slots, "slots", where)
        if parents is not None:
            _same_as_step(step.parents, parents, "parents", where)
    checked = pool.__dict__.setdefault("_spec_layer_checked", set())
    if layer not in checked:
        views = pool.layer(layer)
        tensors = {**views._asdict(), "cursors": pool.cursors}
        tensors.update({k: v for k, v in (("mixed_qkv", mixed_qkv), ("a", a), ("b", b), ("A_log", A_log),
                                          ("dt_bias", dt_bias), ("slots", slots), ("parents", parents), ("out", out))
                        if isinstance(v, torch.Tensor)})
        pool._check_placement(tensors, where)
        checked.add(layer)
    if pool.debug:
        pool._debug_check(slots, where, allow_padding=True, unique=True, in_step=True)
        if parents is not None and not bool(parents_valid(parents.long()).all()):
            raise ValueError(f"{where} (debug check): `parents` must hold -1 or an earlier node in every entry "
                             f"(parents[b, t] in [-1, t-1]); got {parents.tolist()}")
    if out is None:
        out = torch.empty(B, T, lh.num_v_heads, lh.value_dim, dtype=mixed_qkv.dtype, device=pool.device)
    folded, counters = _spec_tensors(pool)
    if conv_weight is not None:  # (before the step opens: nothing has been written if it raises)
        mixed_qkv = _draft_conv(pool, layer, mixed_qkv, conv_weight, conv_bias, slots, parents)
    views = pool.layer(layer)
    call = VerifyCall(mixed_qkv, a, b, A_log, dt_bias, scale, *views, out, slots, pool.cursors, parents,
                      folded[layer], counters, use_qk_l2norm_in_kernel, lower_bound)
    check_verify_plan(plan, call, dims, ring_layout=pool.ring_layout, where=where)  # (before the step opens)
    if step is None:
        step = pool._spec_step = SpecStep(B, T, parents, slots)
    if conv_weight is not None:
        step.conv_layers.add(layer)
    run_verify(call, dims, ring_layout=pool.ring_layout, guard=pool.guard("verify", layer), where=where, plan=plan)
    step.layers.add(layer)
    return out


def _same_as_step(first: torch.Tensor, given: torch.Tensor, name: str, where: str) -> None:
    """A later verify (or the commit) of an open step must name the step's rows as its first verify did: the same
    tensor (an engine's step buffer: no check), else equal values, compared on the host (a sync; skipped while a CUDA
    graph is captured, where syncing is not allowed)."""
    if given is first:
        return
    if given.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if not torch.equal(given.to(first.device, first.dtype), first):
        raise ValueError(f"{where}: `{name}` must be the step's, as its first verify gave them ({first.tolist()}); got "
                         f"{given.tolist()} (every verify and the commit of a step take the same {name})")


def _draft_conv(pool: ReplaySSMStatePool, layer: int, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, slots: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
    """The conv (with SiLU) over the drafts, continuing each row's committed window along its ancestors; the window is
    left alone (commit rolls it) and the pre-conv inputs are staged for commit. Bad rows get zeros (the verify refuses
    and records them). Returns ``[B, T, D]`` contiguous: the verify kernel's arguments view its q, k and v columns
    assuming ``stride(-1) == 1`` (``kernels/verify_args.py``), as the caller's ``mixed_qkv`` is checked to have."""
    B, T = x.shape[0], x.shape[1]
    live, idx = conv.row_verdict(pool, slots)
    window = pool.conv_state[layer].index_select(0, idx)
    if parents is None:
        y, _ = conv.conv_reference(x, window, weight, bias, "silu")
    else:  # a row whose parents are not a tree is refused by the verify: its conv runs on roots, then zeroed
        tree = parents_valid(parents.long())
        live = live & tree
        y = tree_conv(x, window, weight, bias, torch.where(tree[:, None], parents.long(), -1), "silu")
    _staging(pool, B, T)[layer].copy_(x)
    return torch.where(live[:, None, None], y, 0.0).to(x.dtype).contiguous()


def commit(pool: ReplaySSMStatePool, slots: torch.Tensor, num_accepted: torch.Tensor,
           path: torch.Tensor | None) -> None:
    """:meth:`ReplaySSMStatePool.commit`."""
    where = "ReplaySSMStatePool.commit"
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        same_call_on_every_rank(pool, where, slots=slot_ids(slots), num_accepted=num_accepted,
                                path=path)
    step = getattr(pool, "_spec_step", None)
    if step is None:
        raise ValueError(f"{where}: no verify since the last commit (commit follows every layer's verify of a step)")
    validate_commit(slots, num_accepted, path, batch=step.batch, drafts=step.drafts, device=pool.device, where=where)
    _same_as_step(step.slots, slots, "slots", where)  # (a verified row left out would keep a folded ring live)
    missing = sorted(set(range(pool.num_layers)) - step.layers)
    if missing:  # their rings hold no drafts: committing would move their cursors over stale entries
        raise ValueError(f"{where}: every layer's verify comes before the commit; layers {missing} of "
                         f"{pool.num_layers} were not verified in this step")
    if pool.debug:
        pool._debug_check(slots, where, allow_padding=True, unique=True, in_step=True)
        par = (chain_parents(step.batch, step.drafts, pool.device) if step.parents is None
               else step.parents.long())
        pth = torch.arange(step.drafts, device=pool.device).expand(step.batch, -1) if path is None else path.long()
        bad = ~path_valid(par, pth, num_accepted.long()) & (slots >= 0)
        if bool(bad.any()):
            raise ValueError(f"{where} (debug check): rows {bad.nonzero().flatten().tolist()} have `num_accepted` "
                             f"outside [0, T = {step.drafts}] or a `path` that is not a root-first parent chain; "
                             f"num_accepted {num_accepted.tolist()}"
                             + ("" if path is None else f", path {path.tolist()}")
                             + ("" if step.parents is None else f", parents {step.parents.tolist()}"))
    conv_args = None
    if step.conv_layers:
        key = tuple(sorted(step.conv_layers))
        cache = pool.__dict__.setdefault("_spec_layer_index", {})  # made once, outside a graph: a host-to-device
        layers = cache.get(key)  # copy is refused during capture
        if layers is None:
            layers = cache[key] = torch.tensor(key, dtype=torch.long, device=pool.device)
        conv_args = (pool.conv_state, pool.spec_inputs.index_select(0, layers), layers)
    run_commit(pool, slots, num_accepted, step.parents, path, step.drafts, pool.guard("commit"), conv_args)
    pool._spec_step = None


def read_state_in_flight(pool: ReplaySSMStatePool, layer: int, slots: torch.Tensor,
                         states: torch.Tensor) -> torch.Tensor:
    """``states`` (read by the ring) with the slots whose committed ring this step's verify of ``layer`` folded
    (``spec_folded``) replaced by their checkpoint, which holds their committed state until the commit."""
    folded = getattr(pool, "spec_folded", None)
    if folded is None or getattr(pool, "_spec_step", None) is None:  # no step in flight: commit cleared the marks
        return states
    idx = slots.long()
    mark = folded[layer].index_select(0, idx) != 0
    return torch.where(mark[:, None, None, None], pool.checkpoint[layer].index_select(0, idx).float(), states)
