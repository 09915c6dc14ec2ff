"""benchmarks/bench_spec.py's host-side parts, on any machine: the cursor cycle its rows walk, the byte floor of a
verify + commit step, and the ``--override`` plan variants it times."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_spec  # noqa: E402
from plan_args import verify_override_arg  # noqa: E402


def test_cycle_of_three_accepted_drafts_of_four() -> None:
    """L = 16, T = 4, 3 accepted: the cursor walks 3, 6, 9, 12 (12 + 4 > 15 folds: 0 + 3) and repeats; one step in
    four folds."""
    assert bench_spec.cycle(16, 4, 3) == [(3, False), (6, False), (9, False), (12, True)]


def test_verify_bytes_counts_the_checkpoint_once_and_the_fold_at_its_share() -> None:
    """HV = H = 32, B = 32, bf16 checkpoint: the checkpoint read is B*HV*V*K*2 bytes, the fold writes it once in four
    steps; the parts add up to the total."""
    m = bench_spec.verify_bytes(32, 32, 32, 128, 128, 16, 4, 3, 2)
    ckpt = 32 * 32 * 128 * 128 * 2
    assert m["checkpoint_read"] == ckpt and m["fold_share"] == 0.25 and m["fold_write"] == ckpt / 4
    assert m["mean_cursor"] == 7.5
    parts = m["checkpoint_read"] + m["fold_write"] + m["ring_read"] + m["ring_write"] + m["io"]
    assert m["bytes"] == pytest.approx(parts)
    assert 55e6 < m["bytes"] < 57e6  # 55.86 MB: the floor bench_spec prints for this shape


def test_override_names_plan_fields_and_times_the_library_plan_first() -> None:
    assert verify_override_arg("value_chunk=32, num_warps=8") == {"value_chunk": 32, "num_warps": 8}
    assert verify_override_arg("tree=off") == {"tree": False}
    with pytest.raises(argparse.ArgumentTypeError, match="field one of.*operand_parts"):
        verify_override_arg("warps=8")
    with pytest.raises(argparse.ArgumentTypeError, match="value_chunk: expected an int"):
        verify_override_arg("value_chunk=wide")
    args = bench_spec.parse_args(["--batch", "8,32", "--heads", "32", "--state", "bf16", "--override",
                                  "operand_parts=2"])
    assert [(s["B"], s["override"]) for s in bench_spec.shapes(args)] == [
        (8, {}), (8, {"operand_parts": 2}), (32, {}), (32, {"operand_parts": 2})]


def test_forms_accept_fla_without_plan_overrides_and_refuse_unknown_ones() -> None:
    """``--forms fla`` adds rows with no plan override; an unknown form is refused by name."""
    args = bench_spec.parse_args(["--forms", "tensor-cores,fla", "--batch", "8", "--heads", "32", "--state", "bf16",
                                  "--override", "value_chunk=32"])
    rows = bench_spec.shapes(args)
    assert [(r["form"], r["override"]) for r in rows] == [("tensor-cores", {}), ("tensor-cores", {"value_chunk": 32}),
                                                          ("fla", {})]
    with pytest.raises(SystemExit, match="unknown form 'flash'"):
        bench_spec.shapes(bench_spec.parse_args(["--forms", "flash"]))


@pytest.mark.timeout(600)
def test_fla_spec_matches_the_pool_verify_in_the_interpreter() -> None:
    """FLA's spec-decoding verify (benchmarks/fla_spec.py), run in Triton's interpreter, gives the pool's verify
    outputs for the same drafts from each row's committed state (both ring layouts, fp32 and bf16 states, GQA, rings
    holding entries); its state blocks take the drafts' states; a starting block outside 1..T is refused."""
    import os
    import subprocess

    script = r'''
import sys, torch
sys.path.insert(0, "benchmarks")
import fla_spec
from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.testing import random_head_params
torch.manual_seed(0)
H, HV, K, V, B, T = 2, 4, 16, 16, 3, 3
for layout, dtype, tol in (("predecayed", torch.float32, 1e-5), ("sglang", torch.bfloat16, 2e-2)):
    pool = ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=1, num_slots=6, ring_length=8,
                              state_dtype=dtype, ring_layout=layout, device="cpu", cache_dtype=torch.float32)
    ids = pool.alloc(6)
    params = random_head_params(HV, K)
    slots = ids[[4, 1, 2]].to(torch.int32)
    for _ in range(3):
        pool.decode(0, torch.randn(B, 2 * H * K + HV * V), torch.randn(B, HV * K), torch.randn(B, HV),
                    params.A_log, params.dt_bias, slots, advance=True)
    state = fla_spec.FlaSpecState.make(1, B, T, HV, K, V, accepted=2, device="cpu", dtype=dtype)
    before = state.blocks.clone()
    x, a, b = torch.randn(B, T, 2 * H * K + HV * V), torch.randn(B, T, HV * K), torch.randn(B, T, HV)
    err = fla_spec.check(fla_spec.load_fla_fwd(), pool, slots, state, x, a, b, params, None)
    assert err < tol, (layout, dtype, err)
    assert not torch.equal(state.blocks, before)
    print("ok", layout, err)
try:
    fla_spec.FlaSpecState.make(1, 1, 3, 1, 16, 16, accepted=0, device="cpu")
except ValueError as e:
    assert "`accepted` must be in 1..T=3" in str(e)
    print("refused")
'''
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=560)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 2 and "refused" in proc.stdout, proc.stdout


