"""``tp_replayssm.layers.TPKimiDeltaAttention`` against an independent float64 reimplementation of the KDA layer,
at tp 1, 2 and 4: in one process (one pool per rank, no group: the partial sums add up) and on gloo ranks (the layer
all-reduces). Scenarios: packed prefills of several prompt lengths, chunked prefill (a prompt's second piece after a
decode, continuing a state with ring entries), decode steps with a padding row and a forced flush, cursors moved by
the fused advance or by ``pool.advance`` / ``end_prefill``; a prefill leaves the rings empty and the cursor 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import _dist_helpers as dh
import _layer_helpers as lh
from _layer_case_helpers import CONFIGS, TOL, _alloc, _check_ranks, _expected_cursors, _pool
from tp_replayssm.layers import KDALayerConfig, TPKimiDeltaAttention


def _plain_run(cfg: KDALayerConfig, weights: list[dict], calls: list[lh.Call], n: int):  # noqa: ANN202
    return [lh.plain_outputs(lh.PlainKDALayer(w, cfg), calls, n) for w in weights]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", ["gva", "kv", "noconv-lb"])
def test_layer_matches_plain(name: str, tp: int) -> None:
    """Two layers in one pool, one pool per rank: every output (summed over the ranks' partial sums), every state
    (read_state of the ranks, concatenated) and conv window (each rank's channels) equal the float64 layer; the
    cursors are 0 after each prefill step and move once per decode step. The fused advance at tp 2, pool.advance /
    end_prefill otherwise."""
    cfg = CONFIGS[name]
    if cfg.num_v_heads % tp or (cfg.num_heads % tp and tp % cfg.num_heads):
        pytest.skip("not a valid sharding")
    L, n = 3, 3
    weights = [lh.random_weights(cfg, seed) for seed in (10, 11)]
    calls = lh.scenario(cfg.hidden_size, 5, first=[5, 1, 9], second=[3, 19, 2], order2=[[2, 0], [1]],
                        decodes_between=2, decodes_after=3)
    expected = _plain_run(cfg, weights, calls, n)
    ranks, slot_of = [], None
    for r in range(tp):
        pool = _pool(cfg, r, tp, layers=2, ring_length=L)
        layers = [TPKimiDeltaAttention.from_state_dict(w, cfg, pool=pool, layer_idx=i) for i, w in enumerate(weights)]
        ids = _alloc(pool, n)
        assert slot_of is None or ids == slot_of
        slot_of = ids
        ranks.append((pool, layers))
    outs = lh.run_ours(ranks, calls, slot_of, fused=tp == 2)
    for li in range(2):
        for c, (got, want) in enumerate(zip(outs[li], expected[li][0])):
            assert lh.rel(got, want) < TOL, (li, c, calls[c].kind, lh.rel(got, want))
            for r, s in enumerate(calls[c].seqs):
                if s is None:
                    assert bool((got[r] == 0).all()), "a padding row's output is not zero"
    idx = torch.tensor(slot_of, dtype=torch.int32)
    for li in range(2):
        states = torch.cat([pool.read_state(li, idx) for pool, _ in ranks], dim=1)
        want = torch.stack([st["S"] for st in expected[li][1]])
        assert lh.rel(states, want) < TOL
        if cfg.conv_size:
            for pool, _ in ranks:
                glob = torch.stack([st["window"] for st in expected[li][1]])  # [n, D, W-1]
                mine = pool.shard.slice_mixed_qkv(glob.transpose(1, 2)).transpose(1, 2)
                assert lh.rel(pool.read_conv_state(li, idx), mine) < TOL
    want_cur = _expected_cursors(calls, n, L)
    for pool, _ in ranks:
        assert pool.cursors[idx.long()].tolist() == want_cur
        pool.check()


def test_prefill_leaves_ring_empty_and_cursor_zero() -> None:
    """After decode steps (ring entries, cursor 2), a prefill of every layer leaves each layer's ring zero and the
    checkpoint equal to the true state; the cursor stays until the last layer's advance=True sets it to 0, and
    read_state is unchanged by that."""
    cfg = CONFIGS["kv"]
    pool = _pool(cfg, 0, 1, layers=2, ring_length=4)
    layers = [TPKimiDeltaAttention.from_state_dict(lh.random_weights(cfg, s), cfg, pool=pool, layer_idx=i)
              for i, s in enumerate((1, 2))]
    slots = pool.alloc(2)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(2, 64, generator=g)
        for i, layer in enumerate(layers):
            layer(x, slots, advance=i == 1)
    assert pool.cursors[slots.long()].tolist() == [2, 2]
    x = torch.randn(7, 64, generator=g)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    layers[0](x, slots, cu)
    assert pool.cursors[slots.long()].tolist() == [2, 2], "the first layer's prefill must keep the shared cursor"
    before = pool.read_state(1, slots)
    layers[1](x, slots, cu, advance=True)
    assert pool.cursors[slots.long()].tolist() == [0, 0]
    for i in range(2):
        v = pool.layer(i)
        for ring in (v.d_cache, v.k_cache, v.g_cache):
            assert bool((ring[slots.long()] == 0).all())
        assert torch.equal(pool.read_state(i, slots), v.checkpoint[slots.long()].float())
    assert not torch.equal(before, pool.read_state(1, slots))


@pytest.mark.parametrize("name", ["kv", "noconv-lb"])
def test_prefill_of_no_sequence_returns_an_empty_output_and_writes_nothing(name: str) -> None:
    """``cu_seqlens = [0]`` (n = 0 sequences, no slots, no tokens; with and without the conv), as ``[0, hidden]``
    and ``[1, 0, hidden]``, with and without advance: an empty output of the input's shape, no byte of the pool
    changed."""
    cfg = CONFIGS[name]
    pool = _pool(cfg, 0, 1, layers=1, ring_length=4)
    layer = TPKimiDeltaAttention.from_state_dict(lh.random_weights(cfg, 3), cfg, pool=pool, layer_idx=0)
    slots = pool.alloc(2)
    layer(torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(1)), slots, advance=True)
    names = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "conv_state")
    before = {n: getattr(pool, n).clone() for n in names if getattr(pool, n) is not None}
    none, cu = torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for shape in ((0, cfg.hidden_size), (1, 0, cfg.hidden_size)):
        for advance in (False, True):
            y = layer(torch.zeros(shape), none, cu, advance=advance)
            assert y.shape == shape and y.dtype == torch.float32
    for n, t in before.items():
        assert torch.equal(getattr(pool, n), t), n


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_matches_plain(tmp_path: Path, world: int) -> None:
    """On gloo ranks each rank's all-reduced output equals the float64 layer (the fused advance)."""
    cfg, n = CONFIGS["gva"], 3
    weights = lh.random_weights(cfg, 21)
    calls = lh.scenario(cfg.hidden_size, 6, first=[5, 1, 9], second=[3, 18, 2], order2=[[2, 0], [1]])
    expected, _ = lh.plain_outputs(lh.PlainKDALayer(weights, cfg), calls, n)
    results = dh.run_ranks(lh.tp_worker, world, tmp_path, cfg, weights, calls, n, expected, True, timeout_s=200)
    _check_ranks(results, cfg, world, calls, n)
