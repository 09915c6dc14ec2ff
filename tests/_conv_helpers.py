"""Helpers of the conv-state tests (tests/test_conv.py, test_conv_storage.py, test_conv_kernel.py,
test_conv_forms.py): the shapes, the float64 oracles, pools with sentinel-filled windows, conv weights, the bad-slot
cases with their check, and pairs of pools for the decode with the conv.

The float64 oracles share no code with the library: :func:`conv1d_oracle` runs ``torch.nn.functional.conv1d``
(depthwise, causal by left zero padding) over a row's whole sequence, :func:`taps_oracle` sums the taps over a loaded
window explicitly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _slot_cases import assert_reported, bad_slot_cases
from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.kernels.backend import cpu_backend, use_cpu_backend
from tp_replayssm.testing import random_head_params

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
    assert_reported(pool, {r: slots[r] for r in bad_rows}, "ReplaySSMStatePool.conv_update(layer=1)",
                    f"{len(bad_rows)} row(s)")


# ---- decode with the conv -----------------------------------------------------------------------


def decode_pair(device: str = "cpu", W: int = 4) -> tuple[ReplaySSMStatePool, ReplaySSMStatePool, object]:
    pools = []
    for _ in range(2):
        p = make_pool(W, conv_dtype=torch.bfloat16, device=device)
        random_windows(p, [0, 2, 3], seed=21)
        pools.append(p)
    return pools[0], pools[1], random_head_params(HV, K, device=device, generator=torch.Generator().manual_seed(2))
