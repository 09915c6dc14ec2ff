"""Slot safety: a bad slot id never touches another request's state, and the next ``pool.check()`` reports it.

A row whose slot is out of range, not allocated (never, or freed), or repeated within one call is a padding row: zero
output, and no checkpoint, ring or cursor byte of ANY slot changes. Each test runs the bad call on one pool and the
same call with the bad rows replaced by padding (-1) on a twin pool built by the same steps: every output row and
every pool tensor must then be bit-identical between the two, the bad rows' outputs zero, and ``check()`` on the
first pool must raise ``SlotError`` naming the method, layer, rows and slot ids (then clear). The PyTorch path runs
every case; the Helion kernels run one case per kernel path in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from _slot_cases import bad_slot_cases
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError
from tp_replayssm.kernels.backend import use_cpu_backend
from tp_replayssm.testing import random_decode_inputs, random_head_params

H, HV, K, V, L, S = 1, 2, 16, 16, 4, 6
POOL_TENSORS = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors")


def _pool(layout: str, device: str = "cpu", **kw: object) -> tuple[ReplaySSMStatePool, torch.Tensor]:
    """A pool with slots 0-3 allocated and slot 1 freed again (so slots 1, 4, 5 are free), after 3 steps of
    random decoding of slots 0, 2, 3 with the fused advance: rings and cursors hold data, some cursors are 3."""
    pool = ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=2, num_slots=S, ring_length=L,
                              ring_layout=layout, device=device, **kw)
    pool.alloc(4)
    pool.free([1])
    gen = torch.Generator().manual_seed(7)
    params = random_head_params(HV, K, device=device, generator=gen)
    slots = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    with use_cpu_backend("torch"):  # (on CPU the set-up need not run in the interpreter)
        for _ in range(3):
            for layer in range(2):
                inp = random_decode_inputs(3, H, HV, K, V, dtype=torch.float32, device=device, generator=gen)
                pool.decode(layer, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, slots,
                            advance=layer == 1)
    pool.check()
    return pool, params


def _step(pool: ReplaySSMStatePool, params: object, slots: list[int], how: str, seed: int = 11) -> torch.Tensor:
    """One call of ``how`` ("decode", "fused" = decode with the fused advance, "advance" = decode then advance) on
    layer 1 with ``slots``; returns the decode's output."""
    dev = pool.device
    gen = torch.Generator().manual_seed(seed)
    inp = random_decode_inputs(len(slots), H, HV, K, V, dtype=torch.float32, device=dev, generator=gen)
    t = torch.tensor(slots, dtype=torch.int32, device=dev)
    force = torch.tensor([1 if i % 3 == 2 else 0 for i in range(len(slots))], dtype=torch.int32, device=dev)
    out = pool.decode(1, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, t, force_flush=force,
                      advance=how == "fused")
    if how == "advance":
        pool.advance(t, force)
    return out


BAD = bad_slot_cases(S)  # slots of one call -> the bad rows
ALL_BAD = ([0, S, 4, 1, 3, 3, 2, -1], [1, 2, 3, 4, 5])  # every kind of bad row in one call, and its bad rows


def _run_case(layout: str, how: str, case: str | tuple[list[int], list[int]], **pool_kw: object) -> None:
    """The bad call of ``case`` (a name in ``BAD``, or ``(slots, bad rows)``) against the clean call on a twin."""
    slots, bad_rows = BAD[case] if isinstance(case, str) else case
    pool, params = _pool(layout, **pool_kw)
    twin, _ = _pool(layout, **pool_kw)
    clean = [-1 if i in bad_rows else s for i, s in enumerate(slots)]
    out = _step(pool, params, slots, how)
    expect = _step(twin, params, clean, how)
    assert torch.equal(out, expect), "rows of a call with a bad row differ from the clean call"
    for r in bad_rows:
        assert (out[r] == 0).all(), f"bad row {r} is not zero"
    for name in POOL_TENSORS:
        assert torch.equal(getattr(pool, name), getattr(twin, name)), f"{name} differs: a bad row wrote"
    twin.check()  # the clean call recorded nothing
    if not bad_rows:
        pool.check()
        return
    method = "decode"  # the first bad call of the step is the decode
    with pytest.raises(SlotError) as info:
        pool.check()
    msg = str(info.value)
    assert f"ReplaySSMStatePool.{method}(layer=1)" in msg, msg
    for r in bad_rows:
        assert f"row {r} slot {slots[r]}" in msg, msg
    pool.check()  # the record was cleared


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("how", ["decode", "fused", "advance"])
@pytest.mark.parametrize("layout", ["predecayed", "sglang"])
def test_bad_slots_are_padding_rows_and_reported(layout: str, how: str, case: str) -> None:
    _run_case(layout, how, case)


@pytest.mark.parametrize("how,layout,state", [("fused", "predecayed", "fp32"), ("advance", "sglang", "fp32"),
                                              ("decode", "predecayed", "bf16")])
