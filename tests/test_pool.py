"""ReplaySSMStatePool (docs/contract.md, the pool) against the float64 plain recurrence.

On CPU the pool's decode runs the library's PyTorch path (its default for CPU tensors), so these tests are fast
and need no environment variable. The Helion kernel behind the pool runs in Triton's interpreter in one test per
ring layout (``test_pool_kernel_in_interpreter_matches_plain_kda``, the ``interpreter`` fixture), whose cost,
~0.1 s per (live row, value head) and a compile per shape, keeps it to the small geometry ``SMALL`` (H=1, HV=2,
K=V=16, S=4, L=3, B=4). With CUDA present the same tests run on ``cuda:0`` with the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tp_replayssm import KDAHeads, PlacementError, PoolExhaustedError, ReplaySSMStatePool, SlotError
from tp_replayssm import reference
from tp_replayssm.pool import step as pool_module  # (the pool delegates its decode here)
from tp_replayssm.pool.memory import pool_memory, slots_that_fit
from tp_replayssm.pool.pool import DEBUG_ENV
from tp_replayssm.testing import PlainKDA, random_decode_inputs, random_head_params, rel_err
from tp_replayssm.tp import placement
from tp_replayssm.tp.heads import all_shards, concat_outputs

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
KD = VD = 16
SMALL = KDAHeads(1, 2, KD, VD)
S, L, B = 4, 3, 4
SENTINEL = 1e30
CURSOR_SENTINEL = 1000
TOL_BF16 = 2e-2  # ring entries rounded to bf16, outputs in bf16


def make_pool(heads: KDAHeads = SMALL, **kw) -> ReplaySSMStatePool:
    kw.setdefault("num_layers", 2)
    kw.setdefault("num_slots", S)
    kw.setdefault("ring_length", L)
    kw.setdefault("device", DEV)
    return ReplaySSMStatePool(heads, **kw)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def params_for(num_v_heads: int, gen: torch.Generator | None = None):
    return random_head_params(num_v_heads, KD, device=DEV, generator=gen)


def small_inputs(gen: torch.Generator | None = None, device: torch.device | str = DEV):
    """fp32 activations for ``SMALL`` (the kernel tests use fp32: one compiled kernel per dtype)."""
    return random_decode_inputs(B, 1, 2, KD, VD, dtype=torch.float32, device=device, generator=gen)


def pool_tensors(pool: ReplaySSMStatePool) -> dict[str, torch.Tensor]:
    return {"checkpoint": pool.checkpoint, "d_cache": pool.d_cache, "k_cache": pool.k_cache, "g_cache": pool.g_cache}


def snapshot_slots(pool: ReplaySSMStatePool, slots: list[int]) -> dict[str, torch.Tensor]:
    idx = torch.tensor(slots, dtype=torch.long, device=DEV)
    snap = {name: t[:, idx].clone() for name, t in pool_tensors(pool).items()}
    snap["cursors"] = pool.cursors[idx].clone()
    return snap


def assert_bit_identical(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    for name in before:
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name


# ---- the main scenario: many steps, several layers, churn, flushes, load_state, sentinels ---------

# (layout, lower_bound, A_log_shift, fused advance) of the step scenarios, CPU and CUDA-graph alike
STEP_CASES = pytest.mark.parametrize("layout, lower_bound, A_log_shift, fused", [
    ("sglang", None, 0.0, False), ("predecayed", -5.0, 0.0, False), ("predecayed", None, 4.5, False),
    ("sglang", None, 0.0, True), ("predecayed", None, 4.5, True)],
    ids=["sglang-layout", "predecayed-layout", "predecayed-rebasing", "sglang-layout-fused-advance",
         "predecayed-rebasing-fused-advance"])


@STEP_CASES
def test_pool_matches_plain_kda_over_ring_cycles_with_churn(layout, lower_bound, A_log_shift, fused):
    """Two layers, >= 2 full ring cycles, padding rows, forced flushes, free + re-alloc mid-stream
    (of a never-used sentinel-filled slot and of a used one), load_state mid-ring on one layer, and
    read_state equal to the oracle at every cursor; unallocated slots stay bit-identical. In both ring
    layouts: ``ring_layout="predecayed"`` stores cumulative gates and pre-decayed keys per value head (GQA
    here: one q/k head, two value heads); with strong softplus gates (``A_log_shift``) its heads rebase.
    ``fused``: the step's last decode moves the cursors (``decode(..., advance=True)``), no ``advance`` call."""
    NL = 2
    pool = make_pool(num_layers=NL, ring_layout=layout)
    assert pool.k_cache.shape[2] == (2 if layout == "predecayed" else 1)
    gen = torch.Generator().manual_seed(1234)
    rng = random.Random(99)
    params = [params_for(SMALL.num_v_heads, gen) for _ in range(NL)]
    params = [dataclasses.replace(p, A_log=p.A_log + A_log_shift) for p in params]
    rebases = 0
    scales = [None, 0.3]  # layer 1 with an explicit scale
    oracles = [PlainKDA(S, 1, 2, KD, VD) for _ in range(NL)]

    live = pool.alloc(3).tolist()
    unalloc = sorted(set(range(S)) - set(live))
    idx = torch.tensor(unalloc, dtype=torch.long, device=DEV)
    for t in pool_tensors(pool).values():
        t[:, idx] = SENTINEL
    pool.cursors[idx] = CURSOR_SENTINEL
    frozen = snapshot_slots(pool, unalloc)
    cursor_model = {s: 0 for s in live}
    ever_live = set(live)
    reused = []  # re-allocated slots that had held a request before

    n_steps = 3 * L  # three full ring cycles
    for step in range(n_steps):
        if step in (3, 5):  # churn: a request finishes, a new one takes a slot
            gone = live.pop(rng.randrange(len(live)))
            pool.free([gone])
            was_used = set(pool.allocated_slots())
            new = pool.alloc(1).tolist()[0]
            assert new not in was_used
            if new in ever_live:
                reused.append(new)
            ever_live.add(new)
            unalloc = sorted((set(unalloc) | {gone}) - {new})
            frozen = snapshot_slots(pool, unalloc)  # the freed slot's stale content must stay untouched
            live.append(new)
            cursor_model.pop(gone)
            cursor_model[new] = 0
            for o in oracles:
                o.reset([new])
            assert int(pool.cursors[new]) == 0
            for layer in range(NL):  # a re-allocated slot starts from zero, whatever it held
                assert torch.count_nonzero(pool.read_state(layer, i32([new]))) == 0
                assert torch.count_nonzero(pool.checkpoint[layer, new]) == 0
        if step == 7:  # prefill-style load on layer 1 only, mid-ring: other layer and cursors untouched
            target = max(live, key=lambda s: cursor_model[s])
            assert cursor_model[target] > 0
            states = (torch.randn(1, 2, VD, KD, generator=gen) * 0.5).to(DEV)
            other_before = pool.read_state(0, i32([target]))
            cursors_before = pool.cursors.clone()
            pool.load_state(1, i32([target]), states)
            oracles[1].load([target], states)
            assert torch.equal(pool.read_state(1, i32([target])), states)
            assert torch.equal(pool.read_state(0, i32([target])), other_before)
            assert torch.equal(pool.cursors, cursors_before)

        rows = live + [-1] * (B - len(live))
        rng.shuffle(rows)
        slots = i32(rows)
        flush_rows = [1 if (step in (1, 4) and r == rows.index(max(live))) else 0 for r in range(B)]
        flush_rows[rows.index(-1)] = 1  # a padding row asking for a flush is ignored
        force = i32(flush_rows)
        for layer in range(NL):
            inp = small_inputs(gen)
            out = torch.full((B, 1, 2, VD), float("nan"), device=DEV)
            got = pool.decode(layer, inp.mixed_qkv, inp.a, inp.b, params[layer].A_log, params[layer].dt_bias, slots,
                              scale=scales[layer], force_flush=force, out=out, lower_bound=lower_bound,
                              advance=fused and layer == NL - 1)
            assert got is out
            want = oracles[layer].step(inp, params[layer], slots, scale=scales[layer], lower_bound=lower_bound)
            real = slots >= 0
            assert rel_err(out[real, 0], want[real.cpu()]) < TOL_BF16, (step, layer)
            assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padding rows exactly zero
            if layout == "predecayed":  # a rebase leaves G_c = 0 exactly where the head would have appended
                for r, s_ in enumerate(rows):
                    c = cursor_model.get(s_, -1)
                    if s_ >= 0 and not flush_rows[r] and c != L - 1:
                        rebases += int((pool.g_cache[layer, s_, :, c] == 0).all(-1).sum())
        if not fused:
            pool.advance(slots, force)
        for s, f in zip(rows, flush_rows):
            if s >= 0:
                cursor_model[s] = 0 if (f or cursor_model[s] == L - 1) else cursor_model[s] + 1
        assert {s: int(pool.cursors[s]) for s in live} == cursor_model, step
        live_t = i32(live)
        for layer in range(NL):
            assert rel_err(pool.read_state(layer, live_t), oracles[layer].state[live]) < TOL_BF16
        assert_bit_identical(frozen, snapshot_slots(pool, unalloc))
    assert reused  # the churn handed a used slot out again (and it started from zero)
    assert (rebases > 0) == (A_log_shift > 0), rebases  # never under lower_bound -5 at L = 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the tests above run the compiled kernel")
