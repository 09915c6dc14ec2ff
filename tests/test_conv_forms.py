"""The conv kernel's two forms (``ConvPlan.form``): ``"once"`` (one token per row, the library's choice there) and
``"taps"`` (any number of tokens), their plans and their agreement.

Each form runs in Triton's interpreter on tiny shapes against the PyTorch path (windows bit for bit), the float64
oracles of ``_conv_helpers`` (``torch.nn.functional.conv1d`` and explicit taps) and each other, with NaN-poisoned
outputs and sentinel-filled windows no row may touch; ``gpu`` tests do the same on CUDA at Kimi-like channel counts.
The sm_90 compile of the "taps" form's library plans is checked here (the "once" form's is in ``test_conv_kernel``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _conv_helpers import (BAD, D, S, SENTINEL, conv1d_oracle, conv_params, i32, make_pool, random_windows,
                           taps_oracle)
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError
from tp_replayssm.kernels.backend import use_cpu_backend
from tp_replayssm.kernels.conv_plan import (MIN_PROGRAMS_PER_SM, ONCE_CHANNELS_PER_THREAD, ConvPlan, conv_bytes,
                                            plan_conv)


# ---- plans --------------------------------------------------------------------------------------


def test_once_plan_takes_the_widest_programs_the_grid_allows() -> None:
    """One-token calls get form "once": one warp, 32*k channels with the largest k of ONCE_CHANNELS_PER_THREAD that
    keeps MIN_PROGRAMS_PER_SM programs per SM (and a block not above D's power of two); other token counts "taps"."""
    assert plan_conv(128, 12288, 4, 132, 1) == ConvPlan(512, 1, 4, 128, "once")  # HV32 B128: 3072 programs
    assert plan_conv(8, 3072, 4, 132, 1).block_d == 64  # HV8 B8: 384 programs (128 channels: 192 < 264)
    assert plan_conv(8, 12288, 4, 132, 1).block_d == 256  # HV32 B8: 384 programs
    assert plan_conv(1, 12288, 4, 132, 1).block_d == 64  # the smallest block even below the target
    assert plan_conv(4, 40, 2, 132, 1).block_d == 64  # a block above D (masked)
    assert plan_conv(3, 64, 4, 132, 2).form == plan_conv(3, 64, 4, 132).form == "taps"
    for B in (1, 3, 8, 64, 512, 4096):
        for Dc in (64, 1536, 3072, 12288):
            plan = plan_conv(B, Dc, 4, 132, 1)
            k = plan.block_d // 32
            assert plan.form == "once" and plan.num_warps == 1 and k in ONCE_CHANNELS_PER_THREAD
            assert k == ONCE_CHANNELS_PER_THREAD[0] or B * -(-Dc // plan.block_d) >= MIN_PROGRAMS_PER_SM * 132
            wider = 2 * k
            assert wider not in ONCE_CHANNELS_PER_THREAD or 32 * wider > 1 << (Dc - 1).bit_length() or \
                B * -(-Dc // (32 * wider)) < MIN_PROGRAMS_PER_SM * 132


def test_plan_check_and_the_plan_argument() -> None:
    """ConvPlan.check refuses a plan the call cannot run; pool.conv_update(plan=) checks it (ValueError naming the
    problem) before anything is written, on the PyTorch path too."""
    with pytest.raises(ValueError, match="form 'once' runs one token per row; this call has 3"):
        ConvPlan(64, 1, 4, 16, "once").check(3, 4)
    with pytest.raises(ValueError, match=r"`form` must be one of \['once', 'taps'\]; got 'fast'"):
        ConvPlan(64, 1, 4, 16, "fast").check(1, 4)
    with pytest.raises(ValueError, match="`width_block` must be a power of two >= W = 4; got 2"):
        ConvPlan(64, 1, 2, 16, "once").check(1, 4)
    with pytest.raises(ValueError, match="`block_d` must be a power of two; got 48"):
        ConvPlan(48, 1, 4, 16).check(1, 4)
    pool = make_pool(4)
    snapshot = pool.conv_state.clone()
    weight, bias = conv_params(4, seed=1)
    with pytest.raises(ValueError, match=r"conv_update\(layer=0\): ConvPlan: form 'once' runs one token per row"):
        pool.conv_update(0, torch.zeros(2, 3, D), weight, i32([0, 2]), bias=bias, plan=plan_conv(2, D, 4, 132, 1))
    with pytest.raises(ValueError, match="`plan` must be a ConvPlan or None; got dict"):
        pool.conv_update(0, torch.zeros(2, D), weight, i32([0, 2]), plan={})
    assert torch.equal(pool.conv_state, snapshot)


def test_conv_bytes_lives_in_the_plan_module() -> None:
    from tp_replayssm.kernels import conv

    assert conv.conv_bytes is conv_bytes and conv.plan_conv is plan_conv and conv.ConvPlan is ConvPlan


# ---- the kernels in Triton's interpreter ---------------------------------------------------------


def _one_token_call(pool: ReplaySSMStatePool, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    slots: torch.Tensor, plan: ConvPlan | None, activation: str | None = "silu") -> torch.Tensor:
    """``pool.conv_update`` of one token per row into a NaN-poisoned output (every element must be written)."""
    from tp_replayssm.pool import conv as pool_conv

    y = torch.full_like(x, float("nan"))
    pool_conv.conv_update(pool, 1, x, weight, slots, bias, activation, pool.guard("conv_update", 1), "test", out=y,
                          plan=plan)
    return y


def test_forms_agree_in_the_interpreter(interpreter: None) -> None:
    """W = 4, bias, SiLU, bf16 inputs and windows, every kind of bad row: the "once" form (the library's plan) and the
    "taps" form (a plan passed) on twin pools against the PyTorch path on a third: windows bit for bit (the other
    slots' and the scratch window's sentinels untouched), outputs within a bf16 step (the interpreter truncates bf16
    stores) and against the float64 taps; the bad rows are zero and recorded."""
    slots_list, bad_rows = BAD["all"]
    pools = [make_pool(4, torch.bfloat16) for _ in range(3)]
    for p in pools:
        random_windows(p, [0, 2, 3], seed=81)
    weight, bias = conv_params(4, seed=82)
    slots = i32(slots_list)
    x = torch.randn(len(slots_list), D, generator=torch.Generator().manual_seed(83)).bfloat16()
    live = [r for r in range(len(slots_list)) if r not in bad_rows and slots_list[r] >= 0]
    before = pools[0].read_conv_state(1, i32([slots_list[r] for r in live]))
    once = _one_token_call(pools[0], x, weight, bias, slots, None)
    taps = _one_token_call(pools[1], x, weight, bias, slots, dataclasses.replace(plan_conv(8, D, 4, 132, 1),
                                                                                 form="taps"))
    with use_cpu_backend("torch"):
        expect = _one_token_call(pools[2], x, weight, bias, slots, None)
    for y in (once, taps):
        torch.testing.assert_close(y.double(), expect.double(), rtol=1e-2, atol=1e-2)
        assert (y[[r for r in range(len(slots_list)) if r not in live]] == 0).all()
    oracle = taps_oracle(x[live, None], before, weight, bias, "silu")[:, 0]
    torch.testing.assert_close(once[live].double(), oracle, rtol=1e-2, atol=1e-2)
    for p in pools[:2]:
        assert torch.equal(p.conv_state, pools[2].conv_state), "windows differ from the PyTorch path's"
        assert (p.conv_state[:, [4, 5, S]] == SENTINEL).all()
        with pytest.raises(SlotError, match=r"conv_update\(layer=1\): 5 row\(s\)"):
            p.check()


def test_once_form_in_the_interpreter_fp32_strided_taps_and_a_second_slot_tile(interpreter: None) -> None:
    """fp32 inputs and windows, W = 2, no bias, no activation, the taps given as a transposed (column-major) view,
    and 20 rows counted in tiles of 16 with a repeat of row 1's slot in the second tile: both rows are refused;
    outputs against the float64 conv1d from the loaded windows, the PyTorch path and the "taps" form."""
    W = 2
    pools = [make_pool(W) for _ in range(3)]
    for p in pools:
        random_windows(p, [0, 2, 3], seed=91)
    w_t, _ = conv_params(W, seed=92)
    weight = w_t.T.contiguous().T  # [D, W] with strides (1, D)
    assert weight.stride() == (1, D)
    slots_list = [0, 3] + [-1] * 15 + [3, 2, -1]  # row 17 repeats row 1's slot: rows 1 and 17 are bad
    slots = i32(slots_list)
    x = torch.randn(20, D, generator=torch.Generator().manual_seed(93))
    before = pools[0].read_conv_state(1, i32([0, 2]))
    slot3 = pools[0].read_conv_state(1, i32([3]))
    once_plan = dataclasses.replace(plan_conv(20, D, W, 132, 1), named_block=16)
    assert once_plan.form == "once" and once_plan.named_block == 16
    once = _one_token_call(pools[0], x, weight, None, slots, once_plan, activation=None)
    taps = _one_token_call(pools[1], x, weight, None, slots, plan_conv(20, D, W, 132), activation=None)
    with use_cpu_backend("torch"):
        expect = _one_token_call(pools[2], x, weight, None, slots, None, activation=None)
    for y in (once, taps):
        torch.testing.assert_close(y, expect, rtol=1e-6, atol=1e-6)
        assert (y[[1, 17]] == 0).all() and (y[2:17] == 0).all() and (y[19] == 0).all()
    seq = torch.cat([before.transpose(1, 2), x[[0, 18], None]], dim=1)  # the window's inputs, then this one
    want = conv1d_oracle(seq, weight, None, None)[:, -1]  # (the zero padding never reaches the last output)
    torch.testing.assert_close(once[[0, 18]].double(), want, rtol=1e-6, atol=1e-6)
    for p in pools[:2]:
        assert torch.equal(p.conv_state, pools[2].conv_state)
    with pytest.raises(SlotError, match=r"2 row\(s\).*row 1 slot 3, row 17 slot 3"):
        pools[0].check()
    assert torch.equal(pools[0].read_conv_state(1, i32([3])), slot3)  # a refused row's slot: untouched


def test_once_form_without_window_in_the_interpreter(interpreter: None) -> None:
    """W = 1 (no window: a per-channel scale), bias and SiLU, fp32: the "once" form against the float64 conv1d."""
    pool = make_pool(1)
    weight, bias = conv_params(1, seed=95)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(96))
    slots = i32([2, -1, 0, 3])
    y = _one_token_call(pool, x, weight, bias, slots, None)
    live = [0, 2, 3]
    torch.testing.assert_close(y[live, None].double(), conv1d_oracle(x[live, None], weight, bias, "silu"),
                               rtol=1e-6, atol=1e-6)
    assert (y[1] == 0).all()
    pool.check()


@pytest.mark.timeout(300)
def test_taps_form_compiles_for_sm90_without_spills() -> None:
    """benchmarks/conv_regs.py --form taps: the "taps" form at its library plans (4 channels per thread, 1-8 warps)
    compiles for sm_90 with the H200's triton and spills nothing."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(repo / "benchmarks" / "conv_regs.py"), "--json", "--form", "taps",
                          "--case", "8,1,12288,4", "--case", "512,1,12288,4"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r["plan"].endswith("form='taps')") for r in rows] == [True, True]
    for r in rows:
        assert r["stack"] == 0 and 0 < r["regs"] <= 255, r


# ---- the GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 300])
@pytest.mark.parametrize("heads", [4, 32])
def test_forms_agree_on_gpu(heads: int, B: int) -> None:
    """On CUDA, K = V = 128, H = HV = ``heads`` (D = 1536 or 12288), bf16, W = 4 with bias: the "once" form (the
    library's plan) and the "taps" form on twin pools against the PyTorch path on a CPU copy, with a padding row, a
    repeated slot and a free slot among the rows, over three steps: outputs within one bf16 rounding, windows bit for
    bit, the other slots' windows untouched, bad rows zero and recorded."""
    heads_ = KDAHeads(heads, heads, 128, 128)
    Dk = heads_.qkv_width
    kw = dict(num_layers=2, num_slots=B + 4, ring_length=4, conv_kernel_size=4, conv_dtype=torch.bfloat16)
    gpus = [ReplaySSMStatePool(heads_, device="cuda", **kw) for _ in range(2)]
    cpu = ReplaySSMStatePool(heads_, device="cpu", **kw)
    gen = torch.Generator().manual_seed(B + heads)
    for p in (*gpus, cpu):
        p.conv_state.fill_(SENTINEL)
        p.alloc(B + 2)
        p.free([B + 1])
    win = torch.randn(B + 1, Dk, 3, generator=gen)
    for p in (*gpus, cpu):
        p.load_state(1, torch.arange(B + 1, dtype=torch.int32, device=p.device),
                     torch.zeros(B + 1, heads, 128, 128, device=p.device), conv_states=win.to(p.device))
    weight = (torch.randn(Dk, 4, generator=gen) * 0.5).bfloat16()
    bias = (torch.randn(Dk, generator=gen) * 0.1).bfloat16()
    slots = torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)
    bad = []
    if B > 2:
        slots[1] = -1  # padding
        slots[B - 1] = slots[0]  # a repeat: rows 0 and B-1 are refused
        slots[B // 2] = B + 1  # a free slot
        bad = [0, B - 1, B // 2]
    taps_plan = dataclasses.replace(plan_conv(B, Dk, 4, torch.cuda.get_device_properties(0).multi_processor_count),
                                    form="taps")
    for step in range(3):
        x = torch.randn(B, Dk, generator=gen).bfloat16()
        ys = [gpus[0].conv_update(1, x.cuda(), weight.cuda(), slots.cuda(), bias=bias.cuda()),
              gpus[1].conv_update(1, x.cuda(), weight.cuda(), slots.cuda(), bias=bias.cuda(), plan=taps_plan)]
        want = cpu.conv_update(1, x, weight, slots, bias=bias)
        for y in ys:
            torch.testing.assert_close(y.cpu().double(), want.double(), rtol=1e-2, atol=1e-2)
            for r in bad + ([1] if B > 2 else []):
                assert (y[r] == 0).all()
        for g in gpus:
            assert torch.equal(g.conv_state.cpu(), cpu.conv_state), step
            if bad:  # each step's record: its 3 bad rows (a record holds every later call's rows until a check)
                with pytest.raises(SlotError, match=r"conv_update\(layer=1\): 3 row\(s\)"):
                    g.check()
            else:
                g.check()


@pytest.mark.gpu
def test_once_form_graph_replay_with_a_bad_row() -> None:
    """A CUDA graph of one "once" conv_update captured with good slots and replayed with a free slot in the slot
    buffer: the bad row's output is zero, its window and every other window unchanged, check() reports it."""
    pool = make_pool(4, torch.bfloat16, device="cuda")
    twin = make_pool(4, torch.bfloat16, device="cuda")
    for p in (pool, twin):
        random_windows(p, [0, 2, 3], seed=97)
    dev = pool.device
    weight, bias = (t.to(dev) for t in conv_params(4, seed=98))
    x = torch.randn(3, D, device=dev, generator=torch.Generator(device=dev).manual_seed(99)).bfloat16()
    slots = i32([0, 2, 3], dev)
    snapshot = pool.conv_state.clone()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        pool.conv_update(0, x, weight, slots, bias=bias)
    torch.cuda.current_stream().wait_stream(warm)
    pool.conv_state.copy_(snapshot)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = pool.conv_update(0, x, weight, slots, bias=bias)
    slots.copy_(i32([0, 4, 3], dev))  # slot 4 is free
    graph.replay()
    want = twin.conv_update(0, x, weight, i32([0, -1, 3], dev), bias=bias)
    torch.cuda.synchronize()
    assert torch.equal(y, want) and (y[1] == 0).all()
    assert torch.equal(pool.conv_state, twin.conv_state)
    with pytest.raises(SlotError, match=r"conv_update\(layer=0\): 1 row\(s\).*row 1 slot 4"):
        pool.check()
