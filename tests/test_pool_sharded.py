"""Tensor parallel in one process: every rank's ReplaySSMStatePool of a ``tp``-way split, fed its slices of the
inputs, gives the single-rank pool's outputs and states (equal heads and fewer q/k heads than ranks).
"""

from __future__ import annotations

import pytest
import torch

from _pool_helpers import DEV, KD, L, VD, i32, make_pool, params_for
from tp_replayssm import KDAHeads
from tp_replayssm.testing import random_decode_inputs
from tp_replayssm.tp.heads import all_shards, concat_outputs


def assert_single_rank_result(got: torch.Tensor, want: torch.Tensor, step: int) -> None:
    """The sharded result is the single-rank one: exactly where the kernel runs (one program per row and value head
    whatever the shard), to fp32 rounding on the CPU's PyTorch path, whose vectorized elementwise ops round a
    shard's narrower tensors in other SIMD lanes (as test_heads' sharded reference test allows)."""
    if got.device.type == "cuda":
        assert torch.equal(got, want), step
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"step {step}: {m}")


def _run_sharded(heads: KDAHeads, tp: int, ring_length: int, n_steps: int, rows: list[int], flush_at: dict[int, int],
                 ring_layout: str):
    gen = torch.Generator().manual_seed(heads.num_q_heads * 31 + heads.num_v_heads * 7 + tp)
    p = params_for(heads.num_v_heads, gen)
    single = make_pool(heads, num_layers=1, ring_length=ring_length, ring_layout=ring_layout)
    ranks = [make_pool(heads, num_layers=1, ring_length=ring_length, tp_rank=t, tp_size=tp, ring_layout=ring_layout)
             for t in range(tp)]
    ids = [single.alloc(3).tolist()] + [r.alloc(3).tolist() for r in ranks]
    assert all(i == ids[0] for i in ids)  # same allocation order on every rank
    slots = i32([ids[0][r] if r >= 0 else -1 for r in rows])
    for step in range(n_steps):
        inp = random_decode_inputs(len(rows), heads.num_q_heads, heads.num_v_heads, KD, VD, dtype=torch.float32,
                                   device=DEV, generator=gen)
        force = i32([1 if flush_at.get(step) == b else 0 for b in range(len(rows))])
        want = single.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots, force_flush=force)
        outs = []
        for pool in ranks:
            sh = pool.shard
            outs.append(pool.decode(0, sh.slice_mixed_qkv(inp.mixed_qkv), sh.slice_a(inp.a), sh.slice_b(inp.b),
                                    sh.slice_A_log(p.A_log), sh.slice_dt_bias(p.dt_bias), slots, force_flush=force))
            assert outs[-1].shape == (len(rows), 1, heads.num_v_heads // tp, VD)
        assert_single_rank_result(concat_outputs(outs), want, step)
        for pool in [single, *ranks]:
            pool.advance(slots, force)
        assert all(torch.equal(r.cursors, single.cursors) for r in ranks)
        live = slots[slots >= 0]
        full = single.read_state(0, live)
        assert_single_rank_result(concat_outputs([r.read_state(0, live) for r in ranks], dim=1), full, step)
        for pool in ranks:  # each rank's state is the slice of the single-rank one
            assert_single_rank_result(pool.read_state(0, live), pool.shard.slice_state(full), step)


@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_sharded_h_equals_hv_matches_single_rank(layout):
    heads = KDAHeads(2, 2, KD, VD)
    _run_sharded(heads, tp=2, ring_length=4, n_steps=5, rows=[0, -1, 1, 2], flush_at={1: 2}, ring_layout=layout)


@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_sharded_fewer_qk_heads_than_ranks_matches_single_rank(layout):
    heads = KDAHeads(2, 8, KD, VD)  # H=2 < tp=4: each q/k head replicated on two ranks
    assert [s.q_head_start for s in all_shards(heads, 4)] == [0, 0, 1, 1]
    _run_sharded(heads, tp=4, ring_length=L, n_steps=3, rows=[1, -1, 0, -1], flush_at={0: 0}, ring_layout=layout)
