"""The tensor-core verify kernel: one launch per layer verifies ``T`` draft tokens per row on pre-decayed bf16 rings.

One program per (row ``b``, q/k head ``h``, value head ``hv = h*r + sub``, value tile ``tv``), 4 warps, chunks of
``value_chunk`` value rows. A program reads its checkpoint tile ONCE for all drafts and gets every draft's delta and
output for a chunk straight from tensor-core products:

    [Delta; Out] [N, Vc] = A^T @ S0^T + W^T @ D + E^T @ V

Draft ``t``'s delta and output are linear in the residuals ``v_u - S' k_u`` of its ancestors (the forward
substitution of :func:`~.verify_math.solve_chunk`), so the prologue solves that substitution once on per-program
scalars (:func:`~.verify_math.combination`: ``alpha``, ``gamma``) and folds it into the operands: row ``t`` of ``A^T
[N, K]`` is ``-sum_u alpha[t][u] ak_u``, row ``T + t`` is ``aq_t - sum_u gamma[t][u] ak_u``
(:func:`~.verify_math.output_columns`; ``ak_u = exp(tot + Gam_u) * k_u``, ``aq_t`` likewise with ``q_t``; ``tot =
G_{c-1}`` the committed cumulative gate, ``Gam_t`` the drafts' gate sums along their own paths), ``W^T = A^T @ Kt^T
[N, Lb]`` carries the committed deltas ``D [Lb, Vc]`` (``Kt [Lb, K]`` the pre-decayed keys ``kt_j``) and ``E^T [N,
N]`` (:func:`~.verify_math.value_matrix`) the drafts' values ``V [N, Vc]`` (rows ``u < T``). The bf16 ring tiles and
bf16 values are exact operands; ``A^T``, ``W^T``, ``E^T``, other values and an fp32 checkpoint enter as
``operand_parts`` bf16 parts each (:func:`~.verify_math.bf16_parts`, fp32 accumulation: ~2^-16 relative with two
parts, ~2^-24 with three). With 32-row chunks each of the 4 warps computes an 8-column slice of the ``[N, 32]``
products.

Writes as the CUDA-core verify kernel (:mod:`.verify`, docs/spec.md): the outputs, the drafts' ring entries at
``base + t`` (``base = 0`` when the row folds, else the cursor), no checkpoint except where the committed ring folds
(``c + T > L - 1``: ``S_c = (S0 + D^T Kt) * exp(tot)``) or a head rebases (its drafts would pass the bound: ``S_c``
to the checkpoint, the committed deltas zeroed, ``G_{c-1} = 0``). A rebase, and a fold unless ``fold_in_chunks``,
runs a pass over the value tile first and the drafts then start from ``S_c``; with ``fold_in_chunks`` a folding row's
products are those of a row that does not fold (the committed state as ``S0`` and the ring) and each chunk stores
its rows of ``S_c`` from the ``S0`` rows and deltas it holds (one more product per chunk, accumulating onto the
``S0`` rows). Per-head ring rows that other programs of the head read are written by the head's last program to pass
its prologue (an acq_rel count in ``counters``, zero again after the launch); a head of one program writes them after
a CTA barrier alone. Slot safety as in the decode kernel, except that a refused row's programs run through (their
cursor read as 0) with every store masked and zeros for outputs: the drafts' loads then go out before the slot's
cursor and named count are known (a runtime branch on the verdict would need the drafts' lists carried into it, which
Helion 1.5.0 cannot lower), so they no longer wait for the slot -> cursor chain.
"""

from __future__ import annotations

import functools

import torch

import helion
import helion.language as hl