@pytest.mark.parametrize("layout, fused", [("sglang", False), ("predecayed", True)],
                         ids=["sglang-advance", "predecayed-fused-advance"])
def test_pool_kernel_in_interpreter_matches_plain_kda(interpreter, monkeypatch, layout, fused):  # noqa: ARG001
    """The pool's steps through the Helion kernel (Triton's interpreter on CPU), one case per ring layout: three
    live rows and a padding row, a forced flush, a full ring cycle and its wrap; outputs, cursors and ``read_state``
    against the float64 oracle after every step. The cursors move by ``pool.advance`` (sglang) or inside the decode
    (``advance=True``, pre-decayed)."""

    def torch_path(*args, **kwargs):
        raise AssertionError("the interpreter backend must launch the kernel, not the PyTorch path")

    monkeypatch.setattr(reference, "decode_rows", torch_path)
    pool = make_pool(num_layers=1, ring_layout=layout)
    gen = torch.Generator().manual_seed(21)
    p = params_for(2, gen)
    oracle = PlainKDA(S, 1, 2, KD, VD)
    live = pool.alloc(3).tolist()
    rows = [live[0], -1, live[1], live[2]]
    slots = i32(rows)
    cursor_model = {s: 0 for s in live}
    for step in range(L + 1):
        flags = [1 if (step == 1 and r == 2) else 0 for r in range(B)]
        force = i32(flags)
        inp = small_inputs(gen)
        out = pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots, force_flush=force,
                          advance=fused)
        want = oracle.step(inp, p, slots)
        assert rel_err(out[:, 0], want) < TOL_BF16, step
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padding row
        if not fused:
            pool.advance(slots, force)
        for s_, f in zip(rows, flags):
            if s_ >= 0:
                cursor_model[s_] = 0 if (f or cursor_model[s_] == L - 1) else cursor_model[s_] + 1
        assert {s_: int(pool.cursors[s_]) for s_ in live} == cursor_model, step
        assert rel_err(pool.read_state(0, i32(live)), oracle.state[live]) < TOL_BF16, step


