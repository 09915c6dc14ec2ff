"""The Helion ReplaySSM decode kernel (SPEC section 1); the op wrapper is :mod:`tp_replayssm.ops`.

One launch per decode call, one program per (row ``b``, q/k head ``h``, value head
``hv = h*r + sub`` of it, value tile ``tv``); all math fp32. Each program

1. issues the loads of its first value chunk of the checkpoint (``[Vc, K]``) and of the ring deltas,
   then computes, once, what depends on K only: q/k of head ``h`` (optionally l2-normalized), the
   gate ``g [K]``, ``eg = exp(g)``, ``beta``; from the ring's valid entries ``j < c`` (read once,
   masked) the decayed keys ``kdec [Lb, K] = k_j * exp(sum_{j<i<c} g_i)`` (a suffix sum, taken as
   the total minus a forward cumulative sum) and ``tot = sum_{j<c} g_j``; and the ring weights
   ``wk = kdec @ (eg*k)``, ``wq = kdec @ (eg*q)``;
2. walks its value tile chunk by chunk, the next chunk's loads in flight while the current one is
   reduced. The state is never materialized on the every-step path:
   ``S' @ k = S0 @ (exp(tot)*eg*k) + D^T wk`` and likewise for q, two mat-vec products per chunk
   (``_chunk_outputs``). A value row's ``delta`` needs only its own row, so each chunk finishes its
   rows. A row that appends (every step but the flush) runs one loop: ``out`` and the ring append of
   ``delta`` at position ``c``, then ``g`` (and ``k``, once per q/k head) at ``c``. A flush row runs a
   second loop (the branch is per program): ``out`` and the new checkpoint
   ``Snew = S0*exp(tot+g) + D^T @ Kf + delta (outer) k`` with ``Kf [Lb, K] = kdec*exp(g)`` (the keys
   decayed to the new state). With a bf16 ring, ``D^T @ Kf`` is one tensor-core product per chunk:
   ``D`` is exact in bf16 and ``Kf`` is split once per program into ``hi + mid + lo`` bf16 parts
   (~2^-24 relative, as exact as fp32), three MMAs with fp32 accumulation. Other ring dtypes replay
   the ring newest to oldest as rank-1 updates of the chunk. The flush product used to be that replay
   on every path, a serial loop of ``Lb x Vc x K`` FMAs per chunk that cost the flush step about two
   normal steps; on tensor cores the cycle-averaged step is 4-9% faster from B = 128 up and 0.2-0.9 us
   faster at B <= 8 (H200, benchmarks/RESULTS.md, tenth session).
3. with ``chunks_on_tensor_cores`` (set by ``configs.select_config`` for large grids) and a bf16
   checkpoint and ring, the append rows' two mat-vec products per chunk are bf16 MMAs instead:
   ``acc [Vc, 16] = S0 @ A + D^T @ W`` with ``A [K, 16]`` holding ``ak`` and ``aq`` as hi + mid + lo bf16
   columns and ``W [Lb, 16]`` the same of ``wk``, ``wq`` (``_split3_columns``); ``S' @ k`` and ``S' @ q`` are
   column sums of ``acc``. That loop has no hand prefetch: Triton's software pipeline (the config's
   ``range_num_stages``) copies the next chunks with ``cp.async`` straight into shared memory, where the
   MMAs read them, so the chunks in flight hold no registers; the first chunk's hand-issued loads then
   belong to the flush branch only. The loop is ~200 SASS instructions per 16-row chunk against ~760 for
   the register reductions; unpipelined it was slower (eighth session), pipelined and with 12 programs
   per SM it takes 4-11% off the bf16 steps from 1024 programs up (eleventh session).

4. with ``vector_tiles`` (``configs.vector_tiles``: one-warp programs on the register path), the append loop reads
   the checkpoint through ``state_vecs``, the same rows viewed as ``[Ko, span, Ki, kv]`` (``ops._vector_tiles_view``:
   K split into 16-byte vectors of ``kv`` elements, ``Ki = 4`` of them per thread), as ``[Ko, Vc, Ki, kv]`` tiles.
   Triton's coalescing orders a tile's lanes by the contiguity of its dims, ties to the lower dim, so ``Ko`` lanes
   go along K and the other ``32 / Ko`` across the value rows: a row's two dot products sum in its thread and then
   over ``Ko`` lanes (2-3 shuffle rounds) instead of over the 16 or 32 lanes of a ``[Vc, K]`` tile, each lane
   holding ``K / Ko`` entries of ``ak``, ``aq``. Its d-ring tiles take 8-byte vectors (``_ring_rows``), which puts 8
   lanes on the ring entries and most of the ring reduction in-thread. The ring entries at c are then written before
   the loop (after it, what they need stayed live across the loop and spilled). sm_90 (triton 3.6): the chunk loop of
   the HV4 B128 bf16 pre-decayed program is 510 SASS instructions instead of 764 (144 shuffles -> ~30), the fp32
   128:16:1 program's 450 instead of 661; on the H200 the op alone took 5-6% less at bf16 HV4 B128 / HV16 B32 and
   1.5-5% at the large fp32 grids (twenty-first session). The flush branch keeps ``[Vc, K]`` tiles (its product is on
   tensor cores); it loads its own first chunk. With ``vector_tiles = 2`` (one chunk per program) the pre-decayed
   prologue reads its ring keys the same way, through ``k_vecs``, as ``[Ko, Lb, Ki, kv]`` tiles for ``wk``, ``wq``
   (the flush branch then loads its ``[Lb, K]`` keys itself): the 16:16:1 program's every-step path 1617 -> 1361 SASS
   instructions, and the fused step 0.3 us shorter at HV12 / HV16 B8 and HV32 B1 bf16 (over 4 chunks the loop
   spilled, so 64-row tiles keep ``vector_tiles = 1``).

So the checkpoint is read once per step and written once per ring cycle, in the same pass: no second
launch, no second read of the checkpoint, no scratch buffer.

Pre-decayed ring layout (``predecayed_ring``; the pool's ``ring_layout="predecayed"``, the op
``ops.replayssm_decode_predecayed``). The g ring holds cumulative gates ``G_j = g_0 + ... + g_j`` since the
last flush (or rebase) and the k ring, one per VALUE head, the keys ``kt_j = k_j * exp(-G_j)``. Then
``tot = G_{c-1}`` is one row and, with ``G_c = tot + g``, ``ak = exp(G_c) * k`` and ``wk = Kt @ ak``
(``kt_j * exp(G_c) = k_j * exp(G_c - G_j)``): step 1 loses the scan, the exp per entry and key, and one pass
over the ring (in the SASS of the one-warp program, the bound of this prologue was about 970 instructions
shorter: thirteenth session). An append writes ``G_c`` and ``k * exp(-G_c)``; the flush's
``Kf = kt_j * exp(G_c)``. ``exp(-G)`` must stay finite, so a head whose ``G_c`` falls below -75 in some key
lane (``_validation.PREDECAYED_MAX_LOG_DECAY``) REBASES instead of appending: its new state goes to the
checkpoint, its ring deltas ``j <= c`` are zeroed and ``G_c = 0``, ``kt_c = 0`` written; the cursor moves on.
Only unbounded gates or ``(L-1) * |lower_bound| > 75`` get there, and only then is the check compiled in
(``ops.predecayed_mode``), in one of two forms. ``predecayed_ring = 2``: the rebasing head takes the flush branch
(the zeroing stores wait at a CTA barrier for the replay's reads of those rows). That makes the append/flush
choice data-dependent, which cost the 168-register programs 24 spill operations on the every-step path. So
under a register cap, ``predecayed_ring = 3``: the head runs the append loop as usual (outputs; its delta not
stored), then a pass of its own over its value tile folds the ring and this step's delta into the checkpoint
(the ring replayed as rank-1 updates) and zeroes the deltas behind the barrier: 5 spill operations, 2.5-6.6%
faster there, while the uncapped programs were faster with the flush branch (sixteenth session). The zeroed
entries' keys stay below ``exp(75)`` and their products with ``ak`` finite, so they contribute exactly 0.
Where ``exp(G_c)`` underflows (``G_c < -87.3``), ``kt_j * exp(G_c)`` loses at most ``exp(75 - 87.3) ~ 4.4e-6``
of ``|k_j|``. On the H200 the layout took 10-35% off the step at lower_bound = -5 and 3-31% under the softplus
gate (benchmarks/RESULTS.md, fourteenth and fifteenth sessions).

Launch overlap. On sm_90+ the kernel is launched with programmatic dependent launch (PDL): each program
first waits (``griddepcontrol.wait``) until the previous kernel in the stream has completed and its
memory is visible, then lets the next PDL-launched kernel start launching. Nothing is read before the
wait, so the stream order holds for every input; what overlaps is the launch latency of consecutive
decode / cursor-advance kernels, worth 0.53-0.61 us per step at B <= 8 in CUDA graphs on the H200
(benchmarks/RESULTS.md, ninth session). (Earlier versions used a separate flush kernel, and
tensor-core products on every step; their register cost made them slower: benchmarks/RESULTS.md.)

Fused cursor advance (``advance_cursors``; the pool's ``decode(..., advance=True)`` on a step's last layer). The
pool's cursor table is shared by all layers and moves once per model step, after every layer has read it: a
separate one-program kernel (:mod:`tp_replayssm.cursor_kernel`), ~0.8-1.0 us per step on the H200 at B <= 8. With
``advance_cursors = n`` (the programs that read one row's cursor: ``ops.cursor_readers``) each program reads its
cursor with ``atomic_add(cursors[slot], CURSOR_READER)``: the low 16 bits are the cursor, the bits above count the
programs that read it before this one. The n-th reader (count n-1) stores the moved cursor (0 after a flush, else
``c + 1``) with the count cleared. Every read and that store are operations on one word, so coherence alone
orders them: each program sees the cursor of this step, the store comes after all n reads, and nothing else
touches the word during the launch (slots are distinct in a batch; padding rows read no cursor and leave the
scratch entry alone). Between launches the count bits are 0, so the other layers' plain reads see cursors.
At B <= 8 the fused step is 0.2-0.7 us longer than the op alone on per-row cursors (the table's cursor is read
after the slot, with an atomic; the two were not timed apart) and ~0.4 us shorter than decode + advance at B = 1;
at B = 512 it is 3.8% faster to 1.2% slower (benchmarks/RESULTS.md, seventeenth session).
With ``count_after_loads`` (:func:`tp_replayssm.configs.count_after_loads`; off for now) a program first
reads its cursor with a relaxed load (``ld.volatile``; the count bits masked off) and takes its count only once
its ring and input loads are out. The read comes before the same program's count of the same word, so it sees
this step's cursor, and the row's last count, which stores, still comes after every read. What leaves the ring
loads' chain is the count's latency: up to 256 programs count on one word (HV32 B1). The last count's store is
masked, not under an ``if``: a branch there parts the gate math's products from their sums (no FMA), and the
pre-decayed layout's fused results then differ in the last bits from decode + advance (twenty-third session).

Addressing. Slots come from ``ssm_state_indices`` at run time, so caches are indexed by element
offsets: the wrapper passes each cache as an overlapping "row" view ``[span, last]`` with strides
``(1, 1)`` (row ``r`` = the ``last`` contiguous elements starting at element ``r``) plus the element
strides of its outer dims. That supports any strides with a contiguous last dim (a layer slice of
a ``[layers, S, ...]`` pool, padded rows) without copies. Offsets are int64 (``index_dtype``).
"""

