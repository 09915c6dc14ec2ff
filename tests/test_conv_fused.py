"""The conv fused into the decode launch (``DecodePlan.fused_conv``): plans, the kernel in Triton's interpreter, the
sm_90 compile, and (``gpu``) the device.

The fused launch must do what the two launches do (the conv kernel, then the decode on its bf16 outputs): in the
interpreter the two agree bit for bit (outputs, checkpoints, rings, cursors, windows), both against the PyTorch path
(a bf16 step apart: the interpreter truncates bf16 stores) and against an independent float64 conv (``conv1d``,
depthwise and causal, then SiLU) feeding the PyTorch decode. Windows no row names hold sentinels that must stay bit
for bit; outputs start NaN-poisoned; bad rows are padding rows recorded once, as ``decode``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError
from tp_replayssm.kernels.backend import use_cpu_backend
from tp_replayssm.kernels.grid import H200_SMS
from tp_replayssm.kernels.plan import FUSE_CONV_FROM, DecodeProblem, conv_readers, fusable, plan_decode
from tp_replayssm.testing import random_decode_inputs, random_head_params

from _decode_scenario import record_kernel_args

K = V = 16
L, S = 4, 6
SENTINEL = 1234.5
STATE_TENSORS = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "conv_state")


def problem(batch: int, H: int, HV: int, *, state: torch.dtype = torch.bfloat16, device: str = "cuda",
            conv: int = 4, layout: str = "predecayed", advance: bool = False, key_dim: int = 128,
            value_dim: int = 128, lower_bound: float | None = None) -> DecodeProblem:
    bounded = lower_bound is not None and 15 * abs(lower_bound) <= 75  # (L = 16)
    return DecodeProblem(batch, H, HV, key_dim, value_dim, 16, state, torch.bfloat16, device, H200_SMS, layout, True,
                         advance, True, lower_bound is not None, bounded, conv)


# ---- plans --------------------------------------------------------------------------------------


def test_the_plan_fuses_the_conv_where_it_can() -> None:
    """Mode 1 where one program reads a q/k head's windows (H = HV, one value tile), mode 2 with the reader count
    otherwise (value tiles, GQA); no fusion without a window, off the cursor table, with a non-power-of-two K, or
    without the conv. The library's own choice (``fuse_conv=None``) fuses from FUSE_CONV_FROM (row, value head)
    pairs; ``False`` never fuses."""
    assert plan_decode(problem(128, 32, 32)).fused_conv == 1 and plan_decode(problem(8, 32, 32)).fused_conv == 2
    assert plan_decode(problem(8, 8, 8)).fused_conv == 0 and plan_decode(problem(1, 32, 32)).fused_conv == 0
    assert plan_decode(problem(128, 32, 32), fuse_conv=False).fused_conv == 0
    edge = FUSE_CONV_FROM // 8
    assert plan_decode(problem(edge, 8, 8)).fused_conv and not plan_decode(problem(edge - 1, 8, 8)).fused_conv
    p = plan_decode(problem(128, 32, 32), fuse_conv=True)  # HV32 B128: 128-row tiles
    assert (p.value_tile, p.fused_conv, p.conv_readers) == (128, 1, 0)
    p = plan_decode(problem(8, 8, 8), fuse_conv=True)  # HV8 B8: 16-row tiles, 8 per head
    assert (p.value_tile, p.fused_conv, p.conv_readers) == (16, 2, 8)
    p = plan_decode(problem(128, 2, 8), fuse_conv=True)  # GQA: 4 value heads per q/k head
    assert p.fused_conv == 2 and p.conv_readers == 4 * -(-128 // p.value_tile)
    assert plan_decode(problem(8, 8, 8, conv=0), fuse_conv=True).fused_conv == 0
    assert plan_decode(problem(8, 8, 8, conv=1), fuse_conv=True).fused_conv == 0  # no window: the conv's own launch
    assert plan_decode(problem(8, 8, 8, key_dim=96), fuse_conv=True).fused_conv == 0
    no_table = dataclasses.replace(problem(8, 8, 8), cursor_table=False)
    assert not fusable(no_table) and plan_decode(no_table, fuse_conv=True).fused_conv == 0
    assert conv_readers(problem(8, 2, 8), 32) == 16
    for prob in (problem(1, 4, 4), problem(512, 32, 32, state=torch.float32), problem(8, 16, 16, advance=True),
                 problem(8, 8, 8, layout="sglang"), problem(4, 1, 2, device="cpu", key_dim=16, value_dim=16)):
        plan = plan_decode(prob, fuse_conv=True)
        assert plan.fused_conv in (1, 2)
        assert plan.relaxed_conv_count == (plan.fused_conv == 2 and plan.early_qk), plan  # mode 2's count
        plan.check(prob)
    assert plan_decode(problem(8, 8, 8), fuse_conv=True).relaxed_conv_count
    assert not plan_decode(problem(8, 8, 8), fuse_conv=True).without_conv().relaxed_conv_count


def test_plan_check_refuses_a_fused_conv_the_call_cannot_run() -> None:
    prob = problem(8, 8, 8)
    plan = plan_decode(prob, fuse_conv=True)
    with pytest.raises(ValueError, match="`fused_conv` 2 needs a pre-conv call with a window"):
        plan.check(problem(8, 8, 8, conv=0))
    with pytest.raises(ValueError, match="`fused_conv` 1 needs one program per"):
        dataclasses.replace(plan, fused_conv=1, conv_readers=0).check(prob)
    with pytest.raises(ValueError, match="`conv_readers` must be 8 for value tiles of 16 rows; got 3"):
        dataclasses.replace(plan, conv_readers=3).check(prob)
    with pytest.raises(ValueError, match="`conv_readers` must be 0 without a fused conv"):
        dataclasses.replace(plan, fused_conv=0).check(prob)
    with pytest.raises(ValueError, match="`fused_conv` must be 0, 1 or 2; got 5"):
        dataclasses.replace(plan, fused_conv=5).check(prob)
    for edit in (dict(early_qk=False), dict(fused_conv=0, conv_readers=0)):  # the count before the verdict only
        with pytest.raises(ValueError, match="`relaxed_conv_count` is a form of the counted conv before the verdict"):
            dataclasses.replace(plan, relaxed_conv_count=True, **edit).check(prob)
    dataclasses.replace(plan, relaxed_conv_count=True).check(prob)
    plan.without_conv().check(prob)  # two launches: always allowed
    big = problem(128, 32, 32)
    dataclasses.replace(plan_decode(big, fuse_conv=True), fused_conv=2, conv_readers=1).check(big)


# ---- the kernel in Triton's interpreter ---------------------------------------------------------


def make_pool(H: int, HV: int, state: torch.dtype, layout: str = "predecayed", seed: int = 3) -> ReplaySSMStatePool:
    """Slots 0-3 allocated, 1 freed again (1, 4, 5 free), random states and windows in slots 0, 2, 3 of both layers;
    every other window (the scratch one included) holds SENTINEL."""
    pool = ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=2, num_slots=S, ring_length=L, device="cpu",
                              state_dtype=state, ring_layout=layout, conv_kernel_size=4, conv_dtype=torch.bfloat16)
    pool.conv_state.fill_(SENTINEL)
    pool.alloc(4)
    pool.free([1])
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([0, 2, 3], dtype=torch.int32)
    for layer in range(2):
        pool.load_state(layer, ids, torch.randn(3, HV, V, K, generator=gen) * 0.1,
                        conv_states=torch.randn(3, pool.conv_channels, 3, generator=gen))
    return pool


def conv_taps(D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(D, 4, generator=gen) * 0.5).bfloat16(), (torch.randn(D, generator=gen) * 0.2).bfloat16()


def plan_of(pool: ReplaySSMStatePool, batch: int, advance: bool):  # noqa: ANN201
    """The library's plan of a pool's decode with the conv on CPU tensors (the interpreter's plan)."""
    lh = pool.local_heads
    return plan_decode(DecodeProblem(batch, lh.num_q_heads, lh.num_v_heads, K, V, L, pool.checkpoint.dtype,
                                     pool.cache_dtype, "cpu", H200_SMS, pool.ring_layout, True, advance, True, False,
                                     False, 4), fuse_conv=True)


def fused_and_two_launch_steps(H: int, HV: int, state: torch.dtype, slots: list[int], *, steps: int = L + 1,
                               layout: str = "predecayed", plan_edit: dict | None = None,
                               fused_edit: dict | None = None, A_log_shift: float = 0.0, oracle: bool = False,
                               exact: bool = True) -> list[ReplaySSMStatePool]:
    """``steps`` model steps of 2 layers (the fused advance on the last) on three twin pools: the fused launch and the
    two launches in the interpreter, the PyTorch path; asserts at every layer that the first two agree bit for bit
    (``exact=False``: windows, cursors and the k and g rings bit for bit, the rest within 1e-2) and the third within
    bf16 steps, outputs NaN-poisoned first. ``plan_edit`` edits both launches' plans, ``fused_edit`` the fused
    one's alone. With ``oracle``, the live rows' outputs are also held to the PyTorch decode
    fed by a float64 conv1d of the windows' history. Returns the pools."""
    pools = [make_pool(H, HV, state, layout) for _ in range(3)]
    D = pools[0].conv_channels
    weight, bias = conv_taps(D, seed=5)
    params = random_head_params(HV, K, generator=torch.Generator().manual_seed(2))
    A_log = params.A_log + A_log_shift
    ids = torch.tensor(slots, dtype=torch.int32)
    B = len(slots)
    live = [r for r, s in enumerate(slots) if s in (0, 2, 3) and slots.count(s) == 1]
    history = {layer: pools[2].read_conv_state(layer, torch.tensor([slots[r] for r in live], dtype=torch.int32))
               .double() for layer in range(2)}  # [n, D, 3] per layer: the float64 conv's own window
    oracle_pool = make_pool(H, HV, state, layout)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        for layer in range(2):
            x = random_decode_inputs(B, H, HV, K, V, dtype=torch.bfloat16, generator=gen)
            advance = layer == 1
            plan = plan_of(pools[0], B, advance)
            assert plan.fused_conv, plan
            if plan_edit:
                plan = dataclasses.replace(plan, **plan_edit)
            two = plan.without_conv()
            if fused_edit:
                plan = dataclasses.replace(plan, **fused_edit)
            outs = []
            for pool, backend, p in ((pools[0], "interpreter", plan), (pools[1], "interpreter", two),
                                     (pools[2], "torch", None)):
                out = torch.full((B, 1, HV, V), float("nan"), dtype=torch.bfloat16)
                with use_cpu_backend(backend):
                    pool.decode(layer, x.mixed_qkv, x.a, x.b, A_log, params.dt_bias, ids, conv_weight=weight,
                                conv_bias=bias, advance=advance, out=out, plan=p)
                outs.append(out)
            where = f"step {step} layer {layer}"
            if exact:
                assert torch.equal(outs[0], outs[1]), where
            else:
                torch.testing.assert_close(outs[0].double(), outs[1].double(), rtol=1e-2, atol=1e-2)
                for name in ("checkpoint", "d_cache"):  # (the rebase's delta, rounded, feeds the later deltas)
                    torch.testing.assert_close(getattr(pools[0], name).double(), getattr(pools[1], name).double(),
                                               rtol=1e-2, atol=1e-2)
            for name in STATE_TENSORS if exact else STATE_TENSORS[2:]:
                assert torch.equal(getattr(pools[0], name), getattr(pools[1], name)), (where, name)
            torch.testing.assert_close(outs[0].double(), outs[2].double(), rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(pools[0].checkpoint.double(), pools[2].checkpoint.double(), rtol=3e-2,
                                       atol=3e-2)
            assert torch.equal(pools[0].conv_state, pools[2].conv_state), where
            assert torch.equal(pools[0].cursors, pools[2].cursors), where
            for r in range(B):
                if r not in live:
                    assert (outs[0][r] == 0).all(), (where, r)
            if oracle:  # the float64 conv of the history, rounded as the conv's launch hands it over, then decoded
                rows = torch.tensor(live)
                u = torch.cat([history[layer], x.mixed_qkv[rows].double()[:, :, None]], dim=2)  # [n, D, 4]
                y = F.conv1d(u, weight.double()[:, None, :], bias.double(), groups=D)[:, :, -1]
                y = y * torch.sigmoid(y)
                history[layer] = u[:, :, 1:]
                post = torch.zeros(B, D, dtype=torch.bfloat16)
                post[rows] = y.to(torch.bfloat16)
                with use_cpu_backend("torch"):
                    want = oracle_pool.decode(layer, post, x.a, x.b, A_log, params.dt_bias, ids, advance=advance)
                torch.testing.assert_close(outs[0][rows].double(), want[rows].double(), rtol=3e-2, atol=3e-2)
                assert torch.equal(pools[0].read_conv_state(layer, torch.tensor([slots[r] for r in live],
                                                                                dtype=torch.int32)),
                                   history[layer].to(torch.bfloat16)), where
    for p in pools[:2]:
        assert (p.conv_state[:, [4, 5, S]] == SENTINEL).all()  # never-allocated slots and the scratch window
        assert (p.conv_state[:, 1] == 0).all()  # the freed slot (zeroed by alloc)
        if hasattr(p, "conv_counters"):
            assert (p.conv_counters == 0).all()
    return pools


def test_fused_mode2_in_the_interpreter(interpreter: None) -> None:
    """Mode 2 (two value heads read each q/k head's windows), fp32 checkpoint, the tiny-batch path, a padding row,
    over a whole ring cycle and a flush; against the float64 conv1d feeding the PyTorch decode too."""
    pools = fused_and_two_launch_steps(1, 2, torch.float32, [3, -1, 0, 2], oracle=True)
    plan = plan_of(pools[0], 4, False)
    assert plan.fused_conv == 2 and plan.tiny_batch and plan.early_qk, plan
    assert pools[0].conv_counters.shape == (S + 1,)
    for p in pools[:2]:
        p.check()


def test_fused_mode1_in_the_interpreter(interpreter: None) -> None:
    """Mode 1 (H = HV, one value tile: each program owns its windows), bf16 checkpoint (tensor-core chunks), eight rows
    (not the tiny-batch path) with four padding rows, over a ring cycle and a flush."""
    pools = fused_and_two_launch_steps(2, 2, torch.bfloat16, [2, -1, 3, -1, 0, -1, -1, -1])
    plan = plan_of(pools[0], 8, False)
    assert plan.fused_conv == 1 and not plan.tiny_batch and plan.tensor_core_chunks
    for p in pools[:2]:
        p.check()


@pytest.mark.parametrize("H, HV, state, slots", [(1, 2, torch.float32, [3, -1, 0, 2]),
                                                 (2, 2, torch.bfloat16, [2, -1, 3, -1, 0, -1, -1, -1])],
                         ids=["mode2-tiny", "mode1"])
def test_fused_conv_after_the_verdict_in_the_interpreter(interpreter: None, H: int, HV: int, state: torch.dtype,
                                                         slots: list[int]) -> None:
    """The fused conv after the slot's verdict (``early_qk=False``, a plan edit: the windows, inputs and taps loaded
    and the conv computed inside the verdict's branch; in mode 2 each program counted at its end, the last reader
    reading the q/k windows again to write them): bit for bit the two launches, in mode 2 (the tiny-batch path) and
    mode 1, over a ring cycle and a flush."""
    pools = fused_and_two_launch_steps(H, HV, state, slots, fused_edit={"early_qk": False,
                                                                         "relaxed_conv_count": False})
    for p in pools[:2]:
        p.check()


@pytest.mark.parametrize("relaxed", [True, False], ids=["relaxed-count", "fenced-count"])
@pytest.mark.parametrize("H, HV, slots", [(1, 2, [3, -1, 0, 2]), (1, 4, [2, -1, 3, 0, -1, -1, -1, -1])],
                         ids=["tiny", "one-program-per-tile"])
def test_fused_mode2_counts_in_the_interpreter(interpreter: None, monkeypatch: pytest.MonkeyPatch, H: int, HV: int,
                                               slots: list[int], relaxed: bool) -> None:
    """Mode 2's q/k windows' reader count in both forms: the library's relaxed count (``relaxed_conv_count``: the
    increment computed from q and k instead of fences around it) and the fenced ``acq_rel`` count (the plan edit
    ``relaxed_conv_count=False``): bit for bit the two launches over a ring cycle and a flush, the counters zero
    again, on the tiny-batch path and on the path of one program per value tile (4 readers); against the float64
    conv1d feeding the PyTorch decode too."""
    seen = record_kernel_args(monkeypatch, "fused_conv", "relaxed_conv_count")
    pools = fused_and_two_launch_steps(H, HV, torch.float32, slots, fused_edit={"relaxed_conv_count": relaxed},
                                       oracle=True)
    assert plan_of(pools[0], len(slots), False).relaxed_conv_count  # the library's form
    assert (2, relaxed) in seen and (0, False) in seen, set(seen)  # the form reached the fused launches
    assert plan_of(pools[0], len(slots), False).tiny_batch == (len(slots) == 4)
    for p in pools[:2]:
        p.check()


def test_fused_mode3_rebase_in_the_interpreter(interpreter: None) -> None:
    """The rebase as a pass of its own (``predecayed_ring`` 3, a plan edit) with gates that pass the bound: the fused
    launch's pass reads this step's delta back from the ring (the post-conv v is gone by then); against the two
    launches bit for bit and the PyTorch path."""
    pools = fused_and_two_launch_steps(1, 2, torch.float32, [0, 3, -1, 2], steps=3, plan_edit={"predecayed_ring": 3},
                                       A_log_shift=4.0, exact=False)
    # three steps of a 4-entry ring flush nothing: a checkpoint that moved was rebased
    assert not torch.equal(pools[0].checkpoint, make_pool(1, 2, torch.float32).checkpoint), "no head rebased"


def test_fused_sglang_layout_in_the_interpreter(interpreter: None) -> None:
    pools = fused_and_two_launch_steps(1, 1, torch.float32, [0, 2, 3], steps=2, layout="sglang")
    assert plan_of(pools[0], 3, False).fused_conv == 1


@pytest.mark.parametrize("early, relaxed", [(False, False), (True, False), (True, True)],
                         ids=["after-verdict", "fenced-count", "relaxed-count"])
def test_fused_bad_rows_in_the_interpreter(interpreter: None, early: bool, relaxed: bool) -> None:
    """Rows naming a slot out of range, free or twice: zero outputs, no byte of any slot written (windows, states,
    rings, cursors), recorded once as decode; the counters zero again; the good rows as the two launches give them.
    With ``early_qk`` the bad rows' windows are read before their verdict and still never written (and with
    ``relaxed_conv_count`` never counted)."""
    slots = [0, S, 4, 1, 3, 3, 2, -1]  # rows 1-5 bad
    pools = [make_pool(1, 2, torch.float32) for _ in range(2)]
    clean = [-1 if r in (1, 2, 3, 4, 5) else s for r, s in enumerate(slots)]
    weight, bias = conv_taps(pools[0].conv_channels, seed=11)
    params = random_head_params(2, K, generator=torch.Generator().manual_seed(12))
    x = random_decode_inputs(8, 1, 2, K, V, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(13))
    outs = []
    for pool, ids in ((pools[0], slots), (pools[1], clean)):
        out = torch.full((8, 1, 2, V), float("nan"), dtype=torch.bfloat16)
        with use_cpu_backend("interpreter"):
            pool.decode(1, x.mixed_qkv, x.a, x.b, params.A_log, params.dt_bias, torch.tensor(ids, dtype=torch.int32),
                        conv_weight=weight, conv_bias=bias, advance=True, out=out,
                        plan=dataclasses.replace(plan_of(pool, 8, True), early_qk=early, relaxed_conv_count=relaxed))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and (outs[0][1:6] == 0).all()
    for name in STATE_TENSORS:
        assert torch.equal(getattr(pools[0], name), getattr(pools[1], name)), name
    assert (pools[0].conv_counters == 0).all()
    with pytest.raises(SlotError, match=r"ReplaySSMStatePool\.decode\(layer=1\): 5 row\(s\).*row 1 slot 6, row 2 "
                                        r"slot 4, row 3 slot 1, row 4 slot 3, row 5 slot 3"):
        pools[0].check()
    pools[1].check()


def test_fused_decode_argument_errors() -> None:
    """A conv plan beside a plan that fuses the conv, and a fused plan for a call it cannot run, are ValueErrors
    before anything is written."""
    from tp_replayssm.kernels.conv_plan import plan_conv

    pool = make_pool(1, 2, torch.float32)
    snapshot = {n: getattr(pool, n).clone() for n in STATE_TENSORS}
    weight, bias = conv_taps(pool.conv_channels, seed=1)
    params = random_head_params(2, K)
    x = random_decode_inputs(3, 1, 2, K, V, dtype=torch.bfloat16)
    ids = torch.tensor([0, 2, 3], dtype=torch.int32)
    call = (1, x.mixed_qkv, x.a, x.b, params.A_log, params.dt_bias, ids)
    plan = plan_of(pool, 3, False)
    with use_cpu_backend("interpreter"):
        with pytest.raises(ValueError, match="`conv_plan` given, but `plan` fuses the conv"):
            pool.decode(*call, conv_weight=weight, conv_bias=bias, plan=plan,
                        conv_plan=plan_conv(3, pool.conv_channels, 4, 132, 1))
        with pytest.raises(ValueError, match="`conv_readers` must be 2"):
            pool.decode(*call, conv_weight=weight, plan=dataclasses.replace(plan, conv_readers=7))
        with pytest.raises(ValueError, match="`conv_plan` given without `conv_weight`"):
            pool.decode(*call, conv_plan=plan_conv(3, pool.conv_channels, 4, 132, 1))
    for n, t in snapshot.items():
        assert torch.equal(getattr(pool, n), t), n


# ---- sm_90 ---------------------------------------------------------------------------------------

SM90_SCRIPT = """
import json
from benchmarks.kernel_regs import kernel_resources
from benchmarks.plan_args import build_plan
from benchmarks.sass_loops import parse
out = []
for batch, hv, state, advance in ((8, 8, "bf16", False), (128, 32, "bf16", False), (128, 32, "bf16", True),
                                  (512, 32, "fp32", False), (1, 4, "bf16", False), (8, 32, "fp32", True)):
    plan = build_plan(batch=batch, heads=hv, state=state, layout="predecayed", advance=advance, cursor_table=True,
                      conv_kernel_size=4, fuse_conv=True)
    r = kernel_resources(plan, state, with_sass=True)
    ins = parse(r.pop("sass"))
    first_exit = next(a for a, t in ins if t.split()[-1] == "EXIT")
    path = [t for a, t in ins if a < first_exit]
    out.append(dict(batch=batch, hv=hv, state=state, fused=plan.fused_conv, readers=plan.conv_readers,
                    warps=plan.num_warps, maxnreg=plan.maxnreg, spill_ops=sum(("STL" in t or "LDL" in t) for _, t in ins),
                    spills_before_exit=sum(("STL" in t or "LDL" in t) for t in path), **r))
import triton
print("RESULT " + json.dumps(dict(triton=triton.__version__, rows=out)))
"""


@pytest.mark.timeout(300)
def test_fused_programs_compile_for_sm90_within_the_budget() -> None:
    """The fused programs of the library's plans compile for sm_90 (the H200's triton) within the budget of the
    programs without the conv (tests/test_kernel_regs.py): the 4-warp programs at most 168 registers and no spill,
    the one-warp programs at most 48 B of stack (a flush loop's), the capped tensor-core programs (168 registers) their
    flush path's 336-368 B; at most 2 spill operations ahead of the first EXIT in any."""
    from test_kernel_regs import _run_with_h200_triton

    found = _run_with_h200_triton(SM90_SCRIPT)
    assert found["triton"] == "3.6.0"
    rows = found["rows"]
    assert [(r["fused"], r["readers"]) for r in rows] == [(2, 8), (1, 0), (1, 0), (1, 0), (2, 8), (2, 4)]
    for r in rows:
        assert r["local"] == 0 and r["spills_before_exit"] <= 2, r
        if r["maxnreg"] is not None:
            assert r["stack"] <= 368, r
        elif r["warps"] == 1:
            assert r["stack"] <= 48, r
        else:
            assert r["stack"] == 0 and r["regs"] <= 168, r


RELAXED_SCRIPT = """
import dataclasses, json
from benchmarks.kernel_regs import kernel_resources
from benchmarks.plan_args import build_plan
from benchmarks.sass_loops import parse
rows = {}
for batch, hv, advance in ((8, 32, True), (1, 8, False)):
    plan = build_plan(batch=batch, heads=hv, state="bf16", layout="predecayed", advance=advance, cursor_table=True,
                      conv_kernel_size=4, fuse_conv=True)
    for relaxed in (False, True):
        r = kernel_resources(dataclasses.replace(plan, relaxed_conv_count=relaxed), "bf16", hv, with_sass=True)
        ins = [t for _, t in parse(r.pop("sass"))]
        count = lambda op: sum(op in t for t in ins)
        rows[f"B{batch} HV{hv} {relaxed}"] = dict(fused=plan.fused_conv, early=plan.early_qk, tiny=plan.tiny_batch,
                                                  library=plan.relaxed_conv_count,
                                                  membar=count("MEMBAR"), cctl=count("CCTL"), f2i=count("F2I"),
                                                  stack=r["stack"])
print("RESULT " + json.dumps(rows))
"""


@pytest.mark.timeout(300)
def test_relaxed_count_drops_the_fences_on_sm90() -> None:
    """``relaxed_conv_count`` on sm_90 (the H200's triton; HV32 B8 bf16 with the fused advance, one-warp programs,
    and HV8 B1, the 4-warp tiny path): mode 2's fenced count (the plan edit ``relaxed_conv_count=False``) has
    ``MEMBAR.ALL.GPU`` before the atomic and ``CCTL.IVALL`` after it; the library's relaxed count has neither, its
    increment comes from q and k (the one ``F2I`` more: their sum made an int, which the dependency needs), and its
    stack is the fenced form's."""
    from test_kernel_regs import _run_with_h200_triton

    rows = _run_with_h200_triton(RELAXED_SCRIPT)
    for shape in ("B8 HV32", "B1 HV8"):
        fenced, relaxed = rows[f"{shape} False"], rows[f"{shape} True"]
        assert fenced["fused"] == 2 and fenced["early"] and fenced["library"], fenced
        assert fenced["membar"] == 1 and fenced["cctl"] == 1, fenced
        assert relaxed["membar"] == 0 and relaxed["cctl"] == 0, relaxed
        assert relaxed["f2i"] == fenced["f2i"] + 1, (fenced, relaxed)
        assert relaxed["stack"] == fenced["stack"], (fenced, relaxed)
    assert rows["B1 HV8 False"]["tiny"] and not rows["B8 HV32 False"]["tiny"]


# ---- the GPU --------------------------------------------------------------------------------------


def gpu_pools(H: int, HV: int, B: int, state: torch.dtype) -> tuple[list[ReplaySSMStatePool], torch.Tensor]:
    """Two twin CUDA pools (K = V = 128, L = 16, bf16 rings and windows) with B + 2 slots allocated, the last freed;
    random states and windows for the first B + 1; the other windows SENTINEL. Returns them and the rows' slots
    (a permutation, with a padding row, a repeated slot and the free slot where B > 2)."""
    gen = torch.Generator().manual_seed(B * 7 + HV)
    pools = []
    for _ in range(2):
        p = ReplaySSMStatePool(KDAHeads(H, HV, 128, 128), num_layers=2, num_slots=B + 4, ring_length=16,
                               state_dtype=state, device="cuda", conv_kernel_size=4, conv_dtype=torch.bfloat16)
        p.conv_state.fill_(SENTINEL)
        p.alloc(B + 2)
        p.free([B + 1])
        pools.append(p)
    states = torch.randn(B + 1, HV, 128, 128, generator=gen) * 0.05
    windows = torch.randn(B + 1, pools[0].conv_channels, 3, generator=gen)
    ids = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    for p in pools:
        for layer in range(2):
            p.load_state(layer, ids, states.cuda(), conv_states=windows.cuda())
    slots = torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)
    if B > 2:
        slots[1] = -1
        slots[B - 1] = slots[0]
        slots[B // 2] = B + 1
    return pools, slots.cuda()


GPU_SHAPES = [(32, 32, 128, torch.bfloat16), (8, 8, 8, torch.bfloat16), (2, 8, 64, torch.float32),
              (4, 4, 1, torch.bfloat16), (32, 32, 8, torch.float32)]
GPU_FORMS = {"after-verdict": dict(early_qk=False, relaxed_conv_count=False),
             "fenced-count": dict(early_qk=True, relaxed_conv_count=False), "library": {}}


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV,B,state,form", [(*shape, form) for shape in GPU_SHAPES for form in GPU_FORMS
                                               # (mode 2's count: every shape but the first)
                                               if form != "fenced-count" or shape[2] != 128])
