"""GPU tests of the Helion op at Kimi-Linear shapes (run on the H200 through the device tool).

K = V = 128, L = 16, H = HV in {32 (TP1), 16, 8, 4 (TP2..TP8), 12 (Kimi-K3 local)}, one GQA shape,
B in {1, 8, 64, 256}, fp32 and bf16 checkpoints, bf16 activations and rings; each case runs a full
ring cycle plus one step (every cursor phase, the natural flush and random forced flushes) against
the reference and the float64 plain recurrence. Worst errors go to ``$OUT/gpu_op_errors.json``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tp_replayssm import ops
from _decode_scenario import OUT_TOL, Scenario, run_scenario

pytestmark = pytest.mark.gpu

SHAPES = [(32, 32), (16, 16), (8, 8), (4, 4), (12, 12), (16, 32)]  # (H, HV)
BATCHES = [1, 8, 64, 256]
RESULTS: list[dict[str, object]] = []


@pytest.fixture(scope="module", autouse=True)
def _write_results():  # noqa: ANN202
    yield
    path = os.path.join(os.environ.get("OUT", "."), "gpu_op_errors.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("H,HV", SHAPES, ids=[f"H{h}-HV{hv}" for h, hv in SHAPES])
def test_kimi_shapes(H: int, HV: int, B: int, state_dtype: torch.dtype) -> None:
    sc = Scenario(B=B, H=H, HV=HV, K=128, V=128, L=16, S=B + 3, pad_rows=1 if B > 1 else 0, steps=17,
                  state_dtype=state_dtype, lower_bound=-5.0 if B == 8 else None, flush_prob=0.05,
                  seed=B * 1000 + HV, device="cuda")
    worst = run_scenario(sc, ops.replayssm_decode)
    RESULTS.append(dict(H=H, HV=HV, B=B, state=str(state_dtype), **vars(worst)))
    assert worst.out_vs_reference <= OUT_TOL[sc.act_dtype], worst
    assert worst.out_vs_plain64 <= 3e-2 and worst.state_vs_plain64 <= 3e-2, worst


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