from __future__ import annotations

import functools

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


def _decayed_keys(g_ring: torch.Tensor, k_ring: torch.Tensor, valid: torch.Tensor, reverse_scan: bool):
    """``kdec [Lb, K] = k_j * exp(sum_{j<i<c} g_i)`` (zero for j >= c) and ``tot = sum_{j<c} g_j [K]``.

    The suffix sum is ``tot - (inclusive prefix sum)``, a forward scan, unless ``reverse_scan``. A
    reverse ``hl.cumsum`` costs Triton two flips of the tile across lanes and warps (~160 shuffles, ~150
    instructions per program) but measured faster at B = 1 (4.37 against 4.56 us at HV = 8), where one
    program's latency is the step; the forward form was 2.5-6.5% faster from B = 8 up (H200,
    benchmarks/RESULTS.md, fourth session). Its subtraction rounds ``2^-24 * |tot|`` absolute, on
    exponents whose weights ``exp(after)`` are at most 1."""
    g_ring = torch.where(valid[:, None], g_ring, 0.0)
    if reverse_scan:
        after = hl.cumsum(g_ring, 0, reverse=True) - g_ring  # sum of the valid entries after j
    else:
        after = torch.sum(g_ring, dim=0, keepdim=True) - hl.cumsum(g_ring, 0)
    kdec = torch.where(valid[:, None], k_ring.to(torch.float32) * torch.exp(after), 0.0)
    return kdec, torch.sum(g_ring, dim=0)


