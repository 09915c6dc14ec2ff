"""Debug mode's comparison of the ranks' calls: every rank of a pool's group must make the same pool calls with the
same step arguments (docs/layers.md); in debug mode each call that takes slots checks that they do.

:func:`same_call_on_every_rank` is the first thing such a call does in debug mode, before its own argument checks: the
ranks exchange a digest of the call and of the arguments every rank must pass alike (one gloo all-gather on the
pool's check group, :mod:`tp_replayssm.tp.placement`), and on any difference the arguments themselves, so every rank
raises the same :class:`~tp_replayssm.errors.RankMismatchError` naming the call, each argument that differs and which
ranks passed which value, before anything is written. Arguments are compared as passed (a rank's own checks, which
come after, must not refuse on one rank what they accept on another): integer tensors by dtype and value, activations
by dtype and shape (their values are each rank's own), Python values by ``repr``; the one leniency is padding, every
negative slot id counting as -1. The pool is part of the call: pools are numbered in the order each process builds
them (``pool.serial``), so ranks that call two different pools (a model's and a draft model's) raise too.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import RankMismatchError
from ..tp import placement
from ..tp.verdicts import text_digest

if TYPE_CHECKING:
    from .pool import ReplaySSMStatePool

__all__ = ["DEBUG_ENV", "debug_from_env", "mismatch_text", "same_call_on_every_rank", "shape_of",
           "slot_ids"]

DEBUG_ENV = "TP_REPLAYSSM_DEBUG"
_DEBUG_VALUES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                 "off": False, "": False}


def debug_from_env(where: str) -> bool:
    """Debug mode as ``TP_REPLAYSSM_DEBUG`` sets it (1/true/yes/on, 0/false/no/off or unset); another value raises
    ``ValueError`` rather than leave debug mode silently off."""
    value = os.environ.get(DEBUG_ENV, "")
    if value.strip().lower() not in _DEBUG_VALUES:
        raise ValueError(f"{where}: {DEBUG_ENV} must be one of 1, true, yes, on, 0, false, no, off (or unset); got "
                         f"{value!r}")
    return _DEBUG_VALUES[value.strip().lower()]


VALUE_CHARS = 120  # each differing value shown in at most this many characters, around where the values differ


def same_call_on_every_rank(pool: ReplaySSMStatePool, where: str, **args: Any) -> None:
    """Debug mode, on a pool with a group of two or more ranks: the ranks compare this call (``where``, on pool
    ``pool.serial``) and ``args`` (:func:`_value_text`; slot ids through :func:`slot_ids`, activations through
    :func:`shape_of`) and all raise the same :class:`RankMismatchError` when any differs. Ranks in different calls,
    or one in a placement check, raise it too. A rank that does not take part within the check timeout makes the
    others raise ``PlacementError``."""
    if not pool.debug or pool.group is None or pool.tp_size < 2:
        return
    args = {"pool": f"#{pool.serial}", **args}
    mine = (where, {name: _value_text(value) for name, value in args.items()}, dist.get_rank())
    got = placement.gather_if_different(pool.group, text_digest(repr(mine[:2])), mine, f"{where} (debug check)",
                                        f"Local call: {where} with {mine[1]}")
    if got is not None:
        raise RankMismatchError(mismatch_text(got))


def shape_of(t: object) -> object:
    """What ranks must agree on in an activation: its dtype and shape (a rank's values are its own)."""
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def slot_ids(slots: object) -> object:
    """Slot ids as compared: by value and type (an integer tensor's dtype, or the container), every negative id as
    -1 (a padding row)."""
    kind, values = _int_list(slots)
    return slots if values is None else f"{kind} {[-1 if v < 0 else v for v in values]}"


def _int_list(value: object) -> tuple[str, list[int] | None]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.device.type == "meta" or value.dim() != 1:
            return "", None
        try:
            return str(value.dtype), [int(v) for v in value.tolist()]
        except Exception:  # noqa: BLE001 - a tensor whose values cannot be read here
            return "", None
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return type(value).__name__, list(value)
    return "", None


def _value_text(value: object) -> str:
    """How ranks compare one argument, as passed: integer tensors by dtype, shape and value, other tensors by dtype
    and shape, anything else by ``repr`` (any value: the call's own checks come after the exchange)."""
    if isinstance(value, torch.Tensor):
        kind = f"{value.dtype} {tuple(value.shape)}"
        if value.is_floating_point() or value.is_complex() or value.device.type == "meta":
            return kind
        try:
            return f"{value.dtype} {value.tolist()}"
        except Exception:  # noqa: BLE001 - a tensor whose values cannot be read here
            return f"{kind} on {value.device}"
    return repr(value) if not isinstance(value, str) else value


def mismatch_text(got: list[tuple[str, dict[str, str], int]]) -> str:
    """The one text every rank raises, from the gathered ``(call, {argument: value}, global rank)`` of every rank
    (in the order of the pool's group). The calls are the same: ranks in different calls never get here, their
    exchange's first message already differs (:func:`tp_replayssm.tp.placement._first_round`)."""
    names = list(dict.fromkeys(name for _, args, _ in got for name in args))
    diffs = []
    for name in names:
        values = [args.get(name, "(not given)") for _, args, _ in got]
        if len(set(values)) > 1:
            diffs.append(f"`{name}`: {_ranks_with(values, _around_difference(values))}")
    what = f"{got[0][0]}: the ranks passed different arguments: " + "; ".join(diffs)
    global_ranks = [r for _, _, r in got]
    where = "" if global_ranks == list(range(len(got))) else \
        f"; ranks of the pool's group, whose global ranks are {', '.join(map(str, global_ranks))}"
    return (f"{what} (debug check{where}; every rank of a tensor-parallel group must make the same pool calls with "
            f"the same step arguments: docs/layers.md)")


def _ranks_with(values: list[str], shown: dict[str, str]) -> str:
    """Each distinct value (as ``shown`` gives it) with the ranks that passed it."""
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    return "; ".join(f"{shown[value]} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                     for value, r in by_value.items())


def _around_difference(values: list[str]) -> dict[str, str]:
    """Each distinct value longer than :data:`VALUE_CHARS` characters shortened to a window that starts a little
    before its first character unlike the first rank's value (the first rank's own: at the earliest such place),
    with the element there, so a difference deep in a long slot list stays visible; shorter values as they are."""
    def first_unlike(v: str, ref: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(v, ref)) if a != b), min(len(v), len(ref)))

    ref = values[0]
    distinct = list(dict.fromkeys(values))
    shown = {}
    for v in distinct:
        if len(v) <= VALUE_CHARS:
            shown[v] = v
            continue
        first = first_unlike(v, ref) if v != ref else min(first_unlike(o, ref) for o in distinct if o != ref)
        start = max(0, first - 30)
        at = f" (differs from element {v[:first].count(',')})" if v != ref else ""
        shown[v] = (("..." if start else "") + v[start:start + VALUE_CHARS]
                    + ("..." if len(v) > start + VALUE_CHARS else "") + at)
    return shown
