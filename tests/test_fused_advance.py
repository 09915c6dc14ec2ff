"""The cursor advance fused into the step's last decode (``run_decode(..., cursor_table=True, advance=True)``, the
pool's ``decode(..., advance=True)``) against the decode followed by the separate advance.

In the fused launch every program counts itself with an atomic add of ``CURSOR_READER`` on its row's cursor (the
count of readers rides above the cursor's 16 bits): the count is the cursor read itself, and the row's last reader
stores the moved cursor. Every program of the row gets the same cursor, the same outputs and caches bit for bit, the
same cursors afterwards (padding rows leave the scratch entry alone). On CPU the kernel runs in the Triton
interpreter (one program at a time), so the counting is checked there and the ordering on the GPU (``gpu`` marker:
4 to 256 programs per row; the pool's CUDA-graph step with the fused advance is in ``tests/test_pool_cuda_graph.py``).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from tp_replayssm.kernels import cursor, decode
from tp_replayssm.kernels.launch import plan_for, run_decode
from tp_replayssm.kernels.plan import DecodeProblem, cursor_readers, plan_decode, problem_of
from tp_replayssm.testing import random_decode_inputs, random_head_params, random_ring_caches
from tp_replayssm.validation import DecodeCall, DecodeDims, validate_decode
from _decode_scenario import record_kernel_args

ON_GPU = torch.cuda.is_available()


def _run_steps(*, B: int, H: int, HV: int, K: int, V: int, L: int, S: int, steps: int, predecayed: bool,
               state_dtype: torch.dtype = torch.float32, A_log_shift: float = 0.0, seed: int = 0,
               tiny: bool | None = None, device: torch.device = torch.device("cpu"),
               separate_edits: dict | None = None, fused_edits: dict | None = None) -> tuple[tuple, tuple]:
    """``steps`` decode steps of one batch (slots shuffled over ``S``, one padding row, forced flushes) twice
    from the same caches: fused, and decode then ``kernels.cursor.advance``. Returns both runs' (outputs per
    step, final caches, cursor history). ``tiny``: the launch plan's ``tiny_batch`` (None: the library's);
    ``separate_edits`` / ``fused_edits``: edits of the plain / fused decode's plan (the library's otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    params = random_head_params(HV, K, generator=gen)
    params = dataclasses.replace(params, A_log=(params.A_log + A_log_shift).to(device),
                                 dt_bias=params.dt_bias.to(device))
    real = B - 1 if B >= 3 else B  # a padding row from B = 3 up
    perm = torch.randperm(S, generator=gen)[:real].tolist()
    slots = torch.tensor(perm[:1] + [-1] * (B - real) + perm[1:], dtype=torch.int32, device=device)
    start = torch.randint(0, L, (S + 1,), generator=gen, dtype=torch.int32)
    start[perm[0]] = L - 1  # one row flushes on the first step
    inputs = [random_decode_inputs(B, H, HV, K, V, generator=gen) for _ in range(steps)]
    flags = [(torch.rand(B, generator=gen) < 0.25).to(torch.int32).to(device) for _ in range(steps)]
    caches0 = random_ring_caches(S, H, HV, K, V, L, state_dtype=state_dtype, predecayed=predecayed, device=device,
                                 generator=gen)
    layout = "predecayed" if predecayed else "sglang"
    runs = []
    for fused in (False, True):
        caches = [c.clone() for c in caches0]
        cursors = start.clone().to(device)
        outs, history = [], []
        for t in range(steps):
            inp = inputs[t]
            out = torch.full((B, 1, HV, V), float("nan"), dtype=inp.mixed_qkv.dtype, device=device)
            call = DecodeCall(inp.mixed_qkv.to(device), inp.a.to(device), inp.b.to(device), params.A_log,
                              params.dt_bias, None, *caches, out, slots, cursors, flags[t], True)
            plan = None
            edits = dict((fused_edits if fused else separate_edits) or {})
            if tiny is not None:
                edits["tiny_batch"] = tiny
            if edits:
                dims = validate_decode(call, ring_layout=layout, cursor_table=True)
                plan = dataclasses.replace(plan_for(call, dims, ring_layout=layout, cursor_table=True, advance=fused),
                                           **edits)
            run_decode(call, ring_layout=layout, cursor_table=True, advance=fused, plan=plan)
            if not fused:
                cursor.advance(cursors, slots, flags[t], L)
            outs.append(out)
            history.append(cursors.clone())
        runs.append((outs, caches, history))
    return runs[0], runs[1]


