"""Speculative decoding's slot safety and argument checks on the PyTorch path (CPU): bad slots, ``num_accepted``,
``path`` and ``parents`` are padding rows that write nothing and are reported; arguments are checked before anything
is written; debug mode raises at the call; a step keeps its slots and parents and verifies each layer once; slots
between a verify and its commit are refused by the calls that would read or write them.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from _slot_cases import assert_reported, bad_slot_cases
from _spec_helpers import build, decode_step, make_model, random_drafts, read_states, rel, staggered, verify_all
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError
from test_verify_mma import _problem as verify_problem
from tp_replayssm.kernels import verify_plan
from tp_replayssm.testing import random_decode_inputs

K = V = 16
S = 6
BAD = bad_slot_cases(S)  # slots of one call -> the bad rows
POOL_TENSORS = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "spec_folded", "conv_state")


def _pair(layout: str) -> tuple[ReplaySSMStatePool, ReplaySSMStatePool, object]:
    """A pool with slots 0, 2, 3 live (1 freed, 4, 5 never allocated) after some decode steps, and its copy."""
    pool = build(KDAHeads(1, 2, K, V), layout=layout, S=S, L=4, conv_kernel_size=3)
    gen = torch.Generator().manual_seed(7)
    model = make_model(pool, gen, conv=True)
    pool.alloc(4)
    pool.free([1])
    staggered(pool, model, None, [0, 2, 3], gen)
    return pool, copy.deepcopy(pool), model


def _step(pool: ReplaySSMStatePool, model: object, slots: list[int], n: list[int], seed: int = 11,
          parents: list[list[int]] | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    drafts = random_drafts(pool, len(slots), 2, gen)
    t = torch.tensor(slots, dtype=torch.int32)
    par = None if parents is None else torch.tensor(parents, dtype=torch.int32)
    out = verify_all(pool, model, drafts, t, par)
    pool.commit(t, torch.tensor(n, dtype=torch.int32))
    return out


def _same_pools(a: ReplaySSMStatePool, b: ReplaySSMStatePool) -> None:
    for name in POOL_TENSORS:
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{name} differs: a bad row wrote"


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("layout", ["predecayed", "sglang"])
def test_bad_slots_are_padding_rows_and_reported(layout: str, case: str) -> None:
    slots, bad_rows = BAD[case]
    pool, twin, model = _pair(layout)
    clean = [-1 if i in bad_rows else s for i, s in enumerate(slots)]
    n = [1] * len(slots)
    out = _step(pool, model, slots, n)
    expect = _step(twin, model, clean, n)
    assert torch.equal(out, expect)
    for r in bad_rows:
        assert (out[:, r] == 0).all()
    _same_pools(pool, twin)
    twin.check()
    assert_reported(pool, {r: slots[r] for r in bad_rows}, "ReplaySSMStatePool.verify(layer=0)", "more bad row(s)")


@pytest.mark.parametrize("what", ["n-negative", "n-above-T", "path-not-a-chain", "path-out-of-range"])
def test_bad_num_accepted_or_path_takes_no_draft_and_is_reported(what: str) -> None:
    pool, twin, model = _pair("predecayed")
    slots = [0, 2, 3]
    parents = [[-1, 0]] * 3
    gen = torch.Generator().manual_seed(3)
    drafts = random_drafts(pool, 3, 2, gen)
    t = torch.tensor(slots, dtype=torch.int32)
    par = torch.tensor(parents, dtype=torch.int32)
    verify_all(pool, model, drafts, t, par)
    verify_all(twin, model, drafts, t, par)
    n = {"n-negative": [2, -1, 1], "n-above-T": [2, 3, 1]}.get(what, [2, 2, 1])
    path = [[0, 1], [0, 1], [0, 1]]
    if what == "path-not-a-chain":
        path[1] = [1, 0]
    if what == "path-out-of-range":
        path[1] = [0, 5]
    pool.commit(t, torch.tensor(n, dtype=torch.int32), path=torch.tensor(path, dtype=torch.int32))
    twin.commit(t, torch.tensor([2, 0, 1], dtype=torch.int32), path=torch.tensor([[0, 1]] * 3, dtype=torch.int32))
    _same_pools(pool, twin)
    with pytest.raises(SlotError, match=r"ReplaySSMStatePool\.commit: 1 row\(s\).*row 1 slot 2"):
        pool.check()


def test_bad_parents_row_is_refused_in_verify_and_commit() -> None:
    pool, twin, model = _pair("sglang")
    out = _step(pool, model, [0, 2, 3], [1, 1, 2], parents=[[-1, 0], [-1, 1], [-1, -1]])
    expect = _step(twin, model, [0, -1, 3], [1, 1, 2], parents=[[-1, 0], [-1, 0], [-1, -1]])
    assert torch.equal(out[:, [0, 2]], expect[:, [0, 2]]) and (out[:, 1] == 0).all()
    _same_pools(pool, twin)
    with pytest.raises(SlotError, match=r"verify\(layer=0\): 1 row\(s\).*row 1 slot 2"):
        pool.check()


def test_arguments_are_checked_before_anything_is_written() -> None:
    pool, twin, model = _pair("predecayed")
    p = model.params[0]
    gen = torch.Generator().manual_seed(1)
    d = random_drafts(pool, 2, 3, gen)
    ids = torch.tensor([0, 2], dtype=torch.int32)
    x, a, b = d.mixed[0], d.a[0], d.b[0]
    with pytest.raises(ValueError, match=r"`mixed_qkv` must be \[B, T, D\] with 1 <= T <= ring_length - 1 = 3"):
        pool.verify(0, random_drafts(pool, 2, 4, gen).mixed[0], a, b, p.A_log, p.dt_bias, ids)
    with pytest.raises(ValueError, match="`a` must be of shape"):
        pool.verify(0, x, a[:, :2], b, p.A_log, p.dt_bias, ids)
    with pytest.raises(ValueError, match="`parents` must be of dtype torch.int32"):
        pool.verify(0, x, a, b, p.A_log, p.dt_bias, ids, parents=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"verify\(layer=0\): `use_qk_l2norm_in_kernel` must be a bool; got 'yes'"):
        pool.verify(0, x, a, b, p.A_log, p.dt_bias, ids, use_qk_l2norm_in_kernel="yes")
    # a plan is checked on the PyTorch path too, before the step opens: not a plan, a plan of another call
    with pytest.raises(ValueError, match=r"verify\(layer=0\): `plan` must be a VerifyPlan or None; got str"):
        pool.verify(0, x, a, b, p.A_log, p.dt_bias, ids, conv_weight=model.conv[0], plan="tensor-cores")
    other = verify_plan.plan_verify(verify_problem(pool, 2, 3, True))  # a tree's plan
    with pytest.raises(ValueError, match=r"VerifyPlan: `tree` is True but this call needs False"):
        pool.verify(0, x, a, b, p.A_log, p.dt_bias, ids, conv_weight=model.conv[0], plan=other)
    with pytest.raises(ValueError, match="no verify since the last commit"):
        pool.commit(ids, torch.zeros(2, dtype=torch.int32))
    pool.verify(0, x, a, b, p.A_log, p.dt_bias, ids, conv_weight=model.conv[0])
    with pytest.raises(ValueError, match="same rows and drafts"):
        pool.verify(1, d.mixed[1][:, :2], d.a[1][:, :2], d.b[1][:, :2], p.A_log, p.dt_bias, ids)
    with pytest.raises(ValueError, match=r"`num_accepted` must be an int32 tensor of shape \[2\]"):
        pool.commit(ids, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`path` must be an int32 tensor of shape \[2, 3\]"):
        pool.commit(ids, torch.zeros(2, dtype=torch.int32), path=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"layers \[1\] of 2 were not verified in this step"):
        pool.commit(ids, torch.zeros(2, dtype=torch.int32))
    assert rel(read_states(pool, [0, 2]), read_states(twin, [0, 2])) < 1e-6  # nothing a reader sees changed
    p1 = model.params[1]
    pool.verify(1, d.mixed[1], d.a[1], d.b[1], p1.A_log, p1.dt_bias, ids, conv_weight=model.conv[1])
    pool.commit(ids, torch.zeros(2, dtype=torch.int32))
    pool.check()


def test_verify_batch_mismatch_names_the_tensor_that_disagrees() -> None:
    """The verify's batch is the dim-0 size most per-row tensors share (the slots' on a tie), as in decode: a
    ``mixed_qkv`` with a row too few or too many is blamed (expected and actual shape), not its neighbour ``a``."""
    pool, _, model = _pair("predecayed")
    p = model.params[0]
    d = random_drafts(pool, 3, 2, torch.Generator().manual_seed(1))
    ids = torch.tensor([0, 2, 3], dtype=torch.int32)
    x, a, b = d.mixed[0], d.a[0], d.b[0]
    D = x.shape[2]
    for bad in (x[:2], torch.cat([x, x[:1]])):
        with pytest.raises(ValueError, match="`mixed_qkv`") as info:
            pool.verify(0, bad, a, b, p.A_log, p.dt_bias, ids)
        text = str(info.value)
        assert f"of shape [3, 2, {D}]" in text and f"got shape {list(bad.shape)}" in text, text
        assert "`a`" not in text and "ssm_state_indices" not in text, text
    with pytest.raises(ValueError, match=r"`slots` must be of shape \[3\]") as info:
        pool.verify(0, x, a, b, p.A_log, p.dt_bias, ids[:2])
    assert "ssm_state_indices" not in str(info.value)
    pool.check()


def test_debug_mode_raises_at_the_call() -> None:
    pool = build(KDAHeads(1, 2, K, V), L=4, debug=True)
    gen = torch.Generator().manual_seed(1)
    model = make_model(pool, gen)
    pool.alloc(2)
    d = random_drafts(pool, 2, 2, gen)
    with pytest.raises(SlotError, match=r"verify\(layer=0\) \(debug check\)"):
        verify_all(pool, model, d, torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="parents"):
        verify_all(pool, model, d, torch.tensor([0, 1], dtype=torch.int32),
                   torch.tensor([[-1, 1], [-1, 0]], dtype=torch.int32))
    verify_all(pool, model, d, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rows \[1\] have `num_accepted`.*; num_accepted \[1, 3\]$"):
        pool.commit(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32))
    pool.commit(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32))
    tree = torch.tensor([[-1, -1], [-1, 0]], dtype=torch.int32)
    verify_all(pool, model, random_drafts(pool, 2, 2, gen), torch.tensor([0, 1], dtype=torch.int32), tree)
    with pytest.raises(ValueError, match=re.escape("rows [0] have `num_accepted`") + r".*; num_accepted \[2, 2\], "
                                         + re.escape("path [[0, 1], [0, 1]], parents [[-1, -1], [-1, 0]]") + "$"):
        pool.commit(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32),
                    path=torch.tensor([[0, 1], [0, 1]], dtype=torch.int32))


def test_debug_mode_refuses_slots_between_verify_and_commit() -> None:
    """Debug mode: a verified slot waits for the commit (docs/spec.md): a decode, an advance, a conv update or a fork
    naming it in between raises SlotError at the call and writes nothing; other slots decode in the same step; after
    the commit the slot decodes again."""
    pool = build(KDAHeads(1, 2, K, V), L=4, debug=True, conv_kernel_size=4)
    gen = torch.Generator().manual_seed(3)
    model = make_model(pool, gen, conv=True)
    ids = pool.alloc(3)
    verified, other = ids[:2], ids[2:]
    d = random_drafts(pool, 2, 2, gen)
    verify_all(pool, model, d, verified)
    snap = {n: getattr(pool, n).clone() for n in ("checkpoint", "d_cache", "cursors", "conv_state")}
    x = random_decode_inputs(1, 1, 2, K, V, dtype=torch.float32, generator=gen)
    p = model.params[0]
    calls = {"decode": lambda s: pool.decode(0, x.mixed_qkv, x.a, x.b, p.A_log, p.dt_bias, s, **model.conv_kw(0)),
             "advance": lambda s: pool.advance(s),
             "conv_update": lambda s: pool.conv_update(0, x.mixed_qkv, model.conv[0], s),
             "fork": lambda s: pool.fork(s, other)}
    for name, call in calls.items():
        with pytest.raises(SlotError, match=rf"{name}.*\(debug check\).*between a verify and its commit.*"
                                            rf"\[{int(verified[1])}\]"):
            call(verified[1:])
    for n, t in snap.items():
        assert torch.equal(getattr(pool, n), t), n
    decode_step(pool, model, [random_decode_inputs(1, 1, 2, K, V, dtype=torch.float32, generator=gen)] * 2, other)
    pool.commit(verified, torch.tensor([1, 2], dtype=torch.int32))
    decode_step(pool, model, [random_decode_inputs(2, 1, 2, K, V, dtype=torch.float32, generator=gen)] * 2, verified)
    pool.check()


def test_a_step_takes_the_same_slots_and_parents_and_verifies_each_layer_once() -> None:
    """A folding step whose later verify names other slots or other parents, verifies a layer twice, or whose commit
    leaves a verified row out (-1) would count a folded ring twice: each is refused with ValueError before anything is
    written, and the step commits as its first verify gave it."""
    pool = build(KDAHeads(1, 2, K, V), L=4)
    gen = torch.Generator().manual_seed(6)
    model = make_model(pool, gen)
    ids = pool.alloc(3)
    slots = ids[:2]
    for _ in range(2):
        decode_step(pool, model, [random_decode_inputs(3, 1, 2, K, V, dtype=torch.float32, generator=gen)] * 2, ids)
    committed = read_states(pool, slots.tolist())
    d = random_drafts(pool, 2, 3, gen)
    parents = torch.tensor([[-1, 0, 1]] * 2, dtype=torch.int32)
    p = model.params

    def verify(layer: int, s: torch.Tensor, par: torch.Tensor) -> None:
        pool.verify(layer, d.mixed[layer], d.a[layer], d.b[layer], p[layer].A_log, p[layer].dt_bias, s, parents=par)

    names = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "spec_folded")

    def unchanged(snap: dict[str, torch.Tensor]) -> None:
        for n, t in snap.items():
            assert torch.equal(getattr(pool, n), t), n

    verify(0, slots, parents)
    assert pool.spec_folded.sum() > 0, "the verify must fold"
    snap = {n: getattr(pool, n).clone() for n in names}
    with pytest.raises(ValueError, match=r"verify\(layer=1\): `slots` must be the step's, as its first verify gave "
                                         + re.escape(f"them ({slots.tolist()}); got [{int(ids[2])}, {int(ids[1])}]")):
        verify(1, torch.stack([ids[2], ids[1]]), parents)
    with pytest.raises(ValueError, match=r"verify\(layer=1\): `parents` must be the step's"):
        verify(1, slots.clone(), torch.full((2, 3), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"verify\(layer=0\): layer 0 was verified already in this step"):
        verify(0, slots, parents)
    unchanged(snap)
    verify(1, slots.clone(), parents.clone())  # equal values in other tensors: the same step
    snap = {n: getattr(pool, n).clone() for n in names}
    with pytest.raises(ValueError, match=r"commit: `slots` must be the step's"):
        pool.commit(torch.tensor([-1, int(slots[1])], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                    path=torch.tensor([[0, 1, 2]] * 2, dtype=torch.int32))
    unchanged(snap)
    pool.commit(slots, torch.zeros(2, dtype=torch.int32), path=torch.tensor([[0, 1, 2]] * 2, dtype=torch.int32))
    assert rel(read_states(pool, slots.tolist()), committed) < 1e-6
    pool.check()


def test_parents_out_of_range_with_the_conv_refuse_the_row_and_leave_no_step_open() -> None:
    """A tree row whose parents name a later or missing node, with the conv: the row is refused and recorded (as
    without the conv), no IndexError from the drafts' conv, and the step commits."""
    pool = build(KDAHeads(1, 2, K, V), L=5, conv_kernel_size=4)
    gen = torch.Generator().manual_seed(8)
    model = make_model(pool, gen, conv=True)
    ids = pool.alloc(2)
    before = read_states(pool, ids.tolist())
    windows = pool.read_conv_state(0, ids)
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 7]], dtype=torch.int32)
    verify_all(pool, model, random_drafts(pool, 2, 3, gen), ids, parents)
    pool.commit(ids, torch.tensor([2, 2], dtype=torch.int32), path=torch.tensor([[0, 1, 2]] * 2, dtype=torch.int32))
    with pytest.raises(SlotError, match=rf"verify\(layer=0\): 1 row\(s\).*row 1 slot {int(ids[1])}"):
        pool.check()
    assert rel(read_states(pool, ids[1:].tolist()), before[:, 1:]) == 0
    assert torch.equal(pool.read_conv_state(0, ids[1:]), windows[1:])
    assert int(pool.cursors[int(ids[0])]) == 2  # the good row committed


