"""The Helion ReplaySSM decode kernels (SPEC section 1); the op wrapper is :mod:`tp_replayssm.ops`.

Two launches per decode call, one program per (row ``b``, q/k head ``h``, value head
``hv = h*r + sub`` of it, value tile ``tv``), all math fp32:

* :func:`replayssm_step_kernel` (every row, every step): q/k of head ``h`` (optionally
  l2-normalized), gate ``g [K]``, ``beta``; the ring's valid entries ``j < c``, read once and masked,
  reduced to ``kdec [Lb, K] = k_j * exp(sum_{j<i<c} g_i)`` and ``tot = sum_{j<c} g_j``. The state is
  never materialized: with ``x = exp(g)*k`` (and ``exp(g)*q``),
  ``S' @ k = S0 @ (exp(tot)*x) + D^T (kdec @ x)``: two mat-vec products over the checkpoint tile.
  It writes ``out`` and appends ``(delta, k, g)`` at ring position ``c``, or, on a flush row, stores
  the fp32 ``delta`` in a scratch buffer instead.
* :func:`replayssm_flush_kernel` (only flush rows do work; the others exit after three scalar loads):
  ``Snew = S0*exp(tot+g) + D^T @ (kdec*exp(g)) + delta (outer) k`` into the checkpoint.

Keeping the flush (a ``[Vt, Lb] @ [Lb, K]`` product and a second live ``[Vt, K]`` tile) out of the
step kernel keeps those registers out of the every-step path; the flush costs one extra checkpoint
read per ring cycle and a launch over the full grid every step (see benchmarks/RESULTS.md for what
that costs and what is left to gain).

Addressing. Slots come from ``ssm_state_indices`` at run time, so caches are indexed by element
offsets: the wrapper passes each cache as an overlapping "row" view ``[span, last]`` with strides
``(1, 1)`` (row ``r`` = the ``last`` contiguous elements starting at element ``r``) plus the element
strides of its outer dims. That supports any strides with a contiguous last dim (a layer slice of
a ``[layers, S, ...]`` pool, padded rows) without copies. Offsets are int64 (``index_dtype``).
"""

from __future__ import annotations

import functools
import os

import torch

import helion
import helion.language as hl


def _qk_math(q: torch.Tensor, k: torch.Tensor, scale: float, use_l2norm: bool):
    """Scaled q and k (fp32 ``[K]``), l2-normalized when asked."""
    if use_l2norm:
        q = q * torch.rsqrt(torch.sum(q * q, dim=0) + 1e-6)
        k = k * torch.rsqrt(torch.sum(k * k, dim=0) + 1e-6)
    return q * scale, k


def _gate_math(x: torch.Tensor, A_log: torch.Tensor, lower_bound: float, use_lower_bound: bool) -> torch.Tensor:
    """Log-gate ``g [K]`` from ``x = a + dt_bias`` (fp32 ``[K]``) and the head's scalar ``A_log``."""
    A = torch.exp(A_log)
    if use_lower_bound:
        return lower_bound * torch.sigmoid(A * x)
    return -A * torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))


def _decayed_keys(g_ring: torch.Tensor, k_ring: torch.Tensor, valid: torch.Tensor, later: torch.Tensor):
    """``kdec [Lb, K] = k_j * exp(sum_{j<i<c} g_i)`` (zero for j >= c) and ``tot = sum_{j<c} g_j [K]``.

    ``later [Lb, Lb]`` is the strictly-upper-triangular ones matrix, so ``later @ g`` sums later entries.
    """
    g_ring = torch.where(valid[:, None], g_ring, 0.0)
    after = hl.dot(later, g_ring)
    kdec = torch.where(valid[:, None], k_ring.to(torch.float32) * torch.exp(after), 0.0)
    return kdec, torch.sum(g_ring, dim=0)