def _assert_same(separate: tuple, fused: tuple, S: int, L: int) -> None:
    for t, (a, b) in enumerate(zip(separate[0], fused[0])):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), ("out", t)
    for name, a, b in zip(("checkpoint", "d", "k", "g"), separate[1], fused[1]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for t, (a, b) in enumerate(zip(separate[2], fused[2])):
        assert torch.equal(a[:S], b[:S]), ("cursors", t, a.tolist(), b.tolist())
        assert int(b[:S].max()) < L  # no reader count left above the cursor bits
    scratch = [int(h[S]) for h in fused[2]]
    assert len(set(scratch)) == 1, scratch  # the fused launch leaves the padding rows' scratch entry alone


def _problem(dims: DecodeDims, predecayed: bool = False, advance: bool = True,
             device: torch.device = torch.device("cpu")) -> DecodeProblem:
    return problem_of(dims, state_dtype=torch.float32, cache_dtype=torch.bfloat16, device=device,
                      ring_layout="predecayed" if predecayed else "sglang", cursor_table=True, advance=advance,
                      use_l2norm=True, lower_bound=None)


@pytest.mark.parametrize("tiny", [False, True], ids=["batch-path", "tiny-batch-path"])
@pytest.mark.parametrize("predecayed, A_log_shift", [(False, 0.0), (True, 4.5)],
                         ids=["sglang-layout", "predecayed-rebasing"])
def test_fused_advance_matches_decode_then_advance_bitwise(predecayed: bool, A_log_shift: float, tiny: bool,
                                                           monkeypatch: pytest.MonkeyPatch, interpreter: None) -> None:
    """GQA (H=1, HV=3), L=3 over 4 steps: every cursor phase, a flush at L-1, forced flushes, a padding row; V=64
    makes two value tiles per head, so each row has six readers (``plan.cursor_readers``; one tile of a V=16 head
    makes three). Both kernel paths (``DecodePlan.tiny_batch``): the whole ring loaded without waiting for the
    cursor read, or the live entries; checked to reach the kernel."""
    seen = record_kernel_args(monkeypatch, "advance_cursors", "tiny_batch")
    S, L = 5, 3
    for V, readers in ((16, 3), (64, 6)):  # the interpreter's value tile: 32 rows
        problem = _problem(DecodeDims(3, 1, 3, 16, V, L, S), predecayed)
        plan = plan_decode(problem)
        assert plan.advance_readers == cursor_readers(problem, plan.value_tile) == readers, (V, plan)
    separate, fused = _run_steps(B=3, H=1, HV=3, K=16, V=64, L=L, S=S, steps=4, predecayed=predecayed,
                                 A_log_shift=A_log_shift, tiny=tiny)
    _assert_same(separate, fused, S, L)
    assert set(seen) == {(0, tiny), (6, tiny)}, seen  # the separate run's launches, then the fused run's
    flushed = [t for t in range(1, 4) for s in range(S) if separate[2][t][s] == 0 and separate[2][t - 1][s] > 0]
    assert flushed  # some slot went back to 0 along the way


@pytest.mark.parametrize("tiny", [False, True], ids=["batch-path", "tiny-batch-path"])
@pytest.mark.parametrize("predecayed, A_log_shift", [(False, 0.0), (True, 4.5)],
                         ids=["sglang-layout", "predecayed-rebasing"])
def test_late_count_matches_decode_then_advance_bitwise(predecayed: bool, A_log_shift: float, tiny: bool,
                                                        monkeypatch: pytest.MonkeyPatch, interpreter: None) -> None:
    """The late form of the fused advance (``DecodePlan.late_count``: a plain cursor read, the reader count once the
    row's loads are out, a masked store by the last reader; the interpreter's plan for a bf16 checkpoint) against
    the decode then the advance, bit for bit, as the test above: six readers per row, every cursor phase, flushes,
    a padding row; checked to reach the kernel."""
    seen = record_kernel_args(monkeypatch, "advance_cursors", "late_count")
    separate, fused = _run_steps(B=3, H=1, HV=3, K=16, V=64, L=3, S=5, steps=4, predecayed=predecayed,
                                 state_dtype=torch.bfloat16, A_log_shift=A_log_shift, tiny=tiny)
    _assert_same(separate, fused, 5, 3)
    assert set(seen) == {(0, False), (6, True)}, seen


@pytest.mark.parametrize("predecayed, A_log_shift", [(False, 0.0), (True, 4.5)],
                         ids=["sglang-layout", "predecayed-rebasing"])
def test_early_qk_matches_the_plain_decode_bitwise(predecayed: bool, A_log_shift: float,
                                                   monkeypatch: pytest.MonkeyPatch, interpreter: None) -> None:
    """The plain decode's ``early_qk`` form (``DecodePlan.early_qk``: q and k loaded beside the slot and normalized
    before the slot's verdict) against the same plan without it, bit for bit: outputs, caches and cursors over every
    cursor phase, flushes, forced flushes and a padding row (the batch path, bf16 checkpoint); checked to reach the
    kernel."""
    seen = record_kernel_args(monkeypatch, "advance_cursors", "early_qk")
    runs = [_run_steps(B=3, H=1, HV=3, K=16, V=64, L=3, S=5, steps=4, predecayed=predecayed,
                       state_dtype=torch.bfloat16, A_log_shift=A_log_shift, tiny=False,
                       separate_edits=dict(early_qk=early))[0] for early in (False, True)]
    _assert_same(runs[0], runs[1], 5, 3)
    assert {(0, False), (0, True)} <= set(seen), seen


def test_early_qk_in_the_fused_advance_matches_decode_then_advance_bitwise(monkeypatch: pytest.MonkeyPatch,
                                                                           interpreter: None) -> None:
    """``early_qk`` is the plain decode's choice, but the kernel runs it with the fused advance as well (a plan edit
    a benchmark may time): the late count's fused step with it against the decode then the advance without it, bit
    for bit (pre-decayed, rebasing heads, bf16 checkpoint, the batch path)."""
    seen = record_kernel_args(monkeypatch, "advance_cursors", "late_count", "early_qk")
    separate, fused = _run_steps(B=3, H=1, HV=3, K=16, V=64, L=3, S=5, steps=4, predecayed=True,
                                 state_dtype=torch.bfloat16, A_log_shift=4.5, tiny=False,
                                 separate_edits=dict(early_qk=False), fused_edits=dict(early_qk=True))
    _assert_same(separate, fused, 5, 3)
    assert set(seen) == {(0, False, False), (6, True, True)}, seen


@pytest.mark.parametrize("predecayed, A_log_shift, tiny", [(True, 4.5, False), (False, 0.0, True)],
                         ids=["predecayed-rebasing-batch-path", "sglang-layout-tiny-path"])
def test_pinned_loads_match_the_library_plans_bitwise(predecayed: bool, A_log_shift: float, tiny: bool,
                                                      monkeypatch: pytest.MonkeyPatch, interpreter: None) -> None:
    """``DecodePlan.pinned_loads`` (the row's loads kept above the slot's verdict branch: the gate's parameters load
    beside the row's inputs, and the refused path holds a store of them that never runs) changes no result: the
    plain decode and the fused advance with it against the same plans without it, bit for bit (outputs, caches,
    cursors over every cursor phase, flushes, forced flushes, a padding row); checked to reach the kernel."""
    seen = record_kernel_args(monkeypatch, "advance_cursors", "pinned_loads")
    kw = dict(B=3, H=1, HV=3, K=16, V=64, L=3, S=5, steps=4, predecayed=predecayed, state_dtype=torch.bfloat16,
              A_log_shift=A_log_shift, tiny=tiny)
    base = _run_steps(**kw)
    pinned = _run_steps(**kw, separate_edits=dict(pinned_loads=True), fused_edits=dict(pinned_loads=True))
    _assert_same(base[0], pinned[0], 5, 3)
    _assert_same(base[1], pinned[1], 5, 3)
    assert {(0, True), (6, True), (0, False), (6, False)} <= set(seen), seen


def test_cursor_readers_counts_programs_per_row_and_refuses_overflow() -> None:
    problem = _problem(DecodeDims(8, 16, 32, 128, 128, 16, 64), device=torch.device("cuda", 0))
    assert cursor_readers(problem, 32) == 32 * 4
    assert cursor_readers(problem, 128) == 32
    huge = _problem(DecodeDims(1, 4096, 8192, 16, 128, 4, 2))
    with pytest.raises(ValueError, match=r"32767 programs per row.*32768 programs \(HV=8192, V=128, value tile 32\)"):
        cursor_readers(huge, 32)


def test_kernel_count_literal_is_cursor_reader() -> None:
    """The kernel spells the count unit as a literal (a module constant would become a kernel argument)."""
    src = inspect.getsource(decode.replayssm_decode_kernel)
    assert decode.CURSOR_READER == 65536
    # the count as the cursor read, and a refused row's count in the late form (plan.late_count_rule)
    assert src.count("hl.atomic_add(write_pos, [s64], torch.where(in_range, 65536, 0))") == 2
    assert "cur = counted & 65535" in src
    # the last reader of the word (every row naming the slot counts on it) stores, under an `if`
    assert src.count("if in_range & (((counted >> 16) & 65535) >= advance_cursors * named - 1):") == 2
    # the late form's count of an accepted row (named once, the slot in range) and its masked store
    assert src.count("hl.atomic_add(write_pos, [s64], 65536)") == 1
    assert "extra_mask=((counted >> 16) & 65535) >= advance_cursors - 1)" in src


def test_fused_advance_needs_the_cursor_table() -> None:
    """Per-row cursors (``replayssm_decode``'s ``write_pos``) have no table to move: refused before launching."""
    B, H, HV, K, V, L, S = 2, 1, 2, 16, 16, 3, 3
    gen = torch.Generator().manual_seed(0)
    inp = random_decode_inputs(B, H, HV, K, V, generator=gen)
    p = random_head_params(HV, K, generator=gen)
    caches = random_ring_caches(S, H, HV, K, V, L, generator=gen)
    before = [c.clone() for c in caches]
    out = torch.zeros(B, 1, HV, V, dtype=inp.mixed_qkv.dtype)
    rows = torch.zeros(B, dtype=torch.int32)
    call = DecodeCall(inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, 0.25, *caches, out,
                      torch.arange(B, dtype=torch.int32), rows, rows, True, None)
    with pytest.raises(ValueError, match=r"advance=True needs the pool's cursor table.*`write_pos`"):
        run_decode(call, ring_layout="sglang", cursor_table=False, advance=True)
    assert all(torch.equal(a, b) for a, b in zip(before, caches))


# (B, HV, state dtype): readers per row from 4 (HV4 B512) to 256 (HV32 B1 pre-decayed); HV8 B1 is tiny-batch; in the
# sglang layout HV32 B1 and HV8 B8 are 4-warp programs (one chunk and two), HV12 B8 the smallest one-warp grid
# (grid.ONE_WARP_FROM); pre-decayed, B1 HV32 to B8 HV16 are one-warp programs over 16 value rows
GPU_SHAPES = {
    "HV32-B1-bf16": (1, 32, torch.bfloat16), "HV8-B1-bf16": (1, 8, torch.bfloat16),
    "HV32-B8-fp32": (8, 32, torch.float32), "HV16-B8-bf16": (8, 16, torch.bfloat16),
    "HV8-B8-bf16": (8, 8, torch.bfloat16), "HV12-B8-fp32": (8, 12, torch.float32),
    "HV12-B128-bf16": (128, 12, torch.bfloat16),
    "HV32-B512-bf16": (512, 32, torch.bfloat16), "HV4-B512-fp32": (512, 4, torch.float32),
}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("predecayed", [False, True], ids=["sglang-layout", "predecayed-softplus"])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_fused_advance_on_gpu_matches_decode_then_advance(shape: str, predecayed: bool) -> None:
    """The library's launch plans (one-warp and 4-warp programs, register-capped grids, tensor-core chunks), L=4 over
    9 steps (two full cycles and a step), K=V=128: bit-identical to the decode followed by the separate advance."""
    B, HV, state_dtype = GPU_SHAPES[shape]
    S, L = B + 3, 4
    separate, fused = _run_steps(B=B, H=HV, HV=HV, K=128, V=128, L=L, S=S, steps=2 * L + 1, predecayed=predecayed,
                                 state_dtype=state_dtype, seed=B + HV, device=torch.device("cuda", 0))
    torch.cuda.synchronize()
    _assert_same(separate, fused, S, L)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("predecayed", [False, True], ids=["sglang-layout", "predecayed-softplus"])
@pytest.mark.parametrize("shape", ["HV32-B1-bf16", "HV8-B1-bf16", "HV8-B8-bf16", "HV32-B8-fp32", "HV12-B128-bf16"])
def test_pinned_loads_on_gpu_match_the_library_plans(shape: str, predecayed: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``DecodePlan.pinned_loads`` edited into the plain decode's and the fused step's plans (the form that waits for
    the H200's timing): bit-identical to the library's plans over two cursor cycles, on the one-warp, tiny-batch,
    4-warp and tensor-core programs; checked to reach the kernel."""
    seen = record_kernel_args(monkeypatch, "pinned_loads")
    B, HV, state_dtype = GPU_SHAPES[shape]
    S, L = B + 3, 4
    kw = dict(B=B, H=HV, HV=HV, K=128, V=128, L=L, S=S, steps=2 * L + 1, predecayed=predecayed,
              state_dtype=state_dtype, seed=B + HV, device=torch.device("cuda", 0))
    base = _run_steps(**kw)
    pinned = _run_steps(**kw, separate_edits=dict(pinned_loads=True), fused_edits=dict(pinned_loads=True))
    torch.cuda.synchronize()
    _assert_same(base[0], pinned[0], S, L)
    _assert_same(base[1], pinned[1], S, L)
    assert {(False,), (True,)} <= set(seen), seen
