"""The decode kernel's fused conv (:mod:`tp_replayssm.kernels.decode`, ``fused_conv``; docs/conv.md, the fused conv).

Device helpers that Helion traces into the kernel: the prologue's conv of a program's channels from their windows,
as loads and math (:func:`conv_taps`, :func:`conv_qk`) and stores (:func:`conv_stores`, :func:`conv_qk_store`), which
:func:`conv_prologue` runs in one place after the slot's verdict and the ``early_qk`` form splits around it; and the
counted mode's q/k window writes after the chunk loops (:func:`conv_qk_windows`). They read and write the kernel's
tensors through ``hl.load``, ``hl.store`` and ``hl.subscript`` (Helion rewrites ``x[...]`` in the kernel body only);
the math on the loaded tiles is :mod:`.conv_math`'s.

A channel's window is its ``W-1`` columns of ``conv_rows`` in row ``cv_row + channel * cv_d``; the taps are ``ci =
hl.arange(conv_width)``, ``in_window [width]`` the columns ``< W-1`` and ``last_tap [1, width]`` the column ``W-1``.
"""

from __future__ import annotations

import torch
from torch import Tensor

import helion.language as hl
from helion.language import Tile

from .conv_math import conv_output, taps_tile
from .decode_math import as_col, as_row, qk_math

__all__ = ["conv_prologue", "conv_qk", "conv_qk_store", "conv_qk_windows", "conv_stores", "conv_taps"]


def _window(conv_rows: Tensor, rows: Tensor, ci: Tensor, in_window: Tensor) -> Tensor:
    """The window columns ``[C, width]`` of the channels in ``rows [C]`` (the columns ``>= W-1`` masked)."""
    return hl.load(conv_rows, [rows, torch.where(in_window, ci, 0)], extra_mask=as_row(in_window))


def _taps(conv_w: Tensor, ch: Tensor, ci: Tensor, conv_size: int, cw_d: int, cw_i: int) -> Tensor:
    """The taps ``[C, width]`` fp32 of the channels ``ch [C]`` (zero past ``W``)."""
    return hl.load(conv_w, [as_col(ch) * cw_d + as_row(ci) * cw_i],
                   extra_mask=as_row(ci < conv_size)).to(torch.float32)