def test_fused_matches_two_launches_on_gpu(H: int, HV: int, B: int, state: torch.dtype, form: str) -> None:
    """On CUDA, a full ring cycle and a flush of two layers (the fused advance on the last): the fused launch (the
    library's plan with ``fuse_conv=True``: the conv's loads and math before the slot's verdict, mode 2's reader count
    relaxed; or that form with the fenced count; or the conv after the verdict with the fenced count) and the two
    launches (``plan.without_conv()``) on twin pools agree: windows and cursors bit for bit, outputs, checkpoints
    and rings within bf16 rounding; the other windows keep their sentinels; bad rows are zero and recorded once."""
    pools, slots = gpu_pools(H, HV, B, state)
    D = pools[0].conv_channels
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(D, 4, generator=gen) * 0.5).bfloat16().cuda()
    bias = (torch.randn(D, generator=gen) * 0.1).bfloat16().cuda()
    params = random_head_params(HV, 128, device="cuda", generator=torch.Generator().manual_seed(4))
    for step in range(17):
        for layer in range(2):
            x = random_decode_inputs(B, H, HV, 128, 128, dtype=torch.bfloat16, device="cuda",
                                     generator=torch.Generator().manual_seed(step * 2 + layer))
            plan = plan_decode(problem(B, H, HV, state=state, advance=layer == 1), fuse_conv=True)
            assert plan.fused_conv
            two = plan.without_conv()
            assert plan.relaxed_conv_count == (plan.fused_conv == 2 and plan.early_qk), plan
            plan = dataclasses.replace(plan, **GPU_FORMS[form])
            outs = [p.decode(layer, x.mixed_qkv, x.a, x.b, params.A_log, params.dt_bias, slots, conv_weight=weight,
                             conv_bias=bias, advance=layer == 1, plan=pl) for p, pl in ((pools[0], plan),
                                                                                       (pools[1], two))]
            torch.testing.assert_close(outs[0].double(), outs[1].double(), rtol=1e-2, atol=1e-2)
            for name in ("conv_state", "cursors"):
                assert torch.equal(getattr(pools[0], name), getattr(pools[1], name)), (step, layer, name)
            for name in ("checkpoint", "d_cache", "k_cache", "g_cache"):  # (two compiles of the same math: ptxas may
                torch.testing.assert_close(getattr(pools[0], name).double(),  # contract other products into FMAs)
                                           getattr(pools[1], name).double(), rtol=1e-2, atol=1e-2)
            if B > 2:
                for r in (0, 1, B - 1, B // 2):
                    assert (outs[0][r] == 0).all(), (step, layer, r)
    assert (pools[0].conv_state[:, B + 2:] == SENTINEL).all()
    assert (pools[0].conv_counters == 0).all()
    for p in pools:  # 3 bad rows in each of the 17 calls of layer 0 (and as many in layer 1's)
        if B > 2:
            with pytest.raises(SlotError, match=rf"decode\(layer=0\): {3 * 17} row\(s\).*; {3 * 17} more bad"):
                p.check()
        p.check()


@pytest.mark.gpu
def test_fused_graph_replay_with_a_bad_row() -> None:
    """A CUDA graph of a step with the conv (the library's plan; both layers, the fused advance on the last) captured with good slots and replayed
    with a free slot in the slot buffer: the replay runs, the bad row is zero and changes nothing, check() reports it;
    the good rows equal an eager twin's bit for bit."""
    pools, _ = gpu_pools(8, 8, 8, torch.bfloat16)
    pool, twin = pools
    D = pool.conv_channels
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(D, 4, generator=gen) * 0.5).bfloat16().cuda()
    bias = (torch.randn(D, generator=gen) * 0.1).bfloat16().cuda()
    params = random_head_params(8, 128, device="cuda", generator=torch.Generator().manual_seed(6))
    x = random_decode_inputs(3, 8, 8, 128, 128, dtype=torch.bfloat16, device="cuda",
                             generator=torch.Generator().manual_seed(7))
    slots = torch.tensor([0, 2, 3], dtype=torch.int32, device="cuda")

    def step(p: ReplaySSMStatePool, s: torch.Tensor) -> list[torch.Tensor]:
        return [p.decode(layer, x.mixed_qkv, x.a, x.b, params.A_log, params.dt_bias, s, conv_weight=weight,
                         conv_bias=bias, advance=layer == 1) for layer in range(2)]

    snap = {n: getattr(pool, n).clone() for n in STATE_TENSORS}
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        step(pool, slots)
    torch.cuda.current_stream().wait_stream(warm)
    for n, t in snap.items():
        getattr(pool, n).copy_(t)
    pool.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(pool, slots)
    slots.copy_(torch.tensor([0, 9, 3], dtype=torch.int32))  # slot 9 = B + 1 is free
    graph.replay()
    want = step(twin, torch.tensor([0, -1, 3], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        assert torch.equal(o, w) and (o[1] == 0).all()
    for n in STATE_TENSORS:
        assert torch.equal(getattr(pool, n), getattr(twin, n)), n
    with pytest.raises(SlotError, match=r"decode\(layer=0\): .*row 1 slot 9"):
        pool.check()
