"""The conv fused into the decode launch (``DecodePlan.fused_conv``): the kernel in Triton's interpreter and (``gpu``)
the device. The plans and the sm_90 compile are tested in tests/test_conv_fused_plan.py.

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

from _conv_fused_helpers import (K, S, SENTINEL, STATE_TENSORS, V, conv_taps, fused_and_two_launch_steps, make_pool,
                                 plan_of, problem)
from _decode_scenario import record_kernel_args
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError
from tp_replayssm.kernels.backend import use_cpu_backend
from tp_replayssm.kernels.plan import plan_decode
from tp_replayssm.testing import random_decode_inputs, random_head_params


# ---- the kernel in Triton's interpreter ---------------------------------------------------------


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
    """A conv plan beside a plan that fuses the conv (on the torch path too, where nothing fuses), and a fused plan
    for a call it cannot run, are ValueErrors before anything is written."""
    from tp_replayssm.kernels.conv_plan import plan_conv

    pool = make_pool(1, 2, torch.float32)
    snapshot = {n: getattr(pool, n).clone() for n in STATE_TENSORS}
    weight, bias = conv_taps(pool.conv_channels, seed=1)
    params = random_head_params(2, K)
    x = random_decode_inputs(3, 1, 2, K, V, dtype=torch.bfloat16)
    ids = torch.tensor([0, 2, 3], dtype=torch.int32)
    call = (1, x.mixed_qkv, x.a, x.b, params.A_log, params.dt_bias, ids)
    plan = plan_of(pool, 3, False)
    with pytest.raises(ValueError, match="`conv_plan` given, but `plan` fuses the conv"):
        pool.decode(*call, conv_weight=weight, conv_bias=bias, plan=plan,
                    conv_plan=plan_conv(3, pool.conv_channels, 4, 132, 1))
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


def test_conv_plan_without_a_plan_takes_the_conv_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``conv_plan`` without a decode ``plan`` where the library would fuse the conv (every batch here): the conv
    runs in its own launch with that plan, and the decode and the windows equal the torch path's."""
    from tp_replayssm.kernels import plan as plan_module
    from tp_replayssm.kernels.conv_plan import plan_conv

    monkeypatch.setattr(plan_module, "FUSE_CONV_FROM", 1)
    pools = [make_pool(1, 2, torch.float32) for _ in range(2)]
    weight, bias = conv_taps(pools[0].conv_channels, seed=2)
    params = random_head_params(2, K)
    x = random_decode_inputs(3, 1, 2, K, V, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([0, 2, 3], dtype=torch.int32)
    outs = []
    for pool, backend in zip(pools, ("interpreter", "torch")):
        with use_cpu_backend(backend):
            outs.append(pool.decode(1, x.mixed_qkv, x.a, x.b, params.A_log, params.dt_bias, ids, conv_weight=weight,
                                    conv_bias=bias, conv_plan=plan_conv(3, pool.conv_channels, 4, 132, 1)))
    torch.testing.assert_close(outs[0].double(), outs[1].double(), rtol=1e-2, atol=1e-2)  # bf16 outputs
    assert torch.equal(pools[0].conv_state, pools[1].conv_state)  # the windows hold the inputs
    assert getattr(pools[0], "conv_counters", None) is None  # no fused launch ran


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
