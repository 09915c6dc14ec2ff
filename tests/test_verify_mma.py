"""The tensor-core verify kernel (tp_replayssm/kernels/verify_mma.py) against the PyTorch reference and the float64
plain recurrence.

On CPU it runs in Triton's interpreter, one tiny case per path: a chain on an fp32 checkpoint (rows that fold and
rows that do not, padding, a freed and a repeated slot), the same with two value chunks per program (the next chunk's
loads in flight), a tree on a bf16 checkpoint over two value tiles with GQA (the head's last program writes the
per-head rows), and heads that rebase. Each case runs the same call on a twin pool
through the PyTorch path (outputs, every pool tensor), checks the outputs against a float64 recurrence stepped along
each draft's path from the pool's state, poisons the outputs with NaN first and keeps a never-allocated slot filled
with a sentinel that must stay bit-identical. With CUDA (marker ``gpu``): both verify forms at K = V = 128 against the
reference on CPU copies of the pool. The verify's plans and launch arguments are tested in tests/test_verify_plan.py.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from _spec_helpers import Oracle, make_model, random_drafts, read_states, rel
from test_spec_kernels import TENSORS, _pool, _to, _warm
from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.kernels import verify_plan
from tp_replayssm.kernels.backend import use_cpu_backend

on_cpu_machine = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run on machines without CUDA")
SENTINEL = 3.25


def _sentinel(pool: ReplaySSMStatePool, slot: int) -> None:
    for name in ("checkpoint", "d_cache", "k_cache", "g_cache"):
        getattr(pool, name)[:, slot] = SENTINEL


def _verify(pool: ReplaySSMStatePool, model: object, drafts: object, slots: torch.Tensor,
            parents: torch.Tensor | None, plan: verify_plan.VerifyPlan | None = None) -> torch.Tensor:
    """Every layer's verify into NaN-poisoned outputs; ``[NL, B, T, HV, V]``."""
    outs = []
    for layer in range(pool.num_layers):
        p = model.params[layer]
        x = drafts.mixed[layer]
        lh = pool.local_heads
        out = torch.full((x.shape[0], x.shape[1], lh.num_v_heads, lh.value_dim), float("nan"), dtype=x.dtype,
                         device=pool.device)
        outs.append(pool.verify(layer, x, drafts.a[layer], drafts.b[layer], p.A_log, p.dt_bias, slots,
                                parents=parents, lower_bound=model.lower_bound, out=out, plan=plan))
    return torch.stack(outs)