def _chunk_outputs(S0, d_ring, v_c, ak, aq, wk, wq, beta, kq):  # noqa: ANN001, ANN202 - traced by Helion
    """``delta [Vc]`` and ``out [Vc]`` of one value chunk from its checkpoint rows ``S0 [Vc, K]`` and ring
    deltas ``d_ring [Lb, Vc]`` (fp32): ``S' @ k = S0 @ ak + D^T wk``, likewise for q. The vectors come
    broadcastable (``ak, aq [1, K]``, ``wk, wq [Lb, 1]``): Helion 1.5.0 fails to lower an indexing such as
    ``ak[None, :]`` of a kernel value inside a helper called from two loops."""
    spk = _row_dots(S0, ak) + torch.sum(d_ring * wk, dim=0)
    spq = _row_dots(S0, aq) + torch.sum(d_ring * wq, dim=0)
    delta = beta * (v_c - spk)
    return delta, spq + delta * kq


def _row_dots(S0, a):  # noqa: ANN001, ANN202 - traced by Helion
    """``S0 @ a`` per row: ``S0 [Vc, K]`` with ``a [1, K]``, or ``S0 [Ko, Vc, Ki, kv]`` (the append loop's
    vector tiles, see ``state_vecs``) with ``a [Ko, 1, Ki, kv]``."""
    if S0.dim() == 4:
        return torch.sum(torch.sum(torch.sum(S0 * a, dim=3), dim=2), dim=0)
    return torch.sum(S0 * a, dim=1)


