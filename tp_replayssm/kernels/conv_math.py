"""The short convolution's math on loaded tiles, shared by the conv kernel (:mod:`.conv_once`) and the decode kernel's
fused conv (:mod:`.decode`); traced by Helion as torch code (it indexes no kernel argument).

A channel's taps arrive as one ``[C, width]`` tile ``u``: its window columns ``0 .. W-2`` (oldest first), then its
input in column ``W-1`` (:func:`taps_tile`), beside the weights ``w [C, width]`` (zero past ``W``). The output is
``silu(sum_i w[:, i] * u[:, i] + bias)``, the sum a tree over the taps, and the new window is ``u``'s columns ``1 ..
W-1``, which the kernels store back with the column index shifted by one.
"""

from __future__ import annotations

import torch

import helion.language as hl

__all__ = ["conv_output", "silu", "taps_tile"]


def taps_tile(window: torch.Tensor, x_col: torch.Tensor, last_tap: torch.Tensor) -> torch.Tensor:
    """``u [C, width]`` fp32: ``window [C, width]`` (columns ``< W-1`` loaded, the rest ignored) with the input
    ``x_col [C, 1]`` in column ``W-1`` (``last_tap [1, width]``: ``taps == W-1``). The vectors come broadcast: Helion
    1.5.0 fails to lower an indexing such as ``x[:, None]`` inside a helper."""
    return torch.where(last_tap, x_col.to(torch.float32), window.to(torch.float32))


def silu(acc: torch.Tensor, on_gpu: bool) -> torch.Tensor:
    """``acc * sigmoid(acc)`` (fp32); on the GPU as ``acc / (1 + 2^(-acc log2 e))`` with the approximate ex2 and rcp
    (5 instructions where ``torch.sigmoid`` lowers to ~12; a few ulp)."""
    if on_gpu:
        return hl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; add.f32 t, t, 0f3F800000; "
            "rcp.approx.ftz.f32 t, t; mul.f32 $0, $1, t; }", "=r,r", [acc], dtype=torch.float32, is_pure=True, pack=1)
    return acc * torch.sigmoid(acc)


def conv_output(u: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, on_gpu: bool) -> torch.Tensor:
    """``silu(sum_i w[:, i] * u[:, i] + bias) [C]`` fp32 from ``u, w [C, width]`` and ``bias [C]`` (or None)."""
    acc = torch.sum(u * w, dim=1)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return silu(acc, on_gpu)
