"""The pool's checks across ranks: placement (its tensors and a call's on the pool's device, the pool's tensors not
replaced), the exchange of the ranks' slot-check results at ``verify_placement``, and in debug mode the ranks'
agreement on each call's arguments.

All are collective when the pool has a group (every rank calls them at the same point) and raise the same error on
every rank: :class:`~tp_replayssm.errors.PlacementError` from :func:`tp_replayssm.tp.placement.collective_placement_check`,
:class:`~tp_replayssm.errors.SlotError` naming each rank whose ``check()`` raised (docs/contract.md, sections 4 and 5),
:class:`~tp_replayssm.errors.RankMismatchError` naming each argument the ranks passed differently (docs/layers.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import RankMismatchError, SlotError
from ..tp import placement
from ..tp.verdicts import text_digest

if TYPE_CHECKING:
    from .pool import ReplaySSMStatePool

__all__ = ["check_placement", "leading_dims", "replaced_tensors", "same_call_on_every_rank", "verify_placement"]


def verify_placement(pool: ReplaySSMStatePool) -> None:
    """The placement check over every pool tensor, then ``pool.check()`` on every rank, the ranks' results
    exchanged: a ``SlotError`` on any rank is raised on all of them, naming the ranks and their records."""
    where = "ReplaySSMStatePool.verify_placement()"
    check_placement(pool, pool._pool_tensors(), where)
    if pool.group is None:
        pool.check()
        return
    try:
        pool.check()
        mine = None
    except SlotError as exc:
        mine = str(exc)
    texts = placement.gather_texts(pool.group, mine, where)
    bad = [f"rank {rank}: {text}" for rank, text in enumerate(texts) if text is not None]
    if bad:
        raise SlotError(f"{where}: slot errors on {len(bad)} of {len(texts)} ranks; " + "; ".join(bad))


def check_placement(pool: ReplaySSMStatePool, tensors: dict[str, torch.Tensor], context: str) -> None:
    """The collective placement check of ``tensors``, the pool's own tensors among them (named ``pool.<name>`` where
    ``tensors`` holds views of them), and of the views its kernels use: a tensor assigned to the pool after
    construction (``pool.d_cache = ...``) is reported, since the views would still hold the old one."""
    own = {f"pool.{name}": t for name, t in pool._pool_tensors().items()
           if not any(t is other for other in tensors.values())}
    placement.collective_placement_check(
        group=pool.group, expected_device=pool.device, require_current_device=(pool.group is not None),
        fingerprint=pool.fingerprint, tensors={**tensors, **own}, context=context,
        extra_problems=replaced_tensors(pool))


def replaced_tensors(pool: ReplaySSMStatePool) -> list[str]:
    """The problem text for the pool tensors its per-layer views (the kernels' arguments) no longer view, i.e.
    assigned after construction; empty when there are none."""
    views = pool.layer(0)
    replaced = [name for name in views._fields  # (a deep copy keeps a view and its tensor on one storage)
                if getattr(views, name).untyped_storage()._cdata != getattr(pool, name).untyped_storage()._cdata]
    if not replaced:
        return []
    return [f"pool.{', pool.'.join(replaced)} replaced after construction (the decode and verify kernels use views "
            f"of the tensors the pool made; build a new pool instead of assigning its tensors)"]


def same_call_on_every_rank(pool: ReplaySSMStatePool, where: str, **args: Any) -> None:
    """Debug mode, on a pool with a group of two or more ranks: the ranks compare this call and ``args`` (what every
    rank must pass alike: integer tensors by value, other tensors by dtype and shape, anything else by ``repr``) and
    all raise the same :class:`RankMismatchError` when any differs, before the call writes anything. One gloo
    all-gather of a digest per call (the arguments themselves only on a difference); integer tensors are read back
    to the host. Elsewhere nothing happens: ranks that disagree would compute each other's requests' heads or move
    their cursors apart without an error (docs/layers.md)."""
    if not pool.debug or pool.group is None or pool.tp_size < 2:
        return
    mine = (where, {name: _value_text(value) for name, value in args.items()})
    got = placement.gather_if_different(pool.group, text_digest(repr(mine)), mine, f"{where} (debug check)",
                                        f"Local call: {where} with {mine[1]}")
    if got is not None:
        raise RankMismatchError(_mismatch_text(got))


def leading_dims(t: object) -> object:
    """What ranks must agree on in an activation: its dims but the last (a rank's channels are its own)."""
    return tuple(t.shape[:-1]) if isinstance(t, torch.Tensor) else type(t).__name__


def _value_text(value: object) -> str:
    """How ranks compare one argument (any value: the call's own checks come after the exchange)."""
    if isinstance(value, torch.Tensor):
        kind = f"{value.dtype} {tuple(value.shape)}"
        if value.is_floating_point() or value.is_complex() or value.device.type == "meta":
            return kind
        try:
            return f"{value.tolist()}" + ("" if value.dtype == torch.int32 else f" ({value.dtype})")
        except Exception:  # noqa: BLE001 - a tensor whose values cannot be read here
            return f"{kind} on {value.device}"
    return repr(value)


def _mismatch_text(got: list[tuple[str, dict[str, str]]]) -> str:
    """The one text every rank raises, from the gathered ``(call, {argument: value})`` of every rank."""
    def ranks_with(values: list[str]) -> str:
        by_value: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            by_value.setdefault(value, []).append(rank)
        return "; ".join(f"{_short(value)} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                         for value, r in by_value.items())

    calls = [call for call, _ in got]
    if len(set(calls)) > 1:
        what = f"the ranks are in different calls: {ranks_with(calls)}"
    else:
        names = list(dict.fromkeys(name for _, args in got for name in args))
        diffs = [f"`{name}`: {ranks_with([args.get(name, '(not given)') for _, args in got])}" for name in names
                 if len({args.get(name) for _, args in got}) > 1]
        what = f"{calls[0]}: the ranks passed different arguments: " + "; ".join(diffs)
    return (f"{what} (debug check; every rank of a tensor-parallel group must make the same pool calls with the same "
            f"step arguments: docs/layers.md)")


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 5] + " ..."
