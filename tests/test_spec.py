"""Speculative decoding (docs/spec.md): ``pool.verify`` per layer, then ``pool.commit``, on the PyTorch path (CPU).

Every check compares against sequential ``decode`` + ``advance`` of the same tokens from the same state on a deep
copy of the pool (a *twin*), and against :class:`tp_replayssm.testing.PlainKDA`, the float64 plain recurrence (for
trees, stepped along each node's ancestor path). Verify must equal decoding each draft after its ancestors; after
``commit(n)`` every later output and ``read_state`` must equal a pool that decoded only the accepted tokens. The
scenarios run many steps with ``T`` cycling over ``1..L-1`` and random acceptance, so the committed cursors take every
phase and rows fold. Bad slots and arguments, debug mode and the slots of an open step are in tests/test_spec_slots.py;
the Helion kernels (interpreter, GPU) in tests/test_spec_kernels.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _spec_helpers import (Oracle, build, decode_paths, decode_step, make_model, node_paths, random_drafts,
                           read_states, rel, sequential_outputs, staggered, verify_all)
from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.testing import random_decode_inputs

K = V = 16
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # by the cache / state dtype: ring entries are rounded to it


def run_steps(pool: ReplaySSMStatePool, model: object, slots: list[int], gen: torch.Generator, steps: int, *,
              trees: list[list[int]] | None = None, tol: float, oracle_tol: float | None = None,
              conv_check: bool = False, a_shift: float = 0.0, max_drafts: int | None = None,
              after_verify: object = None) -> set[tuple[int, int]]:
    """Verify + commit ``steps`` times, each against the twin and the oracle; returns the (cursor, T) pairs seen for
    live rows. ``trees``: per step, one parents list used by every row (None: chains). ``a_shift`` is added to the
    gate logits; ``after_verify(pool, twin)`` runs between verify and commit (the twin: the pool before verify)."""
    oracle = Oracle(pool) if oracle_tol is not None else None
    staggered(pool, model, oracle, slots, gen, a_shift)
    L, B = pool.ring_length, len(slots)
    t_slots = torch.tensor(slots, dtype=torch.int32)
    live = [r for r, s in enumerate(slots) if s >= 0]
    seen = set()
    for step in range(steps):
        if trees is None:
            T = 1 + step % (max_drafts or L - 1)
            parents_list = [[t - 1 for t in range(T)]] * B
            parents = None
        else:
            parents_list = [trees[step % len(trees)]] * B
            T = len(parents_list[0])
            parents = torch.tensor(parents_list, dtype=torch.int32)
        seen |= {(int(pool.cursors[slots[r]]), T) for r in live}
        drafts = random_drafts(pool, B, T, gen, a_shift=a_shift)
        twin = copy.deepcopy(pool)
        before = read_states(pool, [slots[r] for r in live])
        out = verify_all(pool, model, drafts, t_slots, parents)
        assert all((out[:, r] == 0).all() for r in range(B) if slots[r] < 0), "padding rows must be zero"
        # verify changes nothing a reader sees (a fold moves the committed state into the checkpoint, rounded to the
        # state dtype as a decode's flush rounds it)
        fold_tol = 1e-6 if pool.state_dtype == torch.float32 else 1e-2
        assert rel(read_states(pool, [slots[r] for r in live]), before) < fold_tol
        if after_verify is not None:
            after_verify(pool, twin)
        want = sequential_outputs(twin, model, drafts, slots, parents_list)
        assert rel(out[:, live], want[:, live]) < tol, f"step {step}: verify != sequential decode"
        if oracle is not None:
            exact = oracle.tree_outputs(model, drafts, slots, parents_list)
            assert rel(out[:, live], exact[:, live]) < oracle_tol, f"step {step}: verify != float64 recurrence"
        # accept a random prefix of a random root-to-leaf path per row
        paths = node_paths(parents_list)
        chosen = [paths[r][int(torch.randint(0, T, (1,), generator=gen))] for r in range(B)]
        n = [int(torch.randint(0, len(chosen[r]) + 1, (1,), generator=gen)) for r in range(B)]
        path = torch.tensor([c + [0] * (T - len(c)) for c in chosen], dtype=torch.int32)
        pool.commit(t_slots, torch.tensor(n, dtype=torch.int32), path=None if trees is None else path)
        pool.check()
        accepted = [chosen[r][:n[r]] for r in range(B)]
        decode_paths(twin, model, drafts, slots, accepted)
        if oracle is not None:
            oracle.follow(model, drafts, slots, accepted)
            assert rel(read_states(pool, [slots[r] for r in live]), oracle.states([slots[r] for r in live])) < oracle_tol
        assert rel(read_states(pool, [slots[r] for r in live]), read_states(twin, [slots[r] for r in live])) < tol
        if conv_check:
            for layer in range(pool.num_layers):
                ids = torch.tensor([slots[r] for r in live], dtype=torch.int32)
                assert torch.equal(pool.read_conv_state(layer, ids), twin.read_conv_state(layer, ids))
        assert pool.spec_folded.abs().sum() == 0, "commit clears the fold marks"
    # later decodes agree with the twin's
    lh = pool.local_heads
    inputs = [random_decode_inputs(B, lh.num_q_heads, lh.num_v_heads, K, V, dtype=torch.float32, generator=gen)
              for _ in range(pool.num_layers)]
    inputs = [type(x)(x.mixed_qkv, x.a + a_shift, x.b) for x in inputs]
    assert rel(decode_step(pool, model, inputs, t_slots)[:, live], decode_step(twin, model, inputs, t_slots)[:, live]) < tol
    return seen


@pytest.mark.parametrize("heads", [KDAHeads(1, 2, K, V), KDAHeads(2, 4, K, V)], ids=["HV2", "GQA-H2-HV4"])
@pytest.mark.parametrize("state,cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["predecayed", "sglang"])
def test_chains_match_sequential_decode_and_float64(layout: str, state: torch.dtype, cache: torch.dtype,
                                                    heads: KDAHeads) -> None:
    """Every T in 1..L-1, random acceptance 0..T, padding rows; every cursor phase, folds included."""
    pool = build(heads, layout=layout, state=state, cache=cache)
    gen = torch.Generator().manual_seed(1)
    model = make_model(pool, gen)
    ids = pool.alloc(4).tolist()
    slots = [ids[0], -1, ids[1], ids[2], ids[3]]
    tol = TOL[cache] if state == torch.float32 else TOL[torch.bfloat16]
    seen = run_steps(pool, model, slots, gen, steps=16, tol=tol, oracle_tol=max(tol, 1e-5) * 2)
    L = pool.ring_length
    assert {c for c, _ in seen} == set(range(L)), f"cursor phases seen: {sorted(seen)}"
    assert any(c + t > L - 1 for c, t in seen) and any(c + t <= L - 1 and c > 0 for c, t in seen)


TREES = {
    "chain-as-tree": [[-1, 0, 1, 2]],
    "star": [[-1, -1, -1, -1]],
    "root-fan": [[-1, 0, 0, 0]],
    "deeper": [[-1, 0, 1, 0, 3, 1], [-1, -1, 0, 1, 2, 2], [-1, 0, 1, 2, 3, 4]],
}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("layout", ["predecayed", "sglang"])
def test_trees_match_per_node_float64_paths(layout: str, tree: str) -> None:
    """Each node's output equals decoding its ancestor path (twin and float64); commit of a random path prefix."""
    pool = build(KDAHeads(1, 2, K, V), layout=layout, L=7)
    gen = torch.Generator().manual_seed(2)
    model = make_model(pool, gen)
    ids = pool.alloc(3).tolist()
    seen = run_steps(pool, model, [ids[0], ids[1], -1, ids[2]], gen, steps=6, trees=TREES[tree], tol=2e-5,
                     oracle_tol=2e-5)
    assert any(c + t > pool.ring_length - 1 for c, t in seen)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_conv_windows_follow_the_accepted_path(tree: bool) -> None:
    """W = 4: each draft's conv continues the committed window along its ancestors; commit rolls the window to the
    accepted position in every layer (bitwise, fp32 conv state)."""
    pool = build(KDAHeads(1, 2, K, V), L=6, conv_kernel_size=4, conv_dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    model = make_model(pool, gen, conv=True)
    ids = pool.alloc(3).tolist()
    trees = [[-1, 0, 0, 1], [-1, 0, 1], [-1, -1, 1, 2, 0]] if tree else None
    run_steps(pool, model, [ids[0], -1, ids[1], ids[2]], gen, steps=6, trees=trees, tol=2e-5, conv_check=True)


def test_rebase_when_drafts_pass_the_predecayed_bound() -> None:
    """Strong (unbounded) gates: the committed gates plus the drafts' pass -75 in some lane, so heads rebase their
    committed ring in verify (pre-decayed layout: checkpoint = committed state, deltas j < c zero, G_{c-1} = 0);
    outputs, states and later decodes still follow sequential decode and the float64 recurrence."""
    pool = build(KDAHeads(1, 2, K, V), L=6)
    gen = torch.Generator().manual_seed(4)
    # g = -18 * sigmoid(A x) with x about 2: -12 .. -17 per token. (L-1) * 18 > 75, so the bound is live; T <= 4
    # keeps a path of drafts alone above -75 (past it, no rebase helps: docs/spec.md)
    model = make_model(pool, gen, lower_bound=-18.0)
    ids = pool.alloc(3).tolist()
    rebased = []

    def count(p: ReplaySSMStatePool, before: ReplaySSMStatePool) -> None:
        for s in ids:
            c = int(before.cursors[s])
            if 0 < c and c + p._spec_step.drafts <= p.ring_length - 1:  # no fold: G_{c-1} newly zero is a rebase
                was = (before.g_cache[:, s, :, c - 1] != 0).any(-1)
                now = (p.g_cache[:, s, :, c - 1] == 0).all(-1)
                rebased.append(int((was & now).sum()))

    run_steps(pool, model, [ids[0], -1, ids[1], ids[2]], gen, steps=10, tol=2e-5, oracle_tol=1e-4, a_shift=4.0,
              max_drafts=4, after_verify=count)
    assert sum(rebased) > 0, f"no head rebased: {rebased}"


def test_read_state_between_verify_and_commit_and_reject_all() -> None:
    """After a folding verify of every layer, read_state is the committed state; commit(0) keeps it."""
    pool = build(KDAHeads(1, 2, K, V), L=4)
    gen = torch.Generator().manual_seed(5)
    model = make_model(pool, gen)
    ids = pool.alloc(2)
    slots = ids.tolist()
    for _ in range(2):
        decode_step(pool, model, [random_decode_inputs(2, 1, 2, K, V, dtype=torch.float32, generator=gen)
                                  for _ in range(2)], ids)
    assert int(pool.cursors[slots[0]]) + 3 > 3, "the verify below must fold"
    before = read_states(pool, slots)
    drafts = random_drafts(pool, 2, 3, gen)
    verify_all(pool, model, drafts, ids)
    assert pool.spec_folded.sum() > 0
    assert torch.equal(read_states(pool, slots), before)
    pool.commit(ids, torch.zeros(2, dtype=torch.int32))
    assert rel(read_states(pool, slots), before) < 1e-6
    assert int(pool.cursors[slots[0]]) == 0


def test_an_open_step_is_dropped_by_verifying_the_rest_and_committing_nothing() -> None:
    """An engine's error path in the middle of a step (layer 0 verified and folded, layer 1 not): verifying the
    remaining layers with any inputs and committing ``num_accepted`` all 0 leaves every row's committed state."""
    pool = build(KDAHeads(1, 2, K, V), L=4)
    gen = torch.Generator().manual_seed(6)
    model = make_model(pool, gen)
    ids = pool.alloc(2)
    slots = ids.tolist()
    for _ in range(2):
        decode_step(pool, model, [random_decode_inputs(2, 1, 2, K, V, dtype=torch.float32, generator=gen)
                                  for _ in range(2)], ids)
    before = read_states(pool, slots)
    drafts = random_drafts(pool, 2, 3, gen)
    p = model.params[0]
    pool.verify(0, drafts.mixed[0], drafts.a[0], drafts.b[0], p.A_log, p.dt_bias, ids)  # then the step fails
    assert pool.spec_folded[0].sum() > 0 and pool.spec_folded[1].sum() == 0
    with pytest.raises(ValueError, match=r"layers \[1\] of 2 were not verified"):
        pool.commit(ids, torch.zeros(2, dtype=torch.int32))
    p = model.params[1]
    zeros = [torch.zeros_like(t[1]) for t in (drafts.mixed, drafts.a, drafts.b)]
    pool.verify(1, *zeros, p.A_log, p.dt_bias, ids)
    pool.commit(ids, torch.zeros(2, dtype=torch.int32))
    assert rel(read_states(pool, slots), before) < 1e-6


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU pools: a machine without CUDA (a group's pool "
                    "lives on the rank's current device)")
def test_tp_equivalence_on_gloo(tmp_path) -> None:  # noqa: ANN001 - pytest fixture
    """Two gloo ranks: the gathered verify outputs and states equal a single-rank pool's on the global heads."""
    from _dist_helpers import run_ranks
    from _spec_helpers import tp_spec_equivalence

    for res in run_ranks(tp_spec_equivalence, 2, tmp_path, 5, timeout_s=120):
        assert res["err_out"] < 1e-6 and res["err_state"] < 1e-6 and res["same_cursors"] == 1.0, res
