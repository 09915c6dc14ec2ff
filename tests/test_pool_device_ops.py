"""ReplaySSMStatePool's own device ops (no decode kernel): alloc and free with its free list, the cursor advance
against a cursor model, and ``load_state``/``read_state`` against an independent float64 replay of the ring.
"""

from __future__ import annotations

import random

import pytest
import torch

from _pool_helpers import CURSOR_SENTINEL, DEV, KD, S, SENTINEL, VD, i32, make_pool, pool_tensors
from tp_replayssm import PoolExhaustedError


def test_alloc_zeroes_and_free_list():
    pool = make_pool()
    for t in pool_tensors(pool).values():
        t.fill_(SENTINEL)
    pool.cursors.fill_(CURSOR_SENTINEL)
    ids = pool.alloc(3)
    assert ids.dtype == torch.int32 and ids.device == pool.device and len(set(ids.tolist())) == 3
    for t in pool_tensors(pool).values():
        assert torch.count_nonzero(t[:, ids.long()]) == 0
    assert pool.cursors[ids.long()].tolist() == [0, 0, 0]
    rest = sorted(set(range(S)) - set(ids.tolist()))
    assert (pool.checkpoint[:, rest] == SENTINEL).all()  # other slots untouched
    assert pool.num_free == S - 3 and pool.num_allocated == 3
    assert pool.alloc(0).shape == (0,)
    with pytest.raises(PoolExhaustedError) as exc:
        pool.alloc(S - 2)
    assert all(str(v) in str(exc.value) for v in (S - 2, S - 3, S))
    assert pool.num_free == S - 3  # nothing allocated
    pool.free(ids[:2])
    pool.free([int(ids[2])])
    assert pool.num_free == S and sorted(pool.alloc(S).tolist()) == list(range(S))


def test_free_list_hands_out_the_longest_freed_first():
    """The free list is first in, first out: ids start in order, a freed id goes to the back (SlotTable)."""
    pool = make_pool()
    assert pool.alloc(3).tolist() == [0, 1, 2]
    pool.free([1, 0])
    assert pool.alloc(3).tolist() == [*range(3, S), 1, 0]  # (S = 4)


@pytest.mark.parametrize("bad", [[0, 0], [S], [-1], [1, 2], [0, 5], "0"])
def test_free_rejects_and_frees_nothing(bad):
    pool = make_pool()
    pool.alloc(1)  # slot 0
    with pytest.raises(ValueError):
        pool.free(bad)
    assert pool.allocated_slots() == [0]
    pool.free([0])
    with pytest.raises(ValueError, match="double free"):
        pool.free([0])


def test_free_rejects_bad_id_containers():
    pool = make_pool()
    pool.alloc(2)
    for bad in (torch.tensor([0.0]), torch.zeros(1, 1, dtype=torch.int32), [0, 1.0], None, torch.tensor([True])):
        with pytest.raises(ValueError, match="slots"):
            pool.free(bad)
    assert pool.allocated_slots() == [0, 1]
    pool.free(torch.tensor(1))  # a 0-D tensor or a plain int is one id
    pool.free(0)
    assert pool.num_allocated == 0


@pytest.mark.parametrize("n", [-1, 1.5, True, None])
def test_alloc_rejects_bad_n(n):
    with pytest.raises(ValueError, match="`n`"):
        make_pool().alloc(n)


def test_advance_matches_cursor_model():
    pool = make_pool(num_slots=6, ring_length=4)
    live = pool.alloc(6).tolist()
    rng = random.Random(0)
    for _ in range(30):
        start = [rng.randrange(4) for _ in range(6)]
        pool.cursors[:6] = i32(start)
        rows = [rng.choice(live + [-1, -3]) for _ in range(rng.randrange(1, 9))]
        flags = [rng.choice([0, 0, 1, 7]) for _ in rows]
        use_flags = rng.random() < 0.7
        pool.advance(i32(rows), i32(flags) if use_flags else None)
        expected = list(start)
        for s in set(r for r in rows if r >= 0):
            if rows.count(s) > 1:  # a slot named twice in one call is refused (slot safety): unchanged
                continue
            flushed = start[s] == 3 or (use_flags and any(f for r, f in zip(rows, flags) if r == s))
            expected[s] = 0 if flushed else start[s] + 1
        assert pool.cursors[:6].tolist() == expected
        pool.slot_errors.zero_()


@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_load_state_and_read_state(layout):
    pool = make_pool(num_layers=2, state_dtype=torch.bfloat16, ring_layout=layout)
    ids = pool.alloc(3)
    gen = torch.Generator().manual_seed(4)
    for t in (pool.d_cache, pool.k_cache, pool.g_cache):
        t.copy_(torch.randn(t.shape, generator=gen) * 0.3)  # copy_ moves it to the pool's device
    pool.checkpoint.copy_(torch.randn(pool.checkpoint.shape, generator=gen))
    pool.cursors[ids.long()] = i32([0, 1, 2])
    # read_state = checkpoint + replayed ring of that layer, from an independent float64 recurrence
    for layer in range(2):
        got = pool.read_state(layer, ids)
        assert got.dtype == torch.float32 and got.shape == (3, 2, VD, KD)
        for n, s in enumerate(ids.tolist()):
            c = int(pool.cursors[s])
            Sx = pool.checkpoint[layer, s].double()
            for j in range(c):
                g = pool.g_cache[layer, s, :, j].double()  # [HV, K]
                d = pool.d_cache[layer, s, :, j].double()  # [HV, V]
                if layout == "sglang":  # per-step gates, one key per q/k head (H = 1)
                    k = pool.k_cache[layer, s, 0, j].double()
                    Sx = Sx * g.exp()[:, None, :] + d[:, :, None] * k[None, None, :]
                else:  # keys k_j * exp(-G_j) per value head; the state is scaled by exp(G_{c-1}) at the end
                    k = pool.k_cache[layer, s, :, j].double()  # [HV, K]
                    Sx = Sx + d[:, :, None] * k[:, None, :]
            if layout == "predecayed" and c > 0:
                Sx = Sx * pool.g_cache[layer, s, :, c - 1].double().exp()[:, None, :]
            torch.testing.assert_close(got[n].double(), Sx, rtol=1e-5, atol=1e-5)
    before = {k: v.clone() for k, v in {**pool_tensors(pool), "cursors": pool.cursors}.items()}
    pool.read_state(0, ids)
    assert all(torch.equal(before[k], v) for k, v in {**pool_tensors(pool), "cursors": pool.cursors}.items())

    states = torch.randn(2, 2, VD, KD, generator=gen).to(DEV)
    target = ids[1:]
    layer0 = pool.read_state(0, ids)
    untouched = pool.read_state(1, ids[:1])
    pool.load_state(1, target, states)
    torch.testing.assert_close(pool.read_state(1, target), states.bfloat16().float(), rtol=0, atol=0)
    assert torch.equal(pool.read_state(0, ids), layer0)  # other layer keeps its ring
    assert torch.equal(pool.cursors, before["cursors"])  # shared cursor untouched
    assert torch.equal(pool.read_state(1, ids[:1]), untouched)  # other slots of the layer untouched
