"""The pool's conv state: ``conv_update``, the decode with the conv, the window's storage, and its sharding.

The float64 oracles share no code with the library: :func:`conv1d_oracle` runs ``torch.nn.functional.conv1d``
(depthwise, causal by left zero padding) over a row's whole sequence, :func:`taps_oracle` sums the taps over a loaded
window explicitly. The PyTorch path (CPU tensors' default) runs every case; the Helion kernel runs one case per
kernel path in Triton's interpreter, and on the GPU (``gpu`` marker) against the PyTorch path. FLA's
``ShortConvolution`` is the peer where ``fla`` is importable.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import _dist_helpers as h
from _slot_cases import bad_slot_cases
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError, shard_heads
from tp_replayssm.kernels.backend import cpu_backend, use_cpu_backend
from tp_replayssm.pool.conv import conv_reference
from tp_replayssm.testing import random_decode_inputs, random_head_params
from tp_replayssm.tp.heads import concat_qkv

H, HV, K, V, L, S = 1, 2, 16, 16, 4, 6
D = 2 * H * K + HV * V  # 64 conv channels
SENTINEL = 1234.5  # windows no row names: they must come back bit-identical


# ---- oracles ------------------------------------------------------------------------------------


def conv1d_oracle(seq: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str | None) -> torch.Tensor:
    """``seq [B, N, D]`` from an empty (zero) window: ``conv1d`` with ``W-1`` zeros of left padding, float64."""
    W, N = weight.shape[1], seq.shape[1]
    y = F.conv1d(seq.double().transpose(1, 2), weight.double()[:, None, :],
                 None if bias is None else bias.double(), padding=W - 1, groups=weight.shape[0])[..., :N]
    y = y.transpose(1, 2)
    return y * torch.sigmoid(y) if activation == "silu" else y


def taps_oracle(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                activation: str | None) -> torch.Tensor:
    """``y [B, T, D]`` float64 by explicit sums over the taps of ``u = window, then x``."""
    B, T, _ = x.shape
    W = weight.shape[1]
    u = torch.cat([window.double(), x.double().transpose(1, 2)], dim=2)  # [B, D, W-1+T]
    y = torch.zeros(B, T, x.shape[2], dtype=torch.float64)
    for t in range(T):
        for i in range(W):
            y[:, t] += weight.double()[:, i] * u[:, :, t + i]
    if bias is not None:
        y += bias.double()
    return y * torch.sigmoid(y) if activation == "silu" else y


# ---- set-up -------------------------------------------------------------------------------------


def make_pool(W: int = 4, conv_dtype: torch.dtype = torch.float32, device: str = "cpu",
              **kw: object) -> ReplaySSMStatePool:
    """A pool with slots 0-3 allocated and slot 1 freed again (slots 1, 4, 5 free); every window, the scratch one
    included, holds SENTINEL except the allocated slots' (zeroed by alloc)."""
    pool = ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=2, num_slots=S, ring_length=L, device=device,
                              conv_kernel_size=W, conv_dtype=conv_dtype, **kw)
    if pool.conv_state is not None:
        pool.conv_state.fill_(SENTINEL)
    pool.alloc(4)
    pool.free([1])
    return pool


