"""The Helion ReplaySSM decode kernel: one launch per decode call (``docs/kernel_design.md`` explains it).

One program per (row ``b``, q/k head ``h``, value head ``hv = h*r + sub`` of it, value tile ``tv``), all math fp32.
A program reads its row's checkpoint tile once and the ring's live entries, writes the outputs, and either appends
the step's ``(delta, k, g)`` to the ring at the row's cursor or, on a flush, writes the new state into the
checkpoint: the state is never materialized on the every-step path (``S' @ k = S0 @ ak + D^T wk``).

The constexprs say what the launch is (:class:`tp_replayssm.kernels.plan.DecodePlan` sets every one of them):
``predecayed_ring`` the ring layout and its rebase form, ``cursors_by_slot`` per-row cursors (the op) or the pool's
cursor table, ``advance_cursors`` the fused cursor advance (``late_count``: its reader count after the row's loads),
``early_qk`` and ``pinned_loads`` what goes out before the slot's verdict, ``relaxed_conv_count`` the fused conv's
count without fences, ``tiny_batch`` the latency path,
``chunks_on_tensor_cores`` and ``vector_tiles`` the chunk loop's form. Caches
arrive as overlapping row views with element strides (:mod:`tp_replayssm.kernels.args`), so any strides with a
contiguous last dim work without copies; offsets are int64.
"""

from __future__ import annotations

import torch

import helion.language as hl

from .decode_chunks import chunk_step, empty_ring, mma_chunk, rebase_chunk
from .decode_compile import _SETTINGS, CURSOR_READER, decode_kernel_for
from .decode_conv import conv_prologue, conv_qk, conv_qk_store, conv_qk_windows, conv_stores, conv_taps
from .decode_math import (flush_keys, g_entry, gate_math, k_entry, qk_math, ring_rows, row_dots, sglang_weights,
                          split3_columns, vector_tile)

