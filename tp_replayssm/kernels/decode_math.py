"""Helpers of the decode kernel (:mod:`tp_replayssm.kernels.decode`), traced by Helion as ordinary torch code.

They do math on values the kernel loaded; none indexes a kernel argument (Helion cannot lower ``t[...]`` of one
inside a helper: the helpers that load and store, :mod:`.decode_chunks` and :mod:`.decode_conv`, call ``hl.load`` and
``hl.store``). Vectors come in broadcastable (``[1, K]``, ``[Lb, 1]``), or are broadcast with :func:`as_row` and
:func:`as_col` (``hl.subscript``): Helion 1.5.0 fails to lower a torch indexing such as ``x[None, :]`` of a kernel
value inside a helper called from two loops.
"""

from __future__ import annotations

import torch

import helion.language as hl

__all__ = ["as_col", "as_row", "chunk_outputs", "decayed_keys", "flush_keys", "g_entry", "gate_math", "k_entry",
           "qk_math", "ring_rows", "row_dots", "sglang_weights", "split3_columns", "vector_tile"]


def as_col(x: torch.Tensor) -> torch.Tensor:
    """``x [N]`` as ``[N, 1]``: the kernel body's ``x[:, None]`` (``hl.subscript``), which lowers in any helper."""
    return hl.subscript(x, [slice(None), None])


def as_row(x: torch.Tensor) -> torch.Tensor:
    """``x [N]`` as ``[1, N]``: the kernel body's ``x[None, :]`` (``hl.subscript``), which lowers in any helper."""
    return hl.subscript(x, [None, slice(None)])


def qk_math(q: torch.Tensor, k: torch.Tensor, scale: float, use_l2norm: bool):
    """Scaled q and k (fp32 ``[K]``), l2-normalized when asked."""
    if use_l2norm:
        q = q * torch.rsqrt(torch.sum(q * q, dim=0) + 1e-6)
        k = k * torch.rsqrt(torch.sum(k * k, dim=0) + 1e-6)
    return q * scale, k


def gate_math(x: torch.Tensor, A_log: torch.Tensor, lower_bound: float, use_lower_bound: bool) -> torch.Tensor:
    """Log-gate ``g [K]`` from ``x = a + dt_bias`` (fp32 ``[K]``) and the head's scalar ``A_log``."""
    A = torch.exp(A_log)
    if use_lower_bound:
        return lower_bound * torch.sigmoid(A * x)
    return -A * torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))


def decayed_keys(g_ring: torch.Tensor, k_ring: torch.Tensor, valid: torch.Tensor, reverse_scan: bool):
    """``kdec [Lb, K] = k_j * exp(sum_{j<i<c} g_i)`` (zero for j >= c) and ``tot = sum_{j<c} g_j [K]``.

    The suffix sum is ``tot - (inclusive prefix sum)``, a forward scan, unless ``reverse_scan`` (the tiny-batch
    path, docs/tuning.md). A
    reverse ``hl.cumsum`` costs Triton two flips of the tile across lanes and warps but is the shorter
    dependency chain. The forward form's subtraction rounds ``2^-24 * |tot|`` absolute, on exponents whose weights
    ``exp(after)`` are at most 1."""
    g_ring = torch.where(valid[:, None], g_ring, 0.0)
    if reverse_scan:
        after = hl.cumsum(g_ring, 0, reverse=True) - g_ring  # sum of the valid entries after j
    else:
        after = torch.sum(g_ring, dim=0, keepdim=True) - hl.cumsum(g_ring, 0)
    kdec = torch.where(valid[:, None], k_ring.to(torch.float32) * torch.exp(after), 0.0)
    return kdec, torch.sum(g_ring, dim=0)


