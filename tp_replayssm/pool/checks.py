"""The pool's checks across ranks: placement (its tensors and a call's on the pool's device, the pool's tensors not
replaced) and the exchange of the ranks' slot-check results at ``verify_placement`` (debug mode's comparison of the
ranks' calls is :mod:`tp_replayssm.pool.agreement`).

Both are collective when the pool has a group (every rank calls them at the same point) and raise the same error on
every rank: :class:`~tp_replayssm.errors.PlacementError` from :func:`tp_replayssm.tp.placement.collective_placement_check`,
:class:`~tp_replayssm.errors.SlotError` naming each rank whose ``check()`` raised (docs/contract.md, sections 4 and 5).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..errors import PlacementError, SlotError
from ..tp import placement

if TYPE_CHECKING:
    from .pool import ReplaySSMStatePool

__all__ = ["arguments_on_every_rank", "check_placement", "replaced_tensors", "verify_placement"]


def arguments_on_every_rank(group: object | None, problem: str | None, where: str) -> None:
    """Construction with a group (nothing without one), before anything is allocated: the ranks exchange whether their arguments build a
    pool (``problem``: this rank's ``ValueError`` text, None when they do). One all-gather of a flag per rank, the
    texts only when some rank has one; then every rank raises the same :class:`PlacementError` naming each rank whose
    arguments were refused, where a lone ``ValueError`` would leave the others waiting in their placement check."""
    import torch.distributed as dist

    if group is None:
        return
    texts = placement.gather_texts(group, problem, f"{where}.__init__ (the arguments)")
    bad = [(rank, g, text) for rank, (text, g) in enumerate(zip(texts, dist.get_process_group_ranks(group)))
           if text is not None]
    if bad:  # (the placement check's form: its first line names the offending ranks)
        raise PlacementError("\n".join(
            [f"placement check failed during {where}.__init__ ({len(texts)} ranks): the arguments build no pool; "
             f"offending rank(s): {', '.join(str(rank) for rank, _, _ in bad)}"]
            + [f"  {placement.rank_name(rank, g)}: {text}" for rank, g, text in bad]))


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
        fingerprint=dataclasses.replace(pool.fingerprint, debug=pool.debug),  # (debug mode as it is now)
        tensors={**tensors, **own}, context=context, extra_problems=replaced_tensors(pool))


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
