"""The Helion conv kernel: one case per kernel path in Triton's interpreter against the PyTorch path and the float64
oracles, its launch plans, ``benchmarks/bench_conv.py``'s checks, the sm_90 compile without spills, and (``gpu``
marker) the kernel on CUDA against the PyTorch path and a CUDA graph of the decode with the conv replayed with a bad
row.
"""

from __future__ import annotations

import math

import pytest
import torch

from _conv_helpers import (D, H, HV, K, L, S, SENTINEL, V, conv1d_oracle, conv_params, decode_pair, i32, make_pool,
                           random_windows, run_bad_case, taps_oracle)
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError
from tp_replayssm.kernels.backend import use_cpu_backend
from tp_replayssm.testing import random_decode_inputs, random_head_params


# ---- the Helion kernel in Triton's interpreter ---------------------------------------------------


def test_kernel_in_the_interpreter_window_path(interpreter: None) -> None:
    """The kernel with a window (W = 4), bias and SiLU, bf16 inputs and windows: a 3-token call with every kind of
    bad row and a one-token call ([B, D], NaN-poisoned output), against the PyTorch path on a twin (windows bit for
    bit, y within a bf16 step: the interpreter truncates bf16 stores) and the float64 taps; more bad rows than the
    record holds; then a decode step with the conv."""
    from tp_replayssm.pool import conv as pool_conv

    run_bad_case("all", T=3, conv_dtype=torch.bfloat16)
    pool, twin = make_pool(4, torch.bfloat16), make_pool(4, torch.bfloat16)
    for p in (pool, twin):
        random_windows(p, [0, 2, 3], seed=41)
    weight, bias = conv_params(4, seed=42)
    slots = i32([3, -1, 0])
    before = pool.read_conv_state(0, i32([3, 0]))
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(43)).bfloat16()
    y = torch.full_like(x, float("nan"))  # poisoned: every row must be written (the padding row with zeros)
    pool_conv.conv_update(pool, 0, x, weight, slots, bias, "silu", pool.guard("conv_update", 0), "test", out=y)
    with use_cpu_backend("torch"):
        expect = twin.conv_update(0, x, weight, slots, bias=bias)
    torch.testing.assert_close(y.double(), expect.double(), rtol=1e-2, atol=1e-2)
    oracle = taps_oracle(x[[0, 2], None], before, weight, bias, "silu")[:, 0]
    torch.testing.assert_close(y[[0, 2]].double(), oracle, rtol=1e-2, atol=1e-2)
    assert (y[1] == 0).all() and torch.equal(pool.conv_state, twin.conv_state)
    params = random_head_params(HV, K, generator=torch.Generator().manual_seed(44))
    inp = random_decode_inputs(3, H, HV, K, V, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(45))
    out = pool.decode(1, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, slots, conv_weight=weight,
                      conv_bias=bias)
    with use_cpu_backend("torch"):
        want = twin.decode(1, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, slots, conv_weight=weight,
                           conv_bias=bias)
    torch.testing.assert_close(out.double(), want.double(), rtol=3e-2, atol=3e-2)
    assert torch.equal(pool.conv_state, twin.conv_state)
    pool.check()
    # more bad rows than the record holds: the first RECORDED_ROWS are listed, all are counted
    pool.conv_update(0, torch.zeros(11, D).bfloat16(), weight, i32([S + r for r in range(10)] + [0]), bias=bias)
    with pytest.raises(SlotError) as info:
        pool.check()
    msg = str(info.value)
    assert "conv_update(layer=0): 10 row(s)" in msg and "row 7 slot 13" in msg and "row 8 slot" not in msg, msg


def test_kernel_in_the_interpreter_without_window(interpreter: None) -> None:
    """The kernel without a window (W = 1), without bias and activation, fp32, 2 tokens, NaN-poisoned outputs
    (launched directly): against the float64 conv1d and the PyTorch path; padding rows zero."""
    from tp_replayssm.kernels.conv import launch_conv

    pool = make_pool(1)
    weight, _ = conv_params(1, seed=51)
    x = torch.randn(4, 2, D, generator=torch.Generator().manual_seed(52))
    slots = i32([2, -1, 0, 3])
    y = torch.full_like(x, float("nan"))
    launch_conv(x, y, pool.conv_state, 1, weight, None, slots, pool.cursors, L, False, pool.guard("conv_update", 1))
    live = [0, 2, 3]
    torch.testing.assert_close(y[live].double(), conv1d_oracle(x[live], weight, None, None), rtol=1e-6, atol=1e-6)
    assert (y[1] == 0).all()
    with use_cpu_backend("torch"):
        expect = pool.conv_update(1, x, weight, slots, activation=None)
    torch.testing.assert_close(y, expect, rtol=1e-6, atol=1e-6)
    pool.check()


