"""``tp_replayssm.layers.TPKimiDeltaAttention`` against an independent float64 reimplementation of the KDA layer
(always) and against flash-linear-attention 0.6.0's ``KimiDeltaAttention`` with its own cache (when ``fla`` is
installed: the ``[fla]`` extra), at tp 1, 2 and 4: in one process (one pool per rank, no group: the partial sums
add up) and on gloo ranks (the layer all-reduces). Scenarios: packed prefills of several prompt lengths, chunked
prefill (a prompt's second piece after a decode, continuing a state with ring entries), decode steps with a padding
row and a forced flush, cursors moved by the fused advance or by ``pool.advance`` / ``end_prefill``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _dist_helpers as dh
import _fla_cpu
import _layer_helpers as lh
from tp_replayssm import ReplaySSMStatePool, SlotError
from tp_replayssm.layers import KDALayerConfig, TPKimiDeltaAttention, end_prefill
from tp_replayssm.layers.kda_torch import chunk_kda_torch, kda_activations, packed_conv

REPO = Path(__file__).resolve().parent.parent
logger = logging.getLogger(__name__)
needs_fla = pytest.mark.skipif(not _fla_cpu.FLA_AVAILABLE, reason=_fla_cpu.SKIP_REASON)
needs_fla_core = pytest.mark.skipif(not _fla_cpu.FLA_CORE_AVAILABLE, reason=_fla_cpu.SKIP_REASON_CORE)

# hidden 64, K = V = 16 unless said: GVA with q/k heads replicated at tp 4, conv biases; K != V (FLA's expand_v = 2);
# no short convolution, the bounded gate and no output-gate bias
CONFIGS = {
    "gva": KDALayerConfig(64, 2, 8, 16, 16, 16, conv_size=4, conv_bias=True, gate_bias=True),
    "kv": KDALayerConfig(64, 2, 4, 16, 32, 32, conv_size=4),
    "noconv-lb": KDALayerConfig(64, 4, 4, 16, 16, 16, conv_size=0, gate_bias=False, lower_bound=-4.0),
}
FLA_KWARGS = {  # FLA layers of the same geometry (head_dim = K; expand_v = V / K)
    "gva": dict(hidden_size=64, num_heads=2, num_v_heads=8, head_dim=16, conv_bias=True),
    "kv": dict(hidden_size=64, num_heads=2, num_v_heads=4, head_dim=16, expand_v=2),
    "lb": dict(hidden_size=64, num_heads=4, head_dim=16, lower_bound=-5.0),
}
TOL = 2e-5  # fp32 layer against float64 / fp32 FLA, max abs error over max abs output
GPU_TOL = 1e-4  # fp32 on the GPU (other summation orders in the kernels and GEMMs)


def _pool(cfg: KDALayerConfig, rank: int, tp: int, layers: int = 1, ring_length: int = 3) -> ReplaySSMStatePool:
    return ReplaySSMStatePool(cfg.heads, num_layers=layers, num_slots=6, ring_length=ring_length,
                              cache_dtype=torch.float32, conv_kernel_size=cfg.conv_size, tp_rank=rank, tp_size=tp,
                              device="cpu")


def _alloc(pool: ReplaySSMStatePool, n: int) -> list[int]:
    """``n`` slots that are not 0..n-1 (one slot taken and given back first)."""
    burn = pool.alloc(1)
    ids = pool.alloc(n).tolist()
    pool.free(burn)
    return ids


# ---- the PyTorch prefill math in float64 --------------------------------------------------------------------------


def _plain_recurrence(q, k, v, g, beta, S0, cu):  # noqa: ANN001, ANN202 - the test's own loop
    outs, finals = [], []
    for i in range(len(cu) - 1):
        S = S0[i].clone()
        for t in range(cu[i], cu[i + 1]):
            for hv in range(S.shape[0]):
                S[hv] = S[hv] * torch.exp(g[t, hv])[None, :]
                S[hv] = S[hv] + beta[t, hv] * torch.outer(v[t, hv] - S[hv] @ k[t, hv], k[t, hv])
            outs.append(torch.stack([S[hv] @ q[t, hv] for hv in range(S.shape[0])]))
        finals.append(S)
    return torch.stack(outs), torch.stack(finals)


@pytest.mark.parametrize("chunk", [4, 16])
@pytest.mark.parametrize("gate", ["softplus", "strong", "bounded"])
def test_chunk_kda_torch_float64(chunk: int, gate: str) -> None:
    """The chunked recurrence (packed sequences crossing chunk boundaries, one of a single token, initial states)
    equals the token-by-token recurrence to float64 rounding, also with decays of exp(-600) per step (no overflow)."""
    g = torch.Generator().manual_seed(3)
    cu = [0, 7, 8, 29]
    T, H, HV, K, V = 29, 2, 4, 8, 6
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v, a, b = rnd(T, H, K), rnd(T, H, K), rnd(T, HV, V), rnd(T, HV, K), rnd(T, HV)
    A_log, dt = rnd(HV) * 0.5, rnd(HV * K)
    if gate == "strong":
        a, A_log = a + 30.0, A_log + 2.0
    qa, ka, ga, beta = kda_activations(q, k, a, b, A_log, dt, lower_bound=-3.0 if gate == "bounded" else None)
    assert qa.dtype == torch.float64 and bool((ga <= 0).all())
    S0 = rnd(3, HV, V, K)
    o, S = chunk_kda_torch(qa, ka, v, ga, beta, S0, cu, chunk_size=chunk)
    o_ref, S_ref = _plain_recurrence(qa, ka, v, ga, beta, S0, cu)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert lh.rel(o, o_ref) < 1e-12 and lh.rel(S, S_ref) < 1e-12


def test_packed_conv_float64() -> None:
    """The packed convolution continues each sequence's window (sequences shorter than the window included) and
    returns its last W-1 inputs, as a per-sequence loop over window-then-tokens."""
    g = torch.Generator().manual_seed(4)
    cu, D, W = [0, 2, 3, 11], 12, 4
    x = torch.randn(11, D, generator=g, dtype=torch.float64)
    window = torch.randn(3, D, W - 1, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(D, W, generator=g, dtype=torch.float64), torch.randn(D, generator=g,
                                                                                  dtype=torch.float64)
    y, new_window = packed_conv(x, window, weight, bias, cu)
    for i in range(3):
        u = torch.cat([window[i], x[cu[i]:cu[i + 1]].T], dim=1)  # [D, W-1+T] oldest first
        for t in range(cu[i + 1] - cu[i]):
            want = torch.nn.functional.silu((u[:, t:t + W] * weight).sum(-1) + bias)
            assert torch.allclose(y[cu[i] + t], want, atol=1e-12, rtol=0)
        assert torch.equal(new_window[i], u[:, -(W - 1):])


# ---- the layer against the plain float64 layer ----------------------------------------------------------------


def _plain_run(cfg: KDALayerConfig, weights: list[dict], calls: list[lh.Call], n: int):  # noqa: ANN202
    return [lh.plain_outputs(lh.PlainKDALayer(w, cfg), calls, n) for w in weights]


def _expected_cursors(calls: list[lh.Call], n: int, L: int) -> list[int]:
    cur = [0] * n
    for call in calls:
        for r, s in enumerate(call.seqs):
            if s is None:
                continue
            if call.kind == "prefill":
                cur[s] = 0
            else:
                flush = cur[s] == L - 1 or bool(call.force_flush and call.force_flush[r])
                cur[s] = 0 if flush else cur[s] + 1
    return cur


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


def _check_ranks(results: list[dict], cfg: KDALayerConfig, world: int, calls: list[lh.Call], n: int) -> None:
    want_cur = _expected_cursors(calls, n, 2)
    for r, res in enumerate(results):
        assert max(res["errs"]) < TOL, (r, res["errs"])
        assert res["padding_zero"] and res["cursors"] == want_cur, res
        HVl = cfg.num_v_heads // world
        assert res["v_heads"] == list(range(r * HVl, (r + 1) * HVl))
        H = cfg.num_heads
        assert res["q_heads"] == (list(range(r * H // world, (r + 1) * H // world)) if H % world == 0
                                  else [r * H // world])


# ---- the layer against FLA ------------------------------------------------------------------------------------------

FLA_SCENARIO = dict(first=[5, 1, 9], second=[3, 18, 2], order2=[[2, 0], [1]])


@pytest.fixture(scope="module")
def fla_cases() -> dict:
    """Per FLA config: the FLA layer, the scenario and FLA's outputs with its own cache (computed once)."""
    cases: dict = {}

    def get(name: str) -> tuple:
        if name not in cases:
            fla_layer = _fla_cpu.kda_layer(7, **FLA_KWARGS[name])
            calls = lh.scenario(fla_layer.hidden_size, 8, **FLA_SCENARIO)
            cases[name] = (fla_layer, calls, lh.fla_outputs(fla_layer, calls, 3))
        return cases[name]

    return get  # type: ignore[return-value]


