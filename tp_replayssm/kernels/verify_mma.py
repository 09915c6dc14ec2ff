"""The tensor-core verify kernel: one launch per layer verifies ``T`` draft tokens per row on pre-decayed bf16 rings.

One program per (row ``b``, q/k head ``h``, value head ``hv = h*r + sub``, value tile ``tv``), one warp, chunks of
``value_chunk`` value rows, as the decode kernel. A program reads its checkpoint tile ONCE for all drafts and gets
every draft's two products with the committed state from tensor-core products per chunk:

    P [Vc, N] = S0 @ A + D^T @ W,   A [K, N] = [ak_0 .. ak_{T-1} | aq_0 .. aq_{T-1} | 0],   W = Kt @ A

(``ak_t = exp(tot + Gam_t) * k_t``, ``aq_t`` likewise with ``q_t``; ``tot = G_{c-1}`` the committed cumulative gate,
``Gam_t`` the drafts' gate sums along their own paths; ``D [Lb, Vc]`` the committed deltas and ``Kt [Lb, K]`` the
pre-decayed keys ``kt_j``, both exact bf16 operands). ``A``, ``W`` and an fp32 checkpoint enter the products as two or
three bf16 parts each (:func:`~.verify_math.bf16_parts`, fp32 accumulation), so the products are fp32-accurate to
~2^-16 (two parts) or ~2^-24 (three). Column ``t`` of ``P`` is ``S_c' @ k_t``, column ``T + t`` is ``S_c' @ q_t``; the
drafts then depend on each other through their ancestors' deltas only, a forward substitution over ``T`` on
``[Vc]`` vectors with per-program scalars (:func:`~.verify_math.solve_chunk`).

Writes as the CUDA-core verify kernel (:mod:`.verify`, docs/spec.md): the outputs, the drafts' ring entries at
``base + t`` (``base = 0`` when the row folds, else the cursor), no checkpoint except where the committed ring folds
(``c + T > L - 1``: ``S_c = (S0 + D^T Kt) * exp(tot)``, one more product per chunk) or a head rebases (its drafts
would pass the bound: ``S_c`` to the checkpoint, the committed deltas zeroed, ``G_{c-1} = 0``). Per-head ring rows
that other programs of the head read are written by the head's last program to pass its prologue (an acq_rel count
in ``counters``, zero again after the launch). Slot safety as in the decode kernel.
"""

from __future__ import annotations

import functools

import torch

import helion
import helion.language as hl

from .decode_math import gate_math, qk_math
from .verify_math import (ancestry, bf16_parts, column_matrix, min_log_decay, pair_terms, path_sums, solve_chunk,
                          stack_rows)

__all__ = ["replayssm_verify_mma_kernel", "verify_mma_kernel_for"]