def _vector_tile(x, tiles):  # noqa: ANN001, ANN202 - traced by Helion
    """``x [K]`` as ``[Ko, 1, Ki, kv]``, broadcastable against the ``[Ko, Vc, Ki, kv]`` tiles of ``tiles``'s split."""
    return x.reshape(tiles.size(0), tiles.size(2), tiles.size(3))[:, None, :, :]


def _ring_rows(rows, vector_tiles):  # noqa: ANN001, ANN202 - traced by Helion
    """A head's d-ring rows ``[Lb]`` (in the rows view) for an ``[Lb, Vc]`` access; with ``vector_tiles``, their
    alignment hidden from Triton beyond 4 elements (``tl.multiple_of(rows, 4)``). A ring tile loaded with it gets
    8-byte vectors, so Triton's coalescing spreads it over 8 lanes of ring entries and 4 of value rows (16-byte
    vectors put 16 lanes on the entries) and the reduction over the ring is mostly in-thread. Every ``[Lb, Vc]``
    access takes it: the coalescing gives the loads and stores that share an address computation the widest
    vector among them. sm_90, triton 3.6, HV4 B128 bf16 pre-decayed: the chunk loop 613 SASS instructions without
    the hint, 510 with it; hinted down to 1 element (all 16 entries in 2 lanes) it spilled in the loop. H200:
    9.16 us/step without the hint, 8.22-8.25 with it (twenty-first session)."""
    if vector_tiles:
        return hl.inline_triton("tl.multiple_of({0}, 4)", [rows], rows)
    return rows


def _g_entry(g, g_cum, keep, predecayed_ring):  # noqa: ANN001, ANN202 - traced by Helion
    """The append's g-ring entry at position c: ``G_c = G_{c-1} + g`` in the pre-decayed layout (0, the new base,
    for a rebasing head of mode 3: ``keep`` false), ``g`` in the SPEC layout. (Helion traces helpers on fake
    tensors, so the stores, at data-dependent rows, stay in the kernel body.)"""
    if predecayed_ring == 3:
        return torch.where(keep, g_cum, 0.0)
    if predecayed_ring:
        return g_cum
    return g


def _k_entry(k, g_cum, keep, predecayed_ring):  # noqa: ANN001, ANN202 - traced by Helion
    """The append's k-ring entry at position c: ``kt_c = k*exp(-G_c)`` in the pre-decayed layout (0 for a rebasing
    head of mode 3), ``k`` in the SPEC layout."""
    if predecayed_ring == 3:
        return torch.where(keep, k * torch.exp(-g_cum), 0.0)
    if predecayed_ring:
        return k * torch.exp(-g_cum)
    return k