def replayssm_step_kernel(
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
    delta_scratch: torch.Tensor,  # [B, HV, V] fp32, written on flush rows only
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
    """Outputs and ring appends of one decode step (see the module docstring)."""
    B = q3.size(0)
    H = hl.specialize(q3.size(1))
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
            # loads first, in order of size, so their latencies overlap the gate and ring math
            S0 = state_rows[s64 * st_s + hv * st_h + tv.index * st_v, :].to(torch.float32)  # [Vt, K]
            j = hl.arange(ring_block)
            valid = (j < cur) & (j < ring_length)  # ring entries j < cursor are live
            d_ring = hl.load(d_rows, [s64 * dr_s + hv * dr_h + j * dr_l, tv], extra_mask=valid[:, None])
            g_ring = hl.load(g_rows, [s64 * gr_s + hv * gr_h + j * gr_l, slice(None)], extra_mask=valid[:, None])
            k_ring = hl.load(k_rows, [s64 * kr_s + h * kr_h + j * kr_l, slice(None)], extra_mask=valid[:, None])
            flush = (cur == ring_length - 1) | (force_flush[row] != 0)
            q, k = _qk_math(q3[row, h, :].to(torch.float32), k3[row, h, :].to(torch.float32), scale, use_l2norm)
            x = a3[row, hv, :].to(torch.float32) + dt_bias2[hv, :]
            g = _gate_math(x, A_log[hv], lower_bound, use_lower_bound)
            beta = torch.sigmoid(b2[row, hv].to(torch.float32))
            eg = torch.exp(g)
            kdec, tot = _decayed_keys(g_ring, k_ring, valid, (j[None, :] > j[:, None]).to(torch.float32))
            xk = eg * k
            xq = eg * q
            wk = torch.sum(kdec * xk[None, :], dim=1)  # [Lb]
            wq = torch.sum(kdec * xq[None, :], dim=1)
            et = torch.exp(tot)
            d_ring = torch.where(valid[:, None], d_ring.to(torch.float32), 0.0)  # [Lb, Vt]
            spk = torch.sum(S0 * (et * xk)[None, :], dim=1) + torch.sum(d_ring * wk[:, None], dim=0)
            spq = torch.sum(S0 * (et * xq)[None, :], dim=1) + torch.sum(d_ring * wq[:, None], dim=0)
            delta = beta * (v3[row, hv, tv].to(torch.float32) - spk)
            out3[row, hv, tv] = (spq + delta * torch.sum(k * q, dim=0)).to(out3.dtype)
            if flush:
                delta_scratch[row, hv, tv] = delta
            else:
                d_rows[s64 * dr_s + hv * dr_h + cur * dr_l, tv] = delta.to(d_rows.dtype)
                if tv.begin == 0:
                    g_rows[s64 * gr_s + hv * gr_h + cur * gr_l, :] = g
                    if sub == 0:
                        k_rows[s64 * kr_s + h * kr_h + cur * kr_l, :] = k.to(k_rows.dtype)
        else:
            out3[row, hv, tv] = hl.zeros([tv], dtype=out3.dtype)
    return out3


def replayssm_flush_kernel(
    k3: torch.Tensor,  # [B, H, K]
    a3: torch.Tensor,  # [B, HV, K]
    A_log: torch.Tensor,  # [HV]
    dt_bias2: torch.Tensor,  # [HV, K]
    state_rows: torch.Tensor,  # [span, K]
    d_rows: torch.Tensor,  # [span, V]
    k_rows: torch.Tensor,  # [span, K]
    g_rows: torch.Tensor,  # [span, K]
    delta_scratch: torch.Tensor,  # [B, HV, V] fp32 from the step kernel
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    force_flush: torch.Tensor,
    lower_bound: float,
    st_s: int, st_h: int, st_v: int,
    dr_s: int, dr_h: int, dr_l: int,
    kr_s: int, kr_h: int, kr_l: int,
    gr_s: int, gr_h: int, gr_l: int,
    ring_length: hl.constexpr,
    ring_block: hl.constexpr,
    use_l2norm: hl.constexpr,
    use_lower_bound: hl.constexpr,
) -> torch.Tensor:
    """Checkpoint write of the rows that flush this step (see the module docstring)."""
    B = k3.size(0)
    H = hl.specialize(k3.size(1))
    HV = hl.specialize(delta_scratch.size(1))
    V = hl.specialize(delta_scratch.size(2))
    group = HV // H
    for tile_b, tile_h, tile_r, tv in hl.tile([B, H, group, V], block_size=[1, 1, 1, None]):
        row = tile_b.begin
        h = tile_h.begin
        hv = h * group + tile_r.begin
        slot = slots[row]
        cur = write_pos[row]
        if (slot >= 0) & ((cur == ring_length - 1) | (force_flush[row] != 0)):
            s64 = slot.to(torch.int64)
            rows = s64 * st_s + hv * st_h + tv.index * st_v
            S0 = state_rows[rows, :].to(torch.float32)  # [Vt, K]
            j = hl.arange(ring_block)
            valid = (j < cur) & (j < ring_length)
            d_ring = hl.load(d_rows, [s64 * dr_s + hv * dr_h + j * dr_l, tv], extra_mask=valid[:, None])
            g_ring = hl.load(g_rows, [s64 * gr_s + hv * gr_h + j * gr_l, slice(None)], extra_mask=valid[:, None])
            k_ring = hl.load(k_rows, [s64 * kr_s + h * kr_h + j * kr_l, slice(None)], extra_mask=valid[:, None])
            k_raw = k3[row, h, :].to(torch.float32)
            _, k = _qk_math(k_raw, k_raw, 1.0, use_l2norm)
            x = a3[row, hv, :].to(torch.float32) + dt_bias2[hv, :]
            eg = torch.exp(_gate_math(x, A_log[hv], lower_bound, use_lower_bound))
            kdec, tot = _decayed_keys(g_ring, k_ring, valid, (j[None, :] > j[:, None]).to(torch.float32))
            d_ring = torch.where(valid[:, None], d_ring.to(torch.float32), 0.0)  # [Lb, Vt]
            replayed = hl.dot(d_ring.transpose(0, 1), kdec * eg[None, :])  # [Vt, K]
            S_new = S0 * (torch.exp(tot) * eg)[None, :] + replayed + delta_scratch[row, hv, tv][:, None] * k[None, :]
            state_rows[rows, :] = S_new.to(state_rows.dtype)
    return state_rows


# The two small products (gate suffix sums, ring replay on flush) run on tensor cores as three tf32
# products (``tf32x3``, fp32-level accuracy): faster on the H200 than ``ieee`` FMA products
# (benchmarks/RESULTS.md). TP_REPLAYSSM_DOT_PRECISION=ieee selects the FMA path.
DOT_PRECISION = os.environ.get("TP_REPLAYSSM_DOT_PRECISION", "tf32x3")
_SETTINGS = dict(static_shapes=True, dot_precision=DOT_PRECISION, index_dtype=torch.int64)


@functools.lru_cache(maxsize=None)
def _compiled(which: str, config_items: tuple[tuple[str, object], ...]) -> helion.Kernel:
    config = helion.Config(**{k: list(v) if isinstance(v, tuple) else v for k, v in config_items})
    fn = replayssm_step_kernel if which == "step" else replayssm_flush_kernel
    return helion.kernel(fn, config=config, **_SETTINGS)


def _key(config: helion.Config) -> tuple[tuple[str, object], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.config.items()))


# hot-path cache by config object identity (the pinned configs are module constants); the config is
# kept in the value so its id cannot be reused by another object
_BY_CONFIG: dict[tuple[str, int], tuple[helion.Config, helion.Kernel]] = {}


def _kernel_for(which: str, config: helion.Config) -> helion.Kernel:
    hit = _BY_CONFIG.get((which, id(config)))
    if hit is not None and hit[0] is config:
        return hit[1]
    kern = _compiled(which, _key(config))
    _BY_CONFIG[(which, id(config))] = (config, kern)
    return kern


def step_kernel_for(config: helion.Config) -> helion.Kernel:
    """The step kernel pinned to ``config`` (one compiled kernel object per distinct config)."""
    return _kernel_for("step", config)


def flush_kernel_for(config: helion.Config) -> helion.Kernel:
    """The flush kernel pinned to ``config``."""
    return _kernel_for("flush", config)