@needs_fla
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gva", "kv", "lb"])
def test_layer_matches_fla(fla_cases, name: str) -> None:  # noqa: ANN001
    """from_fla at tp 1, 2, 4 (one pool per rank in this process, partial sums added): FLA's outputs for packed
    prefills of three prompt lengths, a decode, the prompts' second pieces in two calls, two decodes; also against the
    float64 layer built from FLA's config and weights."""
    fla_layer, calls, want = fla_cases(name)
    cfg = KDALayerConfig.from_fla(fla_layer)
    plain, _ = lh.plain_outputs(lh.PlainKDALayer(fla_layer.state_dict(), cfg), calls, 3)
    for c in range(len(calls)):
        assert lh.rel(want[c], plain[c]) < TOL, "FLA and the float64 layer disagree"
    for tp in (1, 2, 4):
        if cfg.num_v_heads % tp or (cfg.num_heads % tp and tp % cfg.num_heads):
            continue
        ranks = []
        for r in range(tp):
            pool = _pool(cfg, r, tp, ring_length=2)
            ranks.append((pool, [TPKimiDeltaAttention.from_fla(fla_layer, pool=pool, layer_idx=0)]))
            slot_of = _alloc(pool, 3)
        outs = lh.run_ours(ranks, calls, slot_of, fused=tp != 2)[0]
        for c, (got, exp) in enumerate(zip(outs, want)):
            assert lh.rel(got, exp) < TOL, (tp, c, calls[c].kind, lh.rel(got, exp))