def random_windows(pool: ReplaySSMStatePool, slots: list[int], seed: int) -> None:
    """Random windows for ``slots`` in both layers (load_state)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(slots, dtype=torch.int32, device=pool.device)
    for layer in range(pool.num_layers):
        win = torch.randn(len(slots), pool.conv_channels, pool.conv_kernel_size - 1, generator=gen)
        pool.load_state(layer, ids, torch.zeros(len(slots), HV, V, K, device=pool.device),
                        conv_states=win.to(pool.device))


def conv_params(W: int, seed: int, with_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(D, W, generator=gen) * 0.5
    return weight, (torch.randn(D, generator=gen) * 0.2 if with_bias else None)


def i32(values: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---- the math -----------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_split_sequences_match_causal_conv1d(W: int, with_bias: bool, activation: str | None) -> None:
    """Rows decode a 7-token sequence from an empty window in calls of 2, 1 ([B, D]), 3 and 1 tokens: the outputs
    concatenate to conv1d with left zero padding (float64), the windows end as the last W-1 inputs, and the padding
    row stays zero."""
    pool = make_pool(W)
    weight, bias = conv_params(W, seed=W, with_bias=with_bias)
    slots = i32([2, -1, 0, 3])
    gen = torch.Generator().manual_seed(11)
    seq = torch.randn(4, 7, D, generator=gen)
    outs, t = [], 0
    for T, flat in ((2, False), (1, True), (3, False), (1, False)):
        x = seq[:, t] if flat else seq[:, t:t + T]
        y = pool.conv_update(1, x, weight, slots, bias=bias, activation=activation)
        assert y.shape == x.shape and y.dtype == x.dtype
        outs.append(y[:, None] if flat else y)
        t += T
    got = torch.cat(outs, dim=1)
    live = [0, 2, 3]
    want = conv1d_oracle(seq[live], weight, bias, activation)
    torch.testing.assert_close(got[live].double(), want, rtol=1e-5, atol=1e-5)
    assert (got[1] == 0).all()
    windows = pool.read_conv_state(1, i32([2, 0, 3]))
    assert torch.equal(windows, seq[live, 7 - (W - 1):].transpose(1, 2).to(pool.conv_dtype))
    pool.check()


@pytest.mark.parametrize("flat", [True, False])
def test_loaded_windows_bf16_match_explicit_taps(flat: bool) -> None:
    """bf16 inputs and windows on loaded (random) windows: outputs against the explicit float64 taps (one bf16
    rounding of y), and the new window holds the inputs exactly (bf16 in, bf16 window)."""
    W = 4
    pool = make_pool(W, conv_dtype=torch.bfloat16)
    random_windows(pool, [0, 2, 3], seed=5)
    weight, bias = conv_params(W, seed=6)
    slots = i32([3, 0, 2])
    before = pool.read_conv_state(0, slots)
    T = 1 if flat else 3
    x = torch.randn(3, T, D, generator=torch.Generator().manual_seed(7)).bfloat16()
    y = pool.conv_update(0, x[:, 0] if flat else x, weight, slots, bias=bias)
    y3 = y[:, None] if flat else y
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y3.double(), taps_oracle(x, before, weight, bias, "silu"), rtol=1e-2, atol=1e-2)
    u = torch.cat([before, x.transpose(1, 2)], dim=2)
    assert torch.equal(pool.read_conv_state(0, slots), u[:, :, -(W - 1):])


def test_reference_matches_the_oracles() -> None:
    """:func:`conv_reference` itself against both oracles (fp32 in, float64 oracles)."""
    gen = torch.Generator().manual_seed(3)
    x, win = torch.randn(3, 5, D, generator=gen), torch.randn(3, D, 3, generator=gen)
    weight, bias = conv_params(4, seed=3)
    y, new = conv_reference(x, win, weight, bias, "silu")
    torch.testing.assert_close(y.double(), taps_oracle(x, win, weight, bias, "silu"), rtol=1e-5, atol=1e-5)
    assert torch.equal(new, torch.cat([win, x.transpose(1, 2)], 2)[:, :, -3:])
    y0, _ = conv_reference(x, torch.zeros(3, D, 3), weight, None, None)
    torch.testing.assert_close(y0.double(), conv1d_oracle(x, weight, None, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("W", [2, 4])
def test_tokens_at_once_equal_single_token_calls_bitwise(W: int) -> None:
    """fp32 on the PyTorch path: T tokens in one call give the bits of T one-token calls (outputs and windows)."""
    a, b = make_pool(W), make_pool(W)
    random_windows(a, [0, 2, 3], seed=1)
    random_windows(b, [0, 2, 3], seed=1)
    weight, bias = conv_params(W, seed=2)
    slots = i32([0, 3, -1, 2])
    x = torch.randn(4, 5, D, generator=torch.Generator().manual_seed(4))
    y_all = a.conv_update(1, x, weight, slots, bias=bias)
    y_one = torch.stack([b.conv_update(1, x[:, t], weight, slots, bias=bias) for t in range(5)], dim=1)
    assert torch.equal(y_all, y_one)
    assert torch.equal(a.conv_state, b.conv_state)


def test_padding_rows_unused_slots_and_scratch_stay_bit_identical() -> None:
    pool = make_pool(4)
    random_windows(pool, [0, 2, 3], seed=8)
    snapshot = pool.conv_state.clone()
    weight, bias = conv_params(4, seed=9)
    y = pool.conv_update(0, torch.randn(4, 2, D), weight, i32([-1, 2, -7, -1]), bias=bias)
    assert (y[[0, 2, 3]] == 0).all() and (y[1] != 0).any()
    changed = (pool.conv_state != snapshot).flatten(2).any(-1)  # [NL, S + 1]
    assert changed.nonzero().tolist() == [[0, 2]], "only layer 0's window of slot 2 may change"
    assert (pool.conv_state[:, [4, 5, S]] == SENTINEL).all()  # never-allocated slots and the scratch window
    assert (pool.conv_state[:, 1] == 0).all()  # freed after alloc zeroed it
    pool.check()


# ---- slot safety --------------------------------------------------------------------------------

BAD = {**bad_slot_cases(S), "all": ([0, S, 4, 1, 3, 3, 2, -1], [1, 2, 3, 4, 5])}  # slots of one call -> bad rows


def run_bad_case(case: str, T: int, conv_dtype: torch.dtype = torch.float32) -> None:
    """The call with bad rows on one pool and the same call with those rows made padding (-1) on a twin: outputs
    and every window equal bit for bit, bad rows zero, and check() names conv_update, the layer, rows and slots."""
    slots, bad_rows = BAD[case]
    pool, twin = make_pool(4, conv_dtype), make_pool(4, conv_dtype)
    for p in (pool, twin):
        random_windows(p, [0, 2, 3], seed=12)
    weight, bias = conv_params(4, seed=13)
    x = torch.randn(len(slots), T, D, generator=torch.Generator().manual_seed(14)).to(
        torch.bfloat16 if conv_dtype == torch.bfloat16 else torch.float32)
    clean = [-1 if i in bad_rows else s for i, s in enumerate(slots)]
    y = pool.conv_update(1, x, weight, i32(slots), bias=bias)
    with use_cpu_backend("torch"):  # the twin on the PyTorch path (the bits of a clean call)
        expect = twin.conv_update(1, x, weight, i32(clean), bias=bias)
    if cpu_backend() == "torch":  # the same path: the same bits
        assert torch.equal(y, expect)
    else:  # the kernel (interpreter): its own rounding of y; the windows still match bit for bit
        torch.testing.assert_close(y.double(), expect.double(), rtol=1e-2, atol=1e-2)
    for r in bad_rows:
        assert (y[r] == 0).all(), f"bad row {r} is not zero"
    assert torch.equal(pool.conv_state, twin.conv_state), "a bad row wrote a window"
    assert torch.equal(pool.cursors, twin.cursors)
    twin.check()
    if not bad_rows:
        pool.check()
        return
    with pytest.raises(SlotError) as info:
        pool.check()
    msg = str(info.value)
    assert "ReplaySSMStatePool.conv_update(layer=1)" in msg and f"{len(bad_rows)} row(s)" in msg, msg
    for r in bad_rows:
        assert f"row {r} slot {slots[r]}" in msg, msg
    pool.check()  # cleared


@pytest.mark.parametrize("case", list(BAD))
def test_bad_slots_are_padding_rows_and_reported(case: str) -> None:
    run_bad_case(case, T=2)


def test_debug_mode_raises_at_the_call() -> None:
    pool = make_pool(4, debug=True)
    snapshot = pool.conv_state.clone()
    weight, _ = conv_params(4, seed=1)
    with pytest.raises(SlotError, match=r"conv_update\(layer=0\) \(debug check\): slots out of range.*\[4\]"):
        pool.conv_update(0, torch.randn(2, D), weight, i32([4, 0]))
    with pytest.raises(SlotError, match="given more than once"):
        pool.conv_update(0, torch.randn(2, D), weight, i32([3, 3]))
    assert torch.equal(pool.conv_state, snapshot)


# ---- decode with the conv -----------------------------------------------------------------------


def decode_pair(device: str = "cpu", W: int = 4) -> tuple[ReplaySSMStatePool, ReplaySSMStatePool, object]:
    pools = []
    for _ in range(2):
        p = make_pool(W, conv_dtype=torch.bfloat16, device=device)
        random_windows(p, [0, 2, 3], seed=21)
        pools.append(p)
    return pools[0], pools[1], random_head_params(HV, K, device=device, generator=torch.Generator().manual_seed(2))


def test_decode_with_conv_is_conv_update_then_decode() -> None:
    """``decode(conv_weight=, conv_bias=)`` on pre-conv ``mixed_qkv`` equals ``conv_update`` (SiLU) followed by a
    plain decode on a twin, bit for bit (PyTorch path), over two steps with the fused advance."""
    pool, twin, params = decode_pair()
    weight, bias = conv_params(4, seed=22)
    slots = i32([3, -1, 0, 2])
    gen = torch.Generator().manual_seed(23)
    for step in range(2):
        for layer in range(2):
            inp = random_decode_inputs(4, H, HV, K, V, dtype=torch.float32, generator=gen)
            out = pool.decode(layer, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, slots,
                              conv_weight=weight, conv_bias=bias, advance=layer == 1)
            y = twin.conv_update(layer, inp.mixed_qkv, weight, slots, bias=bias)
            want = twin.decode(layer, y, inp.a, inp.b, params.A_log, params.dt_bias, slots, advance=layer == 1)
            assert torch.equal(out, want), (step, layer)
    for name in ("conv_state", "checkpoint", "d_cache", "k_cache", "g_cache", "cursors"):
        assert torch.equal(getattr(pool, name), getattr(twin, name)), name
    pool.check()


def test_decode_with_conv_records_bad_rows_once_as_decode() -> None:
    pool, twin, params = decode_pair()
    weight, bias = conv_params(4, seed=24)
    inp = random_decode_inputs(3, H, HV, K, V, dtype=torch.float32, generator=torch.Generator().manual_seed(25))
    out = pool.decode(1, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, i32([0, 4, 0]),
                      conv_weight=weight, conv_bias=bias)
    assert (out == 0).all()  # slot 4 is free, slot 0 named twice
    assert torch.equal(pool.conv_state, twin.conv_state) and torch.equal(pool.checkpoint, twin.checkpoint)
    with pytest.raises(SlotError, match=r"ReplaySSMStatePool\.decode\(layer=1\): 3 row\(s\).*row 0 slot 0, row 1 "
                                        r"slot 4, row 2 slot 0 \[slot 0: named twice in the call; slot 4: not "
                                        r"allocated now\]; they were treated as padding rows.*\)$"):
        pool.check()


def test_decode_conv_argument_errors() -> None:
    pool, _, params = decode_pair()
    inp = random_decode_inputs(2, H, HV, K, V, dtype=torch.float32)
    weight, bias = conv_params(4, seed=1)
    call = (1, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, i32([0, 2]))
    snapshot = pool.conv_state.clone()
    with pytest.raises(ValueError, match="`conv_bias` given without `conv_weight`"):
        pool.decode(*call, conv_bias=bias)
    # the decode's names for the conv's arguments (not conv_update's x, weight, bias)
    with pytest.raises(ValueError, match=r"`conv_weight` must .*\[64, 4\]; got \[64, 3\]"):
        pool.decode(*call, conv_weight=weight[:, :3])
    with pytest.raises(ValueError, match=r"`conv_weight` must be of shape \[64, 4\]; got \[64, 1, 4\] .*"
                                         r"pass weight\[:, 0\]"):
        pool.decode(*call, conv_weight=weight[:, None])  # nn.Conv1d's / FLA's depthwise weight [D, 1, W]
    with pytest.raises(ValueError, match=r"`conv_bias` must .*\[64\]"):
        pool.decode(*call, conv_weight=weight, conv_bias=bias[:5])
    with pytest.raises(ValueError, match=r"`mixed_qkv` must be \[B, D\] or \[B, T, D\] with T >= 1 and D = 64"):
        pool.decode(1, inp.mixed_qkv[:, :5], *call[2:], conv_weight=weight)
    # the decode's own arguments are checked before the conv moves any window
    with pytest.raises(ValueError, match="`a`"):
        pool.decode(1, inp.mixed_qkv, inp.a[:, :5], inp.b, params.A_log, params.dt_bias, i32([0, 2]),
                    conv_weight=weight)
    with pytest.raises(ValueError, match=r"`mixed_qkv` must be \[B, D\] \(one pre-conv token per row\)"):
        pool.decode(1, inp.mixed_qkv[:, None], *call[2:], conv_weight=weight)
    with pytest.raises(ValueError, match="force_flush"):
        pool.decode(*call, conv_weight=weight, force_flush=torch.zeros(3, dtype=torch.int32))
    assert torch.equal(pool.conv_state, snapshot)
    plain = ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=2, num_slots=S, ring_length=L, device="cpu")
    plain.alloc(3)
    with pytest.raises(ValueError, match="`conv_weight` given, but this pool holds no conv state"):
        plain.decode(*call, conv_weight=weight)


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


# ---- FLA's ShortConvolution as a peer ------------------------------------------------------------


def _fla_on_cpu(monkeypatch: pytest.MonkeyPatch) -> object:
    """FLA's conv module; on CPU its Triton kernels run in the interpreter, where their autotuners cannot time
    configs: each keeps its first config."""
    fla_ops = pytest.importorskip("fla.modules.causal_conv1d.ops")
    if not torch.cuda.is_available():
        for name in dir(fla_ops):
            fn = getattr(fla_ops, name)
            while fn is not None and not isinstance(getattr(fn, "configs", None), list):
                fn = getattr(fn, "fn", None)
            if fn is not None and len(fn.configs) > 1:
                monkeypatch.setattr(fn, "configs", fn.configs[:1])
    return fla_ops


@pytest.mark.timeout(300)
def test_against_fla_short_convolution(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLA 0.6.0's ``ShortConvolution`` (SiLU, bias) as the peer: its one-token step and its T-token forward with a
    cache, against the pool's ``conv_update`` on the same weights (``[D, 1, W]``, sliced by ``slice_conv_weight``)
    and windows (FLA's cache ``[N, D, W]`` holds the current input too; its last ``W-1`` columns are our window)."""
    fla_ops = _fla_on_cpu(monkeypatch)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    W = 4
    torch.manual_seed(0)
    fla = fla_ops.ShortConvolution(D, W, bias=True, activation="silu").to(dev)
    weight = shard_heads(KDAHeads(H, HV, K, V), 1, 0).slice_conv_weight(fla.weight.detach())
    bias = fla.bias.detach()
    pool = make_pool(W, device=dev)
    random_windows(pool, [0, 2, 3], seed=31)
    slots = i32([2, 0, 3], dev)
    cache = torch.cat([torch.zeros(3, D, 1, device=dev), pool.read_conv_state(1, slots)], dim=2)
    gen = torch.Generator().manual_seed(32)
    with torch.no_grad():
        for T in (1, 1, 3):
            x = torch.randn(3, T, D, generator=gen).to(dev)
            y_fla, cache = fla(x, cache=cache, output_final_state=True)
            y = pool.conv_update(1, x, weight, slots, bias=bias)
            torch.testing.assert_close(y, y_fla, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pool.read_conv_state(1, slots), cache[:, :, 1:], rtol=0, atol=0)


