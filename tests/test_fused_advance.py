"""The cursor advance fused into the step's last decode (``decode_with_cursor_table(..., advance=True)``, the pool's
``decode(..., advance=True)``) against the decode followed by the separate advance.

In the fused launch every program counts itself with an atomic add of ``CURSOR_READER`` on its row's cursor (the
count of readers rides above the cursor's 16 bits), and the row's last reader stores the moved cursor. The count is
the cursor read itself, or, with ``count_after_loads`` (``configs.count_after_loads``, off unless forced), comes after a
relaxed read and the ring loads; both give the same cursor to
every program of the row, the same outputs and caches bit for bit, the same cursors afterwards (padding rows leave
the scratch entry alone). On CPU the kernel runs in the Triton interpreter (one program at a time), so the
counting is checked there and the ordering on the GPU (``gpu`` marker: 4 to 128 programs per row; the pool's
CUDA-graph step with the fused advance is in ``tests/test_pool.py``).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from tp_replayssm import configs, cursor_kernel, kernel, ops
from tp_replayssm._validation import DecodeDims
from tp_replayssm.configs import launch_config, select_config
from tp_replayssm.testing import random_decode_inputs, random_head_params, random_ring_caches
from _decode_scenario import record_kernel_args

ON_GPU = torch.cuda.is_available()


def _run_steps(*, B: int, H: int, HV: int, K: int, V: int, L: int, S: int, steps: int, predecayed: bool,
               state_dtype: torch.dtype = torch.float32, A_log_shift: float = 0.0, seed: int = 0,
               device: torch.device = torch.device("cpu")) -> tuple[list, list]:
    """``steps`` decode steps of one batch (slots shuffled over ``S``, one padding row, forced flushes) twice
    from the same caches: fused, and decode then ``cursor_kernel.advance``. Returns both runs' (outputs per
    step, final caches, cursor history)."""
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
    runs = []
    for fused in (False, True):
        caches = [c.clone() for c in caches0]
        cursors = start.clone().to(device)
        outs, history = [], []
        for t in range(steps):
            inp = inputs[t]
            out = torch.full((B, 1, HV, V), float("nan"), dtype=inp.mixed_qkv.dtype, device=device)
            ops.decode_with_cursor_table(
                inp.mixed_qkv.to(device), inp.a.to(device), inp.b.to(device), params.A_log, params.dt_bias, None,
                *caches, out, slots, cursors, flags[t], use_qk_l2norm_in_kernel=True, predecayed=predecayed,
                advance=fused)
            if not fused:
                cursor_kernel.advance(cursors, slots, flags[t], L)
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


@pytest.mark.parametrize("late", [False, True], ids=["count-is-read", "count-after-loads"])
@pytest.mark.parametrize("tiny", [False, True], ids=["batch-path", "tiny-batch-path"])
@pytest.mark.parametrize("predecayed, A_log_shift", [(False, 0.0), (True, 4.5)],
                         ids=["spec-layout", "predecayed-rebasing"])
@pytest.mark.parametrize("V", [16, 64], ids=["one-value-tile", "two-value-tiles"])
def test_fused_advance_matches_decode_then_advance_bitwise(V: int, predecayed: bool, A_log_shift: float, tiny: bool,
                                                           late: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """GQA (H=1, HV=3), L=3 over 4 steps: every cursor phase, a flush at L-1, forced flushes, a padding row; with
    V=64 two value tiles per head, so each row has six readers (``ops.cursor_readers``). Both kernel paths
    (``configs.tiny_batch``): the whole ring loaded without waiting for the cursor read, or the live entries; and
    both places of the count (``configs.count_after_loads``), checked to reach the kernel."""
    monkeypatch.setattr(configs, "FORCED_TINY_BATCH", tiny)
    monkeypatch.setattr(configs, "FORCED_COUNT_AFTER_LOADS", late)
    seen = record_kernel_args(monkeypatch, "advance_cursors", "count_after_loads")
    S, L = 5, 3
    dims = DecodeDims(3, 1, 3, 16, V, L, S)
    config = select_config(dims, torch.float32, torch.device("cpu")).config  # value tile min(32, V)
    assert ops.cursor_readers(dims, config) == (3 if V == 16 else 6)
    separate, fused = _run_steps(B=3, H=1, HV=3, K=16, V=V, L=L, S=S, steps=4, predecayed=predecayed,
                                 A_log_shift=A_log_shift)
    _assert_same(separate, fused, S, L)
    readers = 3 if V == 16 else 6
    assert set(seen) == {(0, False), (readers, late)}, seen  # the separate run's launches, then the fused run's
    flushed = [t for t in range(1, 4) for s in range(S) if separate[2][t][s] == 0 and separate[2][t - 1][s] > 0]
    assert flushed  # some slot went back to 0 along the way


def test_cursor_readers_counts_programs_per_row_and_refuses_overflow() -> None:
    dims = DecodeDims(8, 16, 32, 128, 128, 16, 64)
    assert ops.cursor_readers(dims, launch_config(32, 1)) == 32 * 4
    assert ops.cursor_readers(dims, launch_config(128, 1)) == 32
    huge = DecodeDims(1, 4096, 8192, 16, 128, 4, 2)
    with pytest.raises(ValueError, match=r"32767 programs per row.*32768 programs \(HV=8192, V=128, value tile 32\)"):
        ops.cursor_readers(huge, launch_config(32, 4))


def test_kernel_count_literal_is_cursor_reader() -> None:
    """The kernel spells the count unit as a literal (a module constant would become a kernel argument)."""
    src = inspect.getsource(kernel.replayssm_decode_kernel)
    assert kernel.CURSOR_READER == 65536
    assert src.count("hl.atomic_add(write_pos, [s64], 65536)") == 2 and "cur = counted & 65535" in src
    assert 'hl.inline_triton("tl.load({0} + {1}, volatile=True)", [write_pos, s64], slot) & 65535' in src
    assert "if counted >= (advance_cursors - 1) * 65536:" in src  # the atomic read's store, under an `if`
    assert "extra_mask=counted >= (advance_cursors - 1) * 65536)" in src  # the late count's, masked (configs)


def test_count_after_loads_for_small_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``configs.count_after_loads``: off for now (``COUNT_AFTER_LOADS_ON``); its rule, at most 8 rows and 64 (row,
    value head) pairs, where the twenty-third session measured it faster (B = 1; B = 8 up to HV8), the atomic read
    elsewhere (HV12 / HV32 B8 and B >= 32 were slower, HV16 B8 1.3% faster)."""
    def late(B: int, HV: int) -> bool:
        return configs.count_after_loads(DecodeDims(B, HV, HV, 128, 128, 16, 1024))
    assert not configs.COUNT_AFTER_LOADS_ON and not late(1, 32) and not late(8, 4)
    monkeypatch.setattr(configs, "COUNT_AFTER_LOADS_ON", True)
    assert late(1, 32) and late(1, 64) and late(8, 8) and late(8, 4) and late(2, 32)
    assert not late(8, 16) and not late(8, 12) and not late(9, 4) and not late(32, 2) and not late(1, 65)


