"""The conv state's sharding: the slicers of weights, biases and windows against ``mixed_qkv``'s columns, gloo ranks
whose conv and decode with the conv reassemble to a single-rank pool's (workers in ``_conv_workers``), a conv
fingerprint disagreement, and ``launch/decode.py --conv-size``.
"""

from __future__ import annotations

import pytest
import torch

import _dist_helpers as h
from tp_replayssm import KDAHeads, shard_heads
from tp_replayssm.tp.heads import concat_qkv


# ---- sharding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("Hq,Hv,tp", [(2, 4, 2), (2, 8, 4), (4, 8, 4), (1, 2, 2)])
def test_conv_slicers_follow_mixed_qkv_columns(Hq: int, Hv: int, tp: int) -> None:
    """Weights ``[D, W]`` or ``[D, 1, W]``, biases and windows are sliced like ``mixed_qkv``'s columns (replicated
    q/k heads included), and :func:`concat_qkv` reassembles every rank's slices."""
    heads = KDAHeads(Hq, Hv, 3, 5)
    Dg = heads.qkv_width
    gen = torch.Generator().manual_seed(tp)
    cols = torch.arange(Dg, dtype=torch.float64)
    weight, windows = torch.randn(Dg, 1, 4, generator=gen), torch.randn(2, Dg, 3, generator=gen)
    parts = {"y": [], "w": [], "win": []}
    for t in range(tp):
        shard = shard_heads(heads, tp, t)
        mine = shard.slice_mixed_qkv(cols)
        assert torch.equal(shard.slice_conv_weight(weight)[:, 0], weight[mine.long(), 0, 0])
        assert torch.equal(shard.slice_conv_weight(weight[:, 0]), shard.slice_conv_weight(weight))
        assert torch.equal(shard.slice_conv_bias(cols), mine)
        assert torch.equal(shard.slice_conv_state(windows), windows[:, mine.long()])
        parts["y"].append(mine[None])
        parts["w"].append(shard.slice_conv_weight(weight))
        parts["win"].append(shard.slice_conv_state(windows))
    assert torch.equal(concat_qkv(heads, parts["y"]), cols[None])
    assert torch.equal(concat_qkv(heads, parts["w"], dim=0), weight[:, 0])
    assert torch.equal(concat_qkv(heads, parts["win"], dim=1), windows)


def test_conv_slicer_errors() -> None:
    heads = KDAHeads(2, 4, 3, 5)  # D = 32 global, 16 per rank at tp = 2
    shard = shard_heads(heads, 2, 1)
    for bad in (torch.zeros(31, 4), torch.zeros(32, 2, 4), torch.zeros(32), torch.zeros(32, 0)):
        with pytest.raises(ValueError, match=r"slice_conv_weight: `weight` must be .*\[32, W\]"):
            shard.slice_conv_weight(bad)
    with pytest.raises(ValueError, match=r"slice_conv_bias: `bias` must be .*\[32\]"):
        shard.slice_conv_bias(torch.zeros(32, 1))
    with pytest.raises(ValueError, match=r"slice_conv_state: `states` must be .*\[n, 32, W-1\]"):
        shard.slice_conv_state(torch.zeros(2, 31, 3))
    with pytest.raises(ValueError, match="rank 1's part must have 16 channels"):
        concat_qkv(heads, [torch.zeros(1, 16), torch.zeros(1, 15)])
    with pytest.raises(ValueError, match="one tensor per rank"):
        concat_qkv(heads, [])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,Hq,Hv", [(2, 2, 4), (2, 1, 4), (4, 2, 8)])
def test_tp_equivalence(tmp_path, world: int, Hq: int, Hv: int) -> None:  # noqa: ANN001
    """gloo ranks, each with its shard of the heads (``(4, 2, 8)`` and ``(2, 1, 4)`` replicate the q/k heads): every
    rank's conv outputs and windows reassemble to a single-rank pool's, and so do the decode outputs with the conv."""
    import _conv_workers

    results = h.run_ranks(_conv_workers.conv_tp_equivalence, world, tmp_path, Hq, Hv, 8, 8, 4, timeout_s=180)
    for r, res in enumerate(results):
        assert res["err_y"] <= 1e-6 and res["err_win"] == 0.0 and res["err_dec"] <= 1e-5, (r, res)
        assert res["padding_zero"], r
        assert res["D_local"] == 2 * max(1, Hq // world) * 8 + Hv // world * 8
    if world > Hq:  # replicated q/k heads: rank t holds head t*H // tp
        assert [res["q_heads"] for res in results] == [[t * Hq // world] for t in range(world)]


@pytest.mark.timeout(200)
def test_conv_fingerprint_disagreement_is_a_placement_error(tmp_path) -> None:  # noqa: ANN001
    import _conv_workers

    texts = h.run_ranks(_conv_workers.conv_fingerprint_fault, 2, tmp_path, timeout_s=120)
    assert texts[0] == texts[1], texts  # the same text on every rank
    size, dtype = texts[0].split("\n====\n")
    assert "conv_kernel_size=3 (rank 0: 4)" in size and "offending rank(s): 1" in size, size
    assert "conv_dtype='torch.float32' (rank 0: 'torch.bfloat16')" in dtype and "offending rank(s): 1" in dtype, dtype


@pytest.mark.timeout(200)
def test_launcher_runs_the_conv_and_checks_its_window() -> None:
    """``launch/decode.py --conv-size 2`` on two gloo ranks: the layers pass pre-conv q/k/v and their conv weights to
    ``pool.decode``, and the oracle (conv in float64 from the window read before each step) agrees."""
    from test_launcher import _torchrun

    run = _torchrun("--steps", "3", "--batch", "3", "--seed", "2", "--conv-size", "2", "--ring-layout", "sglang")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "conv W=2 (window in the pool)" in out and "RESULT: OK" in out, out[-4000:]
    assert "conv window 128 B" in out, out[-4000:]  # the pool's memory line: D_l = 2*16 + 2*16 channels, bf16
