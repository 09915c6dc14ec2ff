"""The conv update of one token per row with every input and window element read once (``ConvPlan.form == "once"``).

The same contract as :func:`tp_replayssm.kernels.conv.conv_update_kernel` (docs/conv.md) for ``x [B, D]``: one
program per (row, block of ``block_d`` channels). What differs is the order of the memory traffic, which decides the
time of a launch whose programs wait on one another's latency:

- every load goes out before the row's verdict is known: the call's slots (for the count of rows naming the slot),
  the inputs, the taps, the bias, then, once the slot is in, the window and the cursor. The verdict (slot in range,
  allocated, named once) masks the stores only; a refused row's loads read its slot's window (or, out of range, the
  scratch window) and change nothing;
- the window and the input are read once, as one ``[block_d, width_block]`` tile ``u`` (window columns ``0 .. W-2``,
  then the input in column ``W-1``), which gives the output (``sum_i weight[:, i] * u[:, i]``, a tree over the taps,
  plus the bias) and the new window: column ``c`` of the new window is ``u[:, c + 1]``, so the tile is stored back
  with its column index shifted by one (columns ``1 .. W-1`` of ``u`` to window columns ``0 .. W-2``), behind a CTA
  barrier (a thread may store a column another thread loaded; Helion orders no write-after-read);
- the count of rows naming the slot reads the call's slots as one tile (up to ``named_block`` rows; a loop beyond),
  loaded first, so it overlaps the slot -> window and slot -> cursor reads.

A refused row writes zeros to ``y`` and its first program records it in the pool's error record, as the other form
does; a padding row (slot < 0) writes zeros. The window arrives as the overlapping row view of the whole
``pool.conv_state`` (:func:`tp_replayssm.kernels.args.rows_view`), int64 offsets.
"""

from __future__ import annotations

import torch

import helion.language as hl

from .conv_math import silu as silu_of
from .conv_math import taps_tile

__all__ = ["conv_once_kernel"]


def conv_once_kernel(
    x2: torch.Tensor,  # [B, D] the pre-conv inputs, one token per row
    y2: torch.Tensor,  # [B, D] outputs
    win_rows: torch.Tensor,  # rows view [span, W-1] of pool.conv_state (a weight view when W == 1: never read)
    weight_flat: torch.Tensor,  # [span] the taps weight[d, i] at element d*wt_d + i*wt_i (a flat view of weight [D, W])
    bias: torch.Tensor,  # [D] (a weight view without bias: never read)
    slots: torch.Tensor,  # [B] int32, < 0 = padding
    cursors: torch.Tensor,  # [S + 1] int32: the pool's cursor table (a free slot's cursor is FREE_CURSOR)
    slot_errors: torch.Tensor,  # [ERROR_WORDS] int32: the pool's record of bad rows (kernels.guard)
    call_code: torch.Tensor,  # [1] int32: what this call records there
    layer_row: int,  # layer * sl: the layer's first window row
    ws: int,  # window element stride of a slot
    ring_length: int,  # L: an allocated slot's cursor is in [0, L-1]
    wd: hl.constexpr,  # window element stride of a channel (W-1 in the pool: compile-time offsets between channels)
    wt_d: hl.constexpr,  # weight element strides: channel, tap
    wt_i: hl.constexpr,
    kernel_size: hl.constexpr,  # W
    width_block: hl.constexpr,  # the power of two >= W the taps are computed in
    named_block: hl.constexpr,  # rows of the first tile (and of each later step) of the count of rows naming a slot
    has_bias: hl.constexpr,
    silu: hl.constexpr,
    on_gpu: hl.constexpr = True,  # device code (SiLU in inline PTX), or the Triton interpreter
) -> torch.Tensor:
    """One conv update of every row's channels, one token per row (module docstring)."""
    B = x2.size(0)
    D = hl.specialize(x2.size(1))  # a pool's D: the plan's block divides it, so the channel masks fold away
    scratch = cursors.size(0) - 1
    hl.pdl_wait()  # sm_90+: nothing is read before the previous kernel has finished
    hl.pdl_launch_dependents()
    for tile_b, tile_d in hl.tile([B, D], block_size=[1, None]):
        row = tile_b.begin
        d = tile_d.index  # (Helion masks the accesses at d where the block does not divide D)
        others = hl.arange(named_block)  # the call's slots first: the count overlaps the slot -> window chain
        named_tile = hl.load(slots, [others], extra_mask=others < B)
        xv = hl.load(x2, [row, d]).to(torch.float32)  # [block_d]
        i = hl.arange(width_block)  # the taps
        w = hl.load(weight_flat, [d[:, None] * wt_d + i[None, :] * wt_i],
                    extra_mask=(i < kernel_size)[None, :]).to(torch.float32)
        if has_bias:
            bias_d = hl.load(bias, [d]).to(torch.float32)
        slot = slots[row]
        in_range = (slot >= 0) & (slot < scratch)
        s64 = torch.where(in_range, slot, scratch).to(torch.int64)  # out of range: the scratch window (read only)
        if kernel_size > 1:
            wrow = layer_row + s64 * ws + d.to(torch.int64) * wd  # [block_d] the channels' window rows
            in_window = i < kernel_size - 1
            uw = hl.load(win_rows, [wrow, torch.where(in_window, i, 0)], extra_mask=in_window[None, :]).to(torch.float32)
            u = taps_tile(uw, xv[:, None], (i == kernel_size - 1)[None, :])  # [block_d, width_block]
        else:
            u = xv[:, None]
        cur = cursors[s64]
        # slot safety (docs/conv.md): in range, allocated (cursor in [0, L-1]) and named by this row only
        named = torch.sum(((named_tile == slot) & (others < B)).to(torch.float32), dim=0)  # (exact: fp32 counts)
        for nb in hl.grid(named_block, B, named_block):  # batches past one tile
            more = nb + hl.arange(named_block)
            same = (hl.load(slots, [more], extra_mask=more < B) == slot) & (more < B)
            named = named + torch.sum(same.to(torch.float32), dim=0)
        ok = in_range & (cur >= 0) & (cur < ring_length) & (named == 1.0)
        acc = torch.sum(u * w, dim=1)  # [block_d]
        if has_bias:
            acc = acc + bias_d
        if silu:
            acc = silu_of(acc, on_gpu)
        hl.store(y2, [row, d], torch.where(ok, acc, 0.0).to(y2.dtype))
        if kernel_size > 1:  # the new window: u's columns 1 .. W-1 to window columns 0 .. W-2
            shifted = (i >= 1) & (i < kernel_size)
            if on_gpu:
                store = shifted[None, :] & ok
            else:  # the interpreter refuses a 0-d mask broadcast: a 1-D one
                store = shifted[None, :] & torch.where(ok, d >= 0, False)[:, None]
            hl.inline_triton("tl.debug_barrier()", [], None)  # every read of the window before any write
            hl.store(win_rows, [wrow, torch.where(shifted, i - 1, 0)], u.to(win_rows.dtype), extra_mask=store)
        if (slot >= 0) & (ok == 0) & (tile_d.begin == 0):  # a refused row, recorded once (as the decode kernel)
            code = call_code[0]
            first = hl.atomic_cas(slot_errors, [0], 0, code)  # the first bad call owns the record
            hl.atomic_add(slot_errors, [2], 1)
            if (first == 0) | (first == code):
                at = hl.atomic_add(slot_errors, [1], 1)
                if at < 8:  # kernels.guard.RECORDED_ROWS
                    slot_errors[4 + 2 * at] = slot * 0 + row
                    slot_errors[5 + 2 * at] = slot
    return y2