def test_fused_advance_needs_the_cursor_table() -> None:
    """Per-row cursors (``replayssm_decode``'s ``write_pos``) have no table to move: refused before launching."""
    B, H, HV, K, V, L, S = 2, 1, 2, 16, 16, 3, 3
    dims = DecodeDims(B, H, HV, K, V, L, S)
    gen = torch.Generator().manual_seed(0)
    inp = random_decode_inputs(B, H, HV, K, V, generator=gen)
    p = random_head_params(HV, K, generator=gen)
    caches = random_ring_caches(S, H, HV, K, V, L, generator=gen)
    before = [c.clone() for c in caches]
    out = torch.zeros(B, 1, HV, V, dtype=inp.mixed_qkv.dtype)
    rows = torch.zeros(B, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"advance=True needs the pool's cursor table.*`write_pos` \(2,\)"):
        ops.launch(dims, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, 0.25, *caches, out,
                   torch.arange(B, dtype=torch.int32), rows, rows, True, None, cursors_by_slot=False, advance=True)
    assert all(torch.equal(a, b) for a, b in zip(before, caches))


# (B, HV, state dtype): readers per row from 4 (HV4 B512) to 256 (HV32 B1 pre-decayed); HV8 B1 is tiny-batch; in the
# SPEC layout HV32 B1 and HV8 B8 are 4-warp programs (one chunk and two), HV12 B8 the smallest one-warp grid
# (configs.ONE_WARP_FROM); pre-decayed, B1 HV32 to B8 HV16 are one-warp programs over 16 value rows
GPU_SHAPES = {
    "HV32-B1-bf16": (1, 32, torch.bfloat16), "HV8-B1-bf16": (1, 8, torch.bfloat16),
    "HV32-B8-fp32": (8, 32, torch.float32), "HV16-B8-bf16": (8, 16, torch.bfloat16),
    "HV8-B8-bf16": (8, 8, torch.bfloat16), "HV12-B8-fp32": (8, 12, torch.float32),
    "HV12-B128-bf16": (128, 12, torch.bfloat16),
    "HV32-B512-bf16": (512, 32, torch.bfloat16), "HV4-B512-fp32": (512, 4, torch.float32),
}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("predecayed", [False, True], ids=["spec-layout", "predecayed-softplus"])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_fused_advance_on_gpu_matches_decode_then_advance(shape: str, predecayed: bool) -> None:
    """The pinned launch choices (one-warp and 4-warp programs, register-capped grids, tensor-core chunks), L=4 over
    9 steps (two full cycles and a step), K=V=128: bit-identical to the decode followed by the separate advance."""
    B, HV, state_dtype = GPU_SHAPES[shape]
    S, L = B + 3, 4
    separate, fused = _run_steps(B=B, H=HV, HV=HV, K=128, V=128, L=L, S=S, steps=2 * L + 1, predecayed=predecayed,
                                 state_dtype=state_dtype, seed=B + HV, device=torch.device("cuda", 0))
    torch.cuda.synchronize()
    _assert_same(separate, fused, S, L)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("predecayed", [False, True], ids=["spec-layout", "predecayed-softplus"])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_fused_advance_on_gpu_counting_after_the_loads(shape: str, predecayed: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with the count after the loads forced (``configs.count_after_loads``; the relaxed cursor read
    first) from 4 readers per row (HV4 B512) to 256 (HV32 B1) and 16384 programs (HV32 B512): bit-identical to the
    decode followed by the separate advance. Its ``if``-store form failed this for the pre-decayed layout (the
    twenty-third session: the branch parted products from their sums); the masked store has not run here yet."""
    monkeypatch.setattr(configs, "FORCED_COUNT_AFTER_LOADS", True)
    B, HV, state_dtype = GPU_SHAPES[shape]
    S, L = B + 3, 4
    separate, fused = _run_steps(B=B, H=HV, HV=HV, K=128, V=128, L=L, S=S, steps=2 * L + 1, predecayed=predecayed,
                                 state_dtype=state_dtype, seed=B + HV + 1, device=torch.device("cuda", 0))
    torch.cuda.synchronize()
    _assert_same(separate, fused, S, L)
