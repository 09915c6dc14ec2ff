"""The decode op's pre-decayed ring layout (``ring_layout="predecayed"``): the tensor-core chunks, the rebase pass of
register-capped programs, the reference against the float64 recurrence, the layout's input validation, and the
kernel's rebase bound. Its kernel-path cases (``PREDECAYED_CASES``) run with the sglang layout's in ``test_op``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import pytest
import torch

from tp_replayssm import ops, reference, validation
from tp_replayssm.kernels.decode import replayssm_decode_kernel
from _decode_scenario import OUT_TOL, Scenario, planned_op, record_kernel_args, run_scenario
from _op_helpers import (B, BF16_OPERANDS, H, HV, K, L, PREDECAYED_CASES, S, V, _check_rebases, _refused_and_unwritten,
                         _tensors, _with_tensor_core_chunks)


# ---------------------------------------------------------------- the pre-decayed ring layout
# (its kernel-path cases, PREDECAYED_CASES, run with the sglang layout's in test_op.py's test_both_kernel_paths_...)


def test_predecayed_layout_tensor_core_chunks_match_reference(monkeypatch: pytest.MonkeyPatch,
                                                              interpreter: None) -> None:
    """The pre-decayed prologue feeding the bf16 tensor-core chunk products (bf16 checkpoint and rings)."""
    sc = dataclasses.replace(BF16_OPERANDS, lower_bound=-5.0, predecayed=True)
    seen = record_kernel_args(monkeypatch, "predecayed_ring", "chunks_on_tensor_cores")
    worst = run_scenario(sc, planned_op(_with_tensor_core_chunks, tensor_core_chunks=True))
    assert set(seen) == {(1, True)}, seen
    assert worst.flushes > 0 and worst.appends > 0
    assert worst.out_vs_reference <= OUT_TOL[torch.float32], worst
    assert worst.out_vs_plain64 <= 3e-2 and worst.state_vs_plain64 <= 3e-2, worst


# rebasing cases for the rebase pass of register-capped programs: fp32 checkpoint with bf16 rings (register
# chunks), bf16 checkpoint and rings (both chunk paths), all fp32 (the rank-1 flush)
REBASE_PASS_CASES = {
    "gqa-fp32state": PREDECAYED_CASES["gqa-rebasing-softplus"],
    "bf16-operands": dataclasses.replace(BF16_OPERANDS, L=8, steps=12, flush_prob=0.05, predecayed=True,
                                         A_log_shift=4.5),
    "all-fp32": PREDECAYED_CASES["fp32-rebasing-softplus"],
}
# (case, tensor-core chunks, vector tiles): the rebase pass after each append loop, register chunks in row tiles
# and tensor-core chunks (bf16 checkpoint and rings), and the vector tiles of the library's capped register programs
# (fp32 checkpoints over 128-row tiles in 8-row chunks) with a bf16 ring and with an fp32 ring (the rank-1 flush)
REBASE_PASS_PATHS = [("bf16-operands", False, 0), ("bf16-operands", True, 0), ("gqa-fp32state", False, 1),
                     ("all-fp32", False, 1)]


@pytest.mark.parametrize("name,mma,tiles", REBASE_PASS_PATHS,
                         ids=[f"{n}-{'tensor-core-chunks' if m else 'register-chunks'}{'-vector-tiles' if v else ''}"
                              for n, m, v in REBASE_PASS_PATHS])
def test_rebase_pass_of_register_capped_programs(name: str, mma: bool, tiles: int, monkeypatch: pytest.MonkeyPatch,
                                                 interpreter: None) -> None:
    """Under a register cap (``DecodePlan.maxnreg``: GPU tensor-core grids that it saves a wave, and fp32
    register-path grids that it fits into one, with 8-row chunks) a rebasing head runs the append loop and then
    a rebase pass of its own (``predecayed_ring`` 3) instead of the flush branch (2): the same contract, held
    to the same limits. The interpreter's plan has no cap, so the test puts in the GPU's capped plans (the
    interpreter ignores the cap itself) and checks that mode 3 reached the kernel."""
    sc = REBASE_PASS_CASES[name]
    seen = record_kernel_args(monkeypatch, "predecayed_ring", "vector_tiles")
    worst = run_scenario(sc, planned_op(maxnreg=168, predecayed_ring=3, tensor_core_chunks=mma,
                                        value_chunk=16 if mma else 8, vector_tiles=tiles))
    assert set(seen) == {(3, tiles)}, seen  # the rebase pass, with the tiles asked for
    assert worst.flushes > 0 and worst.appends > 0
    _check_rebases(sc, worst.rebases)
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype], worst
    limit = 3e-2 if torch.bfloat16 in (sc.state_dtype, sc.cache_dtype) else 1e-4
    assert worst.out_vs_plain64 <= limit and worst.state_vs_plain64 <= limit, worst


@pytest.mark.parametrize("gate", ["bounded", "rebasing-softplus"])
def test_predecayed_reference_matches_plain_recurrence_tightly_in_fp32(gate: str) -> None:
    sc = Scenario(act_dtype=torch.float32, cache_dtype=torch.float32, steps=10, flush_prob=0.3, predecayed=True)
    if gate == "bounded":
        sc = dataclasses.replace(sc, lower_bound=-5.0)
    else:  # unbounded gates, strong enough that heads rebase between flushes
        sc = dataclasses.replace(sc, L=8, steps=14, flush_prob=0.05, A_log_shift=3.5)
    worst = run_scenario(sc, reference.replayssm_decode)
    _check_rebases(sc, worst.rebases)
    assert worst.out_vs_plain64 < 1e-5 and worst.state_vs_plain64 < 1e-5, worst


def _predecayed_tensors(**overrides: object) -> dict[str, object]:
    return _tensors(**{"k_cache": torch.randn(S, HV, L, K, dtype=torch.bfloat16), "lower_bound": -5.0, **overrides})


PREDECAYED_BAD_INPUTS = {
    "lower_bound-nan": (dict(lower_bound=float("nan")), "None or a finite float.*nan"),
    "lower_bound-positive": (dict(lower_bound=5.0), r"None or a finite float <= 0 .*; got 5\.0"),
    "k_cache-per-qk-head": (dict(k_cache=torch.randn(S, H, L, K, dtype=torch.bfloat16)), r"\[5, 2, 4, 16\]"),
    "mixed_qkv-width": (dict(mixed_qkv=torch.randn(B, 2 * H * K + HV * V + K, dtype=torch.bfloat16)), "width 144"),
}


@pytest.mark.parametrize("impl", [functools.partial(ops.replayssm_decode, ring_layout="predecayed"),
                                  functools.partial(reference.replayssm_decode, ring_layout="predecayed")],
                         ids=["op", "reference"])
@pytest.mark.parametrize("case", list(PREDECAYED_BAD_INPUTS))
def test_predecayed_layout_bad_input_raises_naming_argument_and_writes_nothing(impl: Callable[..., object],
                                                                               case: str) -> None:
    overrides, actual = PREDECAYED_BAD_INPUTS[case]
    message = _refused_and_unwritten(impl, _predecayed_tensors(**overrides), f"`{case.split('-')[0]}`")
    assert re.search(actual, message), message


def test_predecayed_layout_refuses_fp16_rings() -> None:
    t = _predecayed_tensors(d_cache=torch.randn(S, HV, L, V, dtype=torch.float16),
                            k_cache=torch.randn(S, HV, L, K, dtype=torch.float16))
    with pytest.raises(ValueError, match="cache dtype.*float16"):
        ops.replayssm_decode(**t, ring_layout="predecayed")


def test_kernel_rebase_threshold_is_the_validation_bound() -> None:
    """The kernel spells the rebase bound as a literal (a module constant would become a kernel argument);
    it must be the one the reference, the pool and the docs use."""
    import inspect

    src = inspect.getsource(replayssm_decode_kernel)
    assert f"torch.amin(g_cum, dim=0) < -{validation.PREDECAYED_MAX_LOG_DECAY!r}" in src
