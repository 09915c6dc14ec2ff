"""The Helion verify kernel of speculative decoding: one launch per layer verifies ``T`` draft tokens per row.

One program per (row ``b``, q/k head ``h``, value head ``hv = h*r + sub``, value tile ``tv``), as in the decode kernel
(docs/spec.md has the design). A program reads its checkpoint tile ONCE for all ``T`` drafts. With ``Gam_t`` the
drafts' gate sums along their own paths (``Gam = Anc @ g``, ``Anc`` the tree's ancestor-or-self matrix, built by
doubling; a chain's is lower triangular), each value row's products with the committed state are

    PK[:, t] = S0 @ ak_t + D^T (Kr @ rk_t),  ak_t = exp(tot + Gam_t) * k_t        (PQ likewise with q)

(``D``, ``Kr`` the committed ring's deltas and keys: pre-decayed ``kt_j`` with ``rk_t = ak_t``, or, in the sglang
layout, decayed to the committed state with ``rk_t = exp(Gam_t) * k_t``), one ``[Vc, Tb, K]`` product per chunk step.
The drafts depend on each other through their ancestors' deltas only: ``delta_t = beta_t (v_t - PK_t - sum_u delta_u
Mk[u, t])`` over the strict ancestors ``u`` of ``t``, ``Mk[u, t] = k_u . exp(Gam_t - Gam_u) k_t``. So ``Delta (I + N) =
R`` with ``R = (V - PK) diag(beta)`` and ``N = Mk * strict-ancestors * beta``, nilpotent: ``W = (I + N)^-1 = (I - N)
(I + N^2)(I + N^4)...`` once per program (the forward substitution over ``T`` as a product of ``log2(Tb)`` factors),
then ``Delta = R @ W`` and ``Out = PQ + R @ (W @ Mq)`` per chunk (``Mq`` over the ancestors and the node itself). All
fp32, in registers (no tensor-core operand is replicated per warp: that spilled).

Writes: the outputs, the drafts' ring entries at ``base + t`` (``base = 0`` when the row folds, else the cursor ``c``),
and no checkpoint, except where the committed ring is folded (``c + T > L - 1``: the committed state ``Sc`` goes to
the checkpoint) or, in the pre-decayed layout with a gate that can pass the bound, a head rebases (its drafts would
pass it: ``Sc`` to the checkpoint, the committed deltas zeroed, ``G_{c-1} = 0``). Per-head ring rows (gates, keys) at
positions the other programs of the head read (a fold's ``0..T-1``, a rebase's ``c-1``) are written by the LAST program
of the head to pass its prologue, counted with an acq_rel atomic in ``counters`` (zero again after the launch); the
fold's replay takes the committed keys from the prologue's registers. No program moves a cursor: ``commit`` does.
Slot safety as in the decode kernel (out-of-range, free or repeated slots, and rows whose ``parents`` are not a forest
in topological order: zero outputs, nothing written, recorded).
"""

from __future__ import annotations

import functools

import torch

import helion
import helion.language as hl

from .decode_math import decayed_keys, gate_math

__all__ = ["replayssm_verify_kernel", "verify_kernel_for"]