@needs_fla
@pytest.mark.timeout(300)
def test_fla_prefill_backend_on_cpu(fla_cases) -> None:  # noqa: ANN001
    """prefill_backend='fla' (FLA's chunk_kda, here in Triton's interpreter: the call the CUDA prefill makes) gives
    FLA's outputs at tp 2."""
    fla_layer, calls, want = fla_cases("gva")
    ranks = []
    for r in range(2):
        pool = _pool(KDALayerConfig.from_fla(fla_layer), r, 2, ring_length=2)
        ranks.append((pool, [TPKimiDeltaAttention.from_fla(fla_layer, pool=pool, layer_idx=0, prefill_backend="fla")]))
        slot_of = _alloc(pool, 3)
    outs = lh.run_ours(ranks, calls, slot_of, fused=True)[0]
    for c, (got, exp) in enumerate(zip(outs, want)):
        assert lh.rel(got, exp) < TOL, (c, calls[c].kind, lh.rel(got, exp))


@needs_fla
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gloo_matches_fla(fla_cases, tmp_path: Path, world: int) -> None:  # noqa: ANN001
    """On gloo ranks each rank's all-reduced output equals FLA's. The ranks build the layer from FLA's config and
    state dict (what from_fla reads), so they need not import FLA."""
    fla_layer, calls, want = fla_cases("gva")
    cfg = KDALayerConfig.from_fla(fla_layer)
    weights = {k: v.clone() for k, v in fla_layer.state_dict().items()}
    results = dh.run_ranks(lh.tp_worker, world, tmp_path, cfg, weights, calls, 3, want, False, timeout_s=250)
    _check_ranks(results, cfg, world, calls, 3)


