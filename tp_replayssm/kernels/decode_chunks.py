"""One value chunk of the decode kernel's loops (:mod:`tp_replayssm.kernels.decode`; docs/kernel_design.md).

Device helpers that Helion traces into the kernel's chunk loops: the append loop on CUDA cores and the flush loop
(:func:`chunk_step`, one helper for both), the append loop on tensor cores (:func:`mma_chunk`), and the pre-decayed
rebase pass (:func:`rebase_chunk`, :func:`empty_ring`). The loops, the ring replays inside them and the stores that
depend on one mode's variables stay in the kernel body. The helpers read and write the kernel's tensors with
``hl.load`` and ``hl.store`` and broadcast with ``hl.subscript`` (``as_col``, ``as_row``): Helion rewrites ``x[...]``
in the kernel body only, and a torch slice such as ``x[None, :]`` inside a helper called from two loops fails to
lower (InductorLoweringError on ``aten.slice``).

A chunk is the value rows ``rows [Vc]`` of the tile ``tv`` (``live``: the rows ``< tv.end``), its checkpoint rows ``[Vc,
K]`` (or ``[Ko, Vc, Ki, kv]`` tiles of ``state_vecs``) at ``st_base + rows * st_v``, and its ring deltas ``[Lb, Vc]``,
entries ``j = hl.arange(Lb)`` at ``dr_base + j * dr_l`` (``valid``: the live ones, ``j < c``).
"""

from __future__ import annotations

import torch
from torch import Tensor

import helion.language as hl
from helion.language import Tile

from .decode_math import as_col, as_row, chunk_outputs, ring_rows

__all__ = ["chunk_step", "empty_ring", "mma_chunk", "rebase_chunk"]