@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_ring_length_one_flushes_every_step(layout):
    """L = 1: every step folds into the (fp32) checkpoint; tight match with the oracle."""
    pool = make_pool(num_layers=1, ring_length=1, cache_dtype=torch.float32, ring_layout=layout)
    gen = torch.Generator().manual_seed(5)
    p = params_for(2, gen)
    oracle = PlainKDA(S, 1, 2, KD, VD)
    live = pool.alloc(2).tolist()
    slots = i32([live[0], -1, live[1], -1])
    for _ in range(3):
        inp = random_decode_inputs(B, 1, 2, KD, VD, dtype=torch.float32, generator=gen)
        out = pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
        assert out.shape == (B, 1, 2, VD) and out.dtype == torch.float32 and out.device == DEV
        want = oracle.step(inp, p, slots)
        assert rel_err(out[:, 0], want) < 1e-5
        pool.advance(slots)
        assert pool.cursors[live].tolist() == [0] * len(live)  # (the free slots hold FREE_CURSOR)
        assert rel_err(pool.checkpoint[0, live], oracle.state[live]) < 1e-5


# ---- tensor parallel: every rank's pool in one process ------------------------------------------

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


# ---- wiring: the op, the cursors and the placement checks --------------------------------------

@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_decode_calls_the_op_with_layer_views_and_cursors(monkeypatch, layout):
    """The pool's decode is one ``run_decode`` call (the op's entry) on the layer's views, with the pool's cursor
    table read by slot (``cursor_table=True``) in the pool's ring layout."""
    pool = make_pool(num_layers=3, ring_layout=layout)
    live = pool.alloc(3)
    pool.cursors[live.long()] = i32([2, 0, 1])
    seen = {}
    real = pool_module.run_decode

    def spy(call, **kwargs):
        seen["call"], seen["kwargs"] = call, kwargs
        return real(call, **kwargs)

    monkeypatch.setattr(pool_module, "run_decode", spy)
    gen = torch.Generator().manual_seed(3)
    p = params_for(2, gen)
    inp = small_inputs(gen)
    slots = i32([int(live[1]), -1, int(live[0]), int(live[2])])
    ckpt_before = pool.checkpoint.clone()
    out = pool.decode(2, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
    call = seen["call"]
    views = (call.initial_state, call.d_cache, call.k_cache, call.g_cache)
    for got, whole in zip(views, (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache)):
        assert got.data_ptr() == whole[2].data_ptr() and got.shape == whole.shape[1:]
    assert call.out is out and call.ssm_state_indices is slots
    assert call.write_pos is pool.cursors  # the kernel reads each row's cursor by slot from the pool's table
    assert seen["kwargs"]["cursor_table"] is True and seen["kwargs"]["ring_layout"] == layout
    assert seen["kwargs"]["advance"] is False
    assert call.use_qk_l2norm_in_kernel is True
    assert out.dtype == inp.mixed_qkv.dtype
    # live[0] was at cursor L-1: only it flushed, into layer 2's checkpoint
    changed = (pool.checkpoint != ckpt_before).flatten(2).any(-1)
    assert changed.nonzero().tolist() == [[2, int(live[0])]]
    assert pool.cursors[live.long()].tolist() == [2, 0, 1]  # decode never moves cursors


def test_placement_checked_at_build_first_decode_per_layer_and_verify(monkeypatch):
    calls = []
    real = placement.collective_placement_check

    def spy(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(placement, "collective_placement_check", spy)
    pool = make_pool(num_layers=2)
    assert len(calls) == 1
    assert {"checkpoint", "d_cache", "k_cache", "g_cache", "cursors"} <= set(calls[0]["tensors"])
    assert calls[0]["group"] is None and calls[0]["require_current_device"] is False
    assert calls[0]["expected_device"] == pool.device and calls[0]["fingerprint"] == pool.fingerprint
    assert pool.fingerprint.num_slots == S and pool.fingerprint.tp_size == 1
    gen = torch.Generator().manual_seed(0)
    p = params_for(2, gen)
    inp = small_inputs(gen)
    slots = i32([-1, -1, -1, -1])  # padding only: cheap
    for layer in (0, 0, 1, 1, 0):
        pool.decode(layer, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
    assert len(calls) == 3  # once per layer
    names = set(calls[1]["tensors"])
    assert {"mixed_qkv", "a", "b", "A_log", "dt_bias", "slots", "out", "checkpoint", "d_cache"} <= names
    pool.verify_placement()
    assert len(calls) == 4 and "verify_placement" in calls[3]["context"]
    assert {"pool.checkpoint", "pool.d_cache", "pool.slot_errors"} <= names  # the pool's own beside the layer's views


def test_a_pool_tensor_assigned_after_construction_is_refused() -> None:
    """``pool.d_cache = ...`` after construction leaves the kernels' per-layer views on the old tensor (decode and
    verify would use one cache, fork/export/commit the other): the placement check names it, at a layer's first
    decode and at verify_placement(), before anything is written, even when the new tensor is on the pool's device."""
    pool = make_pool(num_layers=2)
    gen = torch.Generator().manual_seed(0)
    p = params_for(2, gen)
    inp = small_inputs(gen)
    slots = i32([-1, -1, -1, -1])
    pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
    original = pool.d_cache
    pool.d_cache = original.clone()
    with pytest.raises(PlacementError, match=r"pool\.d_cache replaced after construction .* build a new pool"):
        pool.verify_placement()
    with pytest.raises(PlacementError, match=r"(?s)decode\(layer=1\).*pool\.d_cache replaced"):
        pool.decode(1, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
    pool.d_cache = original
    pool.verify_placement()
    pool.decode(1, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)


def test_placement_error_on_first_decode_with_inputs_elsewhere():
    pool = make_pool(num_layers=1)
    p = params_for(2)
    inp = small_inputs(device="meta")
    with pytest.raises(PlacementError, match="mixed_qkv"):
        pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, i32([-1] * B))


# ---- the pool's own device ops (no kernel) --------------------------------------------------------

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


# ---- memory accounting ---------------------------------------------------------------------------

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


# ---- bad input and debug mode --------------------------------------------------------------------

@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(heads=(1, 2, 16, 16)), "heads"),
        (dict(num_layers=0), "num_layers"),
        (dict(num_slots=-1), "num_slots"),
        (dict(ring_length=0), "ring_length"),
        (dict(ring_length=2.0), "ring_length"),
        (dict(state_dtype=torch.float16), "state_dtype"),
        (dict(cache_dtype=torch.int8), "cache_dtype"),
        (dict(tp_size=3), "tp=3"),
        (dict(tp_size=2, tp_rank=2), "tp_rank"),
        (dict(heads=KDAHeads(3, 6, 16, 16), tp_size=2, tp_rank=0), "H=3"),
        (dict(ring_layout="pre-decayed"),
         r"`ring_layout` must be one of \['predecayed', 'sglang'\]; got 'pre-decayed'"),
        (dict(ring_layout="spec"), r"`ring_layout` must be one of \['predecayed', 'sglang'\]; got 'spec'"),  # not a layout name
        (dict(ring_layout=None), "`ring_layout`.*got None"),
        (dict(ring_layout="predecayed", cache_dtype=torch.float16), "cache dtype.*float16"),
    ],
)
def test_constructor_rejects_bad_config(kw, needle):
    heads = kw.pop("heads", SMALL)
    with pytest.raises(ValueError, match=needle):
        make_pool(heads, **kw)