def _split3_columns(xk, xq, col):  # noqa: ANN001, ANN202 - traced by Helion
    """``[N, 16]`` bf16 MMA operand from two fp32 columns ``xk, xq [N, 1]`` (``col [1, 16]`` the column
    index; both come broadcast, as in ``_chunk_outputs``): columns 0, 1, 2 hold ``xk`` split into
    ``hi + mid + lo`` bf16 parts (``hi = bf16(x)``, ``mid = bf16(x - hi)``, ``lo = bf16(x - hi - mid)``;
    the sum is ``x`` to ~2^-24 relative), columns 8, 9, 10 the same of ``xq``, the rest zero. ``A @ M``
    summed over columns 0-7 is then ``A @ xk`` to fp32 accuracy when ``A`` is exact in bf16."""
    full = torch.where(col < 8, xk, xq)
    rest1 = full - full.to(torch.bfloat16).to(torch.float32)
    rest2 = rest1 - rest1.to(torch.bfloat16).to(torch.float32)
    part = col % 8
    return torch.where(part == 0, full, torch.where(part == 1, rest1, torch.where(part == 2, rest2, 0.0))).to(
        torch.bfloat16)


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
    scale: float,
    lower_bound: float,
    st_s: int, st_h: int, st_v: int,  # checkpoint element strides (slot, head, value row)
    dr_s: int, dr_h: int, dr_l: int,  # d ring strides (slot, head, ring pos)
    kr_s: int, kr_h: int, kr_l: int,  # k ring strides
    gr_s: int, gr_h: int, gr_l: int,  # g ring strides
    ring_length: hl.constexpr,
    ring_block: hl.constexpr,
    value_chunk: hl.constexpr,
    use_l2norm: hl.constexpr,
    use_lower_bound: hl.constexpr,
    cursors_by_slot: hl.constexpr,
    tiny_batch: hl.constexpr,
    chunks_on_tensor_cores: hl.constexpr,
    predecayed_ring: hl.constexpr,  # 0: SPEC layout; pre-decayed 1: no rebase possible, 2/3: rebases (module docstring)
    advance_cursors: hl.constexpr = 0,  # 0, or the programs per row: they advance the cursor table (module docstring)
    vector_tiles: hl.constexpr = 0,  # 1: the append loop on state_vecs tiles, 2: and the pre-decayed keys on k_vecs
    count_after_loads: hl.constexpr = False,  # the fused advance's count after the loads (module docstring)
) -> torch.Tensor:
    """One decode step: outputs, ring appends and flush-row checkpoint writes (module docstring)."""
    B = q3.size(0)
    H = hl.specialize(q3.size(1))
    HV = hl.specialize(v3.size(1))
    V = hl.specialize(v3.size(2))
    group = HV // H
    # the flush's ring product on tensor cores: bf16 rings (exact MMA operands) and tiles of >= 16 x 16
    ring_on_tensor_cores = d_rows.dtype == torch.bfloat16 and value_chunk >= 16 and state_rows.size(1) >= 16
    # the every-step products on tensor cores too when asked (configs: the streaming regime), for a bf16
    # checkpoint (exact MMA operand, like the bf16 ring); otherwise fp32 row reductions in registers
    mma_chunks = chunks_on_tensor_cores and ring_on_tensor_cores and state_rows.dtype == torch.bfloat16
    # Programmatic dependent launch (sm_90+; nothing elsewhere): wait at entry until the previous kernel
    # in the stream has finished and its writes are visible, then let the next PDL kernel launch, so
    # launches overlap the previous kernel's tail (see the module docstring)
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
        slot = slots[row]
        if slot >= 0:
            s64 = slot.to(torch.int64)
            st_base = s64 * st_s + hv * st_h
            dr_base = s64 * dr_s + hv * dr_h
            # first value chunk's loads go out now, so their latency overlaps the ring math below
            rows = tv.begin + hl.arange(value_chunk)
            live = rows < tv.end
            if vector_tiles:  # [Ko, Vc, Ki, kv] tiles: the value rows across the lanes (module docstring)
                S_next = hl.load(state_vecs, [slice(None), st_base + rows * st_v, slice(None), slice(None)],
                                 extra_mask=live[None, :, None, None])
            elif not mma_chunks:
                S_next = hl.load(state_rows, [st_base + rows * st_v, slice(None)], extra_mask=live[:, None])
            if advance_cursors and count_after_loads:  # the fused advance, read first and counted below
                cur = hl.inline_triton("tl.load({0} + {1}, volatile=True)", [write_pos, s64], slot) & 65535
            elif advance_cursors:  # the fused advance (module docstring): the read is an atomic count of the readers
                # 65536 = CURSOR_READER (a literal: Helion passes a module constant as a kernel argument). The flush
                # flag is read here too: `forced` below keeps its place in the code of the kernels without the flag
                counted = hl.atomic_add(write_pos, [s64], 65536)  # cursor | (readers before this one) << 16
                cur = counted & 65535
                if counted >= (advance_cursors - 1) * 65536:  # the row's last reader: the others have read
                    write_pos[s64] = torch.where((cur >= ring_length - 1) | (force_flush[row] != 0), 0, cur + 1)
            elif cursors_by_slot:
                cur = write_pos[s64]  # the pool's cursor table [S + 1]
            else:
                cur = write_pos[row]
            forced = force_flush[row]
            append = (cur != ring_length - 1) & (forced == 0)  # else this step flushes the row
            j = hl.arange(ring_block)
            valid = (j < cur) & (j < ring_length)  # ring entries j < cursor are live
            if tiny_batch:  # load the whole ring without waiting for the cursor; `valid` masks it below
                ring_mask = j < ring_length
            else:  # load only the live entries (fewer bytes)
                ring_mask = valid
            if not mma_chunks:
                d_next = hl.load(d_rows, [_ring_rows(dr_base + j * dr_l, vector_tiles), rows],
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
            q, k = _qk_math(q3[row, h, :].to(torch.float32), k3[row, h, :].to(torch.float32), scale, use_l2norm)
            x = a3[row, hv, :].to(torch.float32) + dt_bias2[hv, :]
            g = _gate_math(x, A_log[hv], lower_bound, use_lower_bound)
            beta = torch.sigmoid(b2[row, hv].to(torch.float32))
            eg = torch.exp(g)
            if advance_cursors and count_after_loads:  # the count, with the ring and input loads out (docstring)
                counted = hl.atomic_add(write_pos, [s64], 65536)  # (the read above came before it: same word)
                # a masked store, not an `if`: a branch here parts the gate math's products from their sums (no FMA)
                hl.store(write_pos, [s64], torch.where((cur >= ring_length - 1) | (forced != 0), 0, cur + 1),
                         extra_mask=counted >= (advance_cursors - 1) * 65536)
            keep = cur >= 0  # true (a rebasing head of mode 3 clears it below)
            if predecayed_ring:  # kdec holds kt_j = k_j*exp(-G_j), the decayed key kt_j*exp(tot): wk = kt_j . ak
                tot = torch.where(cur > 0, g_last, 0.0)
                g_cum = tot + g  # G_c
                e_new = torch.exp(g_cum)  # the new state's decay; kt_j*e_new = k_j*exp(G_c - G_j) (see below)
                ak = e_new * k  # S0 @ ak = the checkpoint's part of S' @ k
                aq = e_new * q
                if vector_tiles == 2:  # wk, wq over [Ko, Lb, Ki, kv] tiles: in-thread sums and log2(Ko) shuffle rounds
                    ak_loop, aq_loop = _vector_tile(ak, state_vecs), _vector_tile(aq, state_vecs)
                    kt = k_tiles.to(torch.float32)
                    if tiny_batch:  # the whole ring was loaded; the live-entry load returns 0 past the cursor
                        kt = torch.where(valid[None, :, None, None], kt, 0.0)
                    wk = _row_dots(kt, ak_loop)  # [Lb]
                    wq = _row_dots(kt, aq_loop)
                else:
                    kdec = torch.where(valid[:, None], k_ring.to(torch.float32), 0.0)
                    wk = torch.sum(kdec * ak[None, :], dim=1)  # [Lb]
                    wq = torch.sum(kdec * aq[None, :], dim=1)
                # G_c past the bound (unbounded gates): this head rebases its ring instead of appending
                # k*exp(-G_c) (module docstring); never under (L-1)*|lower_bound| <= the bound
                if predecayed_ring >= 2:  # (1: a bounded gate that cannot get there; the wrapper decides)
                    rebase = (torch.amin(g_cum, dim=0) < -75.0) & append  # -_validation.PREDECAYED_MAX_LOG_DECAY
                if predecayed_ring == 2:  # 2: through the flush branch
                    append = append & (rebase == 0)
                    emptied_to = torch.where(rebase, cur, -1)  # a rebase zeroes the deltas j <= c
                if predecayed_ring == 3:  # 3: the append loop (the cursor alone chooses it), then a pass of its own
                    keep = rebase == 0
                    d_end = torch.where(rebase, 0, V)  # the append stores the delta of value rows < d_end
            else:  # (spelled apart from the branch above: this statement order keeps the SPEC path's registers)
                kdec, tot = _decayed_keys(g_ring, k_ring, valid, tiny_batch)  # tiny batches: reverse scan
                g_cum = g  # (the g ring holds gates, not sums)
                xk = eg * k
                xq = eg * q
                wk = torch.sum(kdec * xk[None, :], dim=1)  # [Lb]
                wq = torch.sum(kdec * xq[None, :], dim=1)
                et = torch.exp(tot)
                ak = et * xk  # S0 @ ak = the checkpoint's part of S' @ k
                aq = et * xq
            kq = torch.sum(k * q, dim=0)
            ak_row, aq_row, wk_col, wq_col = ak[None, :], aq[None, :], wk[:, None], wq[:, None]
            if vector_tiles:  # the append loop's [Ko, 1, Ki, kv] (the pre-decayed prologue's key tiles made them above)
                if not (predecayed_ring and vector_tiles == 2):
                    ak_loop, aq_loop = _vector_tile(ak, state_vecs), _vector_tile(aq, state_vecs)
            else:
                ak_loop, aq_loop = ak_row, aq_row
            if append:  # every step but the flush: outputs and the ring append of delta
                if vector_tiles:  # the ring entries at c (g, and k per k-ring head) before the loop: no program of the
                    # launch reads entry c (a whole-ring load masks it); written after the loop, they spilled here
                    if tv.begin == 0:
                        g_rows[s64 * gr_s + hv * gr_h + cur * gr_l, :] = _g_entry(g, g_cum, keep, predecayed_ring)
                        if k_owner:
                            k_rows[s64 * kr_s + kh * kr_h + cur * kr_l, :] = _k_entry(
                                k, g_cum, keep, predecayed_ring).to(k_rows.dtype)
                if mma_chunks:  # the chunk products on tensor cores (module docstring)
                    col = hl.arange(16)[None, :]
                    a_mat = _split3_columns(ak[:, None], aq[:, None], col)  # [K, 16] bf16
                    w_mat = _split3_columns(wk_col, wq_col, col)  # [Lb, 16] bf16
                    k_col = col < 8  # columns of the k products
                    for mchunk in hl.grid(tv.begin, tv.end, value_chunk):
                        mrows = mchunk + hl.arange(value_chunk)
                        mlive = mrows < tv.end
                        mS0 = hl.load(state_rows, [st_base + mrows * st_v, slice(None)], extra_mask=mlive[:, None])
                        md_ring = hl.load(d_rows, [dr_base + j * dr_l, mrows],
                                          extra_mask=valid[:, None] & mlive[None, :])  # dead entries load 0
                        prod = hl.dot(md_ring.T, w_mat, acc=hl.dot(mS0, a_mat))  # [Vc, 16] fp32
                        mspk = torch.sum(torch.where(k_col, prod, 0.0), dim=1)  # S' @ k
                        mspq = torch.sum(torch.where(k_col, 0.0, prod), dim=1)  # S' @ q
                        mv_c = hl.load(v3, [row, hv, mrows], extra_mask=mlive).to(torch.float32)
                        mdelta = beta * (mv_c - mspk)
                        hl.store(out3, [row, hv, mrows], (mspq + mdelta * kq).to(out3.dtype), extra_mask=mlive)
                        if predecayed_ring == 3:  # a rebasing head stores none
                            mlive = mlive & (mrows < d_end)
                        hl.store(d_rows, [dr_base + cur * dr_l, mrows], mdelta.to(d_rows.dtype), extra_mask=mlive)
                else:  # row reductions in registers, the next chunk's loads in flight
                    for chunk in hl.grid(tv.begin, tv.end, value_chunk):
                        rows = chunk + hl.arange(value_chunk)
                        live = rows < tv.end
                        S0 = S_next.to(torch.float32)  # [Ko, Vc, Ki, kv] (vector_tiles) or [Vc, K]
                        d_ring = torch.where(valid[:, None], d_next.to(torch.float32), 0.0)  # [Lb, Vc]
                        after = rows + value_chunk  # prefetch the next chunk (masked after the last)
                        if vector_tiles:
                            S_next = hl.load(state_vecs, [slice(None), st_base + after * st_v, slice(None),
                                                          slice(None)],
                                             extra_mask=(after < tv.end)[None, :, None, None])
                        else:
                            S_next = hl.load(state_rows, [st_base + after * st_v, slice(None)],
                                             extra_mask=(after < tv.end)[:, None])
                        d_next = hl.load(d_rows, [_ring_rows(dr_base + j * dr_l, vector_tiles), after],
                                         extra_mask=valid[:, None] & (after < tv.end)[None, :])
                        v_c = hl.load(v3, [row, hv, rows], extra_mask=live).to(torch.float32)
                        delta, out = _chunk_outputs(S0, d_ring, v_c, ak_loop, aq_loop, wk_col, wq_col, beta, kq)
                        hl.store(out3, [row, hv, rows], out.to(out3.dtype), extra_mask=live)
                        if predecayed_ring == 3:  # a rebasing head stores none
                            live = live & (rows < d_end)
                        hl.store(d_rows, [dr_base + cur * dr_l, rows], delta.to(d_rows.dtype), extra_mask=live)
                if not vector_tiles:  # the ring entries at c, as above
                    if tv.begin == 0:
                        g_rows[s64 * gr_s + hv * gr_h + cur * gr_l, :] = _g_entry(g, g_cum, keep, predecayed_ring)
                        if k_owner:
                            k_rows[s64 * kr_s + kh * kr_h + cur * kr_l, :] = _k_entry(
                                k, g_cum, keep, predecayed_ring).to(k_rows.dtype)
                if predecayed_ring == 3:
                    # A rebase: a second pass over the value tile folds the ring and this step's delta into the
                    # checkpoint, S0*exp(G_c) + delta (outer) k + sum_j d_j (outer) kt_j*exp(G_c) (the ring
                    # replayed as rank-1 updates: rebases are rare), then zeroes the deltas j <= c behind a CTA
                    # barrier (other threads' loads of those rows must be done: Helion does not order a
                    # write-after-read). Mode 2 takes the flush branch instead: a data-dependent choice of loop,
                    # which made the 168-register programs spill on every step (RESULTS.md, sixteenth session)
                    if rebase:
                        for zchunk in hl.grid(tv.begin, tv.end, value_chunk):
                            zrows = zchunk + hl.arange(value_chunk)
                            zlive = zrows < tv.end
                            zS0 = hl.load(state_rows, [st_base + zrows * st_v, slice(None)],
                                          extra_mask=zlive[:, None]).to(torch.float32)
                            zd = hl.load(d_rows, [_ring_rows(dr_base + j * dr_l, vector_tiles), zrows],
                                         extra_mask=valid[:, None] & zlive[None, :]).to(torch.float32)
                            zv = hl.load(v3, [row, hv, zrows], extra_mask=zlive).to(torch.float32)
                            zdelta, _ = _chunk_outputs(zS0, zd, zv, ak_row, aq_row, wk_col, wq_col, beta, kq)
                            zS = zS0 * e_new[None, :] + zdelta[:, None] * k[None, :]
                            for zback in hl.grid(cur):
                                zj = cur - 1 - zback
                                zk = k_rows[s64 * kr_s + kh * kr_h + zj * kr_l, :].to(torch.float32)
                                zdj = hl.load(d_rows, [dr_base + zj * dr_l, zrows],
                                              extra_mask=zlive).to(torch.float32)
                                zS = zS + zdj[:, None] * (zk * e_new)[None, :]
                            hl.store(state_rows, [st_base + zrows * st_v, slice(None)], zS.to(state_rows.dtype),
                                     extra_mask=zlive[:, None])
                            hl.inline_triton("tl.debug_barrier()", [], None)
                            hl.store(d_rows, [_ring_rows(dr_base + j * dr_l, vector_tiles), zrows],
                                     hl.zeros([ring_block, value_chunk], d_rows.dtype),
                                     extra_mask=(j <= cur)[:, None] & zlive[None, :])
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
                    fd_next = hl.load(d_rows, [_ring_rows(dr_base + j * dr_l, vector_tiles), rows],
                                      extra_mask=ring_mask[:, None] & live[None, :])
                else:
                    fS_next, fd_next = S_next, d_next
                if ring_on_tensor_cores:  # Kf = kdec*exp(g) as hi + mid + lo bf16 (~2^-24): exact MMAs
                    if predecayed_ring and vector_tiles == 2:  # the prologue read the keys as tiles: [Lb, K] here
                        kdec = hl.load(k_rows, [s64 * kr_s + kh * kr_h + j * kr_l, slice(None)],
                                       extra_mask=valid[:, None]).to(torch.float32)
                    if predecayed_ring:  # kt_j*exp(G_c)
                        k_flush = kdec * e_new[None, :]  # [Lb, K]
                    else:
                        k_flush = kdec * eg[None, :]  # [Lb, K]
                    k_hi = k_flush.to(torch.bfloat16)
                    k_rest = k_flush - k_hi.to(torch.float32)
                    k_mid = k_rest.to(torch.bfloat16)
                    k_lo = (k_rest - k_mid.to(torch.float32)).to(torch.bfloat16)
                # the append loop's chunk walk again: Helion 1.5.0 fails to lower hl.load inside a helper
                # function called from two loops (InductorLoweringError on aten.slice), so it is spelled out
                for fchunk in hl.grid(tv.begin, tv.end, value_chunk):
                    frows = fchunk + hl.arange(value_chunk)
                    flive = frows < tv.end
                    fS0 = fS_next.to(torch.float32)  # [Vc, K]
                    fd_ring = torch.where(valid[:, None], fd_next.to(torch.float32), 0.0)  # [Lb, Vc]
                    fafter = frows + value_chunk  # prefetch the next chunk (masked after the last)
                    fS_next = hl.load(state_rows, [st_base + fafter * st_v, slice(None)],
                                      extra_mask=(fafter < tv.end)[:, None])
                    fd_next = hl.load(d_rows, [_ring_rows(dr_base + j * dr_l, vector_tiles), fafter],
                                      extra_mask=valid[:, None] & (fafter < tv.end)[None, :])
                    fv_c = hl.load(v3, [row, hv, frows], extra_mask=flive).to(torch.float32)
                    fdelta, fout = _chunk_outputs(fS0, fd_ring, fv_c, ak_row, aq_row, wk_col, wq_col, beta, kq)
                    hl.store(out3, [row, hv, frows], fout.to(out3.dtype), extra_mask=flive)
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
                        hl.inline_triton("tl.debug_barrier()", [], None)
                        hl.store(d_rows, [_ring_rows(dr_base + j * dr_l, vector_tiles), frows],
                                 hl.zeros([ring_block, value_chunk], d_rows.dtype),
                                 extra_mask=(j <= emptied_to)[:, None] & flive[None, :])
        else:
            out3[row, hv, tv] = hl.zeros([tv], dtype=out3.dtype)
    return out3


# The fused advance's count unit: a cursor table entry holds the cursor in its low 16 bits and, during a launch
# with ``advance_cursors``, the number of the row's programs that have read it above them
CURSOR_READER = 1 << 16

# The every-step reductions are fp32 sums in registers; the flush's bf16 MMAs take exact operands (no tf32).
_SETTINGS = dict(static_shapes=True, index_dtype=torch.int64)


@functools.lru_cache(maxsize=None)
def _compiled(config_items: tuple[tuple[str, object], ...]) -> helion.Kernel:
    config = helion.Config(**{k: _as_lists(v) for k, v in config_items})
    return helion.kernel(replayssm_decode_kernel, config=config, **_SETTINGS)


def _as_tuples(v: object) -> object:  # nested lists (``loop_orders=[[...]]``) -> hashable tuples
    return tuple(_as_tuples(x) for x in v) if isinstance(v, list) else v


def _as_lists(v: object) -> object:
    return [_as_lists(x) for x in v] if isinstance(v, tuple) else v


def _key(config: helion.Config) -> tuple[tuple[str, object], ...]:
    return tuple(sorted((k, _as_tuples(v)) for k, v in config.config.items()))


# hot-path cache by config object identity (the pinned configs are module constants); the config is
# kept in the value so its id cannot be reused by another object
_BY_CONFIG: dict[int, tuple[helion.Config, helion.Kernel]] = {}


def decode_kernel_for(config: helion.Config) -> helion.Kernel:
    """The decode kernel pinned to ``config`` (one compiled kernel object per distinct config)."""
    hit = _BY_CONFIG.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    kern = _compiled(_key(config))
    _BY_CONFIG[id(config)] = (config, kern)
    return kern