def sglang_weights(g_ring: torch.Tensor, k_ring: torch.Tensor, valid: torch.Tensor, reverse_scan: bool,
                   eg: torch.Tensor, k: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(kdec, wk, wq, et, ak, aq)`` of the sglang layout, whose g ring holds gates: the decayed keys ``kdec [Lb,
    K]`` (:func:`decayed_keys`), the ring weights ``wk = kdec @ (eg * k)`` and ``wq`` likewise ``[Lb]``, the ring's
    decay ``et = exp(tot) [K]``, and the checkpoint weights ``ak = et * eg * k`` and ``aq`` likewise ``[K]``, so that
    ``S' @ k = S0 @ ak + D^T wk``. ``eg = exp(g)``, ``k``, ``q``: fp32 ``[K]``."""
    kdec, tot = decayed_keys(g_ring, k_ring, valid, reverse_scan)  # tiny batches: reverse scan
    xk = eg * k
    xq = eg * q
    wk = torch.sum(kdec * as_row(xk), dim=1)  # [Lb]
    wq = torch.sum(kdec * as_row(xq), dim=1)
    et = torch.exp(tot)
    ak = et * xk  # S0 @ ak = the checkpoint's part of S' @ k
    aq = et * xq
    return kdec, wk, wq, et, ak, aq


def chunk_outputs(S0, d_ring, v_c, ak, aq, wk, wq, beta, kq):  # noqa: ANN001, ANN202 - traced by Helion
    """``delta [Vc]`` and ``out [Vc]`` of one value chunk from its checkpoint rows ``S0 [Vc, K]`` and ring
    deltas ``d_ring [Lb, Vc]`` (fp32): ``S' @ k = S0 @ ak + D^T wk``, likewise for q. The vectors come
    broadcastable (``ak, aq [1, K]``, ``wk, wq [Lb, 1]``): Helion 1.5.0 fails to lower an indexing such as
    ``ak[None, :]`` of a kernel value inside a helper called from two loops."""
    spk = row_dots(S0, ak) + torch.sum(d_ring * wk, dim=0)
    spq = row_dots(S0, aq) + torch.sum(d_ring * wq, dim=0)
    delta = beta * (v_c - spk)
    return delta, spq + delta * kq


def row_dots(S0, a):  # noqa: ANN001, ANN202 - traced by Helion
    """``S0 @ a`` per row: ``S0 [Vc, K]`` with ``a [1, K]``, or ``S0 [Ko, Vc, Ki, kv]`` (the append loop's
    vector tiles, see ``state_vecs``) with ``a [Ko, 1, Ki, kv]``."""
    if S0.dim() == 4:
        return torch.sum(torch.sum(torch.sum(S0 * a, dim=3), dim=2), dim=0)
    return torch.sum(S0 * a, dim=1)


def vector_tile(x, tiles):  # noqa: ANN001, ANN202 - traced by Helion
    """``x [K]`` as ``[Ko, 1, Ki, kv]``, broadcastable against the ``[Ko, Vc, Ki, kv]`` tiles of ``tiles``'s split."""
    return x.reshape(tiles.size(0), tiles.size(2), tiles.size(3))[:, None, :, :]


def ring_rows(rows, vector_tiles):  # noqa: ANN001, ANN202 - traced by Helion
    """A head's d-ring rows ``[Lb]`` (in the rows view) for an ``[Lb, Vc]`` access; with ``vector_tiles``, their
    alignment hidden from Triton beyond 4 elements (``tl.multiple_of(rows, 4)``). A ring tile loaded with it gets
    8-byte vectors, so Triton's coalescing spreads it over 8 lanes of ring entries and 4 of value rows (16-byte
    vectors put 16 lanes on the entries) and the reduction over the ring is mostly in-thread. Every ``[Lb, Vc]``
    access takes it: the coalescing gives the loads and stores that share an address computation the widest
    vector among them (docs/tuning.md, vector tiles)."""
    if vector_tiles:
        return hl.inline_triton("tl.multiple_of({0}, 4)", [rows], rows)
    return rows


def g_entry(g, g_cum, keep, predecayed_ring):  # noqa: ANN001, ANN202 - traced by Helion
    """The append's g-ring entry at position c: ``G_c = G_{c-1} + g`` in the pre-decayed layout (0, the new base,
    for a rebasing head of mode 3: ``keep`` false), ``g`` in the sglang layout. (Helion traces helpers on fake
    tensors, so the stores, at data-dependent rows, stay in the kernel body.)"""
    if predecayed_ring == 3:
        return torch.where(keep, g_cum, 0.0)
    if predecayed_ring:
        return g_cum
    return g


def k_entry(k, g_cum, keep, predecayed_ring):  # noqa: ANN001, ANN202 - traced by Helion
    """The append's k-ring entry at position c: ``kt_c = k*exp(-G_c)`` in the pre-decayed layout (0 for a rebasing
    head of mode 3), ``k`` in the sglang layout."""
    if predecayed_ring == 3:
        return torch.where(keep, k * torch.exp(-g_cum), 0.0)
    if predecayed_ring:
        return k * torch.exp(-g_cum)
    return k


def split3_columns(xk, xq, col):  # noqa: ANN001, ANN202 - traced by Helion
    """``[N, 16]`` bf16 MMA operand from two fp32 columns ``xk, xq [N, 1]`` (``col [1, 16]`` the column
    index; both come broadcast, as in ``chunk_outputs``): columns 0, 1, 2 hold ``xk`` split into
    ``hi + mid + lo`` bf16 parts (``hi = bf16(x)``, ``mid = bf16(x - hi)``, ``lo = bf16(x - hi - mid)``;
    the sum is ``x`` to ~2^-24 relative), columns 8, 9, 10 the same of ``xq``, the rest zero. ``A @ M``
    summed over columns 0-7 is then ``A @ xk`` to fp32 accuracy when ``A`` is exact in bf16."""
    full = torch.where(col < 8, xk, xq)
    rest1 = full - full.to(torch.bfloat16).to(torch.float32)
    rest2 = rest1 - rest1.to(torch.bfloat16).to(torch.float32)
    part = col % 8
    return torch.where(part == 0, full, torch.where(part == 1, rest1, torch.where(part == 2, rest2, 0.0))).to(
        torch.bfloat16)


def flush_keys(kdec: torch.Tensor, decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k_hi, k_mid, k_lo)`` bf16 ``[Lb, K]``: the flush's keys ``Kf = kdec * decay`` (``kdec [Lb, K]`` fp32,
    ``decay [1, K]``) as ``hi + mid + lo`` bf16 parts (~2^-24 relative), exact operands of its MMAs."""
    k_flush = kdec * decay  # [Lb, K]
    k_hi = k_flush.to(torch.bfloat16)
    k_rest = k_flush - k_hi.to(torch.float32)
    k_mid = k_rest.to(torch.bfloat16)
    k_lo = (k_rest - k_mid.to(torch.float32)).to(torch.bfloat16)
    return k_hi, k_mid, k_lo
