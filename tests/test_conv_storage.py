"""The conv window's storage in the pool: alloc zeroes it, ``load_state``/``read_conv_state`` round trips and their
errors, ``conv_update``'s argument errors, and the memory accounting of the window.
"""

from __future__ import annotations

import pytest
import torch

from _conv_helpers import D, H, HV, K, S, SENTINEL, V, conv_params, i32, make_pool, random_windows
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError


# ---- storage: alloc, load/read, memory, errors --------------------------------------------------


def test_alloc_zeroes_the_window_in_every_layer() -> None:
    pool = make_pool(4)
    random_windows(pool, [2], seed=3)
    pool.free([2])
    ids = pool.alloc(pool.num_free)  # every free slot, 2 among them
    assert 2 in ids.tolist()
    assert (pool.conv_state[:, ids.long()] == 0).all()
    assert (pool.conv_state[:, S] == SENTINEL).all()  # the scratch window is never zeroed or written


def test_load_and_read_conv_state_round_trip() -> None:
    pool = make_pool(4, conv_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    win = torch.randn(2, D, 3, generator=gen)
    ids = i32([3, 0])
    snapshot = pool.conv_state.clone()
    pool.load_state(1, ids, torch.zeros(2, HV, V, K), conv_states=win)
    back = pool.read_conv_state(1, ids)
    assert back.shape == (2, D, 3) and back.dtype == torch.bfloat16
    assert torch.equal(back, win.bfloat16())
    snapshot[1, [3, 0]] = win.bfloat16()
    assert torch.equal(pool.conv_state, snapshot)  # nothing else changed
    pool.load_state(1, ids, torch.zeros(2, HV, V, K))  # without conv_states: the windows stay
    assert torch.equal(pool.read_conv_state(1, ids), win.bfloat16())
    assert torch.equal(pool.read_conv_state(1, ids.long()), back)


def test_load_and_read_conv_state_errors() -> None:
    pool = make_pool(4)
    ids = i32([0, 2])
    states = torch.zeros(2, HV, V, K)
    snapshot = pool.conv_state.clone()
    for bad, what in ((torch.zeros(2, D, 4), r"\[n, D, W-1\] = \[2, 64, 3\]"),
                      (torch.zeros(2, D - 1, 3), "shape"), (torch.zeros(3, D, 3), "shape"),
                      (torch.zeros(2, D, 3, dtype=torch.int32), "dtype torch.int32"),
                      (torch.zeros(2, D, 3, device="meta"), "device meta")):
        with pytest.raises(ValueError, match=f"load_state: `conv_states` must be .*{what}"):
            pool.load_state(0, ids, states, conv_states=bad)
    assert torch.equal(pool.conv_state, snapshot)
    with pytest.raises(SlotError, match=r"read_conv_state: slots out of range .*\[1\]"):
        pool.read_conv_state(0, i32([0, 1]))
    with pytest.raises(ValueError, match="`slots` must be a 1-D"):
        pool.read_conv_state(0, torch.tensor([0.0]))
    plain = ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=1, num_slots=2, ring_length=2, device="cpu")
    plain.alloc(2)
    with pytest.raises(ValueError, match="read_conv_state: this pool holds no conv state"):
        plain.read_conv_state(0, i32([0]))
    with pytest.raises(ValueError, match="`conv_states` given but this pool holds no conv state"):
        plain.load_state(0, i32([0, 1]), torch.zeros(2, HV, V, K), conv_states=torch.zeros(2, D, 3))
    with pytest.raises(ValueError, match="conv_update.*holds no conv state"):
        plain.conv_update(0, torch.zeros(2, D), torch.zeros(D, 4), i32([0, 1]))


def test_conv_update_argument_errors() -> None:
    pool = make_pool(4)
    snapshot = pool.conv_state.clone()
    weight, bias = conv_params(4, seed=1)
    slots = i32([0, 2])
    cases = [
        (dict(x=torch.zeros(2, D + 1)), r"`x` must be \[B, D\] or \[B, T, D\] with T >= 1 and D = 64"),
        (dict(x=torch.zeros(2, 0, D)), "with T >= 1"),
        (dict(x=torch.zeros(2, D, dtype=torch.int64)), "`x`"),
        (dict(weight=torch.zeros(D, 3)), r"`weight` must .*\[64, 4\]"),
        (dict(weight=torch.zeros(D, 4, dtype=torch.int32)), "`weight`"),
        (dict(bias=torch.zeros(D + 2)), r"`bias` must .*\[64\]"),
        (dict(activation="gelu"), "`activation` must be one of"),
        (dict(slots=i32([0])), "`slots` must have one id per row of `x`"),
        (dict(slots=torch.tensor([0, 2])), "`slots` must be a 1-D torch.int32"),
        (dict(layer=2), r"`layer` must be an int in \[0, num_layers=2\)"),
    ]
    for over, match in cases:
        kw = {**dict(layer=0, x=torch.zeros(2, D), weight=weight, slots=slots, bias=bias, activation="silu"), **over}
        with pytest.raises(ValueError, match=match):
            pool.conv_update(kw.pop("layer"), kw.pop("x"), kw.pop("weight"), kw.pop("slots"), **kw)
    assert torch.equal(pool.conv_state, snapshot)
    with pytest.raises(ValueError, match="conv_kernel_size"):
        ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=1, num_slots=1, ring_length=1, conv_kernel_size=-1)
    with pytest.raises(ValueError, match="conv_dtype"):
        ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=1, num_slots=1, ring_length=1, conv_kernel_size=4,
                           conv_dtype=torch.int8)


@pytest.mark.parametrize("W,conv_dtype", [(4, torch.bfloat16), (2, torch.float32), (1, None), (0, None)])
def test_memory_accounting_includes_the_window(W: int, conv_dtype: torch.dtype | None) -> None:
    pool = ReplaySSMStatePool(KDAHeads(2, 4, 16, 8), num_layers=3, num_slots=5, ring_length=4, device="cpu",
                              conv_kernel_size=W, conv_dtype=conv_dtype)
    m = pool.memory
    element = (conv_dtype or pool.cache_dtype).itemsize
    assert m.conv_per_slot_layer == (pool.conv_channels * (W - 1) * element if W else 0)
    owned = [pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache, pool.cursors, pool.slot_errors]
    if W:
        owned.append(pool.conv_state)
        assert pool.conv_state.shape == (3, 6, pool.conv_channels, W - 1)
    else:
        assert pool.conv_state is None
    assert m.total == sum(t.numel() * t.element_size() for t in owned)
    assert pool.fingerprint.conv_kernel_size == W