def test_default_ring_layout_is_predecayed():
    """The pool's default ring layout is "predecayed" (k ring per value head); "sglang" keeps SGLang's k ring, one
    key per q/k head ``[NL, S, H_l, L, K]``. An fp16 cache needs the sglang layout, and the error says so."""
    heads = KDAHeads(2, 8, KD, VD)  # local shard of tp=2: H_l = 1, HV_l = 4
    pool = make_pool(heads, num_layers=3, tp_rank=1, tp_size=2)
    assert pool.ring_layout == "predecayed" and pool.predecayed
    assert tuple(pool.k_cache.shape) == (3, S, 4, L, KD)
    sglang = make_pool(heads, num_layers=3, tp_rank=1, tp_size=2, ring_layout="sglang")
    assert sglang.ring_layout == "sglang" and not sglang.predecayed
    assert tuple(sglang.k_cache.shape) == (3, S, 1, L, KD)
    for p in (pool, sglang):  # the other tensors do not depend on the layout
        assert tuple(p.checkpoint.shape) == (3, S, 4, VD, KD) and tuple(p.d_cache.shape) == (3, S, 4, L, VD)
        assert tuple(p.g_cache.shape) == (3, S, 4, L, KD) and tuple(p.cursors.shape) == (S + 1,)
    with pytest.raises(ValueError, match="ring_layout='sglang'"):
        make_pool(cache_dtype=torch.float16)
    assert make_pool(cache_dtype=torch.float16, ring_layout="sglang").cache_dtype == torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    """A CUDA device (by name, torch.device or index) on a machine without CUDA: a ValueError naming `device`, the
    device asked for and the missing CUDA, not torch's bare AssertionError; in the pool and in export_state."""
    pool = make_pool(num_layers=1)
    ids = pool.alloc(1)
    for device, shown in (("cuda", "cuda"), ("cuda:0", "cuda:0"), ("cuda:1", "cuda:1"),
                          (torch.device("cuda", 1), "cuda:1"), (0, "cuda:0")):
        with pytest.raises(ValueError, match="`device`") as info:
            ReplaySSMStatePool(SMALL, num_layers=1, num_slots=S, ring_length=L, device=device)
        assert f"`device` is {shown} " in str(info.value) and "no CUDA device" in str(info.value), info.value
        with pytest.raises(ValueError, match="`device`") as info:
            pool.export_state(ids, device=device)
        assert str(info.value).startswith("ReplaySSMStatePool.export_state: `device` is "), info.value
        assert f"`device` is {shown} " in str(info.value) and "no CUDA device" in str(info.value), info.value
    with pytest.raises(ValueError, match="`device` must name a torch device; got 'gpu'"):
        pool.export_state(ids, device="gpu")