def test_kernels_refuse_bad_slots_in_the_interpreter(how: str, layout: str, state: str, interpreter: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The Helion decode kernel (both ring layouts, with and without the fused advance; with a bf16 checkpoint the
    plain decode's ``early_qk`` form, which normalizes q and k before the slot's verdict) and the cursor advance
    kernel, one call with every kind of bad row at once."""
    from _decode_scenario import record_kernel_args

    seen = record_kernel_args(monkeypatch, "early_qk")
    _run_case(layout, how, ALL_BAD, state_dtype=torch.bfloat16 if state == "bf16" else torch.float32)
    assert seen and all(early == (state == "bf16") for (early,) in seen), seen


def test_advance_alone_refuses_and_reports() -> None:
    """``pool.advance`` with bad rows (a decode that listed them already recorded them; here advance is the first):
    only the good slots' cursors move, the record names ``advance`` and its rows."""
    pool, _ = _pool("predecayed")
    before = pool.cursors.clone()
    pool.advance(torch.tensor([0, 0, 5, 2, S], dtype=torch.int32))
    moved = before.clone()
    moved[2] = 0 if before[2] == L - 1 else before[2] + 1
    assert torch.equal(pool.cursors, moved)
    with pytest.raises(SlotError, match=r"ReplaySSMStatePool\.advance: 4 row\(s\).*row 0 slot 0, row 1 slot 0, "
                                        r"row 2 slot 5, row 4 slot 6"):
        pool.check()


def test_only_the_first_bad_call_is_named_and_later_ones_counted() -> None:
    """The first call kind (method and layer) with bad rows owns the record; other kinds are counted. Later calls
    of the same kind (the same layer next step, or a graph replay) add their rows to it."""
    pool, params = _pool("predecayed")
    _step(pool, params, [0, 4], "decode")
    _step(pool, params, [5, 0], "advance")  # decode(layer=1) again, then advance: 1 + 1 more rows
    gen = torch.Generator().manual_seed(1)
    inp = random_decode_inputs(2, H, HV, K, V, dtype=torch.float32, generator=gen)
    pool.decode(0, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, torch.tensor([S, 0], dtype=torch.int32))
    with pytest.raises(SlotError, match=r"decode\(layer=1\): 2 row\(s\).*row 1 slot 4, row 0 slot 5 \[slots 4, 5: not "
                                        r"allocated now\]; .*; 2 more bad row\(s\) in later calls"):
        pool.check()


def test_check_says_why_each_slot_shown_was_refused() -> None:
    """``check()`` tells each recorded slot's fault as far as the host can tell then: out of range (with the range),
    named twice in the call, not allocated now, or allocated now (freed slot 1 given out again before the check)."""
    pool, params = _pool("predecayed")
    _step(pool, params, [0, S, 4, 1, 3, 3, 2, -1], "decode")  # ALL_BAD: rows 1-5 bad
    with pytest.raises(SlotError) as info:
        pool.check()
    assert (f"row 1 slot {S}, row 2 slot 4, row 3 slot 1, row 4 slot 3, row 5 slot 3 [slot {S}: out of range [0, "
            f"{S}); slots 4, 1: not allocated now; slot 3: named twice in the call]; they were") in str(info.value), \
        info.value
    _step(pool, params, [1, 0], "decode")
    assert 1 in pool.alloc(3).tolist()  # (every free slot: 1 among them)
    with pytest.raises(SlotError, match=r"row 0 slot 1 \[slot 1: allocated now \(free at the call, or named again "
                                        r"in a row not shown\)\]"):
        pool.check()


def test_many_bad_rows_are_listed_up_to_the_record() -> None:
    pool, params = _pool("predecayed")
    _step(pool, params, [S + i for i in range(10)] + [0], "decode")
    with pytest.raises(SlotError) as info:
        pool.check()
    msg = str(info.value)
    assert "10 row(s)" in msg and "row 7 slot 13" in msg and "row 8 slot" not in msg and msg.count("...") == 1


def test_methods_that_sync_report_first_and_check_their_own_ids() -> None:
    pool, params = _pool("predecayed")
    _step(pool, params, [4, 0], "decode")
    with pytest.raises(SlotError, match="decode"):  # the recorded call first
        pool.read_state(0, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(SlotError, match=r"read_state: slots out of range \[0, 6\) or not allocated: \[1, 6\]"):
        pool.read_state(0, torch.tensor([1, 6], dtype=torch.int32))
    with pytest.raises(SlotError, match="load_state: slots given more than once in one call: \\[2\\]"):
        pool.load_state(0, torch.tensor([2, 2], dtype=torch.int32), torch.zeros(2, HV, V, K))
    _step(pool, params, [0, 0], "decode")
    with pytest.raises(SlotError, match="repeated"):
        pool.verify_placement()


def test_debug_mode_raises_at_the_call_before_anything_is_written() -> None:
    pool, params = _pool("predecayed", debug=True)
    snapshot = {n: getattr(pool, n).clone() for n in POOL_TENSORS}
    with pytest.raises(SlotError, match=r"decode\(layer=1\) \(debug check\): slots out of range.*\[4\]"):
        _step(pool, params, [4, 0], "decode")
    with pytest.raises(SlotError, match="given more than once"):
        _step(pool, params, [3, 3], "decode")
    with pytest.raises(SlotError, match=r"advance \(debug check\): .*given more than once"):
        pool.advance(torch.tensor([3, -1, 3], dtype=torch.int32))
    for n, t in snapshot.items():
        assert torch.equal(getattr(pool, n), t), n


def test_freed_slot_is_refused_until_allocated_again() -> None:
    pool, params = _pool("predecayed")
    pool.free([2])
    out = _step(pool, params, [2, 0], "fused")
    assert (out[0] == 0).all()
    with pytest.raises(SlotError, match="row 0 slot 2"):
        pool.check()
    (again,) = pool.alloc(2).tolist()[:1]
    assert again in (1, 2, 4, 5)
    pool.check()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["predecayed", "sglang"])
def test_graph_replay_with_a_bad_row_keeps_running_and_reports(layout: str) -> None:
    """A CUDA graph of a decode step (two layers, the fused advance) captured with good slots and replayed with a
    bad row in its slot buffer: the replay runs, writes nothing for the bad row, and the next check() reports it;
    the good rows equal an eager twin's bitwise."""
    pool, params = _pool(layout, device="cuda")
    twin, _ = _pool(layout, device="cuda")
    dev = pool.device
    gen = torch.Generator().manual_seed(3)
    inp = random_decode_inputs(3, H, HV, K, V, dtype=torch.bfloat16, device=dev, generator=gen)
    slots = torch.tensor([0, 2, 3], dtype=torch.int32, device=dev)

    def step(p: ReplaySSMStatePool, s: torch.Tensor) -> torch.Tensor:
        p.decode(0, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, s)
        return p.decode(1, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, s, advance=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(pool, slots)  # warm-up: compiles and records the direct launches
        step(twin, slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(pool, slots)
    slots.copy_(torch.tensor([0, 5, 3], dtype=torch.int32))  # slot 5 is free
    graph.replay()
    expect = step(twin, torch.tensor([0, -1, 3], dtype=torch.int32, device=dev))
    torch.cuda.synchronize()
    assert torch.equal(out, expect) and (out[1] == 0).all()
    for name in POOL_TENSORS:
        assert torch.equal(getattr(pool, name), getattr(twin, name)), name
    with pytest.raises(SlotError, match="row 1 slot 5"):
        pool.check()


def _edit_pool_plans(monkeypatch: pytest.MonkeyPatch, **fields: object) -> None:
    """The pool's decode calls take the library's plans with ``fields`` replaced."""
    import dataclasses

    from tp_replayssm.kernels import launch

    library_plan = launch.plan_for
    monkeypatch.setattr(launch, "plan_for", lambda *a, **kw: dataclasses.replace(library_plan(*a, **kw), **fields))


@pytest.mark.parametrize("how,layout,state", [("decode", "predecayed", "bf16"), ("fused", "sglang", "fp32")])
def test_pinned_loads_refuse_bad_slots_in_the_interpreter(how: str, layout: str, state: str, interpreter: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode kernel with ``DecodePlan.pinned_loads`` (the row's loads kept above the slot's verdict branch by a
    use on the refused path, in a store that never runs) edited into the pool's plans: the call with every kind of
    bad row at once, as above; checked to reach the kernel."""
    from _decode_scenario import record_kernel_args

    _edit_pool_plans(monkeypatch, pinned_loads=True)
    seen = record_kernel_args(monkeypatch, "pinned_loads")
    _run_case(layout, how, ALL_BAD, state_dtype=torch.bfloat16 if state == "bf16" else torch.float32)
    assert seen and all(pinned for (pinned,) in seen), seen


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", [False, True], ids=["library-plans", "pinned-loads"])
@pytest.mark.parametrize("how,layout,state", [("decode", "predecayed", "bf16"), ("fused", "sglang", "fp32"),
                                              ("advance", "predecayed", "fp32")])
def test_kernels_refuse_bad_slots_on_gpu(how: str, layout: str, state: str, pinned: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The call with every kind of bad row at once on the GPU, with the library's plans and with
    ``DecodePlan.pinned_loads`` edited into them (a plan edit the library does not take; its tests keep it correct)."""
    _edit_pool_plans(monkeypatch, pinned_loads=pinned)
    _run_case(layout, how, ALL_BAD, device="cuda", state_dtype=torch.bfloat16 if state == "bf16" else torch.float32)
