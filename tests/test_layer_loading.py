"""Loading ``tp_replayssm.layers.TPKimiDeltaAttention``: each rank reads only its slices of a lazy state dict under
Kimi-Linear's names, the warning of a sharded layer without a group, the loader's errors, and what ``from_fla`` /
``KDALayerConfig.from_fla`` / ``from_kimi_config`` accept and refuse.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import _layer_helpers as lh
from _layer_case_helpers import CONFIGS, _pool
from tp_replayssm import ReplaySSMStatePool
from tp_replayssm.layers import KDALayerConfig, TPKimiDeltaAttention


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
