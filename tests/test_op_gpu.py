"""GPU tests of the Helion op at Kimi-Linear shapes (they need a CUDA GPU).

K = V = 128, L = 16, H = HV in {32 (TP1), 16, 8, 4 (TP2..TP8), 12 (Kimi-K3 local)}, one GQA shape,
B in {1, 8, 64, 256}, fp32 and bf16 checkpoints, bf16 activations and rings; each case runs a full
ring cycle plus one step (every cursor phase, the natural flush and random forced flushes) against
the reference and the float64 plain recurrence. Worst errors go to ``$OUT/gpu_op_errors.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator

import pytest
import torch

from tp_replayssm import ops, reference
from tp_replayssm.kernels import direct, launch
from tp_replayssm.kernels.plan import DecodePlan, plan_decode, problem_of
from tp_replayssm.testing import random_decode_inputs, random_head_params, rel_err
from tp_replayssm.validation import DecodeDims
from _decode_scenario import OUT_TOL, PLAIN64_TOL, Scenario, kimi_scenario, run_scenario

pytestmark = pytest.mark.gpu

SHAPES = [(32, 32), (16, 16), (8, 8), (4, 4), (12, 12), (16, 32)]  # (H, HV)
BATCHES = [1, 8, 64, 256]
RESULTS: list[dict[str, object]] = []


def _plan(dims: DecodeDims, state_dtype: torch.dtype, cache_dtype: torch.dtype = torch.bfloat16,
          ring_layout: str = "sglang", lower_bound: float | None = None) -> DecodePlan:
    """The library's plan of an op call of ``dims`` on this GPU."""
    return plan_decode(problem_of(dims, state_dtype=state_dtype, cache_dtype=cache_dtype, device=torch.device("cuda"),
                                  ring_layout=ring_layout, cursor_table=False, advance=False, use_l2norm=True,
                                  lower_bound=lower_bound))


@pytest.fixture(scope="module", autouse=True)
def _write_results() -> Iterator[None]:
    yield
    path = os.path.join(os.environ.get("OUT", "."), "gpu_op_errors.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("H,HV", SHAPES, ids=[f"H{h}-HV{hv}" for h, hv in SHAPES])
def test_kimi_shapes(H: int, HV: int, B: int, state_dtype: torch.dtype) -> None:
    sc = kimi_scenario(H, HV, B, state_dtype)
    hits = launch.DIRECT_PLANS.hits
    worst = run_scenario(sc, ops.replayssm_decode)
    # every step after the first (same metadata, fresh tensors) launched the compiled kernel directly
    assert launch.DIRECT_PLANS.hits - hits >= sc.steps - 1
    RESULTS.append(dict(H=H, HV=HV, B=B, state=str(state_dtype), **vars(worst)))
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype], worst
    assert worst.out_vs_plain64 <= PLAIN64_TOL and worst.state_vs_plain64 <= PLAIN64_TOL, worst


@pytest.mark.parametrize("B,HV", [(256, 8), (128, 32)], ids=["uncapped", "capped"])
def test_tensor_core_chunks_keep_fp32_accuracy(B: int, HV: int) -> None:
    """A bf16 checkpoint with bf16 rings at 1024+ (row, head) pairs takes the tensor-core chunks (under a
    register cap where it saves a wave: 4096 pairs, not 2048); with fp32 activations ``out`` must still match
    the reference to 2e-5."""
    plan = _plan(DecodeDims(B, HV, HV, 128, 128, 16, B), torch.bfloat16)
    assert plan.tensor_core_chunks and (plan.maxnreg is not None) == (B * HV >= 4096)
    sc = Scenario(B=B, H=HV, HV=HV, K=128, V=128, L=16, S=B + 3, act_dtype=torch.float32,
                  state_dtype=torch.bfloat16, steps=17, flush_prob=0.05, seed=B + HV, device="cuda")
    worst = run_scenario(sc, ops.replayssm_decode)
    RESULTS.append(dict(case=f"mma-chunks-fp32act-B{B}-HV{HV}", **vars(worst)))
    assert worst.flushes > 0 and worst.appends > 0
    assert worst.out_vs_reference <= OUT_TOL[torch.float32], worst
    assert worst.out_vs_plain64 <= PLAIN64_TOL and worst.state_vs_plain64 <= PLAIN64_TOL, worst


def test_fp32_register_path_under_the_one_wave_cap() -> None:
    """HV12 B128 with an fp32 checkpoint (1536 one-warp programs) runs 8-row chunks under the 168-register cap,
    which fits the grid into one wave (``grid._capped_one_wave``); the sglang layout's kernel there, a full cycle
    plus one step against the reference and the float64 recurrence."""
    plan = _plan(DecodeDims(128, 12, 12, 128, 128, 16, 131), torch.float32)
    assert plan.maxnreg == 168 and plan.value_chunk == 8 and not plan.tensor_core_chunks, plan
    sc = kimi_scenario(12, 12, 128, torch.float32)
    worst = run_scenario(sc, ops.replayssm_decode)
    RESULTS.append(dict(case="fp32-one-wave-cap-H12-HV12-B128", **vars(worst)))
    assert worst.flushes > 0 and worst.appends > 0
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype], worst
    assert worst.out_vs_plain64 <= PLAIN64_TOL and worst.state_vs_plain64 <= PLAIN64_TOL, worst