# ---- the Helion kernel in Triton's interpreter ---------------------------------------------------


def test_kernel_in_the_interpreter_window_path(interpreter: None) -> None:
    """The kernel with a window (W = 4), bias and SiLU, bf16 inputs and windows: a 3-token call with every kind of
    bad row and a one-token call ([B, D], NaN-poisoned output), against the PyTorch path on a twin (windows bit for
    bit, y within a bf16 step: the interpreter truncates bf16 stores) and the float64 taps; more bad rows than the
    record holds; then a decode step with the conv."""
    from tp_replayssm.pool import conv as pool_conv

    run_bad_case("all", T=3, conv_dtype=torch.bfloat16)
    pool, twin = make_pool(4, torch.bfloat16), make_pool(4, torch.bfloat16)
    for p in (pool, twin):
        random_windows(p, [0, 2, 3], seed=41)
    weight, bias = conv_params(4, seed=42)
    slots = i32([3, -1, 0])
    before = pool.read_conv_state(0, i32([3, 0]))
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(43)).bfloat16()
    y = torch.full_like(x, float("nan"))  # poisoned: every row must be written (the padding row with zeros)
    pool_conv.conv_update(pool, 0, x, weight, slots, bias, "silu", pool.guard("conv_update", 0), "test", out=y)
    with use_cpu_backend("torch"):
        expect = twin.conv_update(0, x, weight, slots, bias=bias)
    torch.testing.assert_close(y.double(), expect.double(), rtol=1e-2, atol=1e-2)
    oracle = taps_oracle(x[[0, 2], None], before, weight, bias, "silu")[:, 0]
    torch.testing.assert_close(y[[0, 2]].double(), oracle, rtol=1e-2, atol=1e-2)
    assert (y[1] == 0).all() and torch.equal(pool.conv_state, twin.conv_state)
    params = random_head_params(HV, K, generator=torch.Generator().manual_seed(44))
    inp = random_decode_inputs(3, H, HV, K, V, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(45))
    out = pool.decode(1, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, slots, conv_weight=weight,
                      conv_bias=bias)
    with use_cpu_backend("torch"):
        want = twin.decode(1, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, slots, conv_weight=weight,
                           conv_bias=bias)
    torch.testing.assert_close(out.double(), want.double(), rtol=3e-2, atol=3e-2)
    assert torch.equal(pool.conv_state, twin.conv_state)
    pool.check()
    # more bad rows than the record holds: the first RECORDED_ROWS are listed, all are counted
    pool.conv_update(0, torch.zeros(11, D).bfloat16(), weight, i32([S + r for r in range(10)] + [0]), bias=bias)
    with pytest.raises(SlotError) as info:
        pool.check()
    msg = str(info.value)
    assert "conv_update(layer=0): 10 row(s)" in msg and "row 7 slot 13" in msg and "row 8 slot" not in msg, msg


