"""The commit of a speculative step (:meth:`tp_replayssm.pool.ReplaySSMStatePool.commit`).

:func:`run_commit` dispatches: on CPU tensors (unless the interpreter backend is chosen) the torch ops of
:func:`tp_replayssm.reference_spec.commit_rows`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..pool.slots import SlotGuard
from ..reference_spec import commit_rows
from .backend import runs_kernel

if TYPE_CHECKING:
    from ..pool.pool import ReplaySSMStatePool

__all__ = ["run_commit"]


def run_commit(pool: ReplaySSMStatePool, slots: torch.Tensor, num_accepted: torch.Tensor,
               parents: torch.Tensor | None, path: torch.Tensor | None, drafts: int, guard: SlotGuard,
               conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """Commit the step of ``slots`` (validated) in place; no host sync."""
    if slots.shape[0] == 0:
        return
    commit_rows(pool.cursors, slots, num_accepted, parents, path, drafts,
                (pool.d_cache, pool.k_cache, pool.g_cache), pool.spec_folded, guard, conv)
