"""Test oracles and random inputs, shared by the tests, the launcher and the benchmarks.

:class:`PlainKDA` is the independent float64 oracle: the plain KDA recurrence with no ring,
``S = S*exp(g); S += beta*(v - S@k) (outer) k; o = S@q``, one full state per slot. It shares no code
with :mod:`tp_replayssm.reference` or the kernel.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """One step's activations for ``B`` rows: ``mixed_qkv [B, 2HK+HV*V]``, ``a [B, HV*K]``, ``b [B, HV]``."""

    mixed_qkv: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass(frozen=True)
class HeadParams:
    """Per-layer constants: ``A_log [HV]`` and ``dt_bias [HV*K]``, fp32."""

    A_log: torch.Tensor
    dt_bias: torch.Tensor


def random_head_params(num_v_heads: int, key_dim: int, *, device: torch.device | str = "cpu",
                       generator: torch.Generator | None = None) -> HeadParams:
    """Gates in the range real KDA checkpoints use: a decay per step ``exp(g)`` between ~0.3 and ~0.99 at ``a = 0``
    (with :func:`random_decode_inputs`' ``a`` added, down to ~0.01)."""
    A_log = torch.empty(num_v_heads).uniform_(-1.0, 0.5, generator=generator)
    dt_bias = torch.empty(num_v_heads * key_dim).uniform_(-4.0, 0.0, generator=generator)
    return HeadParams(A_log.to(device), dt_bias.to(device))


def random_decode_inputs(batch: int, num_q_heads: int, num_v_heads: int, key_dim: int, value_dim: int,
                         *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                         generator: torch.Generator | None = None) -> DecodeInputs:
    """Fresh random activations (drawn on the CPU for reproducibility, then moved)."""
    width = 2 * num_q_heads * key_dim + num_v_heads * value_dim
    mixed_qkv = torch.randn(batch, width, generator=generator)
    a = torch.randn(batch, num_v_heads * key_dim, generator=generator)
    b = torch.randn(batch, num_v_heads, generator=generator)
    return DecodeInputs(*(t.to(device=device, dtype=dtype) for t in (mixed_qkv, a, b)))


