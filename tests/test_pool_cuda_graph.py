"""ReplaySSMStatePool in a CUDA graph (``gpu`` marker): a captured model step replayed over more than one ring cycle
matches eager execution bitwise, in the step scenarios of tests/test_pool.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _pool_helpers import STEP_CASES
from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.testing import random_decode_inputs, random_head_params


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@STEP_CASES
def test_cuda_graph_step_matches_eager_bitwise(layout, lower_bound, A_log_shift, fused):
    """Capture one full model step (every layer's decode + advance) for a fixed batch, replay it over
    more than one full ring cycle with fresh inputs each step, and match eager execution bitwise (both
    ring layouts). ``fused``: the captured step's last decode moves the cursors (``advance=True``), the eager
    one calls ``advance``; the scratch entry of padding rows is the one difference allowed."""
    heads, NL, ring, Bg = KDAHeads(2, 8, 128, 128), 3, 4, 6
    dev = torch.device("cuda", torch.cuda.current_device())
    pools = [ReplaySSMStatePool(heads, num_layers=NL, num_slots=8, ring_length=ring, device=dev, debug=False,
                                ring_layout=layout) for _ in range(2)]
    ids = [pool.alloc(5) for pool in pools]
    assert torch.equal(ids[0], ids[1])
    rows = ids[0].tolist()
    slots = torch.tensor([rows[0], -1, rows[1], rows[2], rows[3], rows[4]], dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(0)
    params = [random_head_params(8, 128, device=dev, generator=gen) for _ in range(NL)]
    params = [dataclasses.replace(p, A_log=p.A_log + A_log_shift) for p in params]
    n_steps = 2 * ring + 2
    steps = []
    for i in range(n_steps + 1):
        layer_inputs = [random_decode_inputs(Bg, 2, 8, 128, 128, device=dev, generator=gen) for _ in range(NL)]
        flags = torch.tensor([1 if (i % 3 == 1 and b == 2) else 0 for b in range(Bg)], dtype=torch.int32, device=dev)
        steps.append((layer_inputs, flags))

    static_in = [random_decode_inputs(Bg, 2, 8, 128, 128, device=dev) for _ in range(NL)]
    static_flags = torch.zeros(Bg, dtype=torch.int32, device=dev)
    static_out = [torch.empty(Bg, 1, 8, 128, dtype=torch.bfloat16, device=dev) for _ in range(NL)]

    def load(i):
        for layer in range(NL):
            for dst, src in zip((static_in[layer].mixed_qkv, static_in[layer].a, static_in[layer].b),
                                (steps[i][0][layer].mixed_qkv, steps[i][0][layer].a, steps[i][0][layer].b)):
                dst.copy_(src)
        static_flags.copy_(steps[i][1])

    def model_step(pool, inputs, flags, outs):
        fuse = fused and pool is pools[0]
        for layer in range(NL):
            pool.decode(layer, inputs[layer].mixed_qkv, inputs[layer].a, inputs[layer].b, params[layer].A_log,
                        params[layer].dt_bias, slots, force_flush=flags, out=outs[layer], lower_bound=lower_bound,
                        advance=fuse and layer == NL - 1)
        if not fuse:
            pool.advance(slots, flags)

    eager_outs = [torch.empty_like(o) for o in static_out]
    # step 0 eagerly on both pools (compiles the kernel, runs the first-decode placement checks),
    # on a side stream as torch recommends before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        load(0)
        model_step(pools[0], static_in, static_flags, static_out)
        model_step(pools[1], steps[0][0], steps[0][1], eager_outs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model_step(pools[0], static_in, static_flags, static_out)
    for i in range(1, n_steps + 1):
        load(i)
        graph.replay()
        model_step(pools[1], steps[i][0], steps[i][1], eager_outs)
        torch.cuda.synchronize()
        for layer in range(NL):
            assert torch.equal(static_out[layer], eager_outs[layer]), (i, layer)
        assert torch.equal(pools[0].cursors[:8], pools[1].cursors[:8]), i  # [S + 1]: entry S is the scratch
    assert n_steps > ring  # more than one full ring cycle
    for name in ("checkpoint", "d_cache", "k_cache", "g_cache"):
        assert torch.equal(getattr(pools[0], name), getattr(pools[1], name)), name
    assert fused or torch.equal(pools[0].cursors, pools[1].cursors)
