"""The pool's conv state: the short causal depthwise convolution every KDA layer runs before the recurrence.

With ``conv_kernel_size = W > 0`` the pool holds, per layer and slot, the last ``W-1`` pre-conv inputs of the rank's
``D = 2*H_l*K + HV_l*V`` channels (``mixed_qkv``'s column order): ``pool.conv_state [NL, S + 1, D, W-1]``, oldest
first, in ``pool.conv_dtype``; slot ``S`` is a scratch window that padding and refused rows read and write back
unchanged. For ``x [B, T, D]`` pre-conv, with ``u`` the window followed by ``x``::

    y[t] = act(sum_i weight[:, i] * u[t + i] + bias)        (i = 0 .. W-1; act = SiLU or the identity)

and the window then holds the last ``W-1`` entries of ``u``. :func:`conv_reference` is that math, readable;
:func:`conv_update` runs it for the pool's rows with slot safety (a row whose slot is out of range, free or repeated
gets ``y = 0`` and changes no window; it is recorded for ``pool.check()``): on CUDA (or in Triton's interpreter) the
Helion kernel of :mod:`tp_replayssm.kernels.conv`, on CPU tensors :func:`conv_update_torch`. The math is fp32; ``y``
takes ``x``'s dtype and the window stores inputs rounded to ``conv_dtype``. docs/conv.md has the contract.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..kernels.args import FusedConv
from ..kernels.backend import runs_kernel
from ..kernels.conv_plan import ConvPlan
from ..kernels.launch import run_decode
from ..kernels.plan import DecodePlan, plan_decode, problem_of
from ..validation import ACTIVATION_DTYPES, DecodeCall, check_tensor, describe, validate_decode_once
from ..kernels.guard import SlotGuard, record_bad_rows
from .agreement import same_call_on_every_rank, shape_of, slot_ids
from .slots import check_ids

if TYPE_CHECKING:
    from .pool import ReplaySSMStatePool

__all__ = ["ACTIVATIONS", "check_conv_args", "checked_conv_update", "conv_before_decode", "conv_reference",
           "conv_update", "conv_update_torch", "decode_with_conv", "row_verdict"]

ACTIVATIONS = ("silu", None)


def conv_reference(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [B, T, D], new_window [B, D, W-1])`` from ``x [B, T, D]``, ``window [B, D, W-1]`` (oldest first),
    ``weight [D, W]`` and ``bias [D]`` (module docstring). fp32 results, ``y`` contiguous (as the conv kernel writes
    it: kernels that take it view its columns with ``stride(-1) == 1``); the taps are summed in order ``i = 0 .. W-1``,
    then the bias is added, whatever ``T`` is (so ``T`` tokens in one call give the bits of ``T`` one-token calls)."""
    W, T = weight.shape[1], x.shape[1]
    u = torch.cat([window.float(), x.float().transpose(1, 2)], dim=2)  # [B, D, W-1+T]
    w = weight.float()
    y = w[:, 0, None] * u[:, :, 0:T]
    for i in range(1, W):
        y = y + w[:, i, None] * u[:, :, i:i + T]
    if bias is not None:
        y = y + bias.float()[:, None]
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2).contiguous(), u[:, :, u.shape[2] - (W - 1):]


