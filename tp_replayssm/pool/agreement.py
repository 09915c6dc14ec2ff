"""Debug mode's comparison of the ranks' calls: every rank of a pool's group must make the same pool calls with the
same step arguments (docs/layers.md); in debug mode each call that takes slots checks that they do.

:func:`same_call_on_every_rank` is the first thing such a call does in debug mode, before its own argument checks: the
ranks exchange a digest of the call and of the arguments every rank must pass alike (one gloo all-gather on the
pool's check group, :mod:`tp_replayssm.tp.placement`), and on any difference the arguments themselves, so every rank
raises the same :class:`~tp_replayssm.errors.RankMismatchError` naming the call, each argument that differs and which
ranks passed which value, before anything is written. Arguments are compared by meaning: slot ids by value whatever
their container or integer dtype (every negative id is a padding row), ``force_flush`` by the rows it flags (None is
no row), ``parents`` and ``path`` of a chain as the chain (None or spelled out), activations by their dims but the
last (a rank's channels are its own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import RankMismatchError
from ..tp import placement
from ..tp.verdicts import text_digest

if TYPE_CHECKING:
    from .pool import ReplaySSMStatePool

__all__ = ["chain_or_value", "flagged_rows", "int_values", "leading_dims", "same_call_on_every_rank", "slot_ids"]

VALUE_CHARS = 120  # each differing value shown in at most this many characters, around where the values differ


def same_call_on_every_rank(pool: ReplaySSMStatePool, where: str, **args: Any) -> None:
    """Debug mode, on a pool with a group of two or more ranks: the ranks compare this call (``where``) and ``args``
    (integer tensors by value, other tensors by dtype and shape, anything else by ``repr``; callers normalize with
    :func:`slot_ids`, :func:`flagged_rows`, :func:`chain_or_value`, :func:`leading_dims`) and all raise the same
    :class:`RankMismatchError` when any differs. Ranks in different calls, or one in a placement check, raise it
    too. A rank that does not take part within the check timeout makes the others raise ``PlacementError``."""
    if not pool.debug or pool.group is None or pool.tp_size < 2:
        return
    mine = (where, {name: _value_text(value) for name, value in args.items()}, dist.get_rank())
    got = placement.gather_if_different(pool.group, text_digest(repr(mine[:2])), mine, f"{where} (debug check)",
                                        f"Local call: {where} with {mine[1]}")
    if got is not None:
        raise RankMismatchError(mismatch_text(got))


def leading_dims(t: object) -> object:
    """What ranks must agree on in an activation: its dims but the last (a rank's channels are its own)."""
    return tuple(t.shape[:-1]) if isinstance(t, torch.Tensor) else type(t).__name__


def slot_ids(slots: object) -> object:
    """Slot ids as a list of ints (any integer tensor, list or tuple), every negative id as -1 (a padding row);
    anything else as it is (the call's own checks refuse it after the comparison)."""
    values = _int_list(slots)
    return slots if values is None else [-1 if v < 0 else v for v in values]


def int_values(value: object) -> object:
    """Integers (any integer tensor, list or tuple of ints) as a list of ints; anything else as it is."""
    values = _int_list(value)
    return value if values is None else values


def flagged_rows(force_flush: object) -> object:
    """The rows a ``force_flush`` flags (None flags none)."""
    if force_flush is None:
        return []
    values = _int_list(force_flush)
    return force_flush if values is None else [i for i, v in enumerate(values) if v != 0]


def chain_or_value(nodes: object, *, path: bool = False) -> object:
    """``parents`` (or with ``path``, commit's ``path``) ``[B, T]``: ``"chain"`` for None or a chain spelled out
    (``parents[b, t] = t - 1``, ``path[b, t] = t``, every row), else the values."""
    if nodes is None:
        return "chain"
    if isinstance(nodes, torch.Tensor) and nodes.dim() == 2 and not nodes.is_floating_point() \
            and nodes.device.type != "meta":
        chain = torch.arange(nodes.shape[1], device=nodes.device) - (0 if path else 1)
        if bool((nodes == chain).all()):
            return "chain"
    return nodes


def _int_list(value: object) -> list[int] | None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.device.type == "meta" or value.dim() != 1:
            return None
        try:
            return [int(v) for v in value.tolist()]
        except Exception:  # noqa: BLE001 - a tensor whose values cannot be read here
            return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _value_text(value: object) -> str:
    """How ranks compare one argument (any value: the call's own checks come after the exchange)."""
    if isinstance(value, torch.Tensor):
        kind = f"{value.dtype} {tuple(value.shape)}"
        if value.is_floating_point() or value.is_complex() or value.device.type == "meta":
            return kind
        try:
            return f"{value.tolist()}"
        except Exception:  # noqa: BLE001 - a tensor whose values cannot be read here
            return f"{kind} on {value.device}"
    return repr(value)


def mismatch_text(got: list[tuple[str, dict[str, str], int]]) -> str:
    """The one text every rank raises, from the gathered ``(call, {argument: value}, global rank)`` of every rank
    (in the order of the pool's group)."""
    calls = [call for call, _, _ in got]
    if len(set(calls)) > 1:
        what = f"the ranks are in different calls: {_ranks_with(calls)}"
    else:
        names = list(dict.fromkeys(name for _, args, _ in got for name in args))
        diffs = []
        for name in names:
            values = [args.get(name, "(not given)") for _, args, _ in got]
            if len(set(values)) > 1:
                diffs.append(f"`{name}`: {_ranks_with(_around_difference(values))}")
        what = f"{calls[0]}: the ranks passed different arguments: " + "; ".join(diffs)
    global_ranks = [r for _, _, r in got]
    where = "" if global_ranks == list(range(len(got))) else \
        f"; ranks of the pool's group, whose global ranks are {', '.join(map(str, global_ranks))}"
    return (f"{what} (debug check{where}; every rank of a tensor-parallel group must make the same pool calls with "
            f"the same step arguments: docs/layers.md)")


def _ranks_with(values: list[str]) -> str:
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    return "; ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                     for value, r in by_value.items())


def _around_difference(values: list[str]) -> list[str]:
    """Each value in at most :data:`VALUE_CHARS` characters, the window starting a little before the first character
    where the values differ (so a difference deep in a long slot list stays visible)."""
    if all(len(v) <= VALUE_CHARS for v in values):
        return values
    first = 0
    while all(first < len(v) for v in values) and len({v[first] for v in values}) == 1:
        first += 1
    start = max(0, first - 30)
    return [("..." if start else "") + v[start:start + VALUE_CHARS] + ("..." if len(v) > start + VALUE_CHARS else "")
            for v in values]