# (H, HV, B); HV12 B128 is a register-capped grid (1536 programs: one wave at 12 per SM), with either checkpoint
# and the one-warp 16-row tiles of 16-132 pairs (HV32 B1, HV8 B8, HV12 B8, HV16 B8)
PREDECAYED_SHAPES = [(16, 16, 8), (8, 8, 1), (32, 32, 32), (4, 4, 256), (16, 32, 64), (12, 12, 8), (12, 12, 128),
                     (32, 32, 1), (8, 8, 8)]
# the gates: KDA's bounded one at -5 (L = 16: keys up to exp(75), no rebase), the softplus one at the usual
# strength, and softplus gates exp(4.5) times stronger (heads rebase; five shapes: tiny, one-warp with 16-row and
# 64-row tiles, MMA chunks, and MMA chunks under the register cap, where the rebase is a pass of its own:
# predecayed_ring 3)
PREDECAYED_CASES = ([(h, hv, b, gate) for h, hv, b in PREDECAYED_SHAPES for gate in ("bounded", "softplus")]
                    + [(h, hv, b, "rebasing") for h, hv, b in PREDECAYED_SHAPES if b in (1, 32, 256, 128)])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
@pytest.mark.parametrize("H,HV,B,gate", PREDECAYED_CASES,
                         ids=[f"H{h}-HV{hv}-B{b}-{gate}" for h, hv, b, gate in PREDECAYED_CASES])
def test_predecayed_layout_at_kimi_shapes(H: int, HV: int, B: int, gate: str, state_dtype: torch.dtype) -> None:
    """The pool's pre-decayed ring layout on the compiled kernel, every config regime (tiny batch, one-warp,
    tensor-core chunks from 1024 pairs), a full cycle plus one step against its reference and the float64
    plain recurrence, under a bounded gate (no rebase possible), the usual softplus gate and one strong enough
    that heads rebase (some must)."""
    sc = dataclasses.replace(kimi_scenario(H, HV, B, state_dtype), predecayed=True,
                             lower_bound=-5.0 if gate == "bounded" else None,
                             A_log_shift=4.5 if gate == "rebasing" else 0.0)
    plan = _plan(DecodeDims(B, H, HV, 128, 128, 16, sc.S), state_dtype, ring_layout="predecayed",
                 lower_bound=sc.lower_bound)
    assert (plan.maxnreg is not None) == (B * HV == 1536)  # the shapes cover the cap (both states at 1536 programs)
    worst = run_scenario(sc, ops.replayssm_decode)
    RESULTS.append(dict(case=f"predecayed-{gate}", H=H, HV=HV, B=B, state=str(state_dtype), **vars(worst)))
    assert worst.flushes > 0 and worst.appends > 0
    if gate != "softplus":  # (the usual softplus gate may or may not rebase: the data decides)
        assert (worst.rebases > 0) if gate == "rebasing" else (worst.rebases == 0), worst
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype], worst
    assert worst.out_vs_plain64 <= PLAIN64_TOL and worst.state_vs_plain64 <= PLAIN64_TOL, worst


@pytest.mark.parametrize("B,HV,warps", [(1, 8, 4), (64, 16, 1)], ids=["4-warp", "1-warp"])
def test_predecayed_fp32_ring_rebases(B: int, HV: int, warps: int) -> None:
    """fp32 rings (the flush's ring replay as rank-1 updates) with heads rebasing, in a four-warp (the tiny-batch
    path's) and a one-warp program: a rebase zeroes the deltas the replay has just read, behind a CTA barrier."""
    plan = _plan(DecodeDims(B, HV, HV, 128, 128, 16, B + 3), torch.float32, torch.float32, ring_layout="predecayed")
    assert plan.num_warps == warps, plan
    sc = Scenario(B=B, H=HV, HV=HV, K=128, V=128, L=16, S=B + 3, act_dtype=torch.float32, cache_dtype=torch.float32,
                  steps=17, pad_rows=1 if B > 1 else 0, flush_prob=0.05, predecayed=True, A_log_shift=4.5,
                  seed=B + HV, device="cuda")
    worst = run_scenario(sc, ops.replayssm_decode)
    RESULTS.append(dict(case=f"predecayed-fp32ring-rebasing-B{B}-HV{HV}", **vars(worst)))
    assert worst.rebases > 0 and worst.flushes > 0, worst
    assert worst.out_vs_reference <= OUT_TOL[torch.float32], worst
    assert worst.out_vs_plain64 <= 1e-4 and worst.state_vs_plain64 <= 1e-4, worst


