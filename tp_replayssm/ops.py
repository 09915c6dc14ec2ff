"""``replayssm_decode``: the KDA ReplaySSM decode op, one token per row, in place.

The signature is the one SGLang's Helion ReplaySSM kernel takes, so the op is a drop-in for it; the contract is in
docs/contract.md. The op validates every argument (``ValueError`` before anything is written), builds the kernel's
views without copying any cache, and runs on the inputs' device whatever the current device is: the Helion kernel on
CUDA tensors, the PyTorch path of :mod:`tp_replayssm.reference` on CPU tensors (or the kernel in Triton's
interpreter: :mod:`tp_replayssm.kernels.backend`).
"""

from __future__ import annotations

import torch

from .kernels.launch import run_decode
from .validation import DecodeCall

__all__ = ["replayssm_decode"]


def replayssm_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor,
    d_cache: torch.Tensor,
    k_cache: torch.Tensor,
    g_cache: torch.Tensor,
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    write_pos: torch.Tensor,
    force_flush: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    lower_bound: float | None = None,
    *,
    ring_layout: str = "sglang",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA ReplaySSM decode, one token per row, in place. Returns ``(out, initial_state)``.

    Shapes: ``mixed_qkv [B, 2HK+HV*V]``, ``a [B, HV*K]`` or ``[B, HV, K]``, ``b [B, HV]``, ``A_log [HV]``,
    ``dt_bias [HV*K]`` or ``[HV, K]``, ``initial_state [S, HV, V, K]``, ``d_cache [S, HV, L, V]``, ``k_cache
    [S, H, L, K]``, ``g_cache [S, HV, L, K]``, ``out [B, 1, HV, V]``, ``ssm_state_indices`` / ``write_pos`` /
    ``force_flush [B]`` int32. ``ring_layout="predecayed"`` runs the pool's default layout instead (``k_cache
    [S, HV, L, K]`` holds pre-decayed keys, ``g_cache`` cumulative gates; docs/contract.md)."""
    call = DecodeCall(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
                      ssm_state_indices, write_pos, force_flush, use_qk_l2norm_in_kernel, lower_bound)
    run_decode(call, ring_layout=ring_layout)
    return out, initial_state
