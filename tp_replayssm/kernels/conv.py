"""The pool's short convolution in one launch (:meth:`tp_replayssm.pool.ReplaySSMStatePool.conv_update`).

KDA layers run a causal depthwise convolution of kernel ``W`` over the ``D`` pre-conv channels of ``mixed_qkv``
before the recurrence. For a row with pre-conv inputs ``x [T, D]`` and its slot's window ``[D, W-1]`` (the last
``W-1`` inputs, oldest first), with ``u`` = the window followed by ``x``::

    y[t, d] = act(sum_i weight[d, i] * u[t + i, d] + bias[d])        (i = 0 .. W-1; act = SiLU or the identity)

and the window then holds the last ``W-1`` entries of ``u``, rounded to its dtype. All math is fp32; ``y`` takes
``x``'s dtype. :func:`tp_replayssm.pool.conv.conv_reference` is the same math in torch ops.

The launch plan (:func:`~.conv_plan.plan_conv`) picks one of two kernels of this contract, its ``form``:
``"once"`` (:mod:`.conv_once`, one token per row: every input and window element read once, every load issued before
the row's verdict; the library's choice for one token) and ``"taps"`` (:func:`conv_update_kernel` below, any number
of tokens). Both run one program per (row, block of ``block_d`` channels). A ``"taps"`` program decides whether its
row may touch its slot exactly as the decode kernel does (slot in range, allocated: its cursor in ``[0, L-1]``, named
by no other row of the call), reads the window columns and inputs each output needs straight from memory (``u[t +
i]`` is a window column while ``t + i < W-1``, else input ``t + i - (W-1)``), writes ``y``, then, behind a CTA
barrier (the window is read by other threads of the program and Helion orders no write-after-read), writes the new
window. In both, a refused row (slot out of range, free, or named twice) writes zeros to ``y`` and nothing else, and
its first program records it in the pool's error record; a padding row (slot < 0) writes zeros. No host sync; on
sm_90+ the kernels are launched with programmatic dependent launch like the decode kernel.

The window arrives as an overlapping row view of the whole ``pool.conv_state [NL, S+1, D, W-1]``
(:func:`tp_replayssm.kernels.args.rows_view`): row ``layer*sl + slot*ss + d*sd`` holds channel ``d``'s window, so
any layer and any strides with a contiguous last dim work without a copy.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

import helion
import helion.language as hl

from .guard import SlotGuard
from . import direct
from .args import rows_view
from .conv_once import conv_once_kernel
from .conv_plan import (CONV_FORMS, MAX_BLOCK_D, MIN_BLOCK_D, MIN_PROGRAMS_PER_SM, NAMED_BLOCK_MAX, ConvPlan,
                        conv_bytes, plan_conv)

__all__ = ["CONV_FORMS", "DIRECT_PLANS", "MAX_BLOCK_D", "MIN_BLOCK_D", "MIN_PROGRAMS_PER_SM", "NAMED_BLOCK_MAX",
           "ConvPlan", "conv_bytes", "conv_kernel_for", "conv_update_kernel", "launch_conv", "plan_conv"]

logger = logging.getLogger(__name__)


def conv_update_kernel(
    xt3: torch.Tensor,  # [B, D, T] the pre-conv inputs, channels before tokens (x viewed as x[b].T)
    y3: torch.Tensor,  # [B, T, D] outputs
    win_rows: torch.Tensor,  # rows view [span, W-1] of pool.conv_state (a weight view when W == 1: never read)
    weight: torch.Tensor,  # [D, W]
    bias: torch.Tensor,  # [D] (a weight view without bias: never read)
    slots: torch.Tensor,  # [B] int32, < 0 = padding
    cursors: torch.Tensor,  # [S + 1] int32: the pool's cursor table (a free slot's cursor is FREE_CURSOR)
    slot_errors: torch.Tensor,  # [ERROR_WORDS] int32: the pool's record of bad rows (kernels.guard)
    call_code: torch.Tensor,  # [1] int32: what this call records there
    layer_row: int,  # layer * sl: the layer's first window row
    ws: int,  # window element strides: slot, channel
    wd: int,
    ring_length: int,  # L: an allocated slot's cursor is in [0, L-1]
    kernel_size: hl.constexpr,  # W
    width_block: hl.constexpr,  # the power of two >= W the taps are computed in
    named_block: hl.constexpr,  # rows per step of the scan that counts how many rows name a slot
    has_bias: hl.constexpr,
    silu: hl.constexpr,
) -> torch.Tensor:
    """One conv update of every row's channels (module docstring)."""
    B = xt3.size(0)
    D = xt3.size(1)
    T = xt3.size(2)
    scratch = cursors.size(0) - 1
    hl.pdl_wait()  # sm_90+: nothing is read before the previous kernel has finished
    hl.pdl_launch_dependents()
    for tile_b, tile_d in hl.tile([B, D], block_size=[1, None]):
        row = tile_b.begin
        d = tile_d.index
        dmask = d < D
        slot = slots[row]
        # slot safety (docs/conv.md): in range, allocated (cursor in [0, L-1]) and named by this row only
        in_range = (slot >= 0) & (slot < scratch)
        s64 = torch.where(in_range, slot, scratch).to(torch.int64)  # refused rows address the scratch window
        cur = cursors[s64]
        named = slot * 0
        for nb in hl.grid(0, B, named_block):
            others = nb + hl.arange(named_block)
            same = (hl.load(slots, [others], extra_mask=others < B) == slot) & (others < B)
            named = named + torch.sum(torch.where(same, 1, 0), dim=0).to(torch.int32)
        ok = in_range & (cur >= 0) & (cur < ring_length) & (named == 1)
        live_d = torch.where(ok, dmask, False)  # [block_d]: the channels this program reads and writes
        i = hl.arange(width_block)  # the taps
        w = hl.load(weight, [d, i], extra_mask=dmask[:, None] & (i < kernel_size)[None, :]).to(torch.float32)
        if has_bias:
            bias_d = hl.load(bias, [d], extra_mask=dmask).to(torch.float32)
        wrow = layer_row + s64 * ws + d.to(torch.int64) * wd  # [block_d] the channels' window rows
        for t in hl.grid(T):
            j = t + i  # u[t + i]: window column j while j < W-1, else input j - (W-1)
            tok = j - (kernel_size - 1)
            from_x = (tok >= 0) & (i < kernel_size)
            ux = hl.load(xt3, [row, d, torch.where(from_x, tok, 0)],
                         extra_mask=live_d[:, None] & from_x[None, :]).to(torch.float32)
            if kernel_size > 1:
                from_window = j < kernel_size - 1
                uw = hl.load(win_rows, [wrow, torch.where(from_window, j, 0)],
                             extra_mask=live_d[:, None] & from_window[None, :]).to(torch.float32)
                u = torch.where(from_window[None, :], uw, ux)
            else:
                u = ux
            acc = torch.sum(u * w, dim=1)  # [block_d]
            if has_bias:
                acc = acc + bias_d
            if silu:
                acc = acc * torch.sigmoid(acc)
            hl.store(y3, [row, t, d], torch.where(ok, acc, 0.0).to(y3.dtype), extra_mask=dmask)
        if kernel_size > 1:  # the new window: u[T + c] for c < W-1
            jn = T + i
            tok_n = jn - (kernel_size - 1)
            keep = jn < kernel_size - 1  # still a column of the old window (T < W-1)
            live = (i < kernel_size - 1) & (tok_n < T)
            nx = hl.load(xt3, [row, d, torch.where(keep, 0, tok_n)],
                         extra_mask=live_d[:, None] & (live & (keep == 0))[None, :])
            nw = hl.load(win_rows, [wrow, torch.where(keep, jn, 0)],
                         extra_mask=live_d[:, None] & keep[None, :])
            new = torch.where(keep[None, :], nw.to(torch.float32), nx.to(torch.float32))
            hl.inline_triton("tl.debug_barrier()", [], None)  # every read of the window before any write
            hl.store(win_rows, [wrow, i], new.to(win_rows.dtype),
                     extra_mask=live_d[:, None] & (i < kernel_size - 1)[None, :])
        if (slot >= 0) & (ok == 0) & (tile_d.begin == 0):  # a refused row, recorded once (as the decode kernel)
            code = call_code[0]
            first = hl.atomic_cas(slot_errors, [0], 0, code)  # the first bad call owns the record
            hl.atomic_add(slot_errors, [2], 1)
            if (first == 0) | (first == code):
                at = hl.atomic_add(slot_errors, [1], 1)
                if at < 8:  # kernels.guard.RECORDED_ROWS
                    slot_errors[4 + 2 * at] = slot * 0 + row
                    slot_errors[5 + 2 * at] = slot
    return y3


