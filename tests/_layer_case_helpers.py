"""What the layer test modules share: the layer configs and their FLA peers' arguments, the tolerances, the
``fla`` skip markers, a pool per rank with slots that are not 0..n-1, the cursors a scenario leaves and the check of
the gloo ranks' results (the oracle, scenarios and rank worker are in ``_layer_helpers``).
"""

from __future__ import annotations

import pytest
import torch

import _fla_cpu
import _layer_helpers as lh
from tp_replayssm import ReplaySSMStatePool
from tp_replayssm.layers import KDALayerConfig

needs_fla = pytest.mark.skipif(not _fla_cpu.FLA_AVAILABLE, reason=_fla_cpu.SKIP_REASON)
needs_fla_core = pytest.mark.skipif(not _fla_cpu.FLA_CORE_AVAILABLE, reason=_fla_cpu.SKIP_REASON_CORE)

# hidden 64, K = V = 16 unless said: GVA with q/k heads replicated at tp 4, conv biases; K != V (FLA's expand_v = 2);
# no short convolution, the bounded gate and no output-gate bias
CONFIGS = {
    "gva": KDALayerConfig(64, 2, 8, 16, 16, 16, conv_size=4, conv_bias=True, gate_bias=True),
    "kv": KDALayerConfig(64, 2, 4, 16, 32, 32, conv_size=4),
    "noconv-lb": KDALayerConfig(64, 4, 4, 16, 16, 16, conv_size=0, gate_bias=False, lower_bound=-4.0),
}
FLA_KWARGS = {  # FLA layers of the same geometry (head_dim = K; expand_v = V / K)
    "gva": dict(hidden_size=64, num_heads=2, num_v_heads=8, head_dim=16, conv_bias=True),
    "kv": dict(hidden_size=64, num_heads=2, num_v_heads=4, head_dim=16, expand_v=2),
    "lb": dict(hidden_size=64, num_heads=4, head_dim=16, lower_bound=-5.0),
}
TOL = 2e-5  # fp32 layer against float64 / fp32 FLA, max abs error over max abs output
GPU_TOL = 1e-4  # fp32 on the GPU (other summation orders in the kernels and GEMMs)


def _pool(cfg: KDALayerConfig, rank: int, tp: int, layers: int = 1, ring_length: int = 3) -> ReplaySSMStatePool:
    return ReplaySSMStatePool(cfg.heads, num_layers=layers, num_slots=6, ring_length=ring_length,
                              cache_dtype=torch.float32, conv_kernel_size=cfg.conv_size, tp_rank=rank, tp_size=tp,
                              device="cpu")


def _alloc(pool: ReplaySSMStatePool, n: int) -> list[int]:
    """``n`` slots that are not 0..n-1 (one slot taken and given back first)."""
    burn = pool.alloc(1)
    ids = pool.alloc(n).tolist()
    pool.free(burn)
    return ids


def _expected_cursors(calls: list[lh.Call], n: int, L: int) -> list[int]:
    cur = [0] * n
    for call in calls:
        for r, s in enumerate(call.seqs):
            if s is None:
                continue
            if call.kind == "prefill":
                cur[s] = 0
            else:
                flush = cur[s] == L - 1 or bool(call.force_flush and call.force_flush[r])
                cur[s] = 0 if flush else cur[s] + 1
    return cur


def _check_ranks(results: list[dict], cfg: KDALayerConfig, world: int, calls: list[lh.Call], n: int) -> None:
    want_cur = _expected_cursors(calls, n, 2)
    for r, res in enumerate(results):
        assert max(res["errs"]) < TOL, (r, res["errs"])
        assert res["padding_zero"] and res["cursors"] == want_cur, res
        HVl = cfg.num_v_heads // world
        assert res["v_heads"] == list(range(r * HVl, (r + 1) * HVl))
        H = cfg.num_heads
        assert res["q_heads"] == (list(range(r * H // world, (r + 1) * H // world)) if H % world == 0
                                  else [r * H // world])
