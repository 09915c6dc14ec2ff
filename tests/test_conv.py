"""The pool's ``conv_update`` on the PyTorch path (CPU tensors' default): the math against the float64 oracles of
``_conv_helpers``, slot safety, the decode with the conv, and FLA's ``ShortConvolution`` as a peer where ``fla`` is
importable.
"""

from __future__ import annotations

import pytest
import torch

from _conv_helpers import (BAD, D, H, HV, K, L, S, SENTINEL, V, conv1d_oracle, conv_params, decode_pair, i32,
                           make_pool, random_windows, run_bad_case, taps_oracle)
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError, shard_heads
from tp_replayssm.pool.conv import conv_reference
from tp_replayssm.testing import random_decode_inputs


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