def conv_taps(conv_rows: Tensor, conv_w: Tensor, conv_b: Tensor, q3: Tensor, k3: Tensor, v3: Tensor, row: int,
              h: int, hv: int, tv: Tile, H: int, V: int, kk: Tensor, ci: Tensor, in_window: Tensor, last_tap: Tensor,
              cv_row: Tensor, cv_d: int, cw_d: int, cw_i: int, conv_size: int, conv_has_bias: bool,
              on_gpu: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q_u, k_u, v_u, q_post, k_post, v_post)``: the taps ``[C, width]`` fp32 of the program's channels (q and k
    of head ``h``, ``[K]`` each with ``kk = hl.arange(K)``; v of value head ``hv``'s tile ``tv``) from their windows
    and the pre-conv inputs, and their conv outputs fp32 ``[C]``. It loads and computes; it stores nothing."""
    q_ch = h * q3.size(2) + kk  # channels of q head h, of its k head, of this value tile
    k_ch = (H + h) * q3.size(2) + kk
    v_ch = 2 * H * q3.size(2) + hv * V + tv.index
    q_u = taps_tile(_window(conv_rows, cv_row + q_ch * cv_d, ci, in_window),
                    as_col(hl.load(q3, [row, h, slice(None)])), last_tap)
    k_u = taps_tile(_window(conv_rows, cv_row + k_ch * cv_d, ci, in_window),
                    as_col(hl.load(k3, [row, h, slice(None)])), last_tap)
    v_u = taps_tile(_window(conv_rows, cv_row + v_ch * cv_d, ci, in_window), as_col(hl.load(v3, [row, hv, tv])),
                    last_tap)
    q_w = _taps(conv_w, q_ch, ci, conv_size, cw_d, cw_i)
    k_w = _taps(conv_w, k_ch, ci, conv_size, cw_d, cw_i)
    v_w = _taps(conv_w, v_ch, ci, conv_size, cw_d, cw_i)
    if conv_has_bias:
        q_post = conv_output(q_u, q_w, hl.load(conv_b, [q_ch]), on_gpu)
        k_post = conv_output(k_u, k_w, hl.load(conv_b, [k_ch]), on_gpu)
        v_post = conv_output(v_u, v_w, hl.load(conv_b, [v_ch]), on_gpu)
    else:
        q_post = conv_output(q_u, q_w, None, on_gpu)
        k_post = conv_output(k_u, k_w, None, on_gpu)
        v_post = conv_output(v_u, v_w, None, on_gpu)
    return q_u, k_u, v_u, q_post, k_post, v_post


def conv_stores(conv_rows: Tensor, q3: Tensor, out3: Tensor, row: int, h: int, hv: int, tv: Tile, H: int, V: int,
                kk: Tensor, ci: Tensor, cv_row: Tensor, cv_d: int, conv_size: int, fused_conv: int, q_u: Tensor,
                k_u: Tensor, v_u: Tensor, v_post: Tensor) -> tuple[Tensor, Tensor]:
    """``(shifted, to_col)``: store :func:`conv_taps`' post-conv v in ``out3``'s rows of the tile and the tile's new
    v window (with ``fused_conv`` 1 the q/k windows too); ``shifted [width]`` are the taps a window keeps and
    ``to_col`` the columns they move to."""
    v_ch = 2 * H * q3.size(2) + hv * V + tv.index
    # the post-conv values in the activation dtype, as the conv's own launch would hand them over;
    # v in out3's rows of this tile until the chunk loops read it through vpost3 (and overwrite it
    # with the outputs): Helion puts a CTA barrier before every load of a tensor the program stores,
    # and the loops load vpost3, which it never stores (the barrier below orders the two)
    hl.store(out3, [row, hv, tv], v_post.to(out3.dtype))
    hl.inline_triton("tl.debug_barrier()", [], None)  # the window reads and the v rows, ordered
    shifted = (ci >= 1) & (ci < conv_size)
    to_col = torch.where(shifted, ci - 1, 0)
    hl.store(conv_rows, [cv_row + v_ch * cv_d, to_col], v_u.to(conv_rows.dtype),  # the new v window
             extra_mask=as_row(shifted))
    if fused_conv == 1:  # the only program that reads this q/k head's windows writes them
        conv_qk_store(conv_rows, q3, h, H, kk, cv_row, cv_d, shifted, to_col, q_u, k_u)
    return shifted, to_col


def conv_qk_store(conv_rows: Tensor, q3: Tensor, h: int, H: int, kk: Tensor, cv_row: Tensor, cv_d: int,
                  shifted: Tensor, to_col: Tensor, q_u: Tensor, k_u: Tensor) -> None:
    """Store head ``h``'s new q/k windows: :func:`conv_taps`' ``q_u``, ``k_u`` with the kept taps ``shifted``
    one column down (``to_col``)."""
    q_ch = h * q3.size(2) + kk
    k_ch = (H + h) * q3.size(2) + kk
    hl.store(conv_rows, [cv_row + q_ch * cv_d, to_col], q_u.to(conv_rows.dtype), extra_mask=as_row(shifted))
    hl.store(conv_rows, [cv_row + k_ch * cv_d, to_col], k_u.to(conv_rows.dtype), extra_mask=as_row(shifted))


def conv_qk(q3: Tensor, k3: Tensor, q_post: Tensor, k_post: Tensor, scale: float,
            use_l2norm: bool) -> tuple[Tensor, Tensor]:
    """q and k (fp32 ``[K]``) from their conv outputs, rounded to the activation dtype as the conv's own launch hands
    them over, through ``qk_math``."""
    return qk_math(q_post.to(q3.dtype).to(torch.float32), k_post.to(k3.dtype).to(torch.float32), scale, use_l2norm)


def conv_prologue(conv_rows: Tensor, conv_w: Tensor, conv_b: Tensor, q3: Tensor, k3: Tensor, v3: Tensor,
                  out3: Tensor, row: int, h: int, hv: int, tv: Tile, H: int, V: int, kk: Tensor, ci: Tensor,
                  in_window: Tensor, last_tap: Tensor, cv_row: Tensor, cv_d: int, cw_d: int, cw_i: int,
                  conv_size: int, conv_has_bias: bool, fused_conv: int, on_gpu: bool, scale: float,
                  use_l2norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q, k, shifted, to_col)``: :func:`conv_taps`, :func:`conv_stores` and :func:`conv_qk` in one place (the
    conv after the slot's verdict)."""
    q_u, k_u, v_u, q_post, k_post, v_post = conv_taps(conv_rows, conv_w, conv_b, q3, k3, v3, row, h, hv, tv, H, V,
                                                      kk, ci, in_window, last_tap, cv_row, cv_d, cw_d, cw_i,
                                                      conv_size, conv_has_bias, on_gpu)
    shifted, to_col = conv_stores(conv_rows, q3, out3, row, h, hv, tv, H, V, kk, ci, cv_row, cv_d, conv_size,
                                  fused_conv, q_u, k_u, v_u, v_post)
    q, k = conv_qk(q3, k3, q_post, k_post, scale, use_l2norm)
    return q, k, shifted, to_col


def conv_qk_windows(conv_rows: Tensor, q3: Tensor, k3: Tensor, row: int, h: int, H: int, kk: Tensor, ci: Tensor,
                    in_window: Tensor, last_tap: Tensor, cv_row: Tensor, cv_d: int, shifted: Tensor,
                    to_col: Tensor) -> None:
    """Write the new q/k windows of head ``h`` (``kk``, ``ci``, ``in_window``, ``last_tap``, ``cv_row``, ``shifted``
    and ``to_col`` as :func:`conv_prologue` had them): the windows and inputs read again, then, behind a CTA
    barrier, each window's kept taps one column down."""
    eq_ch = h * q3.size(2) + kk
    ek_ch = (H + h) * q3.size(2) + kk
    eq_u = taps_tile(_window(conv_rows, cv_row + eq_ch * cv_d, ci, in_window),
                     as_col(hl.load(q3, [row, h, slice(None)])), last_tap)
    ek_u = taps_tile(_window(conv_rows, cv_row + ek_ch * cv_d, ci, in_window),
                     as_col(hl.load(k3, [row, h, slice(None)])), last_tap)
    hl.inline_triton("tl.debug_barrier()", [], None)
    hl.store(conv_rows, [cv_row + eq_ch * cv_d, to_col], eq_u.to(conv_rows.dtype), extra_mask=as_row(shifted))
    hl.store(conv_rows, [cv_row + ek_ch * cv_d, to_col], ek_u.to(conv_rows.dtype), extra_mask=as_row(shifted))