def replayssm_verify_mma_kernel(
    q4: torch.Tensor,  # [B, T, H, K] view into mixed_qkv
    k4: torch.Tensor,  # [B, T, H, K]
    v4: torch.Tensor,  # [B, T, HV, V]
    a4: torch.Tensor,  # [B, T, HV, K]
    b3: torch.Tensor,  # [B, T, HV]
    A_log: torch.Tensor,  # [HV] fp32
    dt_bias2: torch.Tensor,  # [HV, K] fp32
    state_rows: torch.Tensor,  # checkpoint rows view [span, K] (fp32 or bf16)
    d_rows: torch.Tensor,  # d ring rows view [span, V] (bf16)
    k_rows: torch.Tensor,  # k ring rows view [span, K] (bf16, per value head: pre-decayed keys)
    g_rows: torch.Tensor,  # g ring rows view [span, K] (fp32 cumulative gates)
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
    draft_block: hl.constexpr,  # power of two >= T (the drafts' masks)
    columns: hl.constexpr,  # N: power of two >= max(16, 2T), the products' columns
    operand_parts: hl.constexpr,  # 2 or 3 bf16 parts per fp32 operand
    ring_length: hl.constexpr,
    ring_block: hl.constexpr,
    value_chunk: hl.constexpr,
    use_l2norm: hl.constexpr,
    use_lower_bound: hl.constexpr,
    predecayed_ring: hl.constexpr,  # 1: no rebase possible, 2: heads may rebase
    tree: hl.constexpr,
    tile_readers: hl.constexpr,  # programs per value head (ceil(V / value tile))
    named_block: hl.constexpr = 16,
    on_gpu: hl.constexpr = True,
) -> torch.Tensor:
    """One layer's verify on tensor cores (module docstring)."""
    B = q4.size(0)
    T = hl.specialize(q4.size(1))
    H = hl.specialize(q4.size(2))
    HV = hl.specialize(v4.size(2))
    V = hl.specialize(v4.size(3))
    group = HV // H
    fp32_state = state_rows.dtype == torch.float32
    hl.pdl_wait()
    hl.pdl_launch_dependents()
    for tile_b, tile_h, tile_r, tv in hl.tile([B, H, group, V], block_size=[1, 1, 1, None]):
        row = tile_b.begin
        h = tile_h.begin
        sub = tile_r.begin
        hv = h * group + sub
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
            v_next = hl.load(v4, [row, tt, hv, lead], extra_mask=tlive[:, None] & (lead < tv.end)[None, :])  # [Tb, Vc]
            k_ring = hl.load(k_rows, [s64 * kr_s + hv * kr_h + j * kr_l, slice(None)], extra_mask=valid[:, None])
            g_last = g_rows[s64 * gr_s + hv * gr_h + torch.where(cur > 0, cur - 1, 0) * gr_l, :]
            if ok:
                # the drafts, one list entry each: q, k [K] (scaled, normalized), log-gates, beta, parents
                qk = [qk_math(q4[row, t, h, :].to(torch.float32), k4[row, t, h, :].to(torch.float32), scale,
                              use_l2norm) for t in hl.static_range(T)]
                qs = [qk[t][0] for t in hl.static_range(T)]
                ks = [qk[t][1] for t in hl.static_range(T)]
                gates = [gate_math(a4[row, t, hv, :].to(torch.float32) + dt_bias2[hv, :], A_log[hv], lower_bound,
                                   use_lower_bound) for t in hl.static_range(T)]
                betas = [torch.sigmoid(b3[row, t, hv].to(torch.float32)) for t in hl.static_range(T)]
                if tree:
                    pars = [parents[row, t] for t in hl.static_range(T)]
                else:
                    pars = [slot * 0 + (t - 1) for t in hl.static_range(T)]
                anc = ancestry(pars, T)
                gam = path_sums(gates, anc, T)
                tot = torch.where(cur > 0, g_last, 0.0)  # G_{c-1}
                drop = fold  # the committed ring goes to the checkpoint (a fold or a rebase)
                if predecayed_ring == 2:  # drafts that would pass the bound from the committed base rebase the head
                    low = min_log_decay(tot, gam, T)
                    rebase = torch.where((low < -75.0) & (fold == 0) & (cur > 0), 1, 0).to(torch.int32)  # the bound
                    if on_gpu:
                        rebase = hl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", [rebase],
                                                           dtype=torch.int32, is_pure=True, pack=1)
                    drop = drop | (rebase != 0)
                    emptied = torch.where(rebase != 0, cur, 0)  # a rebase zeroes the committed deltas j < emptied
                if drop:  # the committed ring into the checkpoint first, S_c = (S0 + D^T Kt) * exp(tot) (rare):
                    # the drafts then start from S_c at the ring's new base (no ring term, tot = 0)
                    decay = torch.exp(tot)
                    for fchunk in hl.grid(tv.begin, tv.end, value_chunk):
                        frows = fchunk + hl.arange(value_chunk)
                        flive = frows < tv.end
                        f_s0 = hl.load(state_rows, [st_base + frows * st_v, slice(None)], extra_mask=flive[:, None])
                        f_d = hl.load(d_rows, [dr_base + j * dr_l, frows], extra_mask=valid[:, None] & flive[None, :])
                        s_c = (f_s0.to(torch.float32) + hl.dot(f_d.T, k_ring)) * decay[None, :]
                        hl.store(state_rows, [st_base + frows * st_v, slice(None)], s_c.to(state_rows.dtype),
                                 extra_mask=flive[:, None])
                        if predecayed_ring == 2:  # a rebase empties the committed deltas (they live in S_c now);
                            # other threads' loads of these rows must be done first (Helion orders read-after-write)
                            hl.inline_triton("tl.debug_barrier()", [], None)
                            hl.store(d_rows, [dr_base + j * dr_l, frows],
                                     hl.zeros([ring_block, value_chunk], d_rows.dtype),
                                     extra_mask=(j < emptied)[:, None] & flive[None, :])
                    hl.inline_triton("tl.debug_barrier()", [], None)  # S_c's stores before the chunks read it
                    s_next = hl.load(state_rows, [st_base + lead * st_v, slice(None)],
                                     extra_mask=(lead < tv.end)[:, None])
                    tot = tot * 0.0
                ring_live = (j < torch.where(drop, 0, cur)) & (j < ring_length)  # the entries the products read
                # the products' operands: A [K, N] and W = Kt @ A [Lb, N] (zero once folded), as bf16 parts
                col = hl.arange(columns)[None, :]
                aks = [(torch.exp(tot + gam[t]) * ks[t])[:, None] for t in hl.static_range(T)]
                aqs = [(torch.exp(tot + gam[t]) * qs[t])[:, None] for t in hl.static_range(T)]
                a_parts = bf16_parts(column_matrix(aks, aqs, col, T), operand_parts)
                k_prod = torch.where(ring_live[:, None], k_ring, 0.0).to(k_ring.dtype)
                w_mat = hl.dot(k_prod, a_parts[1], acc=hl.dot(k_prod, a_parts[0]))
                if operand_parts == 3:
                    w_mat = hl.dot(k_prod, a_parts[2], acc=w_mat)
                w_parts = bf16_parts(w_mat, operand_parts)
                nk, mq = pair_terms(qs, ks, gam, anc, betas, T)
                # per-head ring rows: the drafts' gates G_t (from the base) and keys kt_t at base + t, and a rebase's
                # new base G_{c-1} = 0
                t_col = tt[:, None]
                g_store = stack_rows([(tot + gam[t])[None, :] for t in hl.static_range(T)], t_col, T)  # [Tb, K]
                k_store = (stack_rows([ks[t][None, :] for t in hl.static_range(T)], t_col, T)
                           * torch.exp(-g_store)).to(k_rows.dtype)
                g_at = s64 * gr_s + hv * gr_h + (base + tt) * gr_l
                k_at = s64 * kr_s + hv * kr_h + (base + tt) * kr_l
                if drop:  # other programs of this head may still read the rows these overwrite (their prologue's
                    # keys and G_{c-1}): the last one past its prologue writes
                    hl.inline_triton("tl.debug_barrier()", [], None)
                    seen = hl.atomic_add(counters, [s64 * (HV + H) + hv], 1, sem="acq_rel")
                    if seen == tile_readers - 1:
                        hl.store(g_rows, [g_at, slice(None)], g_store, extra_mask=tlive[:, None])
                        hl.store(k_rows, [k_at, slice(None)], k_store, extra_mask=tlive[:, None])
                        if predecayed_ring == 2:
                            if rebase != 0:
                                g_rows[s64 * gr_s + hv * gr_h + (cur - 1) * gr_l, :] = hl.zeros(
                                    [g_rows.size(1)], torch.float32)
                        counters[s64 * (HV + H) + hv] = seen * 0
                else:  # the drafts' rows lie beyond every committed one: nobody reads them in this launch
                    if tv.begin == 0:
                        hl.store(g_rows, [g_at, slice(None)], g_store, extra_mask=tlive[:, None])
                        hl.store(k_rows, [k_at, slice(None)], k_store, extra_mask=tlive[:, None])
                if (hv == 0) & (tv.begin == 0):
                    folded[s64] = torch.where(fold, 1, 0)
                # the value chunks: every draft's products, outputs and deltas (the drafts' ring rows lie at
                # base + t, beyond the committed entries or over folded ones: no chunk reads them)
                for chunk in hl.grid(tv.begin, tv.end, value_chunk):
                    rows = chunk + hl.arange(value_chunk)
                    live = rows < tv.end
                    s0 = s_next  # [Vc, K]
                    d_t = torch.where(ring_live[:, None], d_next, 0.0).to(d_next.dtype).T  # [Vc, Lb] bf16
                    after = rows + value_chunk  # the next chunk's loads in flight during this one's math
                    s_next = hl.load(state_rows, [st_base + after * st_v, slice(None)],
                                     extra_mask=(after < tv.end)[:, None])
                    d_next = hl.load(d_rows, [dr_base + j * dr_l, after],
                                     extra_mask=ring_live[:, None] & (after < tv.end)[None, :])
                    v_tile = v_next.to(torch.float32).T  # [Vc, Tb]: the drafts' values of this chunk
                    v_next = hl.load(v4, [row, tt, hv, after], extra_mask=tlive[:, None] & (after < tv.end)[None, :])
                    # P = D^T W + S0 A as independent accumulator chains (one per operand part of A and W), summed
                    # at the end: each chain is a third of the tensor-core steps, so their latencies overlap
                    acc0 = hl.dot(d_t, w_parts[0])  # [Vc, N] fp32
                    acc1 = hl.dot(d_t, w_parts[1])
                    if operand_parts == 3:
                        acc2 = hl.dot(d_t, w_parts[2])
                    if fp32_state:  # the checkpoint rows as bf16 parts too: every part pair above 2^-(8 parts)
                        s_parts = bf16_parts(s0, operand_parts)
                        acc0 = hl.dot(s_parts[0], a_parts[0], acc=acc0)
                        acc1 = hl.dot(s_parts[1], a_parts[0], acc=hl.dot(s_parts[0], a_parts[1], acc=acc1))
                        if operand_parts == 3:
                            acc2 = hl.dot(s_parts[2], a_parts[0], acc=hl.dot(s_parts[0], a_parts[2], acc=acc2))
                            acc0 = hl.dot(s_parts[1], a_parts[1], acc=acc0)
                    else:  # a bf16 checkpoint is an exact operand
                        acc0 = hl.dot(s0, a_parts[0], acc=acc0)
                        acc1 = hl.dot(s0, a_parts[1], acc=acc1)
                        if operand_parts == 3:
                            acc2 = hl.dot(s0, a_parts[2], acc=acc2)
                    prod = acc0 + acc1
                    if operand_parts == 3:
                        prod = prod + acc2
                    pk = [torch.sum(torch.where(col == t, prod, 0.0), dim=1) for t in hl.static_range(T)]
                    pq = [torch.sum(torch.where(col == T + t, prod, 0.0), dim=1) for t in hl.static_range(T)]
                    vs = [torch.sum(torch.where(tt[None, :] == t, v_tile, 0.0), dim=1) for t in hl.static_range(T)]
                    deltas, outs = solve_chunk(pk, pq, vs, betas, nk, mq, T)
                    for t in hl.static_range(T):
                        hl.store(out4, [row, t, hv, rows], outs[t].to(out4.dtype), extra_mask=live)
                        hl.store(d_rows, [dr_base + (base + t) * dr_l, rows], deltas[t].to(d_rows.dtype),
                                 extra_mask=live)
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
def verify_mma_kernel_for(value_tile: int, num_warps: int) -> helion.Kernel:
    """The tensor-core verify kernel pinned to one launch shape (one compiled kernel object per pair)."""
    config = helion.Config(block_sizes=[value_tile], indexing="pointer", num_warps=num_warps, num_stages=1)
    return helion.kernel(replayssm_verify_mma_kernel, config=config, **_SETTINGS)
