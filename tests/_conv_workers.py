"""Worker functions of the conv state's distributed tests (run on every rank by ``_dist_helpers.run_ranks``).

They live in their own module (importable by the spawned ranks as ``_conv_workers``) so the conv tests add nothing
to the shared harness.
"""

from __future__ import annotations

from typing import Any

import torch

NL, S, L = 2, 5, 3


def conv_tp_equivalence(rank: int, world: int, H: int, HV: int, K: int, V: int, W: int) -> dict[str, Any]:
    """Every rank runs the pool's conv on its shard of the same global inputs (drawn on the CPU with one seed, sliced
    with :class:`~tp_replayssm.tp.heads.HeadShard`'s slicers: weights ``[D, 1, W]`` as an ``nn.Conv1d`` holds them,
    bias, prefill windows), over three calls (T = 1, T = 3, T = 1) with a padding row; each rank gathers every rank's
    outputs and windows and reassembles the global ones with :func:`~tp_replayssm.tp.heads.concat_qkv`. Also a decode
    step with the conv (``pool.decode(conv_weight=, conv_bias=)``): its gathered outputs against a single-rank pool's.

    Returns the largest differences (outputs, windows, decode outputs) from a single-rank pool holding every head,
    driven with the global tensors, and whether padding rows were exactly zero."""
    import torch.distributed as dist

    from tp_replayssm import KDAHeads, ReplaySSMStatePool, concat_outputs
    from tp_replayssm.testing import random_decode_inputs, random_head_params
    from tp_replayssm.tp.heads import concat_qkv

    heads = KDAHeads(H, HV, K, V)
    kw = dict(num_layers=NL, num_slots=S, ring_length=L, cache_dtype=torch.float32, conv_kernel_size=W)
    pool = ReplaySSMStatePool(heads, group=dist.group.WORLD, **kw)
    single = ReplaySSMStatePool(heads, device="cpu", **kw)  # every head, one rank (no group)
    shard = pool.shard
    D = heads.qkv_width
    gen = torch.Generator().manual_seed(2024)  # the same draws on every rank
    weight = torch.randn(D, 1, W, generator=gen) * 0.5
    bias = torch.randn(D, generator=gen) * 0.1
    windows = torch.randn(2, D, W - 1, generator=gen)
    ids, ids1 = pool.alloc(2), single.alloc(2)
    layer = 1
    for p, ws in ((pool, shard.slice_conv_state(windows)), (single, windows)):
        states = torch.zeros(2, p.local_heads.num_v_heads, V, K)
        p.load_state(layer, ids if p is pool else ids1, states, conv_states=ws)
    slots = torch.tensor([int(ids[0]), -1, int(ids[1])], dtype=torch.int32)
    w_local, b_local = shard.slice_conv_weight(weight), shard.slice_conv_bias(bias)

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return parts

    err_y = err_win = err_dec = 0.0
    padding_zero = True
    for T in (1, 3, 1):
        x = torch.randn(3, T, D, generator=gen)
        x_in = x[:, 0] if T == 1 else x
        y = pool.conv_update(layer, shard.slice_mixed_qkv(x_in), w_local, slots, bias=b_local)
        want = single.conv_update(layer, x_in, weight[:, 0], slots, bias=bias)
        got = concat_qkv(heads, gather(y))
        err_y = max(err_y, float((got - want).abs().max()))
        padding_zero &= bool((got[1] == 0).all())
        live = torch.tensor([int(ids[0]), int(ids[1])], dtype=torch.int32)
        win = concat_qkv(heads, gather(pool.read_conv_state(layer, live)), dim=1)
        err_win = max(err_win, float((win - single.read_conv_state(layer, ids1)).abs().max()))
    # a decode step with the conv: the pool's q/k/v of each rank come out of its own conv
    params = random_head_params(HV, K, generator=gen)
    inp = random_decode_inputs(3, H, HV, K, V, dtype=torch.float32, generator=gen)
    out = pool.decode(layer, shard.slice_mixed_qkv(inp.mixed_qkv), shard.slice_a(inp.a), shard.slice_b(inp.b),
                      shard.slice_A_log(params.A_log), shard.slice_dt_bias(params.dt_bias), slots,
                      conv_weight=w_local, conv_bias=b_local)
    want = single.decode(layer, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, slots,
                         conv_weight=weight[:, 0], conv_bias=bias)
    err_dec = float((concat_outputs(gather(out)) - want).abs().max())
    pool.check()
    return dict(err_y=err_y, err_win=err_win, err_dec=err_dec, padding_zero=padding_zero,
                D_local=pool.conv_channels, q_heads=list(shard.q_heads))


def conv_fingerprint_fault(rank: int, world: int) -> str | None:
    """Every rank builds a pool with a conv state; the last rank's ``conv_kernel_size`` (or, second, its
    ``conv_dtype``) disagrees. Returns the two ``PlacementError`` texts joined (None where a build passed)."""
    import torch.distributed as dist

    from tp_replayssm import KDAHeads, PlacementError, ReplaySSMStatePool

    texts = []
    heads = KDAHeads(2, 4, 16, 16)
    bad = rank == world - 1
    for over in ({"conv_kernel_size": 3 if bad else 4}, {"conv_kernel_size": 4,
                                                          "conv_dtype": torch.float32 if bad else None}):
        try:
            ReplaySSMStatePool(heads, num_layers=1, num_slots=2, ring_length=2, group=dist.group.WORLD, **over)
            texts.append("no error")
        except PlacementError as exc:
            texts.append(str(exc))
    return "\n====\n".join(texts)