def _case(pool: ReplaySSMStatePool, model: object, slots: list[int], T: int, gen: torch.Generator,
          parents: list[list[int]] | None, tol: float, exact_tol: float, a_shift: float = 0.0,
          dtype: torch.dtype = torch.float32, **override: int) -> None:
    """The kernel (interpreter) against the torch path on a twin (outputs within ``tol``, pool tensors within a bf16
    step), and against float64 along the draft paths from the pool's state (within ``exact_tol``). ``dtype``: the
    drafts' activations (and outputs). ``override``: plan fields replaced (``value_tile`` with its
    ``tile_readers``)."""
    problem = _problem(pool, len(slots), T, parents is not None, model.lower_bound, dtype)
    assert verify_plan.tensor_core_refusal(problem) == ""
    plan = verify_plan.plan_verify(problem, tensor_cores=True)
    if override:
        tiles = -(-pool.local_heads.value_dim // override.get("value_tile", plan.value_tile))
        plan = dataclasses.replace(plan, **override, tile_readers=tiles)
        plan.check(problem)
    unused = pool.num_slots - 1
    _sentinel(pool, unused)
    before = {n: getattr(pool, n)[:, unused].clone() for n in ("checkpoint", "d_cache", "k_cache", "g_cache")}
    twin = copy.deepcopy(pool)
    live = [s for s in slots if s >= 0 and slots.count(s) == 1 and pool.cursors[s] < pool.ring_length]
    oracle = Oracle(pool)
    for layer, o in enumerate(oracle.layers):
        o.load(live, pool.read_state(layer, torch.tensor(live, dtype=torch.int32)))
    drafts = random_drafts(pool, len(slots), T, gen, dtype=dtype, a_shift=a_shift)
    t = torch.tensor(slots, dtype=torch.int32)
    par = None if parents is None else torch.tensor(parents, dtype=torch.int32)
    with use_cpu_backend("interpreter"):
        out = _verify(pool, model, drafts, t, par, plan)
    with use_cpu_backend("torch"):
        want = _verify(twin, model, drafts, t, par)
    assert torch.isfinite(out).all(), "an output was left unwritten"
    assert rel(out, want) < tol, rel(out, want)
    rows = [r for r, s in enumerate(slots) if s in live]
    par_list = parents or [[i - 1 for i in range(T)]] * len(slots)
    exact = oracle.tree_outputs(model, drafts, [s if s in live else -1 for s in slots], par_list)
    assert rel(out[:, rows], exact[:, rows]) < exact_tol, rel(out[:, rows], exact[:, rows])
    for r, s in enumerate(slots):
        if s not in live:
            assert (out[:, r] == 0).all(), f"row {r} (slot {s}) is not a padding row"
    for name in TENSORS:
        a, b = getattr(pool, name).float(), getattr(twin, name).float()
        # (the interpreter's bf16 stores truncate, the torch path's round: one bf16 step apart)
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2), f"{name}: max diff {(a - b).abs().max().item()}"
    for name, saved in before.items():
        assert torch.equal(getattr(pool, name)[:, unused], saved), f"{name} of the unused slot changed"


def _problem(pool: ReplaySSMStatePool, batch: int, drafts: int, tree: bool, lower_bound: float | None = None,
             activation_dtype: torch.dtype = torch.float32) -> verify_plan.VerifyProblem:
    lh = pool.local_heads
    bounded = lower_bound is not None and (pool.ring_length - 1) * abs(lower_bound) <= 75
    return verify_plan.VerifyProblem(batch, drafts, lh.num_q_heads, lh.num_v_heads, lh.key_dim, lh.value_dim,
                                     pool.ring_length, pool.state_dtype, pool.cache_dtype, "cpu", 132,
                                     pool.ring_layout, tree, True, lower_bound is not None, bounded,
                                     activation_dtype)