# Sizes vary per call (batch, tokens); one compile serves them ("once" specializes D). Offsets into a pool exceed
# int32 in large pools.
_SETTINGS = dict(static_shapes=False, index_dtype=torch.int64)

_KERNELS = {"taps": conv_update_kernel, "once": conv_once_kernel}


@functools.lru_cache(maxsize=None)
def conv_kernel_for(config: helion.Config, form: str = "taps") -> helion.Kernel:
    """The conv kernel of ``form`` (:data:`CONV_FORMS`) pinned to ``config`` (one kernel object per pair)."""
    logger.debug("conv kernel %s: %s", form, config)
    return helion.kernel(_KERNELS[form], config=config, **_SETTINGS)


DIRECT_PLANS = direct.PlanCache("conv_update")
_PARAMS = {form: tuple(inspect.signature(k).parameters) for form, k in _KERNELS.items()}


def _input_index(inputs: tuple[torch.Tensor, ...], tensor: torch.Tensor) -> int:
    return next(i for i, t in enumerate(inputs) if t is tensor)


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached per device: asked on every launch)."""
    n = _SMS.get(device)
    if n is None:
        from .grid import _sm_count as sms

        n = _SMS[device] = sms(device)
    return n


_SMS: dict[torch.device, int] = {}


def launch_conv(x3: torch.Tensor, y3: torch.Tensor, conv_state: torch.Tensor, layer: int, weight: torch.Tensor,
                bias: torch.Tensor | None, slots: torch.Tensor, cursors: torch.Tensor, ring_length: int,
                silu: bool, guard: SlotGuard, plan: ConvPlan | None = None) -> None:
    """One launch for validated arguments: ``x3``/``y3 [B, T, D]`` (last dim contiguous), ``conv_state [NL, S+1, D,
    W-1]`` (the pool's; its ``layer``), ``weight [D, W]``, ``bias [D]`` or None, ``slots [B]`` int32, ``cursors
    [S+1]``; ``guard``: where bad rows are recorded. On CUDA, repeated calls of the same metadata and layer launch the
    compiled kernel directly (:mod:`.direct`; the key holds the plan and the layer, which with the tensors' metadata
    determine every integer the launch passes). ``plan`` replaces the library's (:func:`plan_conv`); it must fit the
    call (:meth:`ConvPlan.check`)."""
    B, T, D = x3.shape
    W = weight.shape[1]
    device = x3.device
    if plan is None:
        plan = plan_conv(B, D, W, _sm_count(device), T)
    else:
        plan.check(T, W)
    config = plan.config
    kern = conv_kernel_for(config, plan.form)
    inputs = (x3, y3, conv_state, weight, weight if bias is None else bias, slots, cursors, *guard)

    def make_args() -> direct.LaunchArgs:
        """The kernel's arguments in its signature's order; each tensor tagged with the input it views."""
        if W > 1:
            win, (sl, ss, sd) = rows_view(conv_state)
        else:  # no window: a distinct view the kernel never reads
            win, (sl, ss, sd) = weight[:1], (0, 0, 0)
        tensors = {  # name -> (value, the input it views)
            "xt3": (x3.transpose(1, 2), x3), "y3": (y3, y3), "x2": (x3[:, 0], x3), "y2": (y3[:, 0], y3),
            "win_rows": (win, conv_state if W > 1 else weight),
            "weight": (weight, weight),
            "bias": (weight[0], weight) if bias is None else (bias, bias),  # a distinct view: matched by identity
            "slots": (slots, slots), "cursors": (cursors, cursors), "slot_errors": (guard.errors, guard.errors),
            "call_code": (guard.code, guard.code)}
        wt_d, wt_i = weight.stride()
        span = (D - 1) * wt_d + (W - 1) * wt_i + 1
        tensors["weight_flat"] = (weight.as_strided((span,), (1,)), weight)
        scalars = dict(layer_row=layer * sl, ws=ss, wd=sd, wt_d=wt_d, wt_i=wt_i, ring_length=int(ring_length),
                       kernel_size=W,
                       width_block=plan.width_block, named_block=plan.named_block, has_bias=bias is not None,
                       silu=bool(silu), on_gpu=device.type == "cuda")
        params = _PARAMS[plan.form]
        values = tuple(tensors[n][0] if n in tensors else scalars[n] for n in params)
        sources = tuple(_input_index(inputs, tensors[n][1]) if n in tensors else None for n in params)
        return direct.LaunchArgs(values, sources, {})

    DIRECT_PLANS.launch(kern, config, make_args, inputs, device, (plan, int(layer), int(ring_length), bool(silu)))