def test_calls_that_sync_refuse_slots_between_verify_and_commit_and_fork_records_them() -> None:
    """Default mode: export_state, import_state, load_state and end_prefill (which sync anyway) and free refuse a
    slot of the open verify step with SlotError before anything is written, here after a folding verify (an
    export would read the fold's checkpoint plus the committed ring again; a slot freed and handed out again would
    take the step's commit into the new request); fork copies nothing for a pair naming one (as source or
    destination) and check() reports it, naming the open step; read_state gives the committed state; after the
    commit all of them work again."""
    from tp_replayssm.layers import end_prefill

    pool = build(KDAHeads(1, 2, K, V), L=4, conv_kernel_size=4)
    gen = torch.Generator().manual_seed(4)
    model = make_model(pool, gen, conv=True)
    ids = pool.alloc(4)
    verified, other = ids[:2], ids[2:]
    for _ in range(2):
        decode_step(pool, model, [random_decode_inputs(4, 1, 2, K, V, dtype=torch.float32, generator=gen)] * 2, ids)
    committed = read_states(pool, verified.tolist())
    shard = pool.export_state(other[:1])
    verify_all(pool, model, random_drafts(pool, 2, 3, gen), verified)
    assert pool.spec_folded.sum() > 0, "the verify must fold"
    snap = {n: getattr(pool, n).clone() for n in ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors",
                                                   "conv_state")}
    busy = int(verified[1])
    refused = {"export_state": lambda: pool.export_state(verified[1:]),
               "import_state": lambda: pool.import_state(verified[1:], shard),
               "load_state": lambda: pool.load_state(0, verified[1:], torch.zeros(1, 2, V, K)),
               "end_prefill": lambda: end_prefill(pool, verified[1:]),
               "free": lambda: pool.free([int(other[0]), busy])}
    free_before = pool._slots.num_free
    for name, call in refused.items():
        with pytest.raises(SlotError, match=rf"{name}: slots between a verify and its commit .*\[{busy}\]"):
            call()
    assert pool._slots.num_free == free_before and pool._slots.is_allocated(int(other[0]))
    assert pool._slots.is_allocated(busy) and busy not in pool._slots.peek(pool.num_slots)
    assert torch.equal(read_states(pool, verified.tolist()), committed)
    pool.fork(verified[1:], other[:1])  # a busy source
    with pytest.raises(SlotError, match=rf"fork: 1 row\(s\).*open verify step.*row 0 slot {busy}"):
        pool.check()
    pool.fork(other[1:], verified[1:])  # a busy destination
    with pytest.raises(SlotError, match=rf"fork: 1 row\(s\).*row 0 slot {busy}"):
        pool.check()
    for n, t in snap.items():
        assert torch.equal(getattr(pool, n), t), n
    pool.commit(verified, torch.tensor([1, 0], dtype=torch.int32))
    pool.export_state(verified)
    pool.fork(verified[1:], other[:1])
    pool.check()
    pool.free([busy])  # committed: it frees, and comes back zeroed with cursor 0
    assert pool.cursors[busy] == 0xFFFF and int(pool.alloc(pool._slots.num_free)[-1]) == busy
    assert pool.cursors[busy] == 0 and pool.conv_state[:, busy].abs().max() == 0