def row_verdict(pool: ReplaySSMStatePool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(live, idx)``: which rows may touch their slot (in range, allocated, named once in the call), and the slot
    each row addresses (the scratch slot ``S`` for the others' padding-like reads). No host sync."""
    S = pool.num_slots
    in_range = (slots >= 0) & (slots < S)
    idx = torch.where(in_range, slots, S).long()
    named = torch.zeros(S + 1, dtype=torch.int32, device=slots.device).index_add_(0, idx, in_range.int())
    cur = pool.cursors.index_select(0, idx)
    live = in_range & (named.index_select(0, idx) == 1) & (cur >= 0) & (cur < pool.ring_length)
    return live, idx


DECODE_CONV_NAMES = ("mixed_qkv", "conv_weight", "conv_bias")  # pool.decode's / verify's names of the conv's arguments


def check_conv_args(pool: ReplaySSMStatePool, x: object, weight: object, bias: object, activation: object,
                    where: str, names: tuple[str, str, str] = ("x", "weight", "bias")) -> None:
    """Shapes, dtypes and devices of a conv call's arguments (``ValueError`` naming the argument: ``names`` are the
    caller's names of ``x``, ``weight`` and ``bias``; ``pool.decode`` calls them ``mixed_qkv``, ``conv_weight``,
    ``conv_bias``)."""
    x_name, w_name, b_name = names
    if pool.conv_kernel_size == 0:
        raise ValueError(f"{where}: `{w_name}` given, but this pool holds no conv state (built with "
                         f"conv_kernel_size=0)")
    D, W = pool.conv_channels, pool.conv_kernel_size
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != D \
            or (x.dim() == 3 and x.shape[1] < 1):
        raise ValueError(f"{where}: `{x_name}` must be [B, D] or [B, T, D] with T >= 1 and D = {D} (this rank's "
                         f"q/k/v channels); got {describe(x)}")
    check_tensor(where, x_name, x, (tuple(x.shape),), ACTIVATION_DTYPES)
    if isinstance(weight, torch.Tensor) and weight.dim() == 3 and tuple(weight.shape) == (D, 1, W):
        raise ValueError(f"{where}: `{w_name}` must be of shape [{D}, {W}]; got [{D}, 1, {W}] (an nn.Conv1d / "
                         f"FLA ShortConvolution weight: pass weight[:, 0])")
    check_tensor(where, w_name, weight, ((D, W),), (torch.float32, torch.bfloat16, torch.float16),
                 last_contiguous=False)
    if bias is not None:
        check_tensor(where, b_name, bias, ((D,),), (torch.float32, torch.bfloat16, torch.float16))
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: `activation` must be one of {list(ACTIVATIONS)}; got {activation!r}")
    for name, t in ((x_name, x), (w_name, weight), (b_name, bias)):
        if t is not None and t.device != pool.device:
            raise ValueError(f"{where}: `{name}` must be on {pool.device}; got {t.device}")


def checked_conv_update(pool: ReplaySSMStatePool, layer: int, x: torch.Tensor, weight: torch.Tensor,
                        slots: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                        plan: ConvPlan | None) -> torch.Tensor:
    """:meth:`ReplaySSMStatePool.conv_update`: debug mode's comparison of the ranks' calls, the arguments, the slot
    ids (debug mode: by value), then :func:`conv_update`."""
    where = f"ReplaySSMStatePool.conv_update(layer={layer})"
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        same_call_on_every_rank(pool, where, x=shape_of(x), slots=slot_ids(slots), activation=activation,
                                bias=bias is not None)
    pool._check_layer(layer, "conv_update")
    check_conv_args(pool, x, weight, bias, activation, where)
    check_ids(slots, where, pool.device, (torch.int32,))  # (before the debug check reads the ids)
    if pool.debug:
        pool._debug_check(slots, where, allow_padding=True, unique=True)
    return conv_update(pool, layer, x, weight, slots, bias, activation, pool.guard("conv_update", layer), where,
                       plan=plan)


def conv_update(pool: ReplaySSMStatePool, layer: int, x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                bias: torch.Tensor | None, activation: str | None, guard: SlotGuard | None,
                where: str, out: torch.Tensor | None = None, plan: ConvPlan | None = None) -> torch.Tensor:
    """:meth:`ReplaySSMStatePool.conv_update` after its checks, no host sync, CUDA-graph capturable: the Helion kernel
    (:mod:`tp_replayssm.kernels.conv`) where kernels run (:func:`~tp_replayssm.kernels.backend.runs_kernel`: CUDA,
    or the CPU in Triton's interpreter), else :func:`conv_update_torch`. ``guard`` None records nothing (a decode
    with the conv records its bad rows itself). ``out``: a contiguous tensor of ``x``'s shape and dtype for ``y``.
    ``plan``: the kernel's launch plan instead of the library's (checked on the PyTorch path too)."""
    check_ids(slots, where, pool.device, (torch.int32,))
    if slots.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: `slots` must have one id per row of `x` ({x.shape[0]}); got {describe(slots)}")
    if plan is not None:
        check_conv_plan(plan, x, pool.conv_kernel_size, where)
    if not runs_kernel(pool.device, where):
        y = conv_update_torch(pool, layer, x, weight, slots, bias, activation, guard)
        return y if out is None else out.copy_(y)
    from ..kernels.conv import launch_conv
    from ..kernels.guard import spare_guard

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if x.shape[0]:
        x3, y3 = (x, y) if x.dim() == 3 else (x[:, None], y[:, None])
        launch_conv(x3, y3, pool.conv_state, layer, weight, bias, slots, pool.cursors, pool.ring_length,
                    activation == "silu", guard or spare_guard(pool.device), plan)
    return y


def check_conv_plan(plan: object, x: torch.Tensor, kernel_size: int, where: str) -> None:
    """``ValueError`` unless ``plan`` is a :class:`~tp_replayssm.kernels.conv.ConvPlan` that can run ``x [B, D]`` or
    ``[B, T, D]`` with kernel ``kernel_size``."""
    if not isinstance(plan, ConvPlan):
        raise ValueError(f"{where}: `plan` must be a ConvPlan or None; got {type(plan).__name__}")
    try:
        plan.check(1 if x.dim() == 2 else x.shape[1], kernel_size)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def decode_with_conv(pool: ReplaySSMStatePool, layer: int, call: DecodeCall, weight: torch.Tensor,
                     bias: torch.Tensor | None, *, advance: bool, plan: DecodePlan | None, conv_plan: ConvPlan | None,
                     guard: SlotGuard, where: str) -> None:
    """``pool.decode(..., conv_weight=, conv_bias=)``: the decode of the call's pre-conv ``mixed_qkv [B, D]`` with the
    pool's conv (SiLU) before it. Where kernels run and the decode plan fuses the conv (``plan.fused_conv``, the
    library's plan wherever :func:`~tp_replayssm.kernels.plan.fusable`), one launch does both; otherwise the conv runs
    in a launch of its own (``conv_plan``, or the library's) and the decode reads its output
    (:func:`conv_before_decode`; the PyTorch path for CPU tensors). Every argument is checked first."""
    x = call.mixed_qkv
    check_conv_args(pool, x, weight, bias, "silu", where, DECODE_CONV_NAMES)
    if x.dim() != 2:
        raise ValueError(f"{where}: `mixed_qkv` must be [B, D] (one pre-conv token per row); got {describe(x)}")
    kernel = runs_kernel(pool.device, where)
    dims = validate_decode_once(call, ring_layout=pool.ring_layout, cursor_table=True, where=where,
                                num_q_heads=pool.local_heads.num_q_heads)
    problem = problem_of(dims, state_dtype=call.initial_state.dtype, cache_dtype=call.d_cache.dtype,
                         device=pool.device, ring_layout=pool.ring_layout, cursor_table=True, advance=advance,
                         use_l2norm=bool(call.use_qk_l2norm_in_kernel), lower_bound=call.lower_bound,
                         conv_kernel_size=pool.conv_kernel_size)
    given = plan
    if plan is not None:
        plan.check(problem, device_code=kernel)
        if conv_plan is not None and plan.fused_conv:  # (on every path, though only kernels fuse)
            raise ValueError(f"{where}: `conv_plan` given, but `plan` fuses the conv into the decode launch "
                             f"(fused_conv={plan.fused_conv}); pass a plan with fused_conv=0 for a conv launch")
    elif kernel:  # a conv_plan asks for the conv's own launch
        plan = plan_decode(problem, fuse_conv=False if conv_plan is not None else None)
    if kernel and plan.fused_conv:
        counters = getattr(pool, "conv_counters", None)
        if counters is None:  # made on the first fused call (warm-up, before any graph capture): zero between launches
            counters = pool.conv_counters = torch.zeros((pool.num_slots + 1) * pool.local_heads.num_q_heads,
                                                        dtype=torch.int32, device=pool.device)
        run_decode(call, ring_layout=pool.ring_layout, cursor_table=True, advance=advance, plan=given, guard=guard,
                   where=where, conv=FusedConv(pool.conv_state, layer, weight, bias, counters),  # (None: the same plan)
                   num_q_heads=pool.local_heads.num_q_heads)
        return
    if plan is not None:
        plan = plan.without_conv()
    call = conv_before_decode(pool, layer, call, weight, bias, advance=advance, plan=plan, where=where,
                              conv_plan=conv_plan)
    run_decode(call, ring_layout=pool.ring_layout, cursor_table=True, advance=advance, plan=plan, guard=guard,
               where=where, num_q_heads=pool.local_heads.num_q_heads)


def conv_before_decode(pool: ReplaySSMStatePool, layer: int, call: DecodeCall, weight: torch.Tensor,
                       bias: torch.Tensor | None, *, advance: bool, plan: DecodePlan | None, where: str,
                       conv_plan: ConvPlan | None = None) -> DecodeCall:
    """The conv of ``pool.decode(..., conv_weight=, conv_bias=)``: check the conv's arguments and the whole decode call
    (with a fresh buffer as its ``mixed_qkv``, and ``plan``) first, since the conv moves the windows; then run the
    conv (SiLU) of the call's pre-conv ``mixed_qkv [B, D]`` into that buffer (with ``conv_plan`` where given) and
    return the call that reads it. The conv records no bad rows: the decode kernel records the same rows."""
    x = call.mixed_qkv
    check_conv_args(pool, x, weight, bias, "silu", where, DECODE_CONV_NAMES)
    if x.dim() != 2:
        raise ValueError(f"{where}: `mixed_qkv` must be [B, D] (one pre-conv token per row); got {describe(x)}")
    if conv_plan is not None:
        check_conv_plan(conv_plan, x, pool.conv_kernel_size, where)
    call = call._replace(mixed_qkv=torch.empty(x.shape, dtype=x.dtype, device=pool.device))
    dims = validate_decode_once(call, ring_layout=pool.ring_layout, cursor_table=True, where=where,
                                num_q_heads=pool.local_heads.num_q_heads)
    if plan is not None:
        plan.check(problem_of(dims, state_dtype=call.initial_state.dtype, cache_dtype=call.d_cache.dtype,
                              device=pool.device, ring_layout=pool.ring_layout, cursor_table=True, advance=advance,
                              use_l2norm=bool(call.use_qk_l2norm_in_kernel), lower_bound=call.lower_bound))
    conv_update(pool, layer, x, weight, call.ssm_state_indices, bias, "silu", None, where, out=call.mixed_qkv,
                plan=conv_plan)
    return call


def conv_update_torch(pool: ReplaySSMStatePool, layer: int, x: torch.Tensor, weight: torch.Tensor,
                      slots: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                      guard: SlotGuard | None) -> torch.Tensor:
    """The PyTorch path of :func:`conv_update` (CPU tensors by default): :func:`conv_reference` for every row on the
    window of its slot (the scratch window for padding and refused rows), which a refused row writes back
    unchanged. A few torch ops, no host sync."""
    x3 = x if x.dim() == 3 else x[:, None]
    live, idx = row_verdict(pool, slots)
    states = pool.conv_state[layer]
    window = states.index_select(0, idx)
    y, new_window = conv_reference(x3, window, weight, bias, activation)
    y = torch.where(live[:, None, None], y, 0.0).to(x.dtype)
    states.index_copy_(0, idx, torch.where(live[:, None, None], new_window.to(states.dtype), window))
    if guard is not None:
        record_bad_rows(guard.errors, guard.code, (slots >= 0) & ~live, slots)
    return y if x.dim() == 3 else y[:, 0]