def replayssm_verify_kernel(
    q4: torch.Tensor,  # [B, T, H, K] view into mixed_qkv
    k4: torch.Tensor,  # [B, T, H, K]
    v4: torch.Tensor,  # [B, T, HV, V]
    a4: torch.Tensor,  # [B, T, HV, K]
    b3: torch.Tensor,  # [B, T, HV]
    A_log: torch.Tensor,  # [HV] fp32
    dt_bias2: torch.Tensor,  # [HV, K] fp32
    state_rows: torch.Tensor,  # checkpoint rows view [span, K]
    d_rows: torch.Tensor,  # d ring rows view [span, V]
    k_rows: torch.Tensor,  # k ring rows view [span, K] (per q/k head; per value head if predecayed_ring)
    g_rows: torch.Tensor,  # g ring rows view [span, K] (cumulative gates if predecayed_ring)
    out4: torch.Tensor,  # [B, T, HV, V]
    slots: torch.Tensor,  # [B] int32
    cursors: torch.Tensor,  # [S + 1] int32 (read only)
    parents: torch.Tensor,  # [B, T] int32 (read when tree)
    folded: torch.Tensor,  # [S + 1] int32: this layer's fold marks (1 = folded in this step)
    counters: torch.Tensor,  # [(S + 1) * (HV + H)] int32, zero between launches
    slot_errors: torch.Tensor,  # [ERROR_WORDS] int32 (kernels.guard)
    call_code: torch.Tensor,  # [1] int32
    num_slots: int,
    scale: float,
    lower_bound: float,
    st_s: int, st_h: int, st_v: int,  # checkpoint element strides (slot, head, value row)
    dr_s: int, dr_h: int, dr_l: int,  # d ring strides (slot, head, ring pos)
    kr_s: int, kr_h: int, kr_l: int,  # k ring strides
    gr_s: int, gr_h: int, gr_l: int,  # g ring strides
    draft_block: hl.constexpr,  # Tb: power of two >= max(T, 16)
    ring_length: hl.constexpr,
    ring_block: hl.constexpr,
    value_chunk: hl.constexpr,
    use_l2norm: hl.constexpr,
    use_lower_bound: hl.constexpr,
    predecayed_ring: hl.constexpr,  # 0: sglang layout; pre-decayed 1: no rebase possible, 2: rebases
    tree: hl.constexpr,
    tile_readers: hl.constexpr,  # programs per value head (ceil(V / value tile))
    doubling_steps: hl.constexpr,  # log2(draft_block)
    named_block: hl.constexpr = 16,
    on_gpu: hl.constexpr = True,
) -> torch.Tensor:
    """One layer's verify (module docstring)."""
    B = q4.size(0)
    T = hl.specialize(q4.size(1))
    H = hl.specialize(q4.size(2))
    HV = hl.specialize(v4.size(2))
    V = hl.specialize(v4.size(3))
    group = HV // H
    hl.pdl_wait()
    hl.pdl_launch_dependents()
    for tile_b, tile_h, tile_r, tv in hl.tile([B, H, group, V], block_size=[1, 1, 1, None]):
        row = tile_b.begin
        h = tile_h.begin
        sub = tile_r.begin
        hv = h * group + sub
        if predecayed_ring:
            kh = hv
        else:
            kh = h
        tt = hl.arange(draft_block)
        tlive = tt < T
        slot = slots[row]
        if slot >= 0:
            in_range = slot < num_slots
            s64 = torch.where(in_range, slot, 0).to(torch.int64)
            cur = cursors[s64]
            ok = in_range & (cur >= 0) & (cur < ring_length)
            named = slot * 0
            for nb in hl.grid(0, B, named_block):
                others = nb + hl.arange(named_block)
                same = (hl.load(slots, [others], extra_mask=others < B) == slot) & (others < B)
                named = named + torch.sum(torch.where(same, 1, 0), dim=0).to(torch.int32)
            if tree:  # a row whose parents are not -1 or an earlier node is refused
                par = hl.load(parents, [row, tt], extra_mask=tlive)
                wrong = torch.sum(torch.where(tlive & ((par < -1) | (par >= tt)), 1, 0), dim=0).to(torch.int32)
                named = named + wrong * 4  # (folded into one warp-uniform count: 1 = good)
            if on_gpu:  # lane 0's count to every lane: ptxas then knows the branch below is warp-uniform
                named = hl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", [named],
                                                  dtype=torch.int32, is_pure=True, pack=1)
            ok = ok & (named == 1)
            cur = torch.where(ok, cur, 0)
            fold = cur + T > ring_length - 1  # the drafts do not fit beyond the committed entries
            base = torch.where(fold, 0, cur)
            j = hl.arange(ring_block)
            valid = (j < cur) & (j < ring_length)
            st_base = s64 * st_s + hv * st_h
            dr_base = s64 * dr_s + hv * dr_h
            # the first value chunk's loads go out now, so their latency overlaps the prologue below
            lead = tv.begin + hl.arange(value_chunk)
            s_next = hl.load(state_rows, [st_base + lead * st_v, slice(None)], extra_mask=(lead < tv.end)[:, None])
            d_next = hl.load(d_rows, [dr_base + j * dr_l, lead], extra_mask=valid[:, None] & (lead < tv.end)[None, :])
            k_ring = hl.load(k_rows, [s64 * kr_s + kh * kr_h + j * kr_l, slice(None)], extra_mask=valid[:, None])
            if predecayed_ring:
                g_last = g_rows[s64 * gr_s + hv * gr_h + torch.where(cur > 0, cur - 1, 0) * gr_l, :]
            else:
                g_ring = hl.load(g_rows, [s64 * gr_s + hv * gr_h + j * gr_l, slice(None)], extra_mask=valid[:, None])
            if ok:
                # the drafts: q, k [Tb, K] (rows t >= T are zero), gates, beta
                qd = hl.load(q4, [row, tt, h, slice(None)], extra_mask=tlive[:, None]).to(torch.float32)
                kd = hl.load(k4, [row, tt, h, slice(None)], extra_mask=tlive[:, None]).to(torch.float32)
                if use_l2norm:
                    qd = qd * torch.rsqrt(torch.sum(qd * qd, dim=1) + 1e-6)[:, None]
                    kd = kd * torch.rsqrt(torch.sum(kd * kd, dim=1) + 1e-6)[:, None]
                qd = qd * scale
                xd = hl.load(a4, [row, tt, hv, slice(None)], extra_mask=tlive[:, None]).to(torch.float32)
                gd = gate_math(xd + dt_bias2[hv, :][None, :], A_log[hv], lower_bound, use_lower_bound)
                gd = torch.where(tlive[:, None], gd, 0.0)
                beta = torch.sigmoid(hl.load(b3, [row, tt, hv], extra_mask=tlive).to(torch.float32))
                # the ancestor-or-self matrix anc[t, u] (u on t's path); a chain's is lower triangular
                eye = torch.where(tt[:, None] == tt[None, :], 1.0, 0.0)
                if tree:
                    reach = eye + torch.where((par[:, None] == tt[None, :]) & tlive[:, None], 1.0, 0.0)
                    for _ in hl.static_range(doubling_steps):  # paths of length <= 2^k, then 2^(k+1)
                        reach = torch.where(torch.sum(reach[:, :, None] * reach[None, :, :], dim=1) > 0.5, 1.0, 0.0)
                    anc = reach
                else:
                    anc = torch.where(tt[None, :] <= tt[:, None], 1.0, 0.0)
                gam = torch.sum(anc[:, :, None] * gd[None, :, :], dim=1)  # [Tb, K] path sums of the gates
                if predecayed_ring:
                    tot = torch.where(cur > 0, g_last, 0.0)  # G_{c-1}
                    kring = torch.where(valid[:, None], k_ring.to(torch.float32), 0.0)  # kt_j
                else:
                    kring, tot = decayed_keys(g_ring, k_ring, valid, False)  # k_j decayed to the committed state
                drop = fold  # the committed ring goes to the checkpoint (a fold or a rebase)
                if predecayed_ring == 2:  # drafts that would pass the bound from the committed base rebase the head
                    low = torch.amin(torch.amin(torch.where(tlive[:, None], tot[None, :] + gam, 0.0), dim=1), dim=0)
                    rebase = torch.where((low < -75.0) & (fold == 0) & (cur > 0), 1, 0).to(torch.int32)  # -75: the bound
                    if on_gpu:
                        rebase = hl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", [rebase],
                                                           dtype=torch.int32, is_pure=True, pack=1)
                    drop = drop | (rebase != 0)
                    emptied = torch.where(rebase != 0, cur, 0)  # a rebase zeroes the committed deltas j < emptied
                e_rel = torch.exp(gam)
                e_abs = torch.exp(tot[None, :] + gam)
                ak = e_abs * kd  # [Tb, K]: the checkpoint's part of S' @ k_t is S0 @ ak_t
                aq = e_abs * qd
                if predecayed_ring:  # kt_j . ak_t = k_j . exp(G_t - G_j) k_t
                    rk = ak
                    rq = aq
                else:  # the keys are decayed to the committed state: the draft's own decay only
                    rk = e_rel * kd
                    rq = e_rel * qd
                kt_rel = kd * torch.exp(torch.where(gam > -88.0, -gam, 88.0))  # (finite past e^88: docs/spec.md)
                akr = e_rel * kd
                aqr = e_rel * qd
                wk = hl.zeros([ring_block, draft_block], torch.float32)  # [Lb, Tb] = kring @ rk^T
                wq = hl.zeros([ring_block, draft_block], torch.float32)
                m_k = eye * 0.0  # [Tb(u), Tb(t)] = k_u . exp(Gam_t - Gam_u) k_t
                m_q = eye * 0.0
                for t in hl.static_range(T):  # one draft at a time: [Lb, K] and [Tb, K] reductions
                    pick = tt == t
                    rk_t = torch.sum(torch.where(pick[:, None], rk, 0.0), dim=0)
                    rq_t = torch.sum(torch.where(pick[:, None], rq, 0.0), dim=0)
                    wk = wk + torch.where(pick[None, :], torch.sum(kring * rk_t[None, :], dim=1)[:, None], 0.0)
                    wq = wq + torch.where(pick[None, :], torch.sum(kring * rq_t[None, :], dim=1)[:, None], 0.0)
                    kt_t = torch.sum(torch.where(pick[:, None], kt_rel, 0.0), dim=0)
                    m_k = m_k + torch.where(pick[:, None], torch.sum(akr * kt_t[None, :], dim=1)[None, :], 0.0)
                    m_q = m_q + torch.where(pick[:, None], torch.sum(aqr * kt_t[None, :], dim=1)[None, :], 0.0)
                anc_t = anc.T  # [u, t]: u on t's path
                n_mat = m_k * (anc_t - eye) * beta[None, :]
                power = -n_mat  # P = -N: (I + N)^-1 = I + P + P^2 + ... = (I + P)(I + P^2)(I + P^4)...
                w_inv = eye + power
                if doubling_steps > 1:  # (an empty static range does not trace)
                    for _ in hl.static_range(doubling_steps - 1):
                        power = torch.sum(power[:, :, None] * power[None, :, :], dim=1)
                        w_inv = torch.sum(w_inv[:, :, None] * (eye + power)[None, :, :], dim=1)
                w_out = torch.sum(w_inv[:, :, None] * (m_q * anc_t)[None, :, :], dim=1)  # [Tb, Tb]
                # per-head ring rows: the drafts' gates and keys at base + t, and a rebase's new base G_{c-1} = 0
                if predecayed_ring:
                    g_store = torch.where(drop, 0.0, 1.0) * tot[None, :] + gam  # G_t along the draft's own path
                    k_store = kd * torch.exp(-g_store)
                else:
                    g_store = gd
                    k_store = kd
                g_at = s64 * gr_s + hv * gr_h + (base + tt) * gr_l
                k_at = s64 * kr_s + kh * kr_h + (base + tt) * kr_l
                if drop:  # other programs of this head may still read the rows these overwrite: the last one writes
                    hl.inline_triton("tl.debug_barrier()", [], None)
                    seen = hl.atomic_add(counters, [s64 * (HV + H) + hv], 1, sem="acq_rel")
                    if seen == tile_readers - 1:
                        hl.store(g_rows, [g_at, slice(None)], g_store, extra_mask=tlive[:, None])
                        if predecayed_ring:
                            hl.store(k_rows, [k_at, slice(None)], k_store.to(k_rows.dtype), extra_mask=tlive[:, None])
                            if predecayed_ring == 2:
                                if rebase != 0:
                                    g_rows[s64 * gr_s + hv * gr_h + (cur - 1) * gr_l, :] = hl.zeros(
                                        [g_rows.size(1)], torch.float32)
                        counters[s64 * (HV + H) + hv] = seen * 0
                    if predecayed_ring == 0:  # the sglang k ring is shared by the q/k head's value heads
                        seen_k = hl.atomic_add(counters, [s64 * (HV + H) + HV + h], 1, sem="acq_rel")
                        if seen_k == tile_readers * group - 1:
                            hl.store(k_rows, [k_at, slice(None)], k_store.to(k_rows.dtype), extra_mask=tlive[:, None])
                            counters[s64 * (HV + H) + HV + h] = seen_k * 0
                else:
                    if tv.begin == 0:
                        hl.store(g_rows, [g_at, slice(None)], g_store, extra_mask=tlive[:, None])
                        if predecayed_ring:
                            hl.store(k_rows, [k_at, slice(None)], k_store.to(k_rows.dtype), extra_mask=tlive[:, None])
                        elif sub == 0:  # the q/k head's first value head writes its keys
                            hl.store(k_rows, [k_at, slice(None)], k_store.to(k_rows.dtype), extra_mask=tlive[:, None])
                if (hv == 0) & (tv.begin == 0):
                    folded[s64] = torch.where(fold, 1, 0)
                # the value chunks: outputs, the drafts' deltas, and the committed state where it is dropped
                decay = torch.exp(tot)
                for chunk in hl.grid(tv.begin, tv.end, value_chunk):
                    rows = chunk + hl.arange(value_chunk)
                    live = rows < tv.end
                    s0 = s_next.to(torch.float32)  # [Vc, K]
                    d_c = d_next.to(torch.float32)  # [Lb, Vc]
                    after = rows + value_chunk  # the next chunk's loads in flight during this one's math
                    s_next = hl.load(state_rows, [st_base + after * st_v, slice(None)],
                                     extra_mask=(after < tv.end)[:, None])
                    d_next = hl.load(d_rows, [dr_base + j * dr_l, after], extra_mask=valid[:, None] & (after < tv.end)[None, :])
                    v_c = hl.load(v4, [row, tt, hv, rows], extra_mask=tlive[:, None] & live[None, :]).to(torch.float32)
                    # the drafts' products with the committed state: [Vc, Tb] = sum over K (and over the ring)
                    pk = torch.sum(s0[:, None, :] * ak[None, :, :], dim=2) + torch.sum(d_c[:, :, None] * wk[:, None, :], dim=0)
                    pq = torch.sum(s0[:, None, :] * aq[None, :, :], dim=2) + torch.sum(d_c[:, :, None] * wq[:, None, :], dim=0)
                    resid = (v_c.T - pk) * beta[None, :]
                    delta = torch.sum(resid[:, :, None] * w_inv[None, :, :], dim=1)  # [Vc, Tb]
                    o_c = pq + torch.sum(resid[:, :, None] * w_out[None, :, :], dim=1)
                    hl.store(out4, [row, tt, hv, rows], o_c.T.to(out4.dtype), extra_mask=tlive[:, None] & live[None, :])
                    if drop:  # the committed state of these rows: the ring replayed as rank-1 updates (rare). The
                        # keys come from the prologue's registers: the head's last program may already have written
                        # the drafts' rows over the committed ones
                        ring_c = s0 * 0.0
                        for back in hl.grid(cur):
                            k_j = torch.sum(torch.where((j == back)[:, None], kring, 0.0), dim=0)
                            d_j = hl.load(d_rows, [dr_base + back * dr_l, rows], extra_mask=live).to(torch.float32)
                            ring_c = ring_c + d_j[:, None] * k_j[None, :]
                        if predecayed_ring:  # kt_j: the sum is decayed with the checkpoint
                            s_c = (s0 + ring_c) * decay[None, :]
                        else:  # k_j already decayed to the committed state
                            s_c = s0 * decay[None, :] + ring_c
                        hl.store(state_rows, [st_base + rows * st_v, slice(None)], s_c.to(state_rows.dtype),
                                 extra_mask=live[:, None])
                    # other threads may still read the committed deltas these stores overwrite (a fold's rows
                    # 0..T-1, a rebase's j < c): Helion orders read-after-write only
                    hl.inline_triton("tl.debug_barrier()", [], None)
                    if predecayed_ring == 2:  # a rebase empties the committed deltas (they live in the checkpoint)
                        hl.store(d_rows, [dr_base + j * dr_l, rows], hl.zeros([ring_block, value_chunk], d_rows.dtype),
                                 extra_mask=(j < emptied)[:, None] & live[None, :])
                    hl.store(d_rows, [dr_base + (base + tt) * dr_l, rows], delta.T.to(d_rows.dtype),
                             extra_mask=tlive[:, None] & live[None, :])
            else:  # a refused row: a padding row, recorded once per row
                hl.store(out4, [row, tt, hv, tv.index], hl.zeros([draft_block, tv], out4.dtype),
                         extra_mask=tlive[:, None])
                if (hv == 0) & (tv.begin == 0):
                    code = call_code[0]
                    first = hl.atomic_cas(slot_errors, [0], 0, code)
                    hl.atomic_add(slot_errors, [2], 1)
                    if (first == 0) | (first == code):
                        at = hl.atomic_add(slot_errors, [1], 1)
                        if at < 8:  # kernels.guard.RECORDED_ROWS
                            slot_errors[4 + 2 * at] = slot * 0 + row
                            slot_errors[5 + 2 * at] = slot
        else:
            hl.store(out4, [row, tt, hv, tv.index], hl.zeros([draft_block, tv], out4.dtype), extra_mask=tlive[:, None])
    return out4


# int64 offsets for large pools
_SETTINGS = dict(static_shapes=True, index_dtype=torch.int64)


@functools.lru_cache(maxsize=None)
def verify_kernel_for(value_tile: int, num_warps: int) -> helion.Kernel:
    """The verify kernel pinned to one launch shape (one compiled kernel object per pair)."""
    config = helion.Config(block_sizes=[value_tile], indexing="pointer", num_warps=num_warps, num_stages=1)
    return helion.kernel(replayssm_verify_kernel, config=config, **_SETTINGS)