def test_decode_and_state_calls_reject_bad_input():
    pool = make_pool(num_layers=2)
    ids = pool.alloc(2)
    p = params_for(2)
    inp = small_inputs()
    pad = i32([-1] * B)
    args = (inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias)
    for layer in (-1, 2, True, 0.0, None):
        with pytest.raises(ValueError, match="layer"):
            pool.decode(layer, *args, pad)
        with pytest.raises(ValueError, match="layer"):
            pool.read_state(layer, ids)
        with pytest.raises(ValueError, match="layer"):
            pool.load_state(layer, ids, torch.zeros(2, 2, VD, KD, device=DEV))
    for bad in (pad.long(), pad[None], [-1] * B):
        with pytest.raises(ValueError, match="slots"):
            pool.decode(0, *args, bad)
        with pytest.raises(ValueError, match="slots"):
            pool.advance(bad)
    with pytest.raises(ValueError, match="mixed_qkv"):  # the op's own check passes through
        pool.decode(0, inp.mixed_qkv[:, :-1], *args[1:], pad)
    for bound in (5.0, float("inf")):  # a gate that grows the state, or none at all
        with pytest.raises(ValueError, match=r"`lower_bound` must be None or a finite float <= 0"):
            pool.decode(0, *args, pad, lower_bound=bound)
    with pytest.raises(ValueError, match="out"):
        pool.decode(0, *args, pad, out=torch.empty(B, 1, 2, VD, dtype=torch.float16, device=DEV))
    for ff in (pad.long(), i32([0] * (B - 1)), [0] * B):
        with pytest.raises(ValueError, match="force_flush"):
            pool.advance(pad, ff)
    for states, needle in [(torch.zeros(2, 2, KD, VD + 1), r"\[n, HV_l, V, K\]"),
                           (torch.zeros(1, 2, VD, KD), "shape"),
                           (torch.zeros(2, 2, VD, KD, dtype=torch.int32), "dtype"),
                           (torch.zeros(2, 2, VD, KD, device="meta"), "meta"),
                           (None, "states")]:
        with pytest.raises(ValueError, match=needle):
            pool.load_state(0, ids, states)
    with pytest.raises(ValueError, match="slots"):
        pool.read_state(0, ids.float())
    with pytest.raises(ValueError, match="slots"):
        pool.load_state(0, ids.to("meta"), torch.zeros(2, 2, VD, KD, device=DEV))


def test_decode_batch_mismatch_names_the_tensor_and_slots():
    """The call's batch is the dim-0 size most per-row tensors share, so the error names the tensor that
    disagrees (``mixed_qkv``, not its neighbour ``a``); the pool's errors call the row slots ``slots``."""
    pool = make_pool(num_layers=1)
    pool.alloc(2)
    p = params_for(2)
    inp = small_inputs()
    pad = i32([-1] * B)
    D = inp.mixed_qkv.shape[1]
    for bad in (inp.mixed_qkv[: B - 1], torch.cat([inp.mixed_qkv, inp.mixed_qkv[:2]])):  # too few rows, too many
        for kw in ({}, {"force_flush": i32([0] * B)}):
            with pytest.raises(ValueError, match="`mixed_qkv`") as info:
                pool.decode(0, bad, inp.a, inp.b, p.A_log, p.dt_bias, pad, **kw)
            text = str(info.value)
            assert "`a`" not in text and f"B = {B}" in text, text
            assert f"must be of shape [{B}, {D}]" in text and f"got shape {list(bad.shape)}" in text, text
    with pytest.raises(ValueError, match="`slots`") as info:
        pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, pad[: B - 1])
    assert "ssm_state_indices" not in str(info.value), info.value
    with pytest.raises(ValueError, match="`force_flush`") as info:
        pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, pad, force_flush=pad[: B - 1])
    assert "ssm_state_indices" not in str(info.value), info.value