class PlainKDA:
    """Float64 plain KDA recurrence over ``num_slots`` states ``[HV, V, K]`` (no ring, no checkpoint).

    ``step`` takes one row per active slot and returns the outputs ``[n, HV, V]`` in float64.
    """

    def __init__(self, num_slots: int, num_q_heads: int, num_v_heads: int, key_dim: int, value_dim: int,
                 *, device: torch.device | str = "cpu"):
        self.H, self.HV, self.K, self.V = num_q_heads, num_v_heads, key_dim, value_dim
        self.device = torch.device(device)
        self.state = torch.zeros(num_slots, num_v_heads, value_dim, key_dim, dtype=torch.float64,
                                 device=self.device)

    def load(self, slots: list[int] | torch.Tensor, states: torch.Tensor) -> None:
        self.state[torch.as_tensor(slots, dtype=torch.long)] = states.double().to(self.device)

    def reset(self, slots: list[int] | torch.Tensor) -> None:
        self.state[torch.as_tensor(slots, dtype=torch.long)] = 0.0

    def step(self, inputs: DecodeInputs, params: HeadParams, slots: list[int] | torch.Tensor, *,
             scale: float | None = None, use_qk_l2norm: bool = True,
             lower_bound: float | None = None) -> torch.Tensor:
        """Advance the rows whose slot is ``>= 0``; return ``out [B, HV, V]`` (zeros for padding)."""
        H, HV, K, V = self.H, self.HV, self.K, self.V
        dev = self.device
        x = inputs.mixed_qkv.detach().double().to(dev)
        B = x.shape[0]
        q = x[:, : H * K].reshape(B, H, K)
        k = x[:, H * K : 2 * H * K].reshape(B, H, K)
        v = x[:, 2 * H * K :].reshape(B, HV, V)
        if use_qk_l2norm:
            q = q / torch.sqrt((q**2).sum(-1, keepdim=True) + 1e-6)
            k = k / torch.sqrt((k**2).sum(-1, keepdim=True) + 1e-6)
        q = q * (K**-0.5 if scale is None else scale)
        group = HV // H
        head_of = torch.arange(HV, device=dev) // group  # q/k head read by each value head
        q, k = q[:, head_of], k[:, head_of]  # [B, HV, K]
        z = inputs.a.detach().double().to(dev).reshape(B, HV, K) + params.dt_bias.double().to(dev).reshape(HV, K)
        A = params.A_log.double().to(dev).exp()[:, None]
        if lower_bound is None:
            softplus = torch.where(z > 20.0, z, torch.log1p(torch.exp(torch.clamp(z, max=20.0))))
            g = -A * softplus
        else:
            g = lower_bound / (1.0 + torch.exp(-A * z))
        beta = 1.0 / (1.0 + torch.exp(-inputs.b.detach().double().to(dev)))  # [B, HV]
        out = torch.zeros(B, HV, V, dtype=torch.float64, device=dev)
        slot_list = torch.as_tensor(slots).tolist()
        rows = [r for r, s in enumerate(slot_list) if s >= 0]
        if not rows:
            return out
        if len({slot_list[r] for r in rows}) != len(rows):
            raise ValueError(f"PlainKDA.step: a slot appears twice in one batch: {slot_list}")
        idx = torch.tensor(rows, device=dev)
        sl = torch.tensor([slot_list[r] for r in rows], device=dev)
        S = self.state[sl] * torch.exp(g[idx])[:, :, None, :]  # [n, HV, V, K]
        err = v[idx] - torch.einsum("nhvk,nhk->nhv", S, k[idx])
        S = S + (beta[idx][:, :, None] * err)[..., None] * k[idx][:, :, None, :]
        self.state[sl] = S
        out[idx] = torch.einsum("nhvk,nhk->nhv", S, q[idx])
        return out


def random_ring_caches(num_slots: int, num_q_heads: int, num_v_heads: int, key_dim: int, value_dim: int,
                       ring_length: int, *, state_dtype: torch.dtype = torch.float32, predecayed: bool = False,
                       device: torch.device | str = "cpu", generator: torch.Generator | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches of ``num_slots`` slots, every ring entry filled: checkpoint ``[S, HV, V, K]`` (``state_dtype``),
    bf16 rings ``d [S, HV, L, V]`` and ``k [S, H, L, K]``, fp32 ``g [S, HV, L, K]`` (per-step log-gates in
    ``(-0.05, 0]``). ``predecayed``: the pre-decayed layout (``k`` drawn per value head, then ``k * exp(-G)``; ``g``
    cumulative), so with ``H < HV`` its draws are not the sglang layout's (with ``H = HV`` they are, pre-decayed).
    Drawn on ``device``, or with ``generator`` on the CPU and then moved."""
    from .reference import predecay_rings

    draw = torch.device("cpu") if generator is not None else torch.device(device)
    S, H, HV, K, V, L = num_slots, num_q_heads, num_v_heads, key_dim, value_dim, ring_length
    state = (0.05 * torch.randn(S, HV, V, K, device=draw, generator=generator)).to(state_dtype)
    d = (0.05 * torch.randn(S, HV, L, V, device=draw, generator=generator)).bfloat16()
    k = 0.1 * torch.randn(S, HV if predecayed else H, L, K, device=draw, generator=generator)
    g = -0.05 * torch.rand(S, HV, L, K, device=draw, generator=generator)
    if predecayed:
        k, g = predecay_rings(k, g)
    return tuple(t.to(device) for t in (state, d, k.bfloat16(), g))  # type: ignore[return-value]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64; a NaN or inf in either gives ``inf``."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    return float((a - e).norm() / e.norm().clamp_min(1e-30))