from .decode_math import gate_math
from .verify_math import (ancestry, bf16_parts, column_matrix, combination, draft_qk, exact_products, merged_terms,
                          min_log_decay, output_columns, pair_terms, part_products, path_sums, stack_rows,
                          value_matrix)

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
    fold_chunk: hl.constexpr,  # value rows per step of the fold's pass (verify_plan.MMA_FOLD_CHUNK)
    named_block: hl.constexpr = 16,
    on_gpu: hl.constexpr = True,
    batched_reductions: hl.constexpr = False,  # the prologue's sums over K as reductions over tuples (verify_math)
    chunk_prefetch: hl.constexpr = True,  # each chunk's loads issued during the previous chunk's math (registers)
    fold_in_chunks: hl.constexpr = False,  # a fold's checkpoint rows stored from the chunk loop, not a pass before it
    early_params: hl.constexpr = False,  # the gate's parameters loaded beside the drafts' inputs
    merged_sums: hl.constexpr = False,  # the norms, couplings and rebase test as one reduction (merged_terms)
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
        vc = hl.arange(columns)  # the products' columns; as rows of the values' tile, the drafts u < T
        slot = slots[row]
        if slot >= 0:
            in_range = slot < num_slots
            s64 = torch.where(in_range, slot, 0).to(torch.int64)
            cur = cursors[s64]
            # the drafts' inputs (this row's, always in range), one list entry each, issued while the cursor and
            # the named count are on their way; their math waits for the first chunk's loads below
            q_in = [q4[row, t, h, :] for t in hl.static_range(T)]
            k_in = [k4[row, t, h, :] for t in hl.static_range(T)]
            a_in = [a4[row, t, hv, :] for t in hl.static_range(T)]
            b_in = [b3[row, t, hv] for t in hl.static_range(T)]
            if early_params:  # else they load where the gates are made, after the norms' barriers
                dt_row = dt_bias2[hv, :]
                a_log = A_log[hv]
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
            cur = torch.where(ok, cur, 0)  # a refused row's cursor 0 never folds (T <= L - 1, spec_validation), so
            # its program reaches no checkpoint or ring store that ``ok`` does not mask
            fold = cur + T > ring_length - 1  # the drafts do not fit beyond the committed entries
            base = torch.where(fold, 0, cur)
            j = hl.arange(ring_block)
            valid = (j < cur) & (j < ring_length)
            st_base = s64 * st_s + hv * st_h
            dr_base = s64 * dr_s + hv * dr_h
            lead = tv.begin + hl.arange(value_chunk)
            if chunk_prefetch:  # the first value chunk's loads go out now, so their latency overlaps the prologue
                s_next = hl.load(state_rows, [st_base + lead * st_v, slice(None)], extra_mask=(lead < tv.end)[:, None])
                d_next = hl.load(d_rows, [dr_base + j * dr_l, lead],
                                 extra_mask=valid[:, None] & (lead < tv.end)[None, :])
                v_next = hl.load(v4, [row, vc, hv, lead], extra_mask=(vc < T)[:, None] & (lead < tv.end)[None, :])
            k_ring = hl.load(k_rows, [s64 * kr_s + hv * kr_h + j * kr_l, slice(None)], extra_mask=valid[:, None])
            g_last = g_rows[s64 * gr_s + hv * gr_h + torch.where(cur > 0, cur - 1, 0) * gr_l, :]
            # the drafts: q, k [K] (scaled, normalized), log-gates, beta, parents
            if not merged_sums:
                qs, ks = draft_qk(q_in, k_in, scale, use_l2norm, T, batched_reductions)
            if early_params:
                gates = [gate_math(a_in[t].to(torch.float32) + dt_row, a_log, lower_bound, use_lower_bound)
                         for t in hl.static_range(T)]
            else:
                gates = [gate_math(a_in[t].to(torch.float32) + dt_bias2[hv, :], A_log[hv], lower_bound,
                                   use_lower_bound) for t in hl.static_range(T)]
            betas = [torch.sigmoid(b_in[t].to(torch.float32)) for t in hl.static_range(T)]
            if tree:
                pars = [parents[row, t] for t in hl.static_range(T)]
            else:
                pars = [slot * 0 + (t - 1) for t in hl.static_range(T)]
            anc = ancestry(pars, T)
            gam = path_sums(gates, anc, T)
            if merged_sums:  # q, k, the couplings and the rebase test from one reduction, the decays known
                if predecayed_ring == 2:
                    qs, ks, nk, mq, below = merged_terms(q_in, k_in, gam, anc, betas, scale, use_l2norm, T,
                                                         torch.where(cur > 0, g_last, 0.0))
                else:
                    qs, ks, nk, mq, below = merged_terms(q_in, k_in, gam, anc, betas, scale, use_l2norm, T)
            tot = torch.where(cur > 0, g_last, 0.0)  # G_{c-1}
            if fold_in_chunks:
                decay = torch.exp(tot)  # a folding row's checkpoint S_c = (S0 + D^T Kt) * decay, from each chunk
            drop = fold  # the drafts' rows overwrite committed ring rows (a fold or a rebase)
            if predecayed_ring == 2:  # drafts that would pass the bound from the committed base rebase the head
                if merged_sums:  # (counted in the merged reduction)
                    rebase = torch.where((below > 0.5) & (fold == 0) & (cur > 0), 1, 0).to(torch.int32)
                else:
                    low = min_log_decay(tot, gam, T, batched_reductions)
                    rebase = torch.where((low < -75.0) & (fold == 0) & (cur > 0), 1, 0).to(torch.int32)  # the bound
                if on_gpu:
                    rebase = hl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", [rebase],
                                                       dtype=torch.int32, is_pure=True, pack=1)
                drop = drop | (rebase != 0)
                emptied = torch.where(rebase != 0, cur, 0)  # a rebase zeroes the committed deltas j < emptied
            if fold_in_chunks:  # a fold's checkpoint goes out from the chunk loop: a pass only for a rebase
                prepass = drop & (fold == 0)
            else:
                prepass = drop
            if prepass:  # the committed ring into the checkpoint first, S_c = (S0 + D^T Kt) * exp(tot), a rebase's
                # committed deltas zeroed; the drafts then start from S_c at the ring's new base (no ring term,
                # tot = 0)
                decay = torch.exp(tot)
                for fchunk in hl.grid(tv.begin, tv.end, fold_chunk):
                    frows = fchunk + hl.arange(fold_chunk)
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
                                 hl.zeros([ring_block, fold_chunk], d_rows.dtype),
                                 extra_mask=(j < emptied)[:, None] & flive[None, :])
                hl.inline_triton("tl.debug_barrier()", [], None)  # S_c's stores before the chunks read it
                if chunk_prefetch:
                    s_next = hl.load(state_rows, [st_base + lead * st_v, slice(None)],
                                     extra_mask=(lead < tv.end)[:, None])
                tot = tot * 0.0
            ring_live = (j < torch.where(prepass, 0, cur)) & (j < ring_length)  # the entries the products read
            g_base = tot  # the drafts' cumulative gates start here (0 from a new base)
            if fold_in_chunks:
                g_base = torch.where(drop, 0.0, tot)  # (a fold kept tot for its products)
            # the products' operands, transposed (the chunk's results come out as [N, Vc], a row per store) and
            # as bf16 parts: A^T [N, K] whose rows give every draft's delta and output (the forward substitution
            # over the drafts folded into them, verify_math.combination), W^T = A^T Kt^T [N, Lb] (zero after a
            # rebase) and the values' matrix E^T [N, N]
            row_n = vc[:, None]
            aks = [(torch.exp(tot + gam[t]) * ks[t])[None, :] for t in hl.static_range(T)]
            aqs = [(torch.exp(tot + gam[t]) * qs[t])[None, :] for t in hl.static_range(T)]
            if not merged_sums:
                nk, mq = pair_terms(qs, ks, gam, anc, betas, T, batched_reductions)
            alpha, gamma = combination(betas, nk, mq, T)
            cols_d, cols_o = output_columns(aks, aqs, alpha, gamma, T)
            at_parts = bf16_parts(column_matrix(cols_d, cols_o, row_n, T), operand_parts)
            et_parts = bf16_parts(value_matrix(alpha, gamma, vc[None, :], row_n, T), operand_parts)
            k_prod = torch.where(ring_live[:, None], k_ring, 0.0).to(k_ring.dtype).T  # [K, Lb]
            w_mat = hl.dot(at_parts[1], k_prod, acc=hl.dot(at_parts[0], k_prod))
            if operand_parts == 3:
                w_mat = hl.dot(at_parts[2], k_prod, acc=w_mat)
            wt_parts = bf16_parts(w_mat, operand_parts)
            # per-head ring rows: the drafts' gates G_t (from the base) and keys kt_t at base + t, and a rebase's
            # new base G_{c-1} = 0
            t_col = tt[:, None]
            g_store = stack_rows([(g_base + gam[t])[None, :] for t in hl.static_range(T)], t_col, T)  # [Tb, K]
            k_store = (stack_rows([ks[t][None, :] for t in hl.static_range(T)], t_col, T)
                       * torch.exp(-g_store)).to(k_rows.dtype)
            g_at = s64 * gr_s + hv * gr_h + (base + tt) * gr_l
            k_at = s64 * kr_s + hv * kr_h + (base + tt) * kr_l
            if drop:  # the rows these overwrite were read in the prologue (keys, G_{c-1}) by this program's
                # threads (a barrier) and, with more than one value tile, by the head's other programs: of those,
                # the last one past its prologue writes (an acq_rel count); a head's only program writes at once
                hl.inline_triton("tl.debug_barrier()", [], None)
                if tile_readers > 1:
                    seen = hl.atomic_add(counters, [s64 * (HV + H) + hv], 1, sem="acq_rel")
                    writer = seen == tile_readers - 1
                else:
                    writer = drop
                if writer:
                    hl.store(g_rows, [g_at, slice(None)], g_store, extra_mask=tlive[:, None])
                    hl.store(k_rows, [k_at, slice(None)], k_store, extra_mask=tlive[:, None])
                    if predecayed_ring == 2:
                        if rebase != 0:
                            g_rows[s64 * gr_s + hv * gr_h + (cur - 1) * gr_l, :] = hl.zeros(
                                [g_rows.size(1)], torch.float32)
                    if tile_readers > 1:
                        counters[s64 * (HV + H) + hv] = seen * 0
            else:  # the drafts' rows lie beyond every committed one: nobody reads them in this launch
                if tv.begin == 0:
                    mine = torch.where(ok, tlive, False)[:, None]  # (a refused row writes nothing)
                    hl.store(g_rows, [g_at, slice(None)], g_store, extra_mask=mine)
                    hl.store(k_rows, [k_at, slice(None)], k_store, extra_mask=mine)
            if (hv == 0) & (tv.begin == 0) & ok:
                folded[s64] = torch.where(fold, 1, 0)
            # the value chunks: every draft's delta and output straight from the products (the drafts' ring rows
            # lie at base + t, beyond the committed entries or over folded ones: no chunk reads them)
            for chunk in hl.grid(tv.begin, tv.end, value_chunk):
                rows = chunk + hl.arange(value_chunk)
                live = rows < tv.end
                if chunk_prefetch:
                    s0 = s_next  # [Vc, K]
                    d_cur = torch.where(ring_live[:, None], d_next, 0.0).to(d_next.dtype)  # [Lb, Vc] bf16
                    v_cur = v_next  # [N, Vc]: the drafts' values of this chunk in rows u < T
                    after = rows + value_chunk  # the next chunk's loads in flight during this one's math
                    s_next = hl.load(state_rows, [st_base + after * st_v, slice(None)],
                                     extra_mask=(after < tv.end)[:, None])
                    d_next = hl.load(d_rows, [dr_base + j * dr_l, after],
                                     extra_mask=ring_live[:, None] & (after < tv.end)[None, :])
                    v_next = hl.load(v4, [row, vc, hv, after],
                                     extra_mask=(vc < T)[:, None] & (after < tv.end)[None, :])
                else:  # this chunk's loads here: fewer registers (other programs on the SM hide their latency)
                    s0 = hl.load(state_rows, [st_base + rows * st_v, slice(None)], extra_mask=live[:, None])
                    d_cur = hl.load(d_rows, [dr_base + j * dr_l, rows], extra_mask=ring_live[:, None] & live[None, :])
                    v_cur = hl.load(v4, [row, vc, hv, rows], extra_mask=(vc < T)[:, None] & live[None, :])
                # [Delta; Out] = W^T D + A^T S0^T + E^T V as independent accumulator chains (one per operand
                # part), summed at the end: each chain is a third of the tensor-core steps, so their latencies
                # overlap
                acc0, acc1, acc2 = exact_products(wt_parts, d_cur, None, None, None, operand_parts)  # [N, Vc]
                if fp32_state:  # the checkpoint rows as bf16 parts too
                    acc0, acc1, acc2 = part_products(at_parts, [part.T for part in bf16_parts(s0, operand_parts)],
                                                     acc0, acc1, acc2, operand_parts)
                else:  # a bf16 checkpoint is an exact operand
                    acc0, acc1, acc2 = exact_products(at_parts, s0.T, acc0, acc1, acc2, operand_parts)
                if v4.dtype == torch.bfloat16:  # bf16 values are an exact operand
                    acc0, acc1, acc2 = exact_products(et_parts, v_cur, acc0, acc1, acc2, operand_parts)
                else:  # others as bf16 parts, as the checkpoint
                    acc0, acc1, acc2 = part_products(et_parts, bf16_parts(v_cur.to(torch.float32), operand_parts),
                                                     acc0, acc1, acc2, operand_parts)
                if fold_in_chunks:
                    if fold:  # the committed state's rows into the checkpoint; the products above read the same
                        # state, S0 and the committed ring unrounded, so the fold needs no pass of its own
                        s_row = hl.dot(d_cur.T, k_ring, acc=s0.to(torch.float32)) * decay[None, :]  # [Vc, K]
                        hl.store(state_rows, [st_base + rows * st_v, slice(None)], s_row.to(state_rows.dtype),
                                 extra_mask=live[:, None])
                res = acc0 + acc1  # [N, Vc]: row t < T draft t's delta, row T + t its output
                if operand_parts == 3:
                    res = res + acc2
                hl.store(out4, [row, torch.where(vc >= T, vc - T, 0), hv, rows],
                         torch.where(ok, res, 0.0).to(out4.dtype),  # a refused row: a padding row's zeros
                         extra_mask=((vc >= T) & (vc < 2 * T))[:, None] & live[None, :])
                hl.store(d_rows, [dr_base + (base + torch.where(vc < T, vc, 0)) * dr_l, rows], res.to(d_rows.dtype),
                         extra_mask=torch.where(ok, vc < T, False)[:, None] & live[None, :])
            if ok == 0:  # a refused row, recorded once per row
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


# offsets in int32 where every argument has fewer than 2^31 elements (the packed row views of kernels.args.rows_view
# count the caches' extent), else int64 (Helion decides per bound argument set)
_SETTINGS = dict(static_shapes=True, index_dtype=None)


@functools.lru_cache(maxsize=None)
def verify_mma_kernel_for(value_tile: int, num_warps: int) -> helion.Kernel:
    """The tensor-core verify kernel pinned to one launch shape (one compiled kernel object per pair)."""
    config = helion.Config(block_sizes=[value_tile], indexing="pointer", num_warps=num_warps, num_stages=1)
    return helion.kernel(replayssm_verify_mma_kernel, config=config, **_SETTINGS)
