"""The PyTorch prefill math of ``tp_replayssm.layers.kda_torch`` in float64: ``chunk_kda_torch`` against the
token-by-token recurrence and ``packed_conv`` against a per-sequence loop over window-then-tokens.
"""

from __future__ import annotations

import pytest
import torch

import _layer_helpers as lh
from tp_replayssm.layers.kda_torch import chunk_kda_torch, kda_activations, packed_conv


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
