"""Resharding a request's state between tp sizes (docs/lifecycle.md) through ``export_state`` / ``import_state``:
pools of every tp size side by side in one process, and ``1 -> 2 -> 4 -> 1`` on four gloo processes (the scenario
and the rank worker are in ``_lifecycle_workers``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import _dist_helpers as h
import _lifecycle_workers as lw
from _lifecycle_helpers import DEV, LAYOUTS


@pytest.mark.parametrize(
    ("H_", "HV_", "tps", "state", "cache", "tol"),
    [
        (2, 8, (1, 2, 4, 1), torch.float32, torch.float32, 1e-5),  # q/k heads replicated at tp=4
        (4, 4, (2, 4, 1, 2), torch.float32, torch.bfloat16, 1e-2),  # bf16 rings: rounded where they were written
        (2, 8, (4, 1, 2), torch.bfloat16, torch.bfloat16, 1e-2),  # bf16 checkpoint: the fold is rounded once more
    ],
    ids=["fp32-1-2-4-1", "bf16ring-2-4-1-2", "bf16-4-1-2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reshard_in_one_process(layout: str, H_: int, HV_: int, tps: tuple[int, ...], state: torch.dtype,
                                cache: torch.dtype, tol: float) -> None:
    """Pools of every tp size side by side (no process group): decode, export every rank, import into the next
    tp size, continue; outputs, states and conv windows against the uninterrupted single-rank pool."""
    errs = lw.reshard_chain(H_, HV_, tps, (3, 2, 3, 2)[:len(tps)], layout, state, cache, pickle_shards=True,
                            device=DEV)
    assert errs["out"] < tol and errs["state"] < tol, errs
    assert errs["conv"] == 0.0, errs  # the conv windows travel exactly


@pytest.mark.timeout(300)
def test_reshard_across_processes_1_2_4_1(tmp_path: Path) -> None:
    """Four gloo ranks: tp=1 on rank 0, tp=2 on ranks 0-1 (a group), tp=4 on all, tp=1 again, with H=2 q/k heads
    (replicated at tp=4) and HV=8, conv state W=4, fp32 checkpoints and rings; the shards travel pickled through
    ``all_gather_object``. Both ring layouts in one spawn."""
    res = h.run_ranks(lw.reshard_worker, 4, tmp_path, 2, 8, (1, 2, 4, 1), (3, 2, 3, 2), tuple(LAYOUTS),
                      timeout_s=280)
    for layout in LAYOUTS:
        r0 = res[0][layout]
        assert r0["out"] < 1e-5 and r0["state"] < 1e-5 and r0["conv"] == 0.0, (layout, r0)
        assert r0["shards_seen"] == 1 + 2 + 4 + 1
        assert [r[layout]["ran"] for r in res] == [[1, 2, 4, 1], [2, 4], [4], [4]]
