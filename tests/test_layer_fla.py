"""``tp_replayssm.layers.TPKimiDeltaAttention`` against flash-linear-attention 0.6.0's ``KimiDeltaAttention`` with its
own cache (when ``fla`` is installed: the ``[fla]`` extra): ``from_fla`` at tp 1, 2 and 4 in one process, the
``prefill_backend='fla'`` prefill on the CPU, and gloo ranks that build the layer from FLA's config and state dict.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import _dist_helpers as dh
import _fla_cpu
import _layer_helpers as lh
from _layer_case_helpers import FLA_KWARGS, TOL, _alloc, _check_ranks, _pool, needs_fla
from tp_replayssm.layers import KDALayerConfig, TPKimiDeltaAttention

FLA_SCENARIO = dict(first=[5, 1, 9], second=[3, 18, 2], order2=[[2, 0], [1]])


@pytest.fixture(scope="module")
def fla_cases() -> dict:
    """Per FLA config: the FLA layer, the scenario and FLA's outputs with its own cache (computed once)."""
    cases: dict = {}

    def get(name: str) -> tuple:
        if name not in cases:
            fla_layer = _fla_cpu.kda_layer(7, **FLA_KWARGS[name])
            calls = lh.scenario(fla_layer.hidden_size, 8, **FLA_SCENARIO)
            cases[name] = (fla_layer, calls, lh.fla_outputs(fla_layer, calls, 3))
        return cases[name]

    return get  # type: ignore[return-value]


@needs_fla
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gva", "kv", "lb"])
def test_layer_matches_fla(fla_cases, name: str) -> None:  # noqa: ANN001
    """from_fla at tp 1, 2, 4 (one pool per rank in this process, partial sums added): FLA's outputs for packed
    prefills of three prompt lengths, a decode, the prompts' second pieces in two calls, two decodes; also against the
    float64 layer built from FLA's config and weights."""
    fla_layer, calls, want = fla_cases(name)
    cfg = KDALayerConfig.from_fla(fla_layer)
    plain, _ = lh.plain_outputs(lh.PlainKDALayer(fla_layer.state_dict(), cfg), calls, 3)
    for c in range(len(calls)):
        assert lh.rel(want[c], plain[c]) < TOL, "FLA and the float64 layer disagree"
    for tp in (1, 2, 4):
        if cfg.num_v_heads % tp or (cfg.num_heads % tp and tp % cfg.num_heads):
            continue
        ranks = []
        for r in range(tp):
            pool = _pool(cfg, r, tp, ring_length=2)
            ranks.append((pool, [TPKimiDeltaAttention.from_fla(fla_layer, pool=pool, layer_idx=0)]))
            slot_of = _alloc(pool, 3)
        outs = lh.run_ours(ranks, calls, slot_of, fused=tp != 2)[0]
        for c, (got, exp) in enumerate(zip(outs, want)):
            assert lh.rel(got, exp) < TOL, (tp, c, calls[c].kind, lh.rel(got, exp))


@needs_fla
@pytest.mark.timeout(300)
def test_fla_prefill_backend_on_cpu(fla_cases) -> None:  # noqa: ANN001
    """prefill_backend='fla' (FLA's chunk_kda, here in Triton's interpreter: the call the CUDA prefill makes) gives
    FLA's outputs at tp 2."""
    fla_layer, calls, want = fla_cases("gva")
    ranks = []
    for r in range(2):
        pool = _pool(KDALayerConfig.from_fla(fla_layer), r, 2, ring_length=2)
        ranks.append((pool, [TPKimiDeltaAttention.from_fla(fla_layer, pool=pool, layer_idx=0, prefill_backend="fla")]))
        slot_of = _alloc(pool, 3)
    outs = lh.run_ours(ranks, calls, slot_of, fused=True)[0]
    for c, (got, exp) in enumerate(zip(outs, want)):
        assert lh.rel(got, exp) < TOL, (c, calls[c].kind, lh.rel(got, exp))


@needs_fla
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gloo_matches_fla(fla_cases, tmp_path: Path, world: int) -> None:  # noqa: ANN001
    """On gloo ranks each rank's all-reduced output equals FLA's. The ranks build the layer from FLA's config and
    state dict (what from_fla reads), so they need not import FLA."""
    fla_layer, calls, want = fla_cases("gva")
    cfg = KDALayerConfig.from_fla(fla_layer)
    weights = {k: v.clone() for k, v in fla_layer.state_dict().items()}
    results = dh.run_ranks(lh.tp_worker, world, tmp_path, cfg, weights, calls, 3, want, False, timeout_s=250)
    _check_ranks(results, cfg, world, calls, 3)
