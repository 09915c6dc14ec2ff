"""``tp_replayssm.layers.TPKimiDeltaAttention`` on one GPU: bf16 with FLA's chunk_kda prefill and the Helion decode
against the float64 layer, ``from_fla`` against FLA's bf16 layer, and fp32 with the PyTorch prefill and a decode
step captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
import torch

import _fla_cpu
import _layer_helpers as lh
from _layer_case_helpers import CONFIGS, FLA_KWARGS, GPU_TOL, needs_fla, needs_fla_core
from tp_replayssm import ReplaySSMStatePool
from tp_replayssm.layers import KDALayerConfig, TPKimiDeltaAttention

logger = logging.getLogger(__name__)


def _bf16_weights(cfg: KDALayerConfig, seed: int) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16).float() for k, v in lh.random_weights(cfg, seed).items()}


# prompts of 70 and 130 tokens cross chunk_kda's 64-token chunks
GPU_SCENARIO = dict(first=[70, 1, 9], second=[3, 130, 2], order2=[[2, 0], [1]])


# bf16 weights, activations and rings against the float64 layer: the largest error of a call is 1.2e-2 with this
# scenario on the CPU (the decode and conv kernels in the interpreter; the prefill in fp32, or emulating the bf16
# intermediates of FLA's chunk_kda: l2-normalized q/k, w, u, kg, v_new and the chunk states), set by the projections'
# and o_proj's bf16 outputs; 4e-2 leaves 3x for the GPU's summation orders and TF32 solves
BF16_TOL = 4e-2


@pytest.mark.gpu
@needs_fla_core
def test_gpu_bf16_chunk_kda_prefill_then_decode() -> None:
    """bf16 on one GPU: the prefill runs FLA's chunk_kda (the 'auto' backend on CUDA), decode the Helion kernel
    (bf16 rings); every output matches the float64 layer of the same bf16 weights to bf16 accuracy. The same
    scenario with the PyTorch prefill runs first: where only the chunk_kda run fails, FLA's kernels on this GPU
    (and its Triton) are the cause, not the layer; each run's errors and time are logged as it ends."""
    from tp_replayssm.layers.prefill import prefill_backend_for

    dev = torch.device("cuda", torch.cuda.current_device())
    assert prefill_backend_for("auto", dev) == "fla"
    cfg = CONFIGS["gva"]
    w = _bf16_weights(cfg, 4)
    calls = [dataclasses.replace(c, x=c.x.to(torch.bfloat16).float()) for c in lh.scenario(64, 8, **GPU_SCENARIO)]
    plain, _ = lh.plain_outputs(lh.PlainKDALayer(w, cfg), calls, 3)
    errs: dict[str, list[float]] = {}
    for backend in ("torch", "auto"):
        start = time.perf_counter()
        pool = ReplaySSMStatePool(cfg.heads, num_layers=1, num_slots=4, ring_length=2, conv_kernel_size=4,
                                  device=dev)
        ours = TPKimiDeltaAttention.from_state_dict(w, cfg, pool=pool, layer_idx=0, dtype=torch.bfloat16,
                                                    prefill_backend=backend)
        outs = lh.run_ours([(pool, [ours])], calls, pool.alloc(3).tolist(), fused=True, dtype=torch.bfloat16)[0]
        pool.check()
        errs[backend] = [lh.rel(got, p) for got, p in zip(outs, plain)]
        logger.info("prefill_backend=%r: %.1f s, errors per call %s", backend, time.perf_counter() - start,
                    ", ".join(f"{calls[c].kind} {e:.2e}" for c, e in enumerate(errs[backend])))
    for backend, e in errs.items():
        assert max(e) < BF16_TOL, (backend, [(c, calls[c].kind, round(x, 4)) for c, x in enumerate(e)], errs)


@pytest.mark.gpu
@needs_fla
def test_gpu_bf16_matches_fla_layer() -> None:
    """bf16 on one GPU, from_fla: the outputs match FLA's bf16 layer with its own cache (chunk_kda prefills, then
    its recurrent decode), and both match the float64 layer of FLA's bf16 weights (both prefills run chunk_kda, so
    the float64 layer is what makes the check independent)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    fla_layer = _fla_cpu.kda_layer(7, **FLA_KWARGS["gva"]).to(dev, torch.bfloat16)
    calls = [dataclasses.replace(c, x=c.x.to(torch.bfloat16).float()) for c in lh.scenario(64, 8, **GPU_SCENARIO)]
    want = lh.fla_outputs(fla_layer, calls, 3)
    cfg = KDALayerConfig.from_fla(fla_layer)
    plain, _ = lh.plain_outputs(lh.PlainKDALayer(fla_layer.state_dict(), cfg), calls, 3)
    for c, (w, p) in enumerate(zip(want, plain)):
        assert lh.rel(w, p) < BF16_TOL, ("FLA against the float64 layer", c, lh.rel(w, p))
    pool = ReplaySSMStatePool(cfg.heads, num_layers=1, num_slots=4, ring_length=2, conv_kernel_size=4, device=dev)
    ours = TPKimiDeltaAttention.from_fla(fla_layer, pool=pool, layer_idx=0)
    assert ours.dtype == torch.bfloat16
    outs = lh.run_ours([(pool, [ours])], calls, pool.alloc(3).tolist(), fused=True, dtype=torch.bfloat16)[0]
    for c, (got, w) in enumerate(zip(outs, want)):
        assert lh.rel(got, w) < BF16_TOL, (c, calls[c].kind, lh.rel(got, w))
    pool.check()


@pytest.mark.gpu
def test_gpu_torch_prefill_and_graph_captured_decode() -> None:
    """fp32 on one GPU with the PyTorch prefill; then a decode step (fused advance) captured in a CUDA graph and
    replayed over every cursor phase matches the float64 layer step by step."""
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg, n, L = CONFIGS["gva"], 3, 3
    w = lh.random_weights(cfg, 2)
    plain = lh.PlainKDALayer(w, cfg)
    pool = ReplaySSMStatePool(cfg.heads, num_layers=1, num_slots=4, ring_length=L, cache_dtype=torch.float32,
                              conv_kernel_size=4, device=dev)
    layer = TPKimiDeltaAttention.from_state_dict(w, cfg, pool=pool, layer_idx=0, prefill_backend="torch")
    slots = pool.alloc(n)
    g = torch.Generator().manual_seed(0)
    states = [plain.new_state() for _ in range(n)]
    x = torch.randn(12, 64, generator=g)
    cu = [0, 4, 5, 12]
    y = layer(x.to(dev), slots, torch.tensor(cu, dtype=torch.int32, device=dev), advance=True)
    want = torch.cat([torch.stack([plain.step(t, states[i]) for t in x[cu[i]:cu[i + 1]]]) for i in range(n)])
    assert lh.rel(y, want) < GPU_TOL
    static_x = torch.zeros(n, 64, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up of the captured call (compiles the kernels); its effects are undone
        layer(static_x, slots, advance=True)
    torch.cuda.current_stream().wait_stream(side)
    pool.load_state(0, slots, torch.stack([s["S"].float() for s in states]).to(dev),
                    conv_states=torch.stack([s["window"].float() for s in states]).to(dev))
    pool.cursors[slots.long()] = 0
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x, slots, advance=True)
    for step in range(2 * L):
        xs = torch.randn(n, 64, generator=g)
        static_x.copy_(xs)
        graph.replay()
        want = torch.stack([plain.step(xs[i], states[i]) for i in range(n)])
        assert lh.rel(static_y, want) < GPU_TOL, step
    pool.check()