def chunk_step(state_rows: Tensor, state_vecs: Tensor, d_rows: Tensor, v3: Tensor, vpost3: Tensor, out3: Tensor,
               S_next: Tensor, d_next: Tensor, rows: Tensor, live: Tensor, tv: Tile, value_chunk: int,
               st_base: Tensor, st_v: int, dr_base: Tensor, dr_l: int, j: Tensor, valid: Tensor, vector_tiles: int,
               on_vecs: int, fused_conv: int, row: int, hv: int, ak: Tensor, aq: Tensor, wk_col: Tensor,
               wq_col: Tensor, beta: Tensor, kq: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(S0, d_ring, delta, S_next, d_next)`` of the chunk ``rows``, the next chunk's loads in flight: its
    checkpoint rows ``S0`` and ring deltas ``d_ring [Lb, Vc]`` (fp32, dead entries 0) from the loads ``S_next``,
    ``d_next`` the previous step issued, which it issues again for the next chunk (masked after the last); its
    ``delta [Vc]``; and its outputs, stored in ``out3``. ``on_vecs``: the checkpoint as ``state_vecs`` tiles
    ``[Ko, Vc, Ki, kv]`` (``ak``, ``aq`` as ``[Ko, 1, Ki, kv]``), else ``[Vc, K]`` rows (``ak``, ``aq`` as
    ``[1, K]``). ``v`` comes from ``vpost3`` with the fused conv (``v3`` holds the pre-conv inputs), else ``v3``."""
    S0 = S_next.to(torch.float32)  # [Ko, Vc, Ki, kv] (vector_tiles) or [Vc, K]
    d_ring = torch.where(as_col(valid), d_next.to(torch.float32), 0.0)  # [Lb, Vc]
    after = rows + value_chunk  # prefetch the next chunk (masked after the last)
    if on_vecs:
        S_next = hl.load(state_vecs, [slice(None), st_base + after * st_v, slice(None), slice(None)],
                         extra_mask=hl.subscript(after < tv.end, [None, slice(None), None, None]))
    else:
        S_next = hl.load(state_rows, [st_base + after * st_v, slice(None)], extra_mask=as_col(after < tv.end))
    d_next = hl.load(d_rows, [ring_rows(dr_base + j * dr_l, vector_tiles), after],
                     extra_mask=as_col(valid) & as_row(after < tv.end))
    if fused_conv:
        v_c = hl.load(vpost3, [row, hv, rows], extra_mask=live).to(torch.float32)
    else:
        v_c = hl.load(v3, [row, hv, rows], extra_mask=live).to(torch.float32)
    delta, out = chunk_outputs(S0, d_ring, v_c, ak, aq, wk_col, wq_col, beta, kq)
    hl.store(out3, [row, hv, rows], out.to(out3.dtype), extra_mask=live)
    return S0, d_ring, delta, S_next, d_next


def mma_chunk(state_rows: Tensor, d_rows: Tensor, v3: Tensor, vpost3: Tensor, out3: Tensor, mrows: Tensor,
              mlive: Tensor, st_base: Tensor, st_v: int, dr_base: Tensor, dr_l: int, j: Tensor, valid: Tensor,
              a_mat: Tensor, w_mat: Tensor, k_col: Tensor, fused_conv: int, row: int, hv: int, beta: Tensor,
              kq: Tensor) -> Tensor:
    """``delta [Vc]`` of the chunk ``mrows`` with its products on tensor cores: ``S0 @ a_mat + D^T @ w_mat`` (``a_mat
    [K, 16]``, ``w_mat [Lb, 16]`` bf16, ``split3_columns``), the k products in the columns ``k_col [1, 16]`` and
    the q products in the others; its outputs are stored in ``out3`` (``v`` as in :func:`chunk_step`)."""
    mS0 = hl.load(state_rows, [st_base + mrows * st_v, slice(None)], extra_mask=as_col(mlive))
    md_ring = hl.load(d_rows, [dr_base + j * dr_l, mrows],
                      extra_mask=as_col(valid) & as_row(mlive))  # dead entries load 0
    prod = hl.dot(md_ring.T, w_mat, acc=hl.dot(mS0, a_mat))  # [Vc, 16] fp32
    mspk = torch.sum(torch.where(k_col, prod, 0.0), dim=1)  # S' @ k
    mspq = torch.sum(torch.where(k_col, 0.0, prod), dim=1)  # S' @ q
    if fused_conv:
        mv_c = hl.load(vpost3, [row, hv, mrows], extra_mask=mlive).to(torch.float32)
    else:
        mv_c = hl.load(v3, [row, hv, mrows], extra_mask=mlive).to(torch.float32)
    mdelta = beta * (mv_c - mspk)
    hl.store(out3, [row, hv, mrows], (mspq + mdelta * kq).to(out3.dtype), extra_mask=mlive)
    return mdelta


def rebase_chunk(state_rows: Tensor, d_rows: Tensor, v3: Tensor, zrows: Tensor, zlive: Tensor, st_base: Tensor,
                 st_v: int, dr_base: Tensor, dr_l: int, j: Tensor, valid: Tensor, cur: Tensor, vector_tiles: int,
                 fused_conv: int, row: int, hv: int, e_new: Tensor, k: Tensor, ak_row: Tensor, aq_row: Tensor,
                 wk_col: Tensor, wq_col: Tensor, beta: Tensor, kq: Tensor) -> Tensor:
    """``zS [Vc, K]`` fp32, the rebase pass's chunk ``zrows`` before its ring replay: the checkpoint rows decayed
    to the new base plus this step's update, ``S0*exp(G_c) + delta (outer) k`` (``e_new = exp(G_c)``, ``k [K]``)."""
    zS0 = hl.load(state_rows, [st_base + zrows * st_v, slice(None)], extra_mask=as_col(zlive)).to(torch.float32)
    zd = hl.load(d_rows, [ring_rows(dr_base + j * dr_l, vector_tiles), zrows],
                 extra_mask=as_col(valid) & as_row(zlive)).to(torch.float32)
    if fused_conv:  # the post-conv v is gone (the outputs took its rows): the append
        # loop stored this step's delta at c, as a flush would read it from the ring
        zdelta = hl.load(d_rows, [dr_base + cur * dr_l, zrows], extra_mask=zlive).to(torch.float32)
    else:
        zv = hl.load(v3, [row, hv, zrows], extra_mask=zlive).to(torch.float32)
        zdelta, _ = chunk_outputs(zS0, zd, zv, ak_row, aq_row, wk_col, wq_col, beta, kq)
    return zS0 * as_row(e_new) + as_col(zdelta) * as_row(k)


def empty_ring(d_rows: Tensor, dr_base: Tensor, dr_l: int, j: Tensor, last: Tensor, rows: Tensor, live: Tensor,
               vector_tiles: int, ring_block: int, value_chunk: int) -> None:
    """Zero the ring deltas ``j <= last`` of the value rows ``rows`` behind a CTA barrier: other threads' loads of
    those rows must be done first (Helion does not order a write-after-read)."""
    hl.inline_triton("tl.debug_barrier()", [], None)
    hl.store(d_rows, [ring_rows(dr_base + j * dr_l, vector_tiles), rows],
             hl.zeros([ring_block, value_chunk], d_rows.dtype), extra_mask=as_col(j <= last) & as_row(live))