def test_kernel_in_the_interpreter_without_window(interpreter: None) -> None:
    """The kernel without a window (W = 1), without bias and activation, fp32, 2 tokens, NaN-poisoned outputs
    (launched directly): against the float64 conv1d and the PyTorch path; padding rows zero."""
    from tp_replayssm.kernels.conv import launch_conv

    pool = make_pool(1)
    weight, _ = conv_params(1, seed=51)
    x = torch.randn(4, 2, D, generator=torch.Generator().manual_seed(52))
    slots = i32([2, -1, 0, 3])
    y = torch.full_like(x, float("nan"))
    launch_conv(x, y, pool.conv_state, 1, weight, None, slots, pool.cursors, L, False, pool.guard("conv_update", 1))
    live = [0, 2, 3]
    torch.testing.assert_close(y[live].double(), conv1d_oracle(x[live], weight, None, None), rtol=1e-6, atol=1e-6)
    assert (y[1] == 0).all()
    with use_cpu_backend("torch"):
        expect = pool.conv_update(1, x, weight, slots, activation=None)
    torch.testing.assert_close(y, expect, rtol=1e-6, atol=1e-6)
    pool.check()


def test_kernel_plan_choices() -> None:
    """The channel block: as large as the batch allows while the grid keeps two programs per SM, within
    [MIN_BLOCK_D, MAX_BLOCK_D] and not above D's power of two."""
    from tp_replayssm.kernels.conv import MAX_BLOCK_D, MIN_BLOCK_D, plan_conv

    assert plan_conv(1, 12288, 4, 132).block_d == MIN_BLOCK_D  # 192 programs: latency
    assert plan_conv(512, 12288, 4, 132).block_d == MAX_BLOCK_D  # 6144 programs
    assert plan_conv(32, 1536, 4, 132).block_d == 128  # 32 * 12 = 384 >= 264
    assert plan_conv(2, 64, 4, 132).block_d == 64
    p = plan_conv(8, 40, 3, 132)
    assert (p.block_d, p.width_block, p.num_warps, p.named_block) == (64, 4, 1, 16)
    assert plan_conv(8, 40, 3, 132) is p  # cached
    for B in (1, 3, 8, 64, 512):
        for Dc in (64, 1536, 12288):
            plan = plan_conv(B, Dc, 4, 132)
            block = plan.block_d
            assert MIN_BLOCK_D <= block <= MAX_BLOCK_D and plan.num_warps == min(8, max(1, block // 128))
            assert block == MIN_BLOCK_D or B * -(-Dc // block) >= 2 * 132  # enough programs
            cap = min(MAX_BLOCK_D, max(MIN_BLOCK_D, 1 << (Dc - 1).bit_length()))
            assert block == cap or B * -(-Dc // (2 * block)) < 2 * 132  # and the largest such block


def test_bench_conv_checks_and_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_conv.py: its correctness check passes on a good conv (and flags a wrong one), and its dry run
    prints every standard shape with its byte floor and launch plan."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_conv

    pool = make_pool(4, conv_dtype=torch.bfloat16)
    weight, bias = (t.bfloat16() for t in conv_params(4, seed=71))
    x = torch.randn(3, D).bfloat16()
    assert bench_conv.check_conv(pool, x, weight, bias, i32([0, 2, 3]))["check"] == "ok"
    good = pool.conv_update
    pool.conv_update = lambda *args, **kw: good(*args, **kw) * 1.1  # a conv 10% off
    assert bench_conv.check_conv(pool, x, weight, bias, i32([0, 2, 3]))["check"] == "WRONG"
    assert bench_conv.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "30 shapes, W=4" in out and out.count("ConvPlan(") == 30
    assert "HV32  B512  bf16: D= 12288,   96.121 MiB" in out
    from tp_replayssm.kernels.conv import conv_bytes

    assert conv_bytes(2, 10, 4, tokens=3, act_bytes=4, window_bytes=2, weight_bytes=4, bias=False) == \
        2 * (2 * 3 * 10 * 4 + 2 * 3 * 10 * 2 + 8) + 10 * 4 * 4


@pytest.mark.timeout(300)
def test_kernel_compiles_for_sm90_without_spills() -> None:
    """benchmarks/conv_regs.py compiles the kernel for sm_90 (no GPU: ptxas from the triton wheel; the H200's triton
    3.6 where ``TP_REPLAYSSM_TRITON_H200`` points) at the library's plans: windows of W = 4, 2 and none, one and
    several tokens, 64 to 1024 channels per program; none may spill."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(repo / "benchmarks" / "conv_regs.py"), "--json"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 5
    for r in rows:
        assert r["stack"] == 0 and 0 < r["regs"] <= 255, r


# ---- the GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("W,T,B", [(4, 1, 1), (4, 1, 64), (4, 3, 5), (2, 2, 33), (1, 1, 7), (3, 4, 9)])
def test_kernel_on_gpu_matches_the_pytorch_path(dtype: torch.dtype, W: int, T: int, B: int) -> None:
    """The kernel on CUDA against the PyTorch path on a CPU copy of the pool (Kimi-like channels: K = V = 128,
    HV = H = 4, D = 1536): outputs within one rounding of ``dtype``, windows bit for bit, sentinels untouched;
    repeated calls launch directly."""
    from tp_replayssm.kernels.conv import DIRECT_PLANS

    heads = KDAHeads(4, 4, 128, 128)
    Dk, Sk = heads.qkv_width, B + 3
    kw = dict(num_layers=2, num_slots=Sk, ring_length=4, conv_kernel_size=W, conv_dtype=dtype)
    gpu = ReplaySSMStatePool(heads, device="cuda", **kw)
    cpu = ReplaySSMStatePool(heads, device="cpu", **kw)
    gen = torch.Generator().manual_seed(B * 10 + W)
    for p in (gpu, cpu):
        if W > 1:
            p.conv_state.fill_(SENTINEL)
        p.alloc(B + 1)
    if W > 1:
        win = torch.randn(B + 1, Dk, W - 1, generator=gen)
        for p in (gpu, cpu):
            p.load_state(1, torch.arange(B + 1, dtype=torch.int32, device=p.device),
                         torch.zeros(B + 1, 4, 128, 128, device=p.device), conv_states=win.to(p.device))
    weight = torch.randn(Dk, W, generator=gen) * 0.5
    bias = torch.randn(Dk, generator=gen) * 0.1
    perm = torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)
    pad = B // 2 if B > 2 else None
    if pad is not None:
        perm[pad] = -1  # a padding row
    hits = DIRECT_PLANS.hits
    for step in range(3):
        x = torch.randn(B, T, Dk, generator=gen).to(dtype)
        xin = x[:, 0] if T == 1 and step % 2 else x
        y = gpu.conv_update(1, xin.cuda(), weight.cuda(), perm.cuda(), bias=bias.cuda())
        want = cpu.conv_update(1, xin, weight, perm, bias=bias)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(y.cpu().double(), want.double(), rtol=tol, atol=tol)
        if pad is not None:
            assert torch.equal(y.cpu()[pad], torch.zeros_like(want[pad]))
        if W > 1:
            assert torch.equal(gpu.conv_state.cpu(), cpu.conv_state), step
    assert DIRECT_PLANS.hits > hits
    gpu.check()


@pytest.mark.gpu
def test_graph_replay_of_conv_and_decode_with_a_bad_row() -> None:
    """A CUDA graph of a decode step with the conv on both layers (the fused advance on the last), captured with
    good slots and replayed with a bad row in its slot buffer: the replay runs, the bad row's outputs are zero, no
    window, checkpoint, ring or cursor byte of any slot changes for it, check() reports it; the good rows equal an
    eager twin's bitwise."""
    pool, twin, params = decode_pair(device="cuda")
    dev = pool.device
    weight, bias = (t.to(dev) for t in conv_params(4, seed=61))
    inp = random_decode_inputs(3, H, HV, K, V, dtype=torch.bfloat16, device=dev,
                               generator=torch.Generator().manual_seed(62))
    slots = i32([0, 2, 3], dev)

    def step(p: ReplaySSMStatePool, s: torch.Tensor) -> list[torch.Tensor]:
        return [p.decode(layer, inp.mixed_qkv, inp.a, inp.b, params.A_log, params.dt_bias, s, conv_weight=weight,
                         conv_bias=bias, advance=layer == 1) for layer in range(2)]

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    snap = {n: getattr(pool, n).clone() for n in ("conv_state", "checkpoint", "d_cache", "k_cache", "g_cache",
                                                  "cursors")}
    with torch.cuda.stream(warm):  # warm-up (compiles), then restore the pool
        step(pool, slots)
    torch.cuda.current_stream().wait_stream(warm)
    for n, t in snap.items():
        getattr(pool, n).copy_(t)
    pool.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(pool, slots)
    slots.copy_(i32([0, 4, 3], dev))  # slot 4 is free
    graph.replay()
    want = step(twin, i32([0, -1, 3], dev))
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        assert torch.equal(o, w) and (o[1] == 0).all()
    for n in snap:
        assert torch.equal(getattr(pool, n), getattr(twin, n)), n
    with pytest.raises(SlotError, match=r"decode\(layer=0\): .*row 1 slot 4"):
        pool.check()
    assert math.isfinite(float(outs[0].float().abs().sum()))
