"""The conv fused into the decode launch (``DecodePlan.fused_conv``): the plans (where the library fuses, mode 1 or
2, the reader count, what ``check`` refuses) and the sm_90 compile of the fused programs (registers, stack, spills, and
the relaxed reader count's missing fences) with the H200's triton.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _conv_fused_helpers import problem
from tp_replayssm.kernels.plan import FUSE_CONV_FROM, conv_readers, fusable, plan_decode

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