def test_later_decode_errors_name_the_callers_arguments():
    """After a layer's first decode (whose placement check names a misplaced input as a PlacementError) the call's
    own checks still speak of the caller's arguments: a misplaced ``mixed_qkv`` is named against the pool's device
    (not the pool's own tensors against it), and a wrong width gives the width this rank's shard expects (the
    pre-decayed layout cannot infer the q/k heads from the caches)."""
    pool = make_pool(num_layers=1)
    assert pool.ring_layout == "predecayed"
    pool.alloc(2)
    p = params_for(2)
    inp = small_inputs()
    pad = i32([0, 1, -1, -1])
    pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, pad)
    with pytest.raises(ValueError, match="not on it: mixed_qkv \\(meta\\)$") as info:
        pool.decode(0, inp.mixed_qkv.to("meta"), inp.a, inp.b, p.A_log, p.dt_bias, pad)
    assert f"must be on the pool's device {DEV}" in str(info.value), info.value
    D = inp.mixed_qkv.shape[1]
    with pytest.raises(ValueError, match=rf"`mixed_qkv` must be of shape \[{B}, {D}\]; got \[{B}, {D - 1}\]"):
        pool.decode(0, inp.mixed_qkv[:, 1:], inp.a, inp.b, p.A_log, p.dt_bias, pad)


def test_sharding_errors_name_the_call():
    """A tensor-parallel size the heads cannot split over is refused by the call the user made."""
    heads = KDAHeads(2, 4, KD, VD)
    with pytest.raises(ValueError, match=r"^ReplaySSMStatePool: value heads must split evenly .*tp=3"):
        ReplaySSMStatePool(heads, num_layers=1, num_slots=S, ring_length=L, device="cpu", tp_size=3, tp_rank=0)
    with pytest.raises(ValueError, match=r"^ReplaySSMStatePool: `tp_rank` must be an int in \[0, tp_size=2\)"):
        ReplaySSMStatePool(heads, num_layers=1, num_slots=S, ring_length=L, device="cpu", tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match=r"^slots_that_fit: value heads must split evenly"):
        slots_that_fit(heads, tp_size=3, num_layers=1, ring_length=L, budget_bytes=2**20)


def test_cpu_with_an_index_is_the_cpu():
    """``device="cpu:0"`` (or ``torch.device("cpu", 0)``) names the CPU, where torch keeps every tensor on "cpu"."""
    for device in ("cpu:0", torch.device("cpu", 0)):
        pool = ReplaySSMStatePool(SMALL, num_layers=1, num_slots=S, ring_length=L, device=device)
        assert pool.device == torch.device("cpu")
        ids = pool.alloc(1)
        inp = random_decode_inputs(1, 1, 2, KD, VD, dtype=torch.float32)
        p = random_head_params(2, KD)
        out = pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, ids)
        assert out.device == torch.device("cpu") and torch.isfinite(out).all()


@pytest.mark.parametrize("debug", [False, True], ids=["eager", "debug"])
def test_every_slot_error_speaks_of_slots(debug):
    """Every pool method that takes slot ids calls them by its own argument's name (``slots``; ``src``/``dst`` in
    fork), never ``ssm_state_indices`` (the raw op's name): wrong type, dtype, rank or length, and ids out of range
    (raised at the call, or by ``check()`` from the record)."""
    pool = make_pool(num_layers=1, conv_kernel_size=4, debug=debug)
    ids = pool.alloc(2)
    p = params_for(2)
    inp = small_inputs()
    pad = i32([-1] * B)
    qkv = (inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias)
    T = 2
    drafts = random_decode_inputs(B * T, 1, 2, KD, VD, dtype=torch.float32, device=DEV)
    spec = (drafts.mixed_qkv.view(B, T, -1), drafts.a.view(B, T, -1), drafts.b.view(B, T, -1), p.A_log, p.dt_bias)
    weight = torch.randn(pool.conv_channels, 4, device=DEV)
    x = torch.randn(B, pool.conv_channels, device=DEV)
    states = torch.zeros(2, 2, VD, KD, device=DEV)
    shard = pool.export_state(ids)
    far = i32([S + 5, -1, -1, -1])  # an id out of range
    bad_ids = (pad.long(), pad.float(), pad[None], pad[: B - 1], [-1] * B)  # dtype, rank, length, not a tensor
    calls = {
        "decode": [lambda s=s: pool.decode(0, *qkv, s) for s in bad_ids + (far,)]
        + [lambda: pool.decode(0, *qkv, pad[: B - 1], conv_weight=weight)],
        "advance": [lambda s=s: pool.advance(s) for s in bad_ids[:3] + (bad_ids[4], far)],
        "verify": [lambda s=s: pool.verify(0, *spec, s) for s in bad_ids + (far,)],
        "conv_update": [lambda s=s: pool.conv_update(0, x, weight, s) for s in bad_ids + (far,)],
        "export_state": [lambda s=s: pool.export_state(s) for s in (pad.float(), pad[None, None], [S + 5], "0")],
        "import_state": [lambda s=s: pool.import_state(s, shard) for s in (ids.float(), [S + 5, ids[1].item()])],
        "load_state": [lambda s=s: pool.load_state(0, s, states) for s in (ids.float(), ids[None], [0, 1],
                                                                           i32([S + 5, ids[1].item()]))],
        "read_state": [lambda s=s: pool.read_state(0, s) for s in (ids.float(), ids[None], [0], i32([S + 5]))],
        "read_conv_state": [lambda s=s: pool.read_conv_state(0, s) for s in (ids.float(), ids[None], i32([S + 5]))],
        "free": [lambda s=s: pool.free(s) for s in (ids.float(), ids[None, None], [S + 5], "0")],
    }
    for method, attempts in calls.items():
        for i, attempt in enumerate(attempts):
            with pytest.raises(ValueError) as info:  # SlotError included
                attempt()
                pool.check()  # (eager: a bad id is a padding row, recorded)
            text = str(info.value)
            assert f"ReplaySSMStatePool.{method}" in text, (method, i, text)
            assert "slot" in text and "ssm_state_indices" not in text, (method, i, text)
    # commit: eager, the verify of `far` above opened the step (its row refused); debug refused that verify at the
    # call, so a good verify opens it
    if debug:
        pool.verify(0, *spec, pad)
    for s in (pad.long(), pad[None], pad[: B - 1], [-1] * B):
        with pytest.raises(ValueError, match="ReplaySSMStatePool.commit: `slots`") as info:
            pool.commit(s, i32([0] * B))
        assert "ssm_state_indices" not in str(info.value)
    # eager: the kernel refuses the row, check() reports it; debug: not the step's slots (raised at the call)
    with pytest.raises(ValueError if debug else SlotError, match=r"ReplaySSMStatePool.commit") as info:
        pool.commit(far, i32([0] * B))
        pool.check()
    assert "ssm_state_indices" not in str(info.value)
    if debug:
        pool.commit(pad, i32([0] * B))
    # fork names its own arguments
    for src, dst in ((ids[:1].long(), ids[1:]), (ids[:1], ids[1:][None]), (ids, ids[:1])):
        with pytest.raises(ValueError, match="ReplaySSMStatePool.fork: `src`|`dst`|`src` and `dst`") as info:
            pool.fork(src, dst)
        assert "ssm_state_indices" not in str(info.value)
    with pytest.raises(SlotError, match="ReplaySSMStatePool.fork") as info:
        pool.fork(i32([S + 5]), ids[1:])
        pool.check()
    assert "ssm_state_indices" not in str(info.value)