# ---- loading ----------------------------------------------------------------------------------------------------


class RecordingSource(dict):
    """A state dict of lazy tensors that record every index they are read with (``get_shape()`` and ``[...]``, as
    safetensors' slices): ``reads[name]`` lists the element counts read."""

    class Slice:
        def __init__(self, owner: "RecordingSource", name: str, t: torch.Tensor) -> None:
            self.owner, self.name, self.t = owner, name, t

        def get_shape(self) -> list[int]:
            return list(self.t.shape)

        def __getitem__(self, index: object) -> torch.Tensor:
            out = self.t[index].clone()
            self.owner.reads.setdefault(self.name, []).append(out.numel())
            return out

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__({k: RecordingSource.Slice(self, k, v) for k, v in tensors.items()})
        self.reads: dict[str, list[int]] = {}


def _kimi_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ren = {"f_proj.0.weight": "f_a_proj.weight", "f_proj.1.weight": "f_b_proj.weight",
           "g_proj.0.weight": "g_a_proj.weight", "g_proj.1.weight": "g_b_proj.weight"}
    out = {ren.get(k, k): v for k, v in sd.items()}
    out["A_log"] = sd["A_log"].view(1, 1, -1, 1)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_loader_reads_slices_only(tp: int) -> None:
    """Kimi-Linear's names (f_a/f_b/g_a/g_b, A_log [1, 1, HV, 1], no output-gate bias) from a lazy source: each
    rank reads its slices once and no more (the replicated low-rank halves and norm weight whole), and gives the same
    layer as FLA's names from plain tensors."""
    cfg = dataclasses.replace(CONFIGS["gva"], gate_bias=False)
    sd = lh.random_weights(cfg, 3)
    prefix = "model.layers.0.self_attn."
    full = {k: v.numel() for k, v in _kimi_names(sd).items()}
    g = torch.Generator().manual_seed(1)
    x, x1 = torch.randn(6, 64, generator=g), torch.randn(2, 64, generator=g)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    replicated = {"f_a_proj.weight", "g_a_proj.weight", "o_norm.weight"}
    qk = {"q_proj.weight", "k_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "q_conv1d.bias", "k_conv1d.bias"}
    h_local = max(cfg.num_heads // tp, 1)  # a q/k head is replicated when tp % H == 0
    for r in range(tp):
        src = RecordingSource({prefix + k: v for k, v in _kimi_names(sd).items()})
        pools = [_pool(cfg, r, tp), _pool(cfg, r, tp)]
        ours = TPKimiDeltaAttention.from_state_dict(src, cfg, pool=pools[0], layer_idx=0, prefix=prefix)
        for name, counts in src.reads.items():
            key = name[len(prefix):]
            assert len(counts) == 1, (name, counts)
            want = full[key] if key in replicated else \
                full[key] * h_local // cfg.num_heads if key in qk else full[key] // tp
            assert counts[0] == want, (name, counts, full[key])
        assert sorted(k[len(prefix):] for k in src.reads) == sorted(full)
        plain = TPKimiDeltaAttention.from_state_dict(sd, cfg, pool=pools[1], layer_idx=0)
        for a, b in zip(ours.parameters(), plain.parameters()):
            assert torch.equal(a, b)
        for layer, pool in zip((ours, plain), pools):
            slots = pool.alloc(2)
            layer(x, slots, cu, advance=True)
            layer(x1, slots, advance=True)
        assert torch.equal(pools[0].read_state(0, slots), pools[1].read_state(0, slots))


def test_a_sharded_layer_without_group_says_its_outputs_are_partial_sums(caplog: pytest.LogCaptureFixture) -> None:
    """Built without ``group`` on a pool sharded over ranks, the layer returns this rank's partial sums (the caller
    reduces): it says so once, at construction; at tp 1 it says nothing."""
    cfg = CONFIGS["gva"]
    sd = lh.random_weights(cfg, 3)
    with caplog.at_level(logging.WARNING, logger="tp_replayssm.layers.kda"):
        TPKimiDeltaAttention.from_state_dict(sd, cfg, pool=_pool(cfg, 0, 1), layer_idx=0)
        assert not caplog.records
        TPKimiDeltaAttention.from_state_dict(sd, cfg, pool=_pool(cfg, 1, 2), layer_idx=0)
    assert [r.getMessage() for r in caplog.records] == [
        "TPKimiDeltaAttention(layer_idx=0): no `group` on a pool sharded over 2 ranks: the outputs are this rank's "
        "partial sums, for the caller to all-reduce (pass group= to reduce in the layer)"]


def test_loader_errors() -> None:
    cfg = CONFIGS["gva"]
    sd = lh.random_weights(cfg, 3)
    pool = _pool(cfg, 0, 2)
    with pytest.raises(ValueError, match=r"`v_proj.weight` must have shape \[128, 64\]; got \[128, 63\]"):
        TPKimiDeltaAttention.from_state_dict({**sd, "v_proj.weight": torch.zeros(128, 63)}, cfg, pool=pool,
                                             layer_idx=0)
    with pytest.raises(ValueError, match="`b_proj.weight` is missing"):
        TPKimiDeltaAttention.from_state_dict({k: v for k, v in sd.items() if k != "b_proj.weight"}, cfg, pool=pool,
                                             layer_idx=0)
    with pytest.raises(ValueError, match="conv_bias=False"):
        TPKimiDeltaAttention.from_state_dict(sd, dataclasses.replace(cfg, conv_bias=False), pool=pool, layer_idx=0)
    with pytest.raises(ValueError, match="neither 'f_proj.0.weight'"):
        TPKimiDeltaAttention.from_state_dict({}, cfg, pool=pool, layer_idx=0)
    with pytest.raises(ValueError, match="the pool's heads"):
        TPKimiDeltaAttention.from_state_dict(sd, cfg, pool=_pool(CONFIGS["kv"], 0, 1), layer_idx=0)
    with pytest.raises(ValueError, match="conv_kernel_size=4"):
        bad = ReplaySSMStatePool(cfg.heads, num_layers=1, num_slots=2, ring_length=2, conv_kernel_size=3,
                                 device="cpu")
        TPKimiDeltaAttention.from_state_dict(sd, cfg, pool=bad, layer_idx=0)
    with pytest.raises(ValueError, match="tp_rank/tp_size = 1/2 but the pool holds the shard of rank 0/2"):
        TPKimiDeltaAttention.from_state_dict(sd, cfg, pool=pool, layer_idx=0, tp_rank=1)
    with pytest.raises(ValueError, match="`layer_idx` must be an int in"):
        TPKimiDeltaAttention.from_state_dict(sd, cfg, pool=pool, layer_idx=1)
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        TPKimiDeltaAttention.from_state_dict(sd, cfg, pool=pool, layer_idx=0, dtype=torch.float64)


def test_from_fla_refuses_what_decode_does_not_compute() -> None:
    """allow_neg_eigval (beta = 2 sigmoid(b)) and a non-sigmoid output gate are refused with the reason (an object
    with FLA's attributes stands in for the layer)."""
    from types import SimpleNamespace as NS

    def fake(**over: object) -> NS:
        base = dict(hidden_size=64, num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, use_short_conv=True,
                    conv_size=4, conv_bias=False, allow_neg_eigval=False, lower_bound=None,
                    o_norm=NS(activation="sigmoid", weight=torch.ones(16), eps=1e-5),
                    f_proj=[NS(weight=torch.zeros(16, 64))], g_proj=[None, NS(bias=None)])
        base.update(over)
        return NS(**base)

    assert KDALayerConfig.from_fla(fake()) == KDALayerConfig(64, 2, 4, 16, 16, 16, gate_bias=False)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        KDALayerConfig.from_fla(fake(allow_neg_eigval=True))
    with pytest.raises(ValueError, match="activation='sigmoid'"):
        KDALayerConfig.from_fla(fake(o_norm=NS(activation="swish", weight=torch.ones(16), eps=1e-5)))
    with pytest.raises(ValueError, match="fla.layers.KimiDeltaAttention"):
        KDALayerConfig.from_fla(object())
    layer = fake(state_dict=dict)  # (no weights: the pool's check comes first)
    pool = _pool(KDALayerConfig.from_fla(layer), 0, 1)
    with pytest.raises(ValueError, match=r"^TPKimiDeltaAttention\.from_fla: `layer_idx` must be an int in"):
        TPKimiDeltaAttention.from_fla(layer, pool=pool, layer_idx=1)
    with pytest.raises(ValueError, match=r"^TPKimiDeltaAttention\.from_fla: .*tp_size"):
        TPKimiDeltaAttention.from_fla(layer, pool=pool, layer_idx=0, tp_size=3)
    kimi = {"hidden_size": 2304, "rms_norm_eps": 1e-6,
            "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}}
    assert KDALayerConfig.from_kimi_config(kimi) == KDALayerConfig(2304, 32, 32, 128, 128, 128, conv_size=4,
                                                                   gate_bias=False, norm_eps=1e-6)


# ---- validation and slot safety ---------------------------------------------------------------------------------


def _layer(cfg_name: str = "gva") -> tuple[TPKimiDeltaAttention, ReplaySSMStatePool]:
    cfg = CONFIGS[cfg_name]
    pool = _pool(cfg, 0, 2)
    return TPKimiDeltaAttention.from_state_dict(lh.random_weights(cfg, 1), cfg, pool=pool, layer_idx=0), pool


def _snapshot(pool: ReplaySSMStatePool) -> list[torch.Tensor]:
    return [t.clone() for t in (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache, pool.cursors,
                                pool.conv_state)]


def test_bad_arguments_raise_before_writing() -> None:
    layer, pool = _layer()
    slots = pool.alloc(2)
    before = _snapshot(pool)
    x = torch.randn(5, 64)
    cases = [
        (lambda: layer(torch.randn(2, 63), slots), r"`hidden` must be \[B, hidden_size\] with hidden_size=64"),
        (lambda: layer(torch.randn(2, 64, dtype=torch.bfloat16), slots), "dtype torch.float32"),
        (lambda: layer(torch.randn(2, 64), slots.long()), "`slots` must be a 1-D torch.int32"),
        (lambda: layer(torch.randn(3, 64), slots), "one id per row"),
        (lambda: layer(x, slots, torch.tensor([0.0, 2.0, 5.0])), "`cu_seqlens` must be a 1-D int32"),
        (lambda: layer(x, slots, torch.tensor([0, 2], dtype=torch.int32)), r"\[n\+1\] = \[3\]"),
        (lambda: layer(x, slots, torch.tensor([1, 2, 5], dtype=torch.int32)), "must start at 0"),
        (lambda: layer(x, slots, torch.tensor([0, 2, 4], dtype=torch.int32)), "end at the token count 5"),
        (lambda: layer(x, slots, torch.tensor([0, 0, 5], dtype=torch.int32)), "at least one token"),
        (lambda: layer(torch.randn(2, 5, 64), slots, torch.tensor([0, 2, 5], dtype=torch.int32)),
         r"\[1, T, hidden_size\]"),
        (lambda: layer(x, slots, torch.tensor([0, 2, 5], dtype=torch.int32), force_flush=slots), "decode only"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
    for a, b in zip(before, _snapshot(pool)):
        assert torch.equal(a, b)


def test_bad_slots() -> None:
    """A prefill naming a free slot raises SlotError before anything is written; a decode row naming one is a padding
    row (zero output, nothing written) recorded for pool.check(); a padding row (-1) is zero and unrecorded."""
    layer, pool = _layer()
    slots = pool.alloc(3)
    x = torch.randn(5, 64)
    layer(x, slots[:2], torch.tensor([0, 2, 5], dtype=torch.int32), advance=True)
    pool.free(slots[2:])
    before = _snapshot(pool)
    for bad in (torch.tensor([int(slots[0]), int(slots[2])], dtype=torch.int32),
                torch.tensor([int(slots[0]), int(slots[0])], dtype=torch.int32),
                torch.tensor([int(slots[0]), 9], dtype=torch.int32)):
        with pytest.raises(SlotError):
            layer(x, bad, torch.tensor([0, 2, 5], dtype=torch.int32))
        for a, b in zip(before, _snapshot(pool)):
            assert torch.equal(a, b)
    rows = torch.tensor([int(slots[2]), -1], dtype=torch.int32)
    y = layer(torch.randn(2, 64), rows)
    assert bool((y == 0).all())
    for a, b in zip(before, _snapshot(pool)):
        assert torch.equal(a, b)
    with pytest.raises(SlotError, match="decode"):
        pool.check()
    with pytest.raises(SlotError):
        end_prefill(pool, slots[2:])


def test_imports_and_runs_without_fla() -> None:
    """With ``fla`` unimportable the package imports, a CPU prefill and decode run, and prefill_backend='fla' is a
    ValueError saying what to install."""
    code = (
        "import sys; sys.modules['fla'] = None\n"
        "import torch, _layer_helpers as lh\n"
        "from tp_replayssm import ReplaySSMStatePool\n"
        "from tp_replayssm.layers import KDALayerConfig, TPKimiDeltaAttention\n"
        "cfg = KDALayerConfig(32, 2, 2, 16, 16, 16)\n"
        "pool = ReplaySSMStatePool(cfg.heads, num_layers=1, num_slots=2, ring_length=2, conv_kernel_size=4)\n"
        "w = lh.random_weights(cfg, 0)\n"
        "layer = TPKimiDeltaAttention.from_state_dict(w, cfg, pool=pool, layer_idx=0)\n"
        "s = pool.alloc(1)\n"
        "y = layer(torch.randn(3, 32), s, torch.tensor([0, 3], dtype=torch.int32), advance=True)\n"
        "y = layer(torch.randn(1, 32), s, advance=True)\n"
        "assert torch.isfinite(y).all()\n"
        "layer = TPKimiDeltaAttention.from_state_dict(w, cfg, pool=pool, layer_idx=0, prefill_backend='fla')\n"
        "try:\n"
        "    layer(torch.randn(3, 32), s, torch.tensor([0, 3], dtype=torch.int32))\n"
        "except ValueError as e:\n"
        "    assert 'tp_replayssm[fla]' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "print('OK')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TP_REPLAYSSM_CPU_BACKEND")}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{REPO / 'tests'}"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr


# ---- GPU (the device) -------------------------------------------------------------------------------------------


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


def test_bench_layer_smoke_on_cpu(tmp_path: Path) -> None:
    """benchmarks/bench_layer.py runs end to end on a CPU (wall-clock, no graphs, no FLA) and records every part."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_layer

    rc = bench_layer.main(["--device", "cpu", "--hidden", "32", "--heads", "2", "--head-dim", "16", "--tp", "1,2",
                           "--batch", "2", "--ring-length", "2", "--max-sets", "1", "--inputs", "2", "--no-fla",
                           "--out", str(tmp_path)])
    assert rc == 0
    import json

    records = json.loads((tmp_path / "bench_layer.json").read_text())["records"]
    assert [(r["tp"], r["B"], r["heads_local"]) for r in records] == [(1, 2, 2), (2, 2, 1)]
    for r in records:
        assert all(r[k] > 0 for k in ("layer_us", "proj_us", "conv_us", "rec_us", "out_us", "rec_share")), r