def test_strided_layer_view_fp32_exact_path() -> None:
    sc = Scenario(B=64, H=8, HV=16, K=128, V=128, L=8, S=80, act_dtype=torch.float32,
                  cache_dtype=torch.float32, layer_view=True, a_3d=True, steps=10, device="cuda")
    worst = run_scenario(sc, ops.replayssm_decode)
    RESULTS.append(dict(case="strided-fp32", **vars(worst)))
    assert worst.out_vs_reference <= 2e-5 and worst.out_vs_plain64 <= 1e-4, worst


@pytest.mark.multigpu
def test_launches_on_the_tensors_device_not_the_current_one() -> None:
    sc = Scenario(B=8, H=4, HV=8, K=128, V=128, L=4, S=12, steps=5, device="cuda:1")
    torch.cuda.set_device(0)
    worst = run_scenario(sc, ops.replayssm_decode)
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype]


def _one_step(seed: int, *, B: int = 8, H: int = 8, HV: int = 8, K: int = 128, V: int = 128, L: int = 16,
              column_offset: int = 0) -> tuple:
    """Inputs of one step on cuda: random checkpoints and rings, cursors spread over every phase (some
    rows flush), one padding row; ``mixed_qkv`` starts ``column_offset`` elements into its buffer."""
    gen = torch.Generator().manual_seed(seed)
    S = B + 2
    inp = random_decode_inputs(B, H, HV, K, V, generator=gen, device="cuda")
    width = inp.mixed_qkv.shape[1]
    buf = torch.zeros(B, width + 8, dtype=inp.mixed_qkv.dtype, device="cuda")
    mixed = buf[:, column_offset:column_offset + width]
    mixed.copy_(inp.mixed_qkv)
    params = random_head_params(HV, K, device="cuda", generator=gen)
    state = (0.1 * torch.randn(S, HV, V, K, generator=gen)).cuda()
    d = (0.1 * torch.randn(S, HV, L, V, generator=gen)).to(torch.bfloat16).cuda()
    k = torch.nn.functional.normalize(torch.randn(S, H, L, K, generator=gen), dim=-1).to(torch.bfloat16).cuda()
    g = (-0.05 * torch.rand(S, HV, L, K, generator=gen)).cuda()
    slots = torch.randperm(S, generator=gen)[:B].int()
    slots[B // 2] = -1
    cursors = torch.randint(0, L, (B,), generator=gen, dtype=torch.int32)
    cursors[0] = L - 1
    out = torch.full((B, 1, HV, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    return ((mixed, inp.a, inp.b, params.A_log, params.dt_bias), (state, d, k, g), out,
            slots.cuda(), cursors.cuda())


def _run(op: Callable[..., object], step: tuple, scale: float | None,
         lower_bound: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    acts, caches, out, slots, cursors = step
    caches = [t.clone() for t in caches]
    out = out.clone()
    op(*acts, scale, *caches, out, slots, cursors, None, True, lower_bound)
    torch.cuda.synchronize()
    return out, caches


def test_direct_launch_is_bit_identical_to_helion_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    step = _one_step(1)
    _run(ops.replayssm_decode, _one_step(2), None)  # records the plan of this metadata
    hits = launch.DIRECT_PLANS.hits
    direct_out, direct_caches = _run(ops.replayssm_decode, step, None)
    assert launch.DIRECT_PLANS.hits == hits + 1
    monkeypatch.setattr(direct, "ENABLED", False)
    helion_out, helion_caches = _run(ops.replayssm_decode, step, None)
    assert launch.DIRECT_PLANS.hits == hits + 1
    assert torch.equal(direct_out, helion_out)
    for got, want in zip(direct_caches, helion_caches):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("column_offset", [0, 1], ids=["aligned", "misaligned"])
def test_direct_launch_follows_scale_lower_bound_and_alignment(column_offset: int) -> None:
    # the second call differs from the first only in scale (a runtime argument: same plan); a new
    # lower_bound is a new key (Helion may bake it into the code)
    for seed, scale, lower_bound in ((3, None, None), (4, 0.3, None), (5, 0.05, -5.0), (6, 0.3, -2.0)):
        step = _one_step(seed, column_offset=column_offset)
        hits = launch.DIRECT_PLANS.hits
        out, caches = _run(ops.replayssm_decode, step, scale, lower_bound)
        if seed == 4:
            assert launch.DIRECT_PLANS.hits == hits + 1
        ref_out, ref_caches = _run(reference.replayssm_decode, step, scale, lower_bound)
        pad = step[3] < 0
        assert (out[pad] == 0).all() and torch.isfinite(out).all()
        assert rel_err(out, ref_out) <= OUT_TOL[torch.bfloat16], (seed, scale, lower_bound)
        for got, want in zip(caches, ref_caches):
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)
    assert (step[0][0].data_ptr() % 16 != 0) == bool(column_offset)
