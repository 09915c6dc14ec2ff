"""Memory accounting of ReplaySSMStatePool: ``pool.memory`` against the bytes of its tensors (and the log line at
construction), and ``slots_that_fit`` against ``pool_memory`` for a byte budget.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from _pool_helpers import KD, make_pool, pool_tensors
from tp_replayssm import KDAHeads
from tp_replayssm.pool.memory import pool_memory, slots_that_fit


@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_memory_accounting_matches_tensors(caplog, layout):
    heads = KDAHeads(2, 8, KD, 32)
    with caplog.at_level(logging.INFO, logger="tp_replayssm.pool"):
        pool = make_pool(heads, num_layers=3, num_slots=5, ring_length=4, tp_rank=1, tp_size=2,
                         state_dtype=torch.bfloat16, ring_layout=layout)
    # the local shard: one q/k head, four value heads; the pre-decayed keys are per value head
    assert pool.k_cache.shape[2] == (4 if layout == "predecayed" else 1)
    mem = pool.memory
    tensors = {**pool_tensors(pool), "cursors": pool.cursors, "slot_errors": pool.slot_errors}
    assert mem.total == sum(t.numel() * t.element_size() for t in tensors.values())
    one = {name: t[0, 0] for name, t in pool_tensors(pool).items()}
    nbytes = {name: t.numel() * t.element_size() for name, t in one.items()}
    assert mem.checkpoint_per_slot_layer == nbytes["checkpoint"]
    assert mem.d_ring_per_slot_layer == nbytes["d_cache"]
    assert mem.k_ring_per_slot_layer == nbytes["k_cache"]
    assert mem.g_ring_per_slot_layer == nbytes["g_cache"]
    assert mem.per_layer == sum(t[0].numel() * t.element_size() for t in pool_tensors(pool).values())
    assert mem.per_slot == 3 * sum(nbytes.values()) + pool.cursors.element_size()
    assert any("ReplaySSMStatePool" in r.getMessage() for r in caplog.records)
    assert any(f"per slot {mem.per_slot} B" in r.getMessage() for r in caplog.records)
    assert any(f"{layout} ring layout" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_slots_that_fit(tp, layout):
    heads = KDAHeads(2, 8, 64, 64)
    cfg = dict(tp_size=tp, num_layers=4, ring_length=8, state_dtype=torch.float32, cache_dtype=torch.bfloat16,
               ring_layout=layout)
    for budget in (0, 100, 10**6, 3 * 2**30, pool_memory(heads, num_slots=37, **cfg).total):
        n = slots_that_fit(heads, budget_bytes=budget, **cfg)
        assert n >= 0
        if n:
            assert pool_memory(heads, num_slots=n, **cfg).total <= budget
        assert pool_memory(heads, num_slots=n + 1, **cfg).total > budget
    assert slots_that_fit(heads, budget_bytes=pool_memory(heads, num_slots=37, **cfg).total, **cfg) == 37
    for bad in (dict(budget_bytes=-1), dict(budget_bytes=1.5), dict(num_layers=0), dict(ring_length=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            slots_that_fit(heads, **{**cfg, "budget_bytes": 10**6, **bad})
    with pytest.raises(ValueError, match="tp=3"):
        slots_that_fit(heads, **{**cfg, "tp_size": 3}, budget_bytes=10**6)
    with pytest.raises(ValueError, match="checkpoint_per_slot_layer"):
        dataclasses.replace(pool_memory(heads, num_slots=1, **cfg), checkpoint_per_slot_layer=-1)