def test_model_step_verifies_every_layer_then_commits_once() -> None:
    """``--layers``' model step on a CPU pool of 2 layers: a verify step gives each layer's outputs (the second layer
    verified from its own state) and moves the cursors once, by the accepted drafts; a decode step advances them once
    (fused into the last layer or the separate advance), both decode forms leaving the same state."""
    import copy

    import torch

    from tp_replayssm import KDAHeads, ReplaySSMStatePool
    from tp_replayssm.testing import random_head_params

    torch.manual_seed(0)
    H, K, B, T, L = 2, 16, 3, 3, 8
    D = 3 * H * K
    pool = ReplaySSMStatePool(KDAHeads(H, H, K, K), num_layers=2, num_slots=4, ring_length=L, device="cpu")
    slots = pool.alloc(B).to(torch.int32)
    params = random_head_params(H, K)
    pool.checkpoint.copy_(0.1 * torch.randn(pool.checkpoint.shape))
    twin = copy.deepcopy(pool)
    x1, a1, b1 = torch.randn(B, D), torch.randn(B, H * K), torch.randn(B, H)
    outs = bench_spec.model_step(pool, 2, slots, x1, a1, b1, params, None, fused=True)
    twin_outs = bench_spec.model_step(twin, 2, slots, x1, a1, b1, params, None, fused=False)
    assert len(outs) == 2 and not torch.equal(outs[0], outs[1])  # each layer from its own checkpoint
    for got, want in zip(outs, twin_outs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name in ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors"):
        assert torch.equal(getattr(pool, name), getattr(twin, name)), name
    assert pool.cursors[slots.long()].tolist() == [1] * B  # one advance for the model step, not one per layer
    x, a, b = torch.randn(B, T, D), torch.randn(B, T, H * K), torch.randn(B, T, H)
    accepted = torch.tensor([0, 2, 3], dtype=torch.int32)
    spec_outs = bench_spec.model_step(pool, 2, slots, x, a, b, params, None, accepted=accepted)
    assert [tuple(o.shape) for o in spec_outs] == [(B, T, H, K)] * 2 and not torch.equal(spec_outs[0], spec_outs[1])
    assert pool.cursors[slots.long()].tolist() == [1, 3, 4]  # one commit: cursor + accepted
    pool.check()


def test_layers_option_is_checked() -> None:
    assert bench_spec.parse_args(["--layers", "8"]).layers == 8
    with pytest.raises(SystemExit):
        bench_spec.parse_args(["--layers", "0"])
    with pytest.raises(SystemExit):
        bench_spec.parse_args(["--layers", "2", "--forms", "fla"])
