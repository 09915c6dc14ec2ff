"""Shared pieces of the ReplaySSMStatePool tests (tests/test_pool.py and its siblings: _sharded, _wiring, _device_ops,
_memory, _errors, _cuda_graph): the small geometry ``SMALL`` and its constants, the pool factory, slot ids and inputs
on the test device, snapshots of a pool's slots and their bitwise comparison, and the parametrization of the step
scenarios (CPU and CUDA graph alike).
"""

from __future__ import annotations

import pytest
import torch

from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.testing import random_decode_inputs, random_head_params

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
KD = VD = 16
SMALL = KDAHeads(1, 2, KD, VD)
S, L, B = 4, 3, 4
SENTINEL = 1e30
CURSOR_SENTINEL = 1000
TOL_BF16 = 2e-2  # ring entries rounded to bf16, outputs in bf16


def make_pool(heads: KDAHeads = SMALL, **kw) -> ReplaySSMStatePool:
    kw.setdefault("num_layers", 2)
    kw.setdefault("num_slots", S)
    kw.setdefault("ring_length", L)
    kw.setdefault("device", DEV)
    return ReplaySSMStatePool(heads, **kw)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def params_for(num_v_heads: int, gen: torch.Generator | None = None):
    return random_head_params(num_v_heads, KD, device=DEV, generator=gen)


def small_inputs(gen: torch.Generator | None = None, device: torch.device | str = DEV):
    """fp32 activations for ``SMALL`` (the kernel tests use fp32: one compiled kernel per dtype)."""
    return random_decode_inputs(B, 1, 2, KD, VD, dtype=torch.float32, device=device, generator=gen)


def pool_tensors(pool: ReplaySSMStatePool) -> dict[str, torch.Tensor]:
    return {"checkpoint": pool.checkpoint, "d_cache": pool.d_cache, "k_cache": pool.k_cache, "g_cache": pool.g_cache}


def snapshot_slots(pool: ReplaySSMStatePool, slots: list[int]) -> dict[str, torch.Tensor]:
    idx = torch.tensor(slots, dtype=torch.long, device=DEV)
    snap = {name: t[:, idx].clone() for name, t in pool_tensors(pool).items()}
    snap["cursors"] = pool.cursors[idx].clone()
    return snap


def assert_bit_identical(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    for name in before:
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name


# (layout, lower_bound, A_log_shift, fused advance) of the step scenarios, CPU and CUDA-graph alike
STEP_CASES = pytest.mark.parametrize("layout, lower_bound, A_log_shift, fused", [
    ("sglang", None, 0.0, False), ("predecayed", -5.0, 0.0, False), ("predecayed", None, 4.5, False),
    ("sglang", None, 0.0, True), ("predecayed", None, 4.5, True)],
    ids=["sglang-layout", "predecayed-layout", "predecayed-rebasing", "sglang-layout-fused-advance",
         "predecayed-rebasing-fused-advance"])