@pytest.mark.parametrize("layout", ["predecayed", "sglang"])
def test_a_free_slot_named_by_the_open_step_is_handed_out_only_after_its_commit(layout: str) -> None:
    """A verify row naming a free slot is a refused row; alloc between that verify and the commit skips the slot
    (handed out, it would take the step's commit: a moved cursor, the drafts in its conv window) and hands out the
    next free one, raises PoolExhaustedError naming the wait when no other is free, and hands the slot out zeroed after
    the commit; the slot handed out meanwhile keeps the state alloc gave it through the commit."""
    from tp_replayssm import PoolExhaustedError

    pool = build(KDAHeads(1, 2, K, V), layout=layout, S=3, L=4, conv_kernel_size=4)
    gen = torch.Generator().manual_seed(9)
    model = make_model(pool, gen, conv=True)
    assert pool.alloc(1).tolist() == [0]  # slots 1 and 2 free
    slots = torch.tensor([0, 1], dtype=torch.int32)
    verify_all(pool, model, random_drafts(pool, 2, 3, gen), slots)
    new = pool.alloc(1)
    assert new.tolist() == [2], "the slot the open step names was handed out"
    with pytest.raises(PoolExhaustedError, match=r"only 0 of 3 are free \(1 more free slots are named by the open "
                                                 r"verify step"):
        pool.alloc(1)
    pool.commit(slots, torch.tensor([3, 3], dtype=torch.int32))
    with pytest.raises(SlotError, match=r"verify\(layer=0\): 1 row\(s\).*row 1 slot 1"):
        pool.check()
    assert pool.cursors[2] == 0 and pool.conv_state[:, 2].abs().max() == 0
    assert torch.equal(read_states(pool, [2]), torch.zeros_like(read_states(pool, [2])))
    assert pool.alloc(1).tolist() == [1]
    assert pool.cursors[1] == 0 and pool.conv_state[:, 1].abs().max() == 0
