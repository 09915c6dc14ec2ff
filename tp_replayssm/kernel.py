"""The Helion ReplaySSM decode kernel (SPEC section 1); the op wrapper is :mod:`tp_replayssm.ops`.

One program per (row ``b``, q/k head ``h``, value head ``hv = h*r + sub`` of it, value tile ``tv``), all math fp32:

* q/k of q/k head ``hv // r`` (optionally l2-normalized), gate ``g [K]``, ``beta``;
* the ring's valid entries ``j < c`` are read once per program, masked, and reduced to
  ``kdec [Lb, K] = k_j * exp(sum_{j<i<c} g_i)`` and ``tot [K] = sum_{j<c} g_j``;
* the state tile is never materialized on a non-flush step: with ``x = exp(g)*k`` (and ``exp(g)*q``)
  ``S' @ k = S0 @ (exp(tot)*x) + D^T (kdec @ x)``, two mat-vec products over the checkpoint tile;
* a flush step (``c == L-1`` or ``force_flush``) builds ``Snew = S0*exp(tot+g) + D^T @ (kdec*exp(g)) +
  delta (outer) k`` with one small dot and writes it to the checkpoint; any other step appends
  ``(delta, k, g)`` at ring position ``c``.

Addressing. Slots come from ``ssm_state_indices`` at run time, so the cache tensors are indexed by
element offsets: the wrapper passes each cache as an overlapping "row" view ``[span, last]`` with
strides ``(1, 1)`` (row ``r`` = the ``last`` contiguous elements starting at element ``r``) plus the
element strides of its outer dims. That supports any strides with a contiguous last dim (a layer
slice of a ``[layers, S, ...]`` pool, padded rows) without copies.
"""

from __future__ import annotations

import functools

import torch

import helion
import helion.language as hl