def test_debug_mode_checks(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert make_pool().debug is False
    monkeypatch.setenv(DEBUG_ENV, "1")
    pool = make_pool(num_layers=1)
    assert pool.debug is True
    assert make_pool(debug=False).debug is False

    def forbidden(*args, **kwargs):
        raise AssertionError("the op must not run when a debug check fails")

    monkeypatch.setattr(pool_module, "run_decode", forbidden)
    ids = pool.alloc(2).tolist()
    p = params_for(2)
    inp = small_inputs()
    args = (inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias)
    free_slot = (set(range(S)) - set(ids)).pop()
    for rows, needle in [([ids[0], free_slot, -1, -1], "not allocated"), ([ids[0], S, -1, -1], "out of range"),
                         ([ids[0], ids[0], -1, -1], "more than once")]:
        with pytest.raises(SlotError, match=needle):  # a ValueError
            pool.decode(0, *args, i32(rows))
    pool.cursors[ids[1]] = L
    with pytest.raises(SlotError, match="cursors"):
        pool.decode(0, *args, i32([ids[1], -1, -1, -1]))
    with pytest.raises(SlotError, match="cursors"):
        pool.advance(i32([ids[1]]))
    pool.cursors[ids[1]] = 0
    with pytest.raises(SlotError, match="not allocated"):
        pool.advance(i32([free_slot]))
    pool.advance(i32([ids[0], ids[0], -1]))  # duplicates are fine in advance
    with pytest.raises(SlotError, match="not allocated"):
        pool.read_state(0, i32([free_slot]))
    with pytest.raises(SlotError, match="more than once"):
        pool.load_state(0, i32([ids[0], ids[0]]), torch.zeros(2, 2, VD, KD, device=DEV))


# ---- a pool on CPU with no environment variable ----------------------------------------------------

_NO_ENV_SCRIPT = """
import os
assert "TRITON_INTERPRET" not in os.environ and "TP_REPLAYSSM_CPU_BACKEND" not in os.environ
import torch
from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.testing import PlainKDA, random_decode_inputs, random_head_params, rel_err

H, HV, K, V, S, L, B = 1, 2, 16, 16, 4, 3, 4
for layout in ("predecayed", "sglang"):
    gen = torch.Generator().manual_seed(5)
    pool = ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=1, num_slots=S, ring_length=L, device="cpu",
                              ring_layout=layout)
    ids = pool.alloc(3)
    p = random_head_params(HV, K, generator=gen)
    oracle = PlainKDA(S, H, HV, K, V)
    slots = torch.tensor([int(ids[0]), -1, int(ids[1]), int(ids[2])], dtype=torch.int32)
    err_out = err_state = 0.0
    for step in range(L + 1):
        x = random_decode_inputs(B, H, HV, K, V, dtype=torch.float32, generator=gen)
        out = pool.decode(0, x.mixed_qkv, x.a, x.b, p.A_log, p.dt_bias, slots)
        err_out = max(err_out, rel_err(out[:, 0], oracle.step(x, p, slots)))
        pool.advance(slots)
        err_state = max(err_state, rel_err(pool.read_state(0, ids), oracle.state[ids.long()]))
    print(f"{layout}: cursors {pool.cursors[ids.long()].tolist()} out {err_out:.3e} state {err_state:.3e}")
"""


@pytest.mark.timeout(120)
def test_cpu_pool_works_without_environment_variables():
    """A fresh process with neither ``TRITON_INTERPRET`` nor ``TP_REPLAYSSM_CPU_BACKEND`` builds a CPU pool, allocs,
    decodes a few steps, advances and reads the state, equal to the float64 oracle (both ring layouts)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TP_REPLAYSSM_CPU_BACKEND")}
    repo = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", _NO_ENV_SCRIPT], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=110)
    assert run.returncode == 0, run.stderr[-4000:]
    found = re.findall(r"^(\w+): cursors \[(.*)\] out (\S+) state (\S+)$", run.stdout, flags=re.M)
    assert [f[0] for f in found] == ["predecayed", "sglang"], run.stdout
    for _, cursors, err_out, err_state in found:
        assert cursors == "1, 1, 1"  # L + 1 steps: a full ring cycle (the flush at L-1 wraps to 0), one more
        assert float(err_out) < TOL_BF16 and float(err_state) < TOL_BF16, run.stdout


# ---- CUDA graphs (run on the GPU) -------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@STEP_CASES
def test_cuda_graph_step_matches_eager_bitwise(layout, lower_bound, A_log_shift, fused):
    """Capture one full model step (every layer's decode + advance) for a fixed batch, replay it over
    more than one full ring cycle with fresh inputs each step, and match eager execution bitwise (both
    ring layouts). ``fused``: the captured step's last decode moves the cursors (``advance=True``), the eager
    one calls ``advance``; the scratch entry of padding rows is the one difference allowed."""
    heads, NL, ring, Bg = KDAHeads(2, 8, 128, 128), 3, 4, 6
    dev = torch.device("cuda", torch.cuda.current_device())
    pools = [ReplaySSMStatePool(heads, num_layers=NL, num_slots=8, ring_length=ring, device=dev, debug=False,
                                ring_layout=layout) for _ in range(2)]
    ids = [pool.alloc(5) for pool in pools]
    assert torch.equal(ids[0], ids[1])
    rows = ids[0].tolist()
    slots = torch.tensor([rows[0], -1, rows[1], rows[2], rows[3], rows[4]], dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(0)
    params = [random_head_params(8, 128, device=dev, generator=gen) for _ in range(NL)]
    params = [dataclasses.replace(p, A_log=p.A_log + A_log_shift) for p in params]
    n_steps = 2 * ring + 2
    steps = []
    for i in range(n_steps + 1):
        layer_inputs = [random_decode_inputs(Bg, 2, 8, 128, 128, device=dev, generator=gen) for _ in range(NL)]
        flags = torch.tensor([1 if (i % 3 == 1 and b == 2) else 0 for b in range(Bg)], dtype=torch.int32, device=dev)
        steps.append((layer_inputs, flags))

    static_in = [random_decode_inputs(Bg, 2, 8, 128, 128, device=dev) for _ in range(NL)]
    static_flags = torch.zeros(Bg, dtype=torch.int32, device=dev)
    static_out = [torch.empty(Bg, 1, 8, 128, dtype=torch.bfloat16, device=dev) for _ in range(NL)]

    def load(i):
        for layer in range(NL):
            for dst, src in zip((static_in[layer].mixed_qkv, static_in[layer].a, static_in[layer].b),
                                (steps[i][0][layer].mixed_qkv, steps[i][0][layer].a, steps[i][0][layer].b)):
                dst.copy_(src)
        static_flags.copy_(steps[i][1])

    def model_step(pool, inputs, flags, outs):
        fuse = fused and pool is pools[0]
        for layer in range(NL):
            pool.decode(layer, inputs[layer].mixed_qkv, inputs[layer].a, inputs[layer].b, params[layer].A_log,
                        params[layer].dt_bias, slots, force_flush=flags, out=outs[layer], lower_bound=lower_bound,
                        advance=fuse and layer == NL - 1)
        if not fuse:
            pool.advance(slots, flags)

    eager_outs = [torch.empty_like(o) for o in static_out]
    # step 0 eagerly on both pools (compiles the kernel, runs the first-decode placement checks),
    # on a side stream as torch recommends before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        load(0)
        model_step(pools[0], static_in, static_flags, static_out)
        model_step(pools[1], steps[0][0], steps[0][1], eager_outs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model_step(pools[0], static_in, static_flags, static_out)
    for i in range(1, n_steps + 1):
        load(i)
        graph.replay()
        model_step(pools[1], steps[i][0], steps[i][1], eager_outs)
        torch.cuda.synchronize()
        for layer in range(NL):
            assert torch.equal(static_out[layer], eager_outs[layer]), (i, layer)
        assert torch.equal(pools[0].cursors[:8], pools[1].cursors[:8]), i  # [S + 1]: entry S is the scratch
    assert n_steps > ring  # more than one full ring cycle
    for name in ("checkpoint", "d_cache", "k_cache", "g_cache"):
        assert torch.equal(getattr(pools[0], name), getattr(pools[1], name)), name
    assert fused or torch.equal(pools[0].cursors, pools[1].cursors)