@on_cpu_machine
def test_mma_verify_chain_fp32_state_with_bad_rows() -> None:
    """A chain of 3 drafts on an fp32 checkpoint (three bf16 parts per operand); rows: one that folds (cursor 4,
    L = 6), one that does not (cursor 2), padding, a freed slot, a repeated slot."""
    pool = _pool(KDAHeads(1, 2, 16, 16), num_slots=6, ring_length=6, cache_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(21)
    model = make_model(pool, gen)
    pool.alloc(4)
    pool.free([3])
    _warm(pool, model, [[0, 1, 2], [0, -1, 2], [0, -1, -1], [0, -1, -1]], gen)
    assert pool.cursors[[0, 2]].tolist() == [4, 2]
    _case(pool, model, [0, -1, 2, 3, 1, 1], 3, gen, None, 1e-5, 1e-5)
    assert pool.slot_errors[2] == 3 and pool.spec_folded[0, [0, 2]].tolist() == [1, 0]


@on_cpu_machine
def test_mma_verify_tree_bf16_state_two_value_tiles() -> None:
    """Five drafts in a tree (draft block 8) on a bf16 checkpoint, GQA (H = 1, HV = 2), V = 32 (two value tiles: the
    head's last program writes the per-head rows of the row that folds). Rows: cursor 4 folds (L = 8), cursor 2 not."""
    pool = _pool(KDAHeads(1, 2, 16, 32), num_slots=3, ring_length=8, cache_dtype=torch.bfloat16,
                 state_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(22)
    model = make_model(pool, gen)
    pool.alloc(2)
    _warm(pool, model, [[0, 1], [0, 1], [0, -1], [0, -1]], gen)
    assert pool.cursors[:2].tolist() == [4, 2]
    _case(pool, model, [0, 1], 5, gen, [[-1, 0, 0, 1, 3], [-1, -1, 1, 0, 2]], 5e-3, 5e-3)  # bf16 outputs
    assert pool.spec_folded[0, :2].tolist() == [1, 0] and pool.spec_counters.abs().sum() == 0


@on_cpu_machine
def test_mma_verify_two_chunks_per_program() -> None:
    """A program of two 16-row value chunks (V = 32, one value tile of 32 rows): the second chunk's checkpoint rows,
    deltas and draft values are loaded during the first one's math; fp32 checkpoint with bf16 activations (two bf16
    parts per fp32 operand), a chain of 3 drafts; rows: one that folds (cursor 4, L = 6), one that does not (cursor
    2), padding, a repeated slot."""
    pool = _pool(KDAHeads(1, 2, 16, 32), num_slots=5, ring_length=6, cache_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(23)
    model = make_model(pool, gen)
    pool.alloc(4)
    _warm(pool, model, [[0, 1, 2], [0, -1, 2], [0, -1, -1], [0, -1, -1]], gen)
    assert pool.cursors[[0, 2]].tolist() == [4, 2]
    _case(pool, model, [0, 2, -1, 1, 1], 3, gen, None, 5e-3, 5e-3, dtype=torch.bfloat16, value_tile=32)
    assert pool.slot_errors[2] == 2 and pool.spec_folded[0, [0, 2]].tolist() == [1, 0]


@on_cpu_machine
@pytest.mark.parametrize("edit", [{}, {"merged_sums": False}], ids=["library-plan", "unmerged-sums"])
def test_mma_verify_rebase(edit: dict) -> None:
    """Pre-decayed rings with a gate that can pass the bound within a ring (lower bound -18, L = 6): the committed
    gates plus the drafts pass -75, so heads rebase (checkpoint, zeroed deltas, G_{c-1} = 0); the library's plan has
    the rebase test as a count in the merged reduction, ``merged_sums=False`` as minima of their own."""
    pool = _pool(KDAHeads(1, 2, 16, 16), num_slots=3, ring_length=6, cache_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(24)
    model = make_model(pool, gen, lower_bound=-18.0)
    pool.alloc(2)
    _warm(pool, model, [[0, 1], [0, 1], [0, -1]], gen, a_shift=4.0)
    before = pool.g_cache[0, 0, :, 2].clone()
    _case(pool, model, [0, 1], 2, gen, None, 1e-5, 1e-5, a_shift=4.0, **edit)
    assert (before != 0).any() and (pool.g_cache[0, 0, :, 2] == 0).all(), "row 0 (cursor 3) did not rebase"


CHOICES = {"separate-reductions": dict(batched_reductions=False, merged_sums=False),
           "no-prefetch": dict(chunk_prefetch=False), "fold-pass": dict(fold_in_chunks=False),
           "fold-in-chunks": dict(fold_in_chunks=True), "early-params": dict(early_params=True),
           "unmerged-sums": dict(merged_sums=False)}


@on_cpu_machine
@pytest.mark.parametrize("choice", list(CHOICES))
def test_mma_verify_plan_choices(choice: str) -> None:
    """The tensor-core form's plan edits (``batched_reductions=False``: the prologue's sums over K as separate
    reductions; ``chunk_prefetch=False``: each chunk's loads at its start; ``fold_in_chunks``; ``early_params``: the
    gate's parameters loaded beside the drafts' inputs; ``merged_sums=False``: the norms, couplings and rebase test
    as batched reductions of their own): a
    chain of 3 drafts on an fp32 checkpoint in
    two 16-row chunks per program with a row that folds, padding and a repeated slot; then a tree of 5 drafts on a
    bf16 checkpoint with GQA and a row that folds; against the torch path and float64 as the library's plan is."""
    pool = _pool(KDAHeads(1, 2, 16, 32), num_slots=5, ring_length=6, cache_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(23)
    model = make_model(pool, gen)
    pool.alloc(4)
    _warm(pool, model, [[0, 1, 2], [0, -1, 2], [0, -1, -1], [0, -1, -1]], gen)
    _case(pool, model, [0, 2, -1, 1, 1], 3, gen, None, 1e-5, 1e-5, value_tile=32, **CHOICES[choice])
    assert pool.slot_errors[2] == 2 and pool.spec_folded[0, [0, 2]].tolist() == [1, 0]
    pool = _pool(KDAHeads(1, 2, 16, 32), num_slots=3, ring_length=8, cache_dtype=torch.bfloat16,
                 state_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(22)
    model = make_model(pool, gen)
    pool.alloc(2)
    _warm(pool, model, [[0, 1], [0, 1], [0, -1], [0, -1]], gen)
    _case(pool, model, [0, 1], 5, gen, [[-1, 0, 0, 1, 3], [-1, -1, 1, 0, 2]], 5e-3, 5e-3, **CHOICES[choice])


@on_cpu_machine
def test_merged_sums_without_l2norm() -> None:
    """The library's ``merged_sums`` (the couplings on the raw inputs, scaled afterwards) where the call does not
    normalize q and k (``use_qk_l2norm_in_kernel=False``: the couplings scale by ``scale`` alone, no norms are
    summed): a chain of 3 drafts in the interpreter against the torch path."""
    pool = _pool(KDAHeads(1, 2, 16, 16), num_slots=4, ring_length=6, cache_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(25)
    model = make_model(pool, gen)
    pool.alloc(3)
    _warm(pool, model, [[0, 1, 2], [0, -1, 2]], gen)
    twin = copy.deepcopy(pool)
    problem = dataclasses.replace(_problem(pool, 3, 3, False), use_l2norm=False)
    plan = verify_plan.plan_verify(problem, tensor_cores=True)
    drafts = random_drafts(pool, 3, 3, gen)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    p = model.params[0]
    outs = []
    for target, backend, kw in ((pool, "interpreter", dict(plan=plan)), (twin, "torch", {})):
        with use_cpu_backend(backend):
            outs.append(target.verify(0, drafts.mixed[0], drafts.a[0], drafts.b[0], p.A_log, p.dt_bias, slots,
                                      use_qk_l2norm_in_kernel=False, **kw))
    assert plan.merged_sums and not plan.use_l2norm, plan
    assert torch.isfinite(outs[0]).all() and rel(outs[0], outs[1]) < 1e-5, rel(outs[0], outs[1])


@on_cpu_machine
def test_mma_verify_separate_reductions_rebase() -> None:
    """``batched_reductions=False`` (a plan edit: the drafts' minima over K as separate reductions) with heads that
    rebase (the minima pass the bound)."""
    pool = _pool(KDAHeads(1, 2, 16, 16), num_slots=3, ring_length=6, cache_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(24)
    model = make_model(pool, gen, lower_bound=-18.0)
    pool.alloc(2)
    _warm(pool, model, [[0, 1], [0, 1], [0, -1]], gen, a_shift=4.0)
    before = pool.g_cache[0, 0, :, 2].clone()
    _case(pool, model, [0, 1], 2, gen, None, 1e-5, 1e-5, a_shift=4.0, batched_reductions=False, merged_sums=False)
    assert (before != 0).any() and (pool.g_cache[0, 0, :, 2] == 0).all(), "row 0 (cursor 3) did not rebase"


# ---- GPU --------------------------------------------------------------------------------------------------------


@pytest.fixture(params=["tensor-cores", "tensor-cores-separate", "tensor-cores-no-prefetch",
                        "tensor-cores-early-params", "tensor-cores-unmerged-sums", "cuda-cores"])
def verify_form(request: pytest.FixtureRequest) -> str:
    """The verify form a test's calls take: the tensor-core form (the library's plan; or with
    ``batched_reductions=False``; or with ``chunk_prefetch=False``; or with ``early_params``, a plan edit no rule
    sets; or with ``merged_sums=False``) or the CUDA-core form."""
    return request.param


def _form_plan(pool: ReplaySSMStatePool, batch: int, drafts: int, tree: bool, form: str) -> verify_plan.VerifyPlan:
    lh = pool.local_heads
    problem = verify_plan.VerifyProblem(batch, drafts, lh.num_q_heads, lh.num_v_heads, lh.key_dim, lh.value_dim,
                                        pool.ring_length, pool.state_dtype, pool.cache_dtype, pool.device.type,
                                        torch.cuda.get_device_properties(pool.device).multi_processor_count,
                                        pool.ring_layout, tree, True, False, False, torch.bfloat16)
    plan = verify_plan.plan_verify(problem, tensor_cores=form != "cuda-cores")
    return dataclasses.replace(plan, batched_reductions=plan.batched_reductions and "separate" not in form,
                               chunk_prefetch="no-prefetch" not in form, early_params="early-params" in form,
                               merged_sums=plan.merged_sums and "separate" not in form and "unmerged" not in form)


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_both_verify_forms_match_reference(verify_form: str, state: torch.dtype, tree: bool) -> None:
    """Both verify forms at K = V = 128, L = 16, T = 4, HV = 16 over B = 24 rows (padding rows among them), over
    steps that cross every fold phase, against the reference on CPU copies: outputs, every pool tensor after the
    commit, read_state."""
    heads, batch = KDAHeads(16, 16, 128, 128), 24
    pool = ReplaySSMStatePool(heads, num_layers=1, num_slots=batch + 2, ring_length=16, state_dtype=state,
                              cache_dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(31)
    model = make_model(pool, gen)
    cpu_model = type(model)([type(p)(p.A_log.cpu(), p.dt_bias.cpu()) for p in model.params])
    ids = pool.alloc(batch).tolist()
    slots = [s if r % 7 != 3 else -1 for r, s in enumerate(ids)]
    t = torch.tensor(slots, dtype=torch.int32, device="cuda")
    _warm(pool, model, [[s if r % 5 > i else -1 for r, s in enumerate(slots)] for i in range(4)], gen)
    T = 4
    parents = torch.tensor([[-1, 0, 0, 1]] * batch, dtype=torch.int32, device="cuda") if tree else None
    live = [r for r, s in enumerate(slots) if s >= 0]
    plan = _form_plan(pool, batch, T, tree, verify_form)
    assert plan.tensor_cores == (verify_form != "cuda-cores"), plan
    for step in range(6):
        ref = _to(pool, "cpu")
        drafts = random_drafts(pool, batch, T, gen, dtype=torch.bfloat16)
        out = _verify(pool, model, drafts, t, parents, plan)
        cpu_drafts = type(drafts)(drafts.mixed.cpu(), drafts.a.cpu(), drafts.b.cpu())
        want = _verify(ref, cpu_model, cpu_drafts, t.cpu(), None if parents is None else parents.cpu())
        assert torch.isfinite(out).all() and rel(out[:, live], want[:, live]) < 2e-2, f"step {step}"
        n = torch.randint(0, 3 if tree else T + 1, (batch,), generator=gen, dtype=torch.int32)
        path = torch.tensor([[0, 1, 3, 2]] * batch, dtype=torch.int32) if tree else None
        pool.commit(t, n.cuda(), path=None if path is None else path.cuda())
        ref.commit(t.cpu(), n, path=path)
        pool.check()
        assert torch.equal(pool.cursors.cpu(), ref.cursors)
        assert rel(read_states(pool, [slots[r] for r in live]), read_states(ref, [slots[r] for r in live])) < 2e-2