def replayssm_decode_kernel(
    q3: torch.Tensor,  # [B, H, K] view into mixed_qkv
    k3: torch.Tensor,  # [B, H, K]
    v3: torch.Tensor,  # [B, HV, V]
    a3: torch.Tensor,  # [B, HV, K]
    b2: torch.Tensor,  # [B, HV]
    A_log: torch.Tensor,  # [HV] fp32
    dt_bias2: torch.Tensor,  # [HV, K] fp32
    state_rows: torch.Tensor,  # checkpoint rows view [span, K]
    d_rows: torch.Tensor,  # d ring rows view [span, V]
    k_rows: torch.Tensor,  # k ring rows view [span, K]
    g_rows: torch.Tensor,  # g ring rows view [span, K]
    out3: torch.Tensor,  # [B, HV, V]
    slots: torch.Tensor,  # [B] int32
    write_pos: torch.Tensor,  # [B] int32
    force_flush: torch.Tensor,  # [B] int32 (zeros when the caller passed None)
    scale: float,
    lower_bound: float,
    st_s: int, st_h: int, st_v: int,  # checkpoint element strides (slot, head, value row)
    dr_s: int, dr_h: int, dr_l: int,  # d ring strides (slot, head, ring pos)
    kr_s: int, kr_h: int, kr_l: int,  # k ring strides
    gr_s: int, gr_h: int, gr_l: int,  # g ring strides
    ring_length: hl.constexpr,
    ring_block: hl.constexpr,
    use_l2norm: hl.constexpr,
    use_lower_bound: hl.constexpr,
) -> torch.Tensor:
    B = q3.size(0)
    H = hl.specialize(q3.size(1))
    K = hl.specialize(q3.size(2))
    HV = hl.specialize(v3.size(1))
    V = hl.specialize(v3.size(2))
    group = HV // H
    for tile_b, tile_h, tile_r, tv in hl.tile([B, H, group, V], block_size=[1, 1, 1, None]):
        row = tile_b.begin
        h = tile_h.begin
        sub = tile_r.begin  # value head hv = h*group + sub reads q/k head h
        hv = h * group + sub
        slot = slots[row]
        if slot >= 0:
            s64 = slot.to(torch.int64)
            cur = write_pos[row]
            flush = (cur == ring_length - 1) | (force_flush[row] != 0)
            q = q3[row, h, :].to(torch.float32)
            k = k3[row, h, :].to(torch.float32)
            if use_l2norm:
                q = q * torch.rsqrt(torch.sum(q * q, dim=0) + 1e-6)
                k = k * torch.rsqrt(torch.sum(k * k, dim=0) + 1e-6)
            q = q * scale
            x = a3[row, hv, :].to(torch.float32) + dt_bias2[hv, :]
            A = torch.exp(A_log[hv])
            if use_lower_bound:
                g = lower_bound * torch.sigmoid(A * x)
            else:
                g = -A * torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
            beta = torch.sigmoid(b2[row, hv].to(torch.float32))
            eg = torch.exp(g)

            # ring: entries j < cur are valid
            j = hl.arange(ring_block)
            valid = (j < cur) & (j < ring_length)
            g_ring = hl.load(g_rows, [s64 * gr_s + hv * gr_h + j * gr_l, slice(None)], extra_mask=valid[:, None])
            g_ring = torch.where(valid[:, None], g_ring, 0.0)
            # after[j] = sum_{j<i<c} g_i, as a strictly-upper-triangular [Lb, Lb] @ [Lb, K] product
            later = (j[None, :] > j[:, None]).to(torch.float32)
            after = hl.dot(later, g_ring)
            tot = torch.sum(g_ring, dim=0)  # [K]
            k_ring = hl.load(k_rows, [s64 * kr_s + h * kr_h + j * kr_l, slice(None)], extra_mask=valid[:, None])
            kdec = torch.where(valid[:, None], k_ring.to(torch.float32) * torch.exp(after), 0.0)  # [Lb, K]
            xk = eg * k
            xq = eg * q
            wk = torch.sum(kdec * xk[None, :], dim=1)  # [Lb]
            wq = torch.sum(kdec * xq[None, :], dim=1)
            et = torch.exp(tot)
            d_ring = hl.load(d_rows, [s64 * dr_s + hv * dr_h + j * dr_l, tv], extra_mask=valid[:, None])
            d_ring = torch.where(valid[:, None], d_ring.to(torch.float32), 0.0)  # [Lb, Vt]

            S0 = state_rows[s64 * st_s + hv * st_h + tv.index * st_v, :].to(torch.float32)  # [Vt, K]
            spk = torch.sum(S0 * (et * xk)[None, :], dim=1) + torch.sum(d_ring * wk[:, None], dim=0)
            spq = torch.sum(S0 * (et * xq)[None, :], dim=1) + torch.sum(d_ring * wq[:, None], dim=0)
            v = v3[row, hv, tv].to(torch.float32)
            delta = beta * (v - spk)
            kq = torch.sum(k * q, dim=0)
            out3[row, hv, tv] = (spq + delta * kq).to(out3.dtype)
            if flush:
                replayed = hl.dot(d_ring.transpose(0, 1), kdec * eg[None, :])  # [Vt, K]
                S_new = S0 * (et * eg)[None, :] + replayed + delta[:, None] * k[None, :]
                state_rows[s64 * st_s + hv * st_h + tv.index * st_v, :] = S_new.to(state_rows.dtype)
            else:
                d_rows[s64 * dr_s + hv * dr_h + cur * dr_l, tv] = delta.to(d_rows.dtype)
                if tv.begin == 0:
                    g_rows[s64 * gr_s + hv * gr_h + cur * gr_l, :] = g
                    if sub == 0:
                        k_rows[s64 * kr_s + h * kr_h + cur * kr_l, :] = k.to(k_rows.dtype)
        else:
            out3[row, hv, tv] = hl.zeros([tv], dtype=out3.dtype)
    return out3


@functools.lru_cache(maxsize=None)
def _compiled(config_items: tuple[tuple[str, object], ...]) -> helion.Kernel:
    config = helion.Config(**{k: list(v) if isinstance(v, tuple) else v for k, v in config_items})
    return helion.kernel(
        replayssm_decode_kernel, config=config, static_shapes=True, dot_precision="ieee", index_dtype=torch.int64,
    )


def kernel_for(config: helion.Config) -> helion.Kernel:
    """The Helion kernel pinned to ``config`` (one compiled kernel object per distinct config)."""
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.config.items()))
    return _compiled(items)