__all__ = ["CURSOR_READER", "decode_kernel_for", "replayssm_decode_kernel"]


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
    k_rows: torch.Tensor,  # k ring rows view [span, K] (per q/k head; per value head if predecayed_ring)
    g_rows: torch.Tensor,  # g ring rows view [span, K] (cumulative gates if predecayed_ring)
    state_vecs: torch.Tensor,  # the checkpoint rows as [Ko, span, Ki, kv], K = Ko*Ki*kv, kv = one 16-byte vector
    k_vecs: torch.Tensor,  # the k ring rows, split as state_vecs
    out3: torch.Tensor,  # [B, HV, V]
    slots: torch.Tensor,  # [B] int32
    write_pos: torch.Tensor,  # [B] int32 cursor per row, or [S + 1] per slot (cursors_by_slot)
    force_flush: torch.Tensor,  # [B] int32 (zeros when the caller passed None)
    slot_errors: torch.Tensor,  # [ERROR_WORDS] int32: the pool's record of bad rows (kernels.guard)
    call_code: torch.Tensor,  # [1] int32: what this call records there
    conv_rows: torch.Tensor,  # fused_conv: rows view [span, W-1] of pool.conv_state (else any tensor, never read)
    conv_w: torch.Tensor,  # fused_conv: the taps weight[d, i] at element d*cw_d + i*cw_i of this flat view
    conv_b: torch.Tensor,  # fused_conv with conv_has_bias: [D] the bias
    conv_counters: torch.Tensor,  # fused_conv == 2: [(S + 1) * H] int32, zero between launches
    vpost3: torch.Tensor,  # fused_conv: [B, HV, V] out3's memory again: the chunk loops read the post-conv v there
    num_slots: int,  # S: a row whose slot is >= S is refused
    cv_base: int,  # fused_conv: the layer's first window row, and the window element stride of a slot
    cv_s: int,
    scale: float, lower_bound: float,
    st_s: int, st_h: int, st_v: int,  # checkpoint element strides (slot, head, value row)
    dr_s: int, dr_h: int, dr_l: int,  # d ring strides (slot, head, ring pos)
    kr_s: int, kr_h: int, kr_l: int,  # k ring strides
    gr_s: int, gr_h: int, gr_l: int,  # g ring strides
    ring_length: hl.constexpr, ring_block: hl.constexpr, value_chunk: hl.constexpr,
    use_l2norm: hl.constexpr, use_lower_bound: hl.constexpr,
    cursors_by_slot: hl.constexpr, tiny_batch: hl.constexpr, chunks_on_tensor_cores: hl.constexpr,
    predecayed_ring: hl.constexpr,  # 0: sglang layout; pre-decayed 1: no rebase possible, 2/3: rebases (docs/kernel_design.md)
    advance_cursors: hl.constexpr = 0,  # 0, or the programs per row: they advance the cursor table (docs/kernel_design.md)
    vector_tiles: hl.constexpr = 0,  # 1: the append loop on state_vecs tiles, 2: and the pre-decayed keys on k_vecs
    named_block: hl.constexpr = 16,  # rows per step of the scan that counts how many rows name a slot
    on_gpu: hl.constexpr = True,  # device code, or the Triton interpreter (which runs no inline PTX)
    fused_conv: hl.constexpr = 0,  # 0: q3/k3/v3 post-conv; 1/2: pre-conv, the conv fused (docs/conv.md; 2: counted)
    conv_readers: hl.constexpr = 0,  # fused_conv == 2: the programs of one (row, q/k head)
    conv_size: hl.constexpr = 1,  # W
    conv_width: hl.constexpr = 1,  # the power of two >= W the taps are computed in
    conv_has_bias: hl.constexpr = False,
    cv_d: hl.constexpr = 0,  # window element stride of a channel (W-1 in the pool)
    cw_d: hl.constexpr = 0,  # taps' element strides: channel, tap
    cw_i: hl.constexpr = 0,
    late_count: hl.constexpr = False,  # the fused advance's reader count after the row's loads (plan.late_count_rule)
    early_qk: hl.constexpr = False,  # q, k (fused_conv: the conv) loaded, computed before the verdict (plan)
    pinned_loads: hl.constexpr = False,  # the row's loads kept above the verdict's branch (DecodePlan.pinned_loads)
    relaxed_conv_count: hl.constexpr = False,  # fused_conv 2, early_qk: the count without fences (docs/conv.md)
) -> torch.Tensor:
    """One decode step: outputs, ring appends and flush-row checkpoint writes (docs/kernel_design.md)."""
    B = q3.size(0)
    H = hl.specialize(q3.size(1))
    HV = hl.specialize(v3.size(1))
    V = hl.specialize(v3.size(2))
    group = HV // H
    # the flush's ring product on tensor cores: bf16 rings (exact MMA operands) and tiles of >= 16 x 16
    ring_on_tensor_cores = d_rows.dtype == torch.bfloat16 and value_chunk >= 16 and state_rows.size(1) >= 16
    # the every-step products on tensor cores too when asked, for a bf16 checkpoint; else fp32 sums in registers
    mma_chunks = chunks_on_tensor_cores and ring_on_tensor_cores and state_rows.dtype == torch.bfloat16
    # Programmatic dependent launch (sm_90+; nothing elsewhere): wait at entry until the previous kernel has finished
    # and its writes are visible, then let the next PDL kernel launch early (docs/kernel_design.md)
    hl.pdl_wait()
    hl.pdl_launch_dependents()
    for tile_b, tile_h, tile_r, tv in hl.tile([B, H, group, V], block_size=[1, 1, 1, None]):
        row = tile_b.begin
        h = tile_h.begin
        sub = tile_r.begin  # value head hv = h*group + sub reads q/k head h
        hv = h * group + sub
        if predecayed_ring:  # the k ring's head: pre-decayed keys depend on the value head's gates
            kh = hv
            k_owner = True  # every value head appends its own keys
        else:
            kh = h
            k_owner = sub == 0  # the q/k head's first value head appends its key
        if cursors_by_slot:  # the call's slots, to count the rows that name this row's slot (issued first: its
            # latency overlaps the slot -> cursor chain; see below)
            others = hl.arange(named_block)
            named_tile = hl.load(slots, [others], extra_mask=others < B)
        slot = slots[row]
        if tiny_batch or early_qk:  # the row's inputs (always in range) load beside the slot, not after its verdict
            if not fused_conv:  # (pre-conv q/k are read by the conv itself)
                q_in = q3[row, h, :]
                k_in = k3[row, h, :]
            a_in = a3[row, hv, :]
            b_in = b2[row, hv]
        if slot >= 0:
            # slot safety (docs/contract.md): a slot >= S, a cursor outside [0, L-1] (a free slot's is FREE_CURSOR)
            # or, in the pool's calls, a slot that two rows name makes this a padding row; the address stays in range
            in_range = slot < num_slots
            s64 = torch.where(in_range, slot, 0).to(torch.int64)
            st_base = s64 * st_s + hv * st_h
            dr_base = s64 * dr_s + hv * dr_h
            # first value chunk's loads go out now, so their latency overlaps the ring math below
            rows = tv.begin + hl.arange(value_chunk)
            live = rows < tv.end
            if vector_tiles:  # [Ko, Vc, Ki, kv] tiles: the value rows across the lanes (docs/kernel_design.md)
                S_next = hl.load(state_vecs, [slice(None), st_base + rows * st_v, slice(None), slice(None)],
                                 extra_mask=live[None, :, None, None])
            elif not mma_chunks:
                S_next = hl.load(state_rows, [st_base + rows * st_v, slice(None)], extra_mask=live[:, None])
            if advance_cursors and late_count:  # a plain read; the count after the row's loads (kernel_design.md)
                cur = write_pos[s64] & 65535
            elif advance_cursors:  # the fused advance (docs/kernel_design.md): the read is an atomic count of the readers
                # 65536 = CURSOR_READER (a literal: Helion passes a module constant as a kernel argument)
                counted = hl.atomic_add(write_pos, [s64], torch.where(in_range, 65536, 0))  # cursor | readers << 16
                cur = counted & 65535
            elif cursors_by_slot:
                cur = write_pos[s64]  # the pool's cursor table [S + 1]
            else:
                cur = write_pos[row]
            if early_qk:  # outside the verdict's branch, so the compiler cannot sink q/k's loads into it
                if fused_conv:  # the conv's windows, inputs and taps load beside the cursor; its math before the
                    # verdict too (the stores wait for it: conv_stores below)
                    ci = hl.arange(conv_width)  # the taps
                    in_window = ci < conv_size - 1
                    last_tap = (ci == conv_size - 1)[None, :]
                    kk = hl.arange(q3.size(2))
                    cv_row = cv_base + s64 * cv_s  # the slot's window rows start here (in range: s64 is clamped)
                    q_u, k_u, v_u, q_post, k_post, v_post = conv_taps(
                        conv_rows, conv_w, conv_b, q3, k3, v3, row, h, hv, tv, H, V, kk, ci, in_window, last_tap,
                        cv_row, cv_d, cw_d, cw_i, conv_size, conv_has_bias, on_gpu)
                    q, k = conv_qk(q3, k3, q_post, k_post, scale, use_l2norm)
                else:
                    q, k = qk_math(q_in.to(torch.float32), k_in.to(torch.float32), scale, use_l2norm)
            cur_ok = in_range & (cur >= 0) & (cur < ring_length)
            ok = cur_ok
            if cursors_by_slot:  # how many rows of the call name this slot
                named = torch.sum(torch.where((named_tile == slot) & (others < B), 1, 0), dim=0).to(torch.int32)
                if B > named_block:  # batches past one tile: the rest in a loop
                    for nb in hl.grid(named_block, B, named_block):
                        more = nb + hl.arange(named_block)
                        same = (hl.load(slots, [more], extra_mask=more < B) == slot) & (more < B)
                        named = named + torch.sum(torch.where(same, 1, 0), dim=0).to(torch.int32)
                if on_gpu:  # lane 0's count to every lane: ptxas then knows it is warp-uniform, and the branches
                    # below need no divergent-warp code for their shuffles (which doubled the SASS and spilled)
                    named = hl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", [named],
                                                      dtype=torch.int32, is_pure=True, pack=1)
                ok = ok & (named == 1)
            if advance_cursors and not late_count:  # the last reader of the word (of every row naming the slot) stores
                if in_range & (((counted >> 16) & 65535) >= advance_cursors * named - 1):
                    write_pos[s64] = torch.where(
                        ok, torch.where((cur >= ring_length - 1) | (force_flush[row] != 0), 0, cur + 1), cur)
            # a cursor out of range addresses entry 0 (from the cursor alone: the ring loads need not wait for the count)
            cur_read = cur
            cur = torch.where(cur_ok, cur, 0)
            forced = force_flush[row]
            append = (cur != ring_length - 1) & (forced == 0)  # else this step flushes the row
            j = hl.arange(ring_block)
            valid = (j < cur) & (j < ring_length)  # ring entries j < cursor are live
            if tiny_batch:  # load the whole ring without waiting for the cursor; `valid` masks it below
                ring_mask = j < ring_length
            else:  # load only the live entries (fewer bytes)
                ring_mask = valid
            if not mma_chunks:
                d_next = hl.load(d_rows, [ring_rows(dr_base + j * dr_l, vector_tiles), rows],
                                 extra_mask=ring_mask[:, None] & live[None, :])
            if predecayed_ring:  # tot = G_{c-1}, one row (0 for an empty ring); no scan, no exp per entry
                g_last = g_rows[s64 * gr_s + hv * gr_h + torch.where(cur > 0, cur - 1, 0) * gr_l, :]
            else:
                g_ring = hl.load(g_rows, [s64 * gr_s + hv * gr_h + j * gr_l, slice(None)], extra_mask=ring_mask[:, None])
            if predecayed_ring and vector_tiles == 2:  # the pre-decayed keys as [Ko, Lb, Ki, kv] tiles (docstring)
                k_tiles = hl.load(k_vecs, [slice(None), s64 * kr_s + kh * kr_h + j * kr_l, slice(None), slice(None)],
                                  extra_mask=ring_mask[None, :, None, None])
            else:
                k_ring = hl.load(k_rows, [s64 * kr_s + kh * kr_h + j * kr_l, slice(None)],
                                 extra_mask=ring_mask[:, None])
            if pinned_loads:  # the gate's parameters beside the row's inputs (kept above the branch: see below)
                dt_row = dt_bias2[hv, :]
                a_log = A_log[hv]
            if ok:
                if fused_conv and early_qk:  # the conv's stores (its loads and math above)
                    shifted, to_col = conv_stores(conv_rows, q3, out3, row, h, hv, tv, H, V, kk, ci, cv_row, cv_d,
                                                  conv_size, fused_conv, q_u, k_u, v_u, v_post)
                    if fused_conv == 2:  # counted right after the conv (conv_stores' barrier: this program's window
                        # reads are done): the last of the head's readers writes the q/k windows from its registers
                        if relaxed_conv_count:  # a relaxed count that adds 1 computed from q and k, so from every
                            # q/k window value read here: it cannot issue before they have returned (num_slots >> 31
                            # is 0: an int32 count); the writer stores after seeing every count (docs/conv.md,
                            # "The count without fences")
                            qk_bits = torch.sum(q + k, dim=0).to(torch.int32)
                            step = 1 + (qk_bits & ((slot * 0 + num_slots) >> 31))
                            seen = hl.atomic_add(conv_counters, [s64 * H + h], step)
                        else:
                            seen = hl.atomic_add(conv_counters, [s64 * H + h], 1, sem="acq_rel")
                        if seen == conv_readers - 1:
                            conv_qk_store(conv_rows, q3, h, H, kk, cv_row, cv_d, shifted, to_col, q_u, k_u)
                            conv_counters[s64 * H + h] = seen * 0
                elif fused_conv:  # the conv of this program's channels from their windows (docs/conv.md: fused conv)
                    ci = hl.arange(conv_width)  # the taps
                    in_window = ci < conv_size - 1
                    last_tap = (ci == conv_size - 1)[None, :]
                    kk = hl.arange(q3.size(2))
                    cv_row = cv_base + s64 * cv_s  # the slot's window rows start here
                    q, k, shifted, to_col = conv_prologue(
                        conv_rows, conv_w, conv_b, q3, k3, v3, out3, row, h, hv, tv, H, V, kk, ci, in_window, last_tap,
                        cv_row, cv_d, cw_d, cw_i, conv_size, conv_has_bias, fused_conv, on_gpu, scale, use_l2norm)
                elif not early_qk:
                    if not tiny_batch:
                        q_in = q3[row, h, :]
                        k_in = k3[row, h, :]
                    if not late_count:
                        q, k = qk_math(q_in.to(torch.float32), k_in.to(torch.float32), scale, use_l2norm)
                if late_count:  # the row's loads are out: the count; the last reader stores (masked: docs/pitfalls.md)
                    if not tiny_batch and not early_qk:
                        a_in = a3[row, hv, :]
                        b_in = b2[row, hv]
                    counted = hl.atomic_add(write_pos, [s64], 65536)  # named == 1 and the slot in range here
                    hl.store(write_pos, [s64], torch.where((cur >= ring_length - 1) | (forced != 0), 0, cur + 1),
                             extra_mask=((counted >> 16) & 65535) >= advance_cursors - 1)
                    if not fused_conv and not early_qk:
                        q, k = qk_math(q_in.to(torch.float32), k_in.to(torch.float32), scale, use_l2norm)
                if not tiny_batch and not late_count and not early_qk:
                    a_in = a3[row, hv, :]
                if pinned_loads:  # (two calls: one after a branch that only places the loads reorders the code
                    # of every program of the library, sass_hashes.py --compare)
                    g = gate_math(a_in.to(torch.float32) + dt_row, a_log, lower_bound, use_lower_bound)
                else:
                    x = a_in.to(torch.float32) + dt_bias2[hv, :]
                    g = gate_math(x, A_log[hv], lower_bound, use_lower_bound)
                if not tiny_batch and not late_count and not early_qk:
                    b_in = b2[row, hv]
                beta = torch.sigmoid(b_in.to(torch.float32))
                eg = torch.exp(g)
                keep = cur >= 0  # true (a rebasing head of mode 3 clears it below)
                if predecayed_ring:  # kdec holds kt_j = k_j*exp(-G_j), the decayed key kt_j*exp(tot): wk = kt_j . ak
                    tot = torch.where(cur > 0, g_last, 0.0)
                    g_cum = tot + g  # G_c
                    e_new = torch.exp(g_cum)  # the new state's decay; kt_j*e_new = k_j*exp(G_c - G_j) (see below)
                    ak = e_new * k  # S0 @ ak = the checkpoint's part of S' @ k
                    aq = e_new * q
                    if vector_tiles == 2:  # wk, wq over [Ko, Lb, Ki, kv] tiles: in-thread sums and log2(Ko) shuffle rounds
                        ak_loop, aq_loop = vector_tile(ak, state_vecs), vector_tile(aq, state_vecs)
                        kt = k_tiles.to(torch.float32)
                        if tiny_batch:  # the whole ring was loaded; the live-entry load returns 0 past the cursor
                            kt = torch.where(valid[None, :, None, None], kt, 0.0)
                        wk = row_dots(kt, ak_loop)  # [Lb]
                        wq = row_dots(kt, aq_loop)
                    else:
                        kdec = torch.where(valid[:, None], k_ring.to(torch.float32), 0.0)
                        wk = torch.sum(kdec * ak[None, :], dim=1)  # [Lb]
                        wq = torch.sum(kdec * aq[None, :], dim=1)
                    # G_c past the bound (unbounded gates): this head rebases its ring instead of appending
                    # k*exp(-G_c) (docs/kernel_design.md); never under (L-1)*|lower_bound| <= the bound
                    if predecayed_ring >= 2:  # (1: a bounded gate that cannot get there; the wrapper decides)
                        rebase = (torch.amin(g_cum, dim=0) < -75.0) & append  # -validation.PREDECAYED_MAX_LOG_DECAY
                    if predecayed_ring == 2:  # 2: through the flush branch
                        append = append & (rebase == 0)
                        emptied_to = torch.where(rebase, cur, -1)  # a rebase zeroes the deltas j <= c
                    if predecayed_ring == 3:  # 3: the append loop (the cursor alone chooses it), then a pass of its own
                        keep = rebase == 0
                        d_end = torch.where(rebase, 0, V)  # the append stores the delta of value rows < d_end
                else:  # (spelled apart from the branch above: this statement order keeps the sglang path's registers)
                    kdec, wk, wq, et, ak, aq = sglang_weights(g_ring, k_ring, valid, tiny_batch, eg, k, q)
                    g_cum = g  # (the g ring holds gates, not sums)
                kq = torch.sum(k * q, dim=0)
                ak_row, aq_row, wk_col, wq_col = ak[None, :], aq[None, :], wk[:, None], wq[:, None]
                if vector_tiles:  # the append loop's [Ko, 1, Ki, kv] (the pre-decayed prologue's key tiles made them above)
                    if not (predecayed_ring and vector_tiles == 2):
                        ak_loop, aq_loop = vector_tile(ak, state_vecs), vector_tile(aq, state_vecs)
                else:
                    ak_loop, aq_loop = ak_row, aq_row
                if append:  # every step but the flush: outputs and the ring append of delta
                    if vector_tiles:  # the ring entries at c (g, and k per k-ring head) before the loop: no program of the
                        # launch reads entry c (a whole-ring load masks it); written after the loop, they spilled here
                        if tv.begin == 0:
                            g_rows[s64 * gr_s + hv * gr_h + cur * gr_l, :] = g_entry(g, g_cum, keep, predecayed_ring)
                            if k_owner:
                                k_rows[s64 * kr_s + kh * kr_h + cur * kr_l, :] = k_entry(
                                    k, g_cum, keep, predecayed_ring).to(k_rows.dtype)
                    if mma_chunks:  # the chunk products on tensor cores (docs/kernel_design.md)
                        col = hl.arange(16)[None, :]
                        a_mat = split3_columns(ak[:, None], aq[:, None], col)  # [K, 16] bf16
                        w_mat = split3_columns(wk_col, wq_col, col)  # [Lb, 16] bf16
                        k_col = col < 8  # columns of the k products
                        for mchunk in hl.grid(tv.begin, tv.end, value_chunk):
                            mrows = mchunk + hl.arange(value_chunk)
                            mlive = mrows < tv.end
                            mdelta = mma_chunk(state_rows, d_rows, v3, vpost3, out3, mrows, mlive, st_base, st_v,
                                               dr_base, dr_l, j, valid, a_mat, w_mat, k_col, fused_conv, row, hv, beta,
                                               kq)
                            if predecayed_ring == 3 and not fused_conv:  # a rebasing head stores none (with the
                                mlive = mlive & (mrows < d_end)  # fused conv its rebase pass reads the delta back)
                            hl.store(d_rows, [dr_base + cur * dr_l, mrows], mdelta.to(d_rows.dtype), extra_mask=mlive)
                    else:  # row reductions in registers, the next chunk's loads in flight
                        for chunk in hl.grid(tv.begin, tv.end, value_chunk):
                            rows = chunk + hl.arange(value_chunk)
                            live = rows < tv.end
                            S0, d_ring, delta, S_next, d_next = chunk_step(
                                state_rows, state_vecs, d_rows, v3, vpost3, out3, S_next, d_next, rows, live, tv,
                                value_chunk, st_base, st_v, dr_base, dr_l, j, valid, vector_tiles, vector_tiles,
                                fused_conv, row, hv, ak_loop, aq_loop, wk_col, wq_col, beta, kq)
                            if predecayed_ring == 3 and not fused_conv:  # a rebasing head stores none (as above)
                                live = live & (rows < d_end)
                            hl.store(d_rows, [dr_base + cur * dr_l, rows], delta.to(d_rows.dtype), extra_mask=live)
                    if not vector_tiles:  # the ring entries at c, as above
                        if tv.begin == 0:
                            g_rows[s64 * gr_s + hv * gr_h + cur * gr_l, :] = g_entry(g, g_cum, keep, predecayed_ring)
                            if k_owner:
                                k_rows[s64 * kr_s + kh * kr_h + cur * kr_l, :] = k_entry(
                                    k, g_cum, keep, predecayed_ring).to(k_rows.dtype)
                    if predecayed_ring == 3:
                        # A rebase: a second pass folds the ring and this step's delta into the checkpoint, S0*exp(G_c)
                        # + delta (outer) k + sum_j d_j (outer) kt_j*exp(G_c) (rank-1 updates: rebases are rare), then
                        # zeroes the deltas j <= c behind a CTA barrier (empty_ring). Mode 2 takes the flush branch: a
                        # data-dependent choice of loop spilled the 168-register programs every step (docs/tuning.md)
                        if rebase:
                            for zchunk in hl.grid(tv.begin, tv.end, value_chunk):
                                zrows = zchunk + hl.arange(value_chunk)
                                zlive = zrows < tv.end
                                zS = rebase_chunk(state_rows, d_rows, v3, zrows, zlive, st_base, st_v, dr_base, dr_l, j,
                                                  valid, cur, vector_tiles, fused_conv, row, hv, e_new, k, ak_row,
                                                  aq_row, wk_col, wq_col, beta, kq)
                                for zback in hl.grid(cur):
                                    zj = cur - 1 - zback
                                    zk = k_rows[s64 * kr_s + kh * kr_h + zj * kr_l, :].to(torch.float32)
                                    zdj = hl.load(d_rows, [dr_base + zj * dr_l, zrows],
                                                  extra_mask=zlive).to(torch.float32)
                                    zS = zS + zdj[:, None] * (zk * e_new)[None, :]
                                hl.store(state_rows, [st_base + zrows * st_v, slice(None)], zS.to(state_rows.dtype),
                                         extra_mask=zlive[:, None])
                                empty_ring(d_rows, dr_base, dr_l, j, cur, zrows, zlive, vector_tiles, ring_block,
                                           value_chunk)
                else:  # flush: Snew = S0*exp(tot+g) + D^T @ Kf + delta (outer) k, Kf[j] = k_j*exp(sum_{j<i<=c} g_i)
                    # a rebase (mode 2): G_c = 0 is the new base and kt_c = 0 (finite; its delta becomes 0). No program
                    # of this launch reads entry c. Written before the loop: after it, the addresses spilled (one warp)
                    if predecayed_ring == 2:
                        if tv.begin == 0:
                            if rebase:
                                g_rows[s64 * gr_s + hv * gr_h + cur * gr_l, :] = hl.zeros([g_rows.size(1)], torch.float32)
                                k_rows[s64 * kr_s + hv * kr_h + cur * kr_l, :] = hl.zeros([k_rows.size(1)], k_rows.dtype)
                    if mma_chunks or vector_tiles:  # the first chunk's [Vc, K] tile (the prologue's on the other path)
                        fS_next = hl.load(state_rows, [st_base + rows * st_v, slice(None)], extra_mask=live[:, None])
                        fd_next = hl.load(d_rows, [ring_rows(dr_base + j * dr_l, vector_tiles), rows],
                                          extra_mask=ring_mask[:, None] & live[None, :])
                    else:
                        fS_next, fd_next = S_next, d_next
                    if ring_on_tensor_cores:  # Kf = kdec*exp(g) as hi + mid + lo bf16 (~2^-24): exact MMAs
                        if predecayed_ring and vector_tiles == 2:  # the prologue read the keys as tiles: [Lb, K] here
                            kdec = hl.load(k_rows, [s64 * kr_s + kh * kr_h + j * kr_l, slice(None)],
                                           extra_mask=valid[:, None]).to(torch.float32)
                        if predecayed_ring:  # kt_j*exp(G_c)
                            k_hi, k_mid, k_lo = flush_keys(kdec, e_new[None, :])  # [Lb, K] each
                        else:
                            k_hi, k_mid, k_lo = flush_keys(kdec, eg[None, :])
                    # the append loop's chunk walk again (chunk_step, on the [Vc, K] rows)
                    for fchunk in hl.grid(tv.begin, tv.end, value_chunk):
                        frows = fchunk + hl.arange(value_chunk)
                        flive = frows < tv.end
                        fS0, fd_ring, fdelta, fS_next, fd_next = chunk_step(
                            state_rows, state_vecs, d_rows, v3, vpost3, out3, fS_next, fd_next, frows, flive, tv,
                            value_chunk, st_base, st_v, dr_base, dr_l, j, valid, vector_tiles, 0, fused_conv, row, hv,
                            ak_row, aq_row, wk_col, wq_col, beta, kq)
                        if predecayed_ring:  # exp(G_c)
                            S_new = fS0 * e_new[None, :] + fdelta[:, None] * k[None, :]
                        else:
                            S_new = fS0 * (et * eg)[None, :] + fdelta[:, None] * k[None, :]
                        if ring_on_tensor_cores:  # [Vc, Lb] @ [Lb, K], fp32 accumulation; the bf16 ring is exact
                            d_t = fd_ring.to(torch.bfloat16).T
                            S_new = hl.dot(d_t, k_hi, acc=hl.dot(d_t, k_mid, acc=hl.dot(d_t, k_lo, acc=S_new)))
                        else:  # the ring replayed newest to oldest as rank-1 updates (fp32 or fp16 rings)
                            decay = g  # log-decay from entry j to the new state
                            for back in hl.grid(cur):
                                jr = cur - 1 - back
                                k_j = k_rows[s64 * kr_s + kh * kr_h + jr * kr_l, :].to(torch.float32)
                                d_j = hl.load(d_rows, [dr_base + jr * dr_l, frows], extra_mask=flive).to(torch.float32)
                                if predecayed_ring:  # kt_j*exp(G_c)
                                    S_new = S_new + d_j[:, None] * (k_j * e_new)[None, :]
                                else:
                                    S_new = S_new + d_j[:, None] * (k_j * torch.exp(decay))[None, :]
                                    decay = decay + g_rows[s64 * gr_s + hv * gr_h + jr * gr_l, :]
                        hl.store(state_rows, [st_base + frows * st_v, slice(None)], S_new.to(state_rows.dtype),
                                 extra_mask=flive[:, None])
                        if predecayed_ring == 2:  # a rebase empties the ring: its deltas j <= c now live in the checkpoint.
                            # The CTA barrier first: other threads' reads of these rows (the replay's) must be done. (Not
                            # inside an `if rebase`: that branch cost the capped programs 13 more spills on every step)
                            empty_ring(d_rows, dr_base, dr_l, j, emptied_to, frows, flive, vector_tiles, ring_block,
                                       value_chunk)
                if fused_conv:  # the q/k window writes that wait for the loops (docs/conv.md, the fused conv)
                    if fused_conv == 2 and not early_qk:  # the q/k windows, by the last of the head's programs to get
                        # here: all the others have read them (a CTA barrier, then an acq_rel count of the programs;
                        # zero again after). (The early form counts right after its conv, above.)
                        hl.inline_triton("tl.debug_barrier()", [], None)
                        seen = hl.atomic_add(conv_counters, [s64 * H + h], 1, sem="acq_rel")
                        if seen == conv_readers - 1:
                            conv_qk_windows(conv_rows, q3, k3, row, h, H, kk, ci, in_window, last_tap, cv_row, cv_d,
                                            shifted, to_col)
                            conv_counters[s64 * H + h] = seen * 0
            else:  # a refused row: a padding row, recorded once per row (value head 0, first value tile)
                out3[row, hv, tv] = hl.zeros([tv], dtype=out3.dtype)
                if pinned_loads:  # a use of the row's loads on this path too, in a store that never runs (no pool
                    # has a negative slot count): ptxas otherwise sinks loads whose only uses lie in the verdict's
                    # branch into it, after the count and the cursor (docs/pitfalls.md: a load used only inside a
                    # branch is issued inside it)
                    if num_slots < 0:
                        kept = torch.sum(dt_row, dim=0) + a_log + forced
                        if vector_tiles:  # [Ko, Vc, Ki, kv]
                            s_sum = torch.sum(torch.sum(S_next.to(torch.float32), dim=3), dim=2)
                            kept = kept + torch.sum(torch.sum(s_sum, dim=1), dim=0)
                        elif not mma_chunks:  # [Vc, K]
                            kept = kept + torch.sum(torch.sum(S_next.to(torch.float32), dim=1), dim=0)
                        if predecayed_ring:
                            kept = kept + torch.sum(g_last, dim=0)
                        if tiny_batch or early_qk:
                            kept = kept + torch.sum(a_in.to(torch.float32), dim=0) + b_in.to(torch.float32)
                        slot_errors[3] = kept.to(torch.int32)
                if late_count:  # it reads the word too: the last reader stores the cursor as it was, count cleared
                    counted = hl.atomic_add(write_pos, [s64], torch.where(in_range, 65536, 0))
                    if in_range & (((counted >> 16) & 65535) >= advance_cursors * named - 1):
                        write_pos[s64] = cur_read
                if cursors_by_slot:
                    if (hv == 0) & (tv.begin == 0):
                        code = call_code[0]
                        first = hl.atomic_cas(slot_errors, [0], 0, code)  # the first bad call owns the record
                        hl.atomic_add(slot_errors, [2], 1)
                        if (first == 0) | (first == code):
                            at = hl.atomic_add(slot_errors, [1], 1)
                            if at < 8:  # kernels.guard.RECORDED_ROWS
                                slot_errors[4 + 2 * at] = slot * 0 + row
                                slot_errors[5 + 2 * at] = slot
        else:
            out3[row, hv, tv] = hl.zeros([tv], dtype=out3.dtype)
    return out3
