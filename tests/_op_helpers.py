"""Helpers of the decode op's CPU tests (tests/test_op.py, test_op_launch.py, test_op_validation.py,
test_op_predecayed.py): the scenario cases of both ring layouts, the check of their rebases, the bf16-operand scenario
and its plan check, and the tensors of one small decode call with the check that a refused call wrote nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tp_replayssm.kernels.plan import DecodePlan
from _decode_scenario import Scenario

B, H, HV, K, V, L, S = 3, 2, 4, 16, 16, 4, 5

CASES = {
    # GQA r=2, bf16 activations and rings, fp32 checkpoint, l2norm, softplus gate
    "gqa-bf16ring-fp32state": Scenario(),
    # H = HV, bf16 checkpoint, fp32 rings, fp16 activations, no l2norm, bounded gate, L=3
    "bf16state-fp32ring-bounded": Scenario(H=4, HV=4, L=3, act_dtype=torch.float16, state_dtype=torch.bfloat16,
                                            cache_dtype=torch.float32, l2norm=False, lower_bound=-5.0, steps=7),
    # L = 1: every step flushes
    "ring-length-1": Scenario(L=1, act_dtype=torch.float32, cache_dtype=torch.float32, steps=3, B=3),
    # layer slice of a [2, S, ...] pool (strided views), two value tiles (V=64), a [B,HV,K], dt_bias [HV,K]
    "strided-layer-view-2-vtiles": Scenario(V=64, layer_view=True, a_3d=True, act_dtype=torch.float32,
                                            cache_dtype=torch.float32, steps=6, B=3, HV=2, H=1),
}


PREDECAYED_CASES = {
    # GQA r=2 (keys per value head), bf16 rings and activations, fp32 checkpoint, l2norm
    "gqa-bf16ring-fp32state": Scenario(lower_bound=-5.0, predecayed=True),
    # all fp32 (the rank-1 replay flush of non-bf16 rings), no l2norm, L=5 at the widest bound without a
    # rebase: (L-1) * 18.75 = 75, keys up to exp(75)
    "fp32-widest-bound": Scenario(H=4, HV=4, L=5, act_dtype=torch.float32, cache_dtype=torch.float32, l2norm=False,
                                  lower_bound=-18.75, predecayed=True, steps=8, flush_prob=0.1),
    # softplus gates ~exp(4.5) times the usual: cumulative gates pass -75 within the ring and heads rebase
    "gqa-rebasing-softplus": Scenario(L=8, steps=12, predecayed=True, A_log_shift=4.5, flush_prob=0.05),
    # all fp32, the rank-1 flush, a rebase now and then among appends (held to 1e-4 of float64)
    "fp32-rebasing-softplus": Scenario(H=4, HV=4, L=8, act_dtype=torch.float32, cache_dtype=torch.float32,
                                       predecayed=True, A_log_shift=3.0, steps=12, flush_prob=0.05, seed=1),
}


def _check_rebases(sc: Scenario, rebases: int) -> None:
    """A pre-decayed case with ``A_log_shift`` must rebase (else it tests nothing new); one whose bound allows
    no rebase, ``(L-1) * |lower_bound| <= 75``, must not."""
    if sc.A_log_shift:
        assert rebases > 0, "the rebasing case never rebased"
    elif sc.predecayed and sc.lower_bound is not None and (sc.L - 1) * abs(sc.lower_bound) <= 75:
        assert rebases == 0, f"{rebases} rebases under a bound that allows none"


# bf16 checkpoint and rings (the interpreter's plan takes the tensor-core chunks), fp32 activations: out held to
# fp32 accuracy
BF16_OPERANDS = Scenario(act_dtype=torch.float32, state_dtype=torch.bfloat16)


def _with_tensor_core_chunks(plan: DecodePlan) -> DecodePlan:
    assert plan.tensor_core_chunks  # the interpreter's plan takes the MMAs whenever both operands are bf16
    return plan


def _tensors(**overrides: object) -> dict[str, object]:
    t: dict[str, object] = dict(
        mixed_qkv=torch.randn(B, 2 * H * K + HV * V, dtype=torch.bfloat16),
        a=torch.randn(B, HV * K, dtype=torch.bfloat16),
        b=torch.randn(B, HV, dtype=torch.bfloat16),
        A_log=torch.randn(HV),
        dt_bias=torch.randn(HV * K),
        scale=None,
        initial_state=torch.randn(S, HV, V, K),
        d_cache=torch.randn(S, HV, L, V, dtype=torch.bfloat16),
        k_cache=torch.randn(S, H, L, K, dtype=torch.bfloat16),
        g_cache=torch.randn(S, HV, L, K),
        out=torch.full((B, 1, HV, V), 7.0, dtype=torch.bfloat16),
        ssm_state_indices=torch.tensor([0, 2, -1], dtype=torch.int32),
        write_pos=torch.tensor([0, 1, 0], dtype=torch.int32),
        force_flush=None,
        use_qk_l2norm_in_kernel=True,
        lower_bound=None,
    )
    t.update(overrides)
    return t


def _refused_and_unwritten(call: Callable[..., object], t: dict[str, object], match: str) -> str:
    """``call(**t)`` raises a ``ValueError`` matching ``match`` and leaves every tensor of ``t`` as it was; returns
    the message."""
    snapshot = {k: v.clone() for k, v in t.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=match) as info:
        call(**t)
    for k, v in snapshot.items():
        assert torch.equal(t[k], v), f"{k} was written"
    return str(info.value)
