"""KDAHeads, the TP sharding rule (docs/contract.md, sharding) and the slicing helpers.

The expected sharding is derived per head from the contract's rule (value head ``hv`` lives on rank
``hv // (HV/tp)``, value head ``hv`` reads q/k head ``hv // r``), never from the library's offsets.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tp_replayssm import KDAHeads, reference
from tp_replayssm.tp.heads import HeadShard, all_shards, concat_outputs, shard_heads

K = V = 4


def _rule_allows(H: int, HV: int, tp: int) -> bool:
    return HV % tp == 0 and (H % tp == 0 or tp % H == 0)


# ---- KDAHeads -----------------------------------------------------------------------------------

def test_kda_heads_valid_and_properties():
    h = KDAHeads(2, 8, 16, 32)
    assert (h.num_q_heads, h.num_v_heads, h.key_dim, h.value_dim) == (2, 8, 16, 32)
    assert h.group == 4
    assert h.qkv_width == 2 * 2 * 16 + 8 * 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.num_q_heads = 4  # frozen


@pytest.mark.parametrize(
    "args, field",
    [
        ((0, 4, 16, 16), "num_q_heads"),
        ((2, -4, 16, 16), "num_v_heads"),
        ((2, 4, 0, 16), "key_dim"),
        ((2, 4, 16, 0), "value_dim"),
        ((2, 4, 16.0, 16), "key_dim"),
        ((True, 4, 16, 16), "num_q_heads"),
        ((3, 4, 16, 16), "HV % H"),
    ],
)
def test_kda_heads_invalid_prints_every_factor(args, field):
    with pytest.raises(ValueError) as exc:
        KDAHeads(*args)
    msg = str(exc.value)
    assert field in msg
    for name, value in zip(("num_q_heads", "num_v_heads", "key_dim", "value_dim"), args):
        assert f"{name}" in msg and repr(value) in msg


# ---- the sharding rule --------------------------------------------------------------------------

def _check_shard_against_rule(heads: KDAHeads, tp: int) -> None:
    H, HV, r = heads.num_q_heads, heads.num_v_heads, heads.group
    shards = all_shards(heads, tp)
    owned_v: list[int] = []
    held_q: dict[int, int] = {}
    for t, s in enumerate(shards):
        assert isinstance(s, HeadShard) and s.tp_rank == t and s.tp_size == tp and s.heads == heads
        expected_v = [hv for hv in range(HV) if hv // (HV // tp) == t]
        assert list(s.v_heads) == expected_v
        expected_q = sorted({hv // r for hv in expected_v})  # the q/k heads its value heads read
        assert list(s.q_heads) == expected_q
        assert s.num_v_heads_local == len(expected_v) and s.num_q_heads_local == len(expected_q)
        local = s.local
        assert (local.num_q_heads, local.num_v_heads, local.key_dim, local.value_dim) == (
            len(expected_q), len(expected_v), heads.key_dim, heads.value_dim)
        # local value head i reads local q/k head i // r_local == global head (hv // r)
        for i, hv in enumerate(s.v_heads):
            assert s.q_head_start + i // local.group == hv // r
        assert s.qk_replicated == (H < tp)
        owned_v += list(s.v_heads)
        for h in s.q_heads:
            held_q[h] = held_q.get(h, 0) + 1
    assert owned_v == list(range(HV))  # every value head exactly once, in rank order
    assert sorted(held_q) == list(range(H))
    assert set(held_q.values()) == {max(1, tp // H)}


@pytest.mark.parametrize(
    "H, HV, tp",
    [(1, 1, 1), (4, 4, 1), (4, 4, 2), (4, 4, 4), (2, 8, 2), (2, 8, 4), (2, 8, 8), (1, 4, 4), (4, 16, 8),
     (8, 16, 4), (3, 6, 3), (6, 12, 3)],
)
def test_shard_heads_matches_rule(H, HV, tp):
    _check_shard_against_rule(KDAHeads(H, HV, K, V), tp)


def test_shard_h_less_than_tp_replicates():
    heads = KDAHeads(2, 8, K, V)
    shards = all_shards(heads, 4)
    assert [s.q_head_start for s in shards] == [t * 2 // 4 for t in range(4)] == [0, 0, 1, 1]
    assert all(s.num_q_heads_local == 1 and s.num_v_heads_local == 2 for s in shards)


@given(H=st.integers(1, 8), r=st.integers(1, 4), tp=st.integers(1, 8))
@settings(max_examples=150, deadline=None)
def test_shard_heads_property(H, r, tp):
    heads = KDAHeads(H, H * r, K, V)
    if _rule_allows(H, H * r, tp):
        _check_shard_against_rule(heads, tp)
    else:
        with pytest.raises(ValueError) as exc:
            shard_heads(heads, tp, 0)
        msg = str(exc.value)
        assert f"H={H}" in msg and f"HV={H * r}" in msg and f"tp={tp}" in msg


@pytest.mark.parametrize("H, HV, tp", [(3, 6, 2), (2, 2, 4), (4, 8, 3), (6, 6, 4)])
def test_shard_heads_invalid_combo_prints_h_hv_tp(H, HV, tp):
    with pytest.raises(ValueError) as exc:
        shard_heads(KDAHeads(H, HV, K, V), tp, 0)
    msg = str(exc.value)
    assert f"H={H}" in msg and f"HV={HV}" in msg and f"tp={tp}" in msg


@pytest.mark.parametrize("tp_size, tp_rank", [(0, 0), (-1, 0), (2, 2), (2, -1), (2, 1.0), (True, 0)])
def test_shard_heads_bad_rank_or_size(tp_size, tp_rank):
    with pytest.raises(ValueError):
        shard_heads(KDAHeads(2, 4, K, V), tp_size, tp_rank)


def test_shard_heads_rejects_non_heads():
    with pytest.raises(ValueError, match="KDAHeads"):
        shard_heads((2, 4, K, V), 1, 0)  # type: ignore[arg-type]


# ---- slicing helpers ----------------------------------------------------------------------------

@pytest.mark.parametrize("H, HV, tp", [(4, 4, 2), (2, 8, 4), (2, 4, 2), (4, 8, 4), (1, 2, 2)])
def test_slicing_helpers_select_the_rank_heads(H, HV, tp):
    heads = KDAHeads(H, HV, K, V)
    B, n = 3, 2
    g = torch.Generator().manual_seed(H * 100 + HV * 10 + tp)
    mixed = torch.randn(B, heads.qkv_width, generator=g)
    q_all = mixed[:, : H * K].reshape(B, H, K)
    k_all = mixed[:, H * K : 2 * H * K].reshape(B, H, K)
    v_all = mixed[:, 2 * H * K :].reshape(B, HV, V)
    a = torch.randn(B, HV * K, generator=g)
    b = torch.randn(B, HV, generator=g)
    A_log = torch.randn(HV, generator=g)
    dt = torch.randn(HV * K, generator=g)
    state = torch.randn(n, HV, V, K, generator=g)
    for s in all_shards(heads, tp):
        qh, vh = list(s.q_heads), list(s.v_heads)
        Hl, HVl = len(qh), len(vh)
        loc = s.slice_mixed_qkv(mixed)
        assert loc.shape == (B, s.local.qkv_width)
        assert torch.equal(loc[:, : Hl * K].reshape(B, Hl, K), q_all[:, qh])
        assert torch.equal(loc[:, Hl * K : 2 * Hl * K].reshape(B, Hl, K), k_all[:, qh])
        assert torch.equal(loc[:, 2 * Hl * K :].reshape(B, HVl, V), v_all[:, vh])
        assert torch.equal(s.slice_a(a).reshape(B, HVl, K), a.reshape(B, HV, K)[:, vh])
        assert torch.equal(s.slice_a(a.reshape(B, HV, K)), a.reshape(B, HV, K)[:, vh])
        assert s.slice_a(a).stride(-1) == 1
        assert torch.equal(s.slice_b(b), b[:, vh])
        assert torch.equal(s.slice_A_log(A_log), A_log[vh])
        assert torch.equal(s.slice_dt_bias(dt).reshape(HVl, K), dt.reshape(HV, K)[vh])
        assert torch.equal(s.slice_dt_bias(dt.reshape(HV, K)), dt.reshape(HV, K)[vh])
        assert torch.equal(s.slice_state(state), state[:, vh])


def test_slicing_helpers_reject_wrong_shapes():
    s = shard_heads(KDAHeads(2, 4, K, V), 2, 1)
    bad = torch.zeros(3, 7)
    for fn, name in [(s.slice_mixed_qkv, "mixed_qkv"), (s.slice_a, "a"), (s.slice_b, "b"),
                     (s.slice_A_log, "A_log"), (s.slice_dt_bias, "dt_bias"), (s.slice_state, "state")]:
        with pytest.raises(ValueError, match=rf"^slice_{name}: `{name}` must be"):  # names the argument checked
            fn(bad)
    with pytest.raises(ValueError):
        s.slice_state(torch.zeros(2, 2, V, K))  # local, not global, head count
    with pytest.raises(ValueError):
        s.slice_mixed_qkv(None)  # type: ignore[arg-type]


def test_concat_outputs_inverts_the_split():
    heads = KDAHeads(2, 8, K, V)
    out = torch.randn(5, 1, 8, V)
    for tp in (1, 2, 4, 8):
        parts = [out[:, :, list(s.v_heads)] for s in all_shards(heads, tp)]
        assert torch.equal(concat_outputs(parts), out)
    with pytest.raises(ValueError):
        concat_outputs([])
    with pytest.raises(ValueError, match="rank 1"):
        concat_outputs([torch.zeros(5, 1, 2, V), torch.zeros(4, 1, 2, V)])


@pytest.mark.parametrize("ring_layout", ["sglang", "predecayed"])
@pytest.mark.parametrize("H, HV, tp", [(4, 4, 2), (2, 8, 4)])
def test_sharded_reference_op_equals_single_rank(H, HV, tp, ring_layout):
    """With the PyTorch reference op: slicing global inputs + state per rank and concatenating the
    outputs gives the single-rank result, and each rank's state is the slice of the global one. In both ring
    layouts: the k ring is sliced by q/k head (sglang) or by value head (pre-decayed)."""
    predecayed = ring_layout == "predecayed"
    heads = KDAHeads(H, HV, K, V)
    B, S, L = 4, 5, 3
    g = torch.Generator().manual_seed(7)
    mixed = torch.randn(B, heads.qkv_width, generator=g)
    a, b = torch.randn(B, HV * K, generator=g), torch.randn(B, HV, generator=g)
    A_log, dt = torch.rand(HV, generator=g) - 0.5, torch.rand(HV * K, generator=g) - 2.0
    slots = torch.tensor([3, -1, 0, 2], dtype=torch.int32)
    wpos = torch.tensor([1, 0, 2, 0], dtype=torch.int32)
    S0 = torch.randn(S, HV, V, K, generator=g)
    d = torch.randn(S, HV, L, V, generator=g)
    kr = torch.randn(S, HV if predecayed else H, L, K, generator=g)
    gr = -torch.rand(S, HV, L, K, generator=g)
    if predecayed:  # cumulative gates, keys pre-decayed by them
        kr, gr = reference.predecay_rings(kr, gr)

    def run(hs: HeadShard | None):
        if hs is None:
            args = (mixed, a, b, A_log, dt)
            st0, dd, kk, gg = S0.clone(), d.clone(), kr.clone(), gr.clone()
        else:
            args = (hs.slice_mixed_qkv(mixed), hs.slice_a(a), hs.slice_b(b), hs.slice_A_log(A_log),
                    hs.slice_dt_bias(dt))
            st0 = hs.slice_state(S0).clone()
            dd, gg = d[:, list(hs.v_heads)].clone(), gr[:, list(hs.v_heads)].clone()
            kk = kr[:, list(hs.v_heads if predecayed else hs.q_heads)].clone()
        out = torch.empty(B, 1, st0.shape[1], V)
        reference.replayssm_decode(*args, None, st0, dd, kk, gg, out, slots, wpos, None, True, None,
                                   ring_layout=ring_layout)
        return out, st0

    full_out, full_state = run(None)
    parts = [run(s) for s in all_shards(heads, tp)]
    torch.testing.assert_close(concat_outputs([p[0] for p in parts]), full_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(concat_outputs([p[1] for p in parts], dim=1), full_state, rtol=1e-6, atol=1e-6)