def test_kernel_plan_choices() -> None:
    """The channel block: as large as the batch allows while the grid keeps two programs per SM, within
    [MIN_BLOCK_D, MAX_BLOCK_D] and not above D's power of two."""
    from tp_replayssm.kernels.conv import MAX_BLOCK_D, MIN_BLOCK_D, plan_conv

    assert plan_conv(1, 12288, 4, 132).block_d == MIN_BLOCK_D  # 192 programs: latency
    assert plan_conv(512, 12288, 4, 132).block_d == MAX_BLOCK_D  # 6144 programs
    assert plan_conv(32, 1536, 4, 132).block_d == 128  # 32 * 12 = 384 >= 264
    assert plan_conv(2, 64, 4, 132).block_d == 64
    p = plan_conv(8, 40, 3, 132)
    assert (p.block_d, p.width_block, p.num_warps, p.named_block) == (64, 4, 1, 16)
    assert plan_conv(8, 40, 3, 132) is p  # cached
    for B in (1, 3, 8, 64, 512):
        for Dc in (64, 1536, 12288):
            plan = plan_conv(B, Dc, 4, 132)
            block = plan.block_d
            assert MIN_BLOCK_D <= block <= MAX_BLOCK_D and plan.num_warps == min(8, max(1, block // 128))
            assert block == MIN_BLOCK_D or B * -(-Dc // block) >= 2 * 132  # enough programs
            cap = min(MAX_BLOCK_D, max(MIN_BLOCK_D, 1 << (Dc - 1).bit_length()))
            assert block == cap or B * -(-Dc // (2 * block)) < 2 * 132  # and the largest such block


def test_bench_conv_checks_and_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_conv.py: its correctness check passes on a good conv (and flags a wrong one), and its dry run
    prints every standard shape with its byte floor and launch plan."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_conv

    pool = make_pool(4, conv_dtype=torch.bfloat16)
    weight, bias = (t.bfloat16() for t in conv_params(4, seed=71))
    x = torch.randn(3, D).bfloat16()
    assert bench_conv.check_conv(pool, x, weight, bias, i32([0, 2, 3]))["check"] == "ok"
    good = pool.conv_update
    pool.conv_update = lambda *args, **kw: good(*args, **kw) * 1.1  # a conv 10% off
    assert bench_conv.check_conv(pool, x, weight, bias, i32([0, 2, 3]))["check"] == "WRONG"
    assert bench_conv.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "30 shapes, W=4" in out and out.count("ConvPlan(") == 30
    assert "HV32  B512  bf16: D= 12288,   96.121 MiB" in out
    from tp_replayssm.kernels.conv import conv_bytes

    assert conv_bytes(2, 10, 4, tokens=3, act_bytes=4, window_bytes=2, weight_bytes=4, bias=False) == \
        2 * (2 * 3 * 10 * 4 + 2 * 3 * 10 * 2 + 8) + 10 * 4 * 4


@pytest.mark.timeout(300)
def test_kernel_compiles_for_sm90_without_spills() -> None:
    """benchmarks/conv_regs.py compiles the kernel for sm_90 (no GPU: ptxas from the triton wheel; the H200's triton
    3.6 where ``TP_REPLAYSSM_TRITON_H200`` points) at the library's plans: windows of W = 4, 2 and none, one and
    several tokens, 64 to 1024 channels per program; none may spill."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(repo / "benchmarks" / "conv_regs.py"), "--json"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 5
    for r in rows:
        assert r["stack"] == 0 and 0 < r["regs"] <= 255, r


# ---- the GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("W,T,B", [(4, 1, 1), (4, 1, 64), (4, 3, 5), (2, 2, 33), (1, 1, 7), (3, 4, 9)])
def test_kernel_on_gpu_matches_the_pytorch_path(dtype: torch.dtype, W: int, T: int, B: int) -> None:
    """The kernel on CUDA against the PyTorch path on a CPU copy of the pool (Kimi-like channels: K = V = 128,
    HV = H = 4, D = 1536): outputs within one rounding of ``dtype``, windows bit for bit, sentinels untouched;
    repeated calls launch directly."""
    from tp_replayssm.kernels.conv import DIRECT_PLANS

    heads = KDAHeads(4, 4, 128, 128)
    Dk, Sk = heads.qkv_width, B + 3
    kw = dict(num_layers=2, num_slots=Sk, ring_length=4, conv_kernel_size=W, conv_dtype=dtype)
    gpu = ReplaySSMStatePool(heads, device="cuda", **kw)
    cpu = ReplaySSMStatePool(heads, device="cpu", **kw)
    gen = torch.Generator().manual_seed(B * 10 + W)
    for p in (gpu, cpu):
        if W > 1:
            p.conv_state.fill_(SENTINEL)
        p.alloc(B + 1)
    if W > 1:
        win = torch.randn(B + 1, Dk, W - 1, generator=gen)
        for p in (gpu, cpu):
            p.load_state(1, torch.arange(B + 1, dtype=torch.int32, device=p.device),
                         torch.zeros(B + 1, 4, 128, 128, device=p.device), conv_states=win.to(p.device))
    weight = torch.randn(Dk, W, generator=gen) * 0.5
    bias = torch.randn(Dk, generator=gen) * 0.1
    perm = torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)
    pad = B // 2 if B > 2 else None
    if pad is not None:
        perm[pad] = -1  # a padding row
    hits = DIRECT_PLANS.hits
    for step in range(3):
        x = torch.randn(B, T, Dk, generator=gen).to(dtype)
        xin = x[:, 0] if T == 1 and step % 2 else x
        y = gpu.conv_update(1, xin.cuda(), weight.cuda(), perm.cuda(), bias=bias.cuda())
        want = cpu.conv_update(1, xin, weight, perm, bias=bias)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(y.cpu().double(), want.double(), rtol=tol, atol=tol)
        if pad is not None:
            assert torch.equal(y.cpu()[pad], torch.zeros_like(want[pad]))
        if W > 1:
            assert torch.equal(gpu.conv_state.cpu(), cpu.conv_state), step
    assert DIRECT_PLANS.hits > hits
    gpu.check()


@pytest.mark.gpu
def test_graph_replay_of_conv_and_decode_with_a_bad_row() -> None:
    """A CUDA graph of a decode step with the conv on both layers (the fused advance on the last), captured with
    good slots and replayed with a bad row in its slot buffer: the replay runs, the bad row's outputs are zero, no
    window, checkpoint, ring or cursor byte of any slot changes for it, check() reports it; the good rows equal an
    eager twin's bitwise."""
    pool, twin, params = decode_pair(device="cuda")
    dev = pool.device
    weight, bias = (t.to(dev) for t in conv_params(4, seed=61))
    inp = random_decode_inputs(3, H, HV, K, V, dtype=torch.bfloat16, device=dev,
                               generator=torch.Generator().manual_seed(62))
    slots = i32([0, 2, 3], dev)

    def step(p: ReplaySSMStatePool, s: torch.Tensor) -> list[torch.Tensor]:
        return [p.decode(layer, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, s, conv_weight=weight,
                         conv_bias=bias, advance=layer == 1) for layer in range(2)]

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    snap = {n: getattr(pool, n).clone() for n in ("conv_state", "checkpoint", "d_cache", "k_cache", "g_cache",
                                                  "cursors")}
    with torch.cuda.stream(warm):  # warm-up (compiles), then restore the pool
        step(pool, slots)
    torch.cuda.current_stream().wait_stream(warm)
    for n, t in snap.items():
        getattr(pool, n).copy_(t)
    pool.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(pool, slots)
    slots.copy_(i32([0, 4, 3], dev))  # slot 4 is free
    graph.replay()
    want = step(twin, i32([0, -1, 3], dev))
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        assert torch.equal(o, w) and (o[1] == 0).all()
    for n in snap:
        assert torch.equal(getattr(pool, n), getattr(twin, n)), n
    with pytest.raises(SlotError, match=r"decode\(layer=0\): .*row 1 slot 4"):
        pool.check()
    assert math.isfinite(float(outs[0].float().abs().sum()))
