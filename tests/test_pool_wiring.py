"""How ReplaySSMStatePool wires its decode: one op call on the layer's views with the pool's cursor table, and the
collective placement checks at construction, at each layer's first decode and at ``verify_placement()``.
"""

from __future__ import annotations

import pytest
import torch

from _pool_helpers import B, S, i32, make_pool, params_for, small_inputs
from tp_replayssm import PlacementError
from tp_replayssm.pool import step as pool_module  # (the pool delegates its decode here)
from tp_replayssm.tp import placement


@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_decode_calls_the_op_with_layer_views_and_cursors(monkeypatch, layout):
    """The pool's decode is one ``run_decode`` call (the op's entry) on the layer's views, with the pool's cursor
    table read by slot (``cursor_table=True``) in the pool's ring layout."""
    pool = make_pool(num_layers=3, ring_layout=layout)
    live = pool.alloc(3)
    pool.cursors[live.long()] = i32([2, 0, 1])
    seen = {}
    real = pool_module.run_decode

    def spy(call, **kwargs):
        seen["call"], seen["kwargs"] = call, kwargs
        return real(call, **kwargs)

    monkeypatch.setattr(pool_module, "run_decode", spy)
    gen = torch.Generator().manual_seed(3)
    p = params_for(2, gen)
    inp = small_inputs(gen)
    slots = i32([int(live[1]), -1, int(live[0]), int(live[2])])
    ckpt_before = pool.checkpoint.clone()
    out = pool.decode(2, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
    call = seen["call"]
    views = (call.initial_state, call.d_cache, call.k_cache, call.g_cache)
    for got, whole in zip(views, (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache)):
        assert got.data_ptr() == whole[2].data_ptr() and got.shape == whole.shape[1:]
    assert call.out is out and call.ssm_state_indices is slots
    assert call.write_pos is pool.cursors  # the kernel reads each row's cursor by slot from the pool's table
    assert seen["kwargs"]["cursor_table"] is True and seen["kwargs"]["ring_layout"] == layout
    assert seen["kwargs"]["advance"] is False
    assert call.use_qk_l2norm_in_kernel is True
    assert out.dtype == inp.mixed_qkv.dtype
    # live[0] was at cursor L-1: only it flushed, into layer 2's checkpoint
    changed = (pool.checkpoint != ckpt_before).flatten(2).any(-1)
    assert changed.nonzero().tolist() == [[2, int(live[0])]]
    assert pool.cursors[live.long()].tolist() == [2, 0, 1]  # decode never moves cursors


def test_placement_checked_at_build_first_decode_per_layer_and_verify(monkeypatch):
    calls = []
    real = placement.collective_placement_check

    def spy(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(placement, "collective_placement_check", spy)
    pool = make_pool(num_layers=2)
    assert len(calls) == 1
    assert {"checkpoint", "d_cache", "k_cache", "g_cache", "cursors"} <= set(calls[0]["tensors"])
    assert calls[0]["group"] is None and calls[0]["require_current_device"] is False
    assert calls[0]["expected_device"] == pool.device and calls[0]["fingerprint"] == pool.fingerprint
    assert pool.fingerprint.num_slots == S and pool.fingerprint.tp_size == 1
    gen = torch.Generator().manual_seed(0)
    p = params_for(2, gen)
    inp = small_inputs(gen)
    slots = i32([-1, -1, -1, -1])  # padding only: cheap
    for layer in (0, 0, 1, 1, 0):
        pool.decode(layer, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
    assert len(calls) == 3  # once per layer
    names = set(calls[1]["tensors"])
    assert {"mixed_qkv", "a", "b", "A_log", "dt_bias", "slots", "out", "checkpoint", "d_cache"} <= names
    pool.verify_placement()
    assert len(calls) == 4 and "verify_placement" in calls[3]["context"]
    assert {"pool.checkpoint", "pool.d_cache", "pool.slot_errors"} <= names  # the pool's own beside the layer's views


def test_a_pool_tensor_assigned_after_construction_is_refused() -> None:
    """``pool.d_cache = ...`` after construction leaves the kernels' per-layer views on the old tensor (decode and
    verify would use one cache, fork/export/commit the other): the placement check names it, at a layer's first
    decode and at verify_placement(), before anything is written, even when the new tensor is on the pool's device."""
    pool = make_pool(num_layers=2)
    gen = torch.Generator().manual_seed(0)
    p = params_for(2, gen)
    inp = small_inputs(gen)
    slots = i32([-1, -1, -1, -1])
    pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
    original = pool.d_cache
    pool.d_cache = original.clone()
    with pytest.raises(PlacementError, match=r"pool\.d_cache replaced after construction .* build a new pool"):
        pool.verify_placement()
    with pytest.raises(PlacementError, match=r"(?s)decode\(layer=1\).*pool\.d_cache replaced"):
        pool.decode(1, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
    pool.d_cache = original
    pool.verify_placement()
    pool.decode(1, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)


def test_placement_error_on_first_decode_with_inputs_elsewhere():
    pool = make_pool(num_layers=1)
    p = params_for(2)
    inp = small_inputs(device="meta")
    with pytest.raises(PlacementError, match="mixed_qkv"):
        pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, i32([-1] * B))
