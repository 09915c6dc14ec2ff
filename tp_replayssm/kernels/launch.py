"""One entry for every decode launch: validate, choose the path, plan, launch.

:func:`run_decode` is what the op (:func:`tp_replayssm.ops.replayssm_decode`) and the pool call. It validates the
call (``ValueError`` before anything is written), then runs it on the inputs' device, whatever the current device
is: on CPU tensors the PyTorch path of :mod:`tp_replayssm.reference` unless the interpreter backend is chosen
(:mod:`.backend`), else the Helion kernel with the call's :class:`~.plan.DecodePlan` (or the one passed), through
the direct launcher after a metadata key's first call.
"""

from __future__ import annotations


from .args import FusedConv, decode_kernel_args, no_flush
from .guard import SlotGuard, spare_guard
from ..validation import DecodeCall, DecodeDims, resolve_scale, validate_decode_once
from . import direct
from .backend import runs_kernel
from .decode import decode_kernel_for
from .plan import DecodePlan, plan_decode, problem_of

__all__ = ["DIRECT_PLANS", "launch_decode", "plan_for", "run_decode"]

# Direct-launch plans of the decode kernel
DIRECT_PLANS = direct.PlanCache("replayssm_decode")

def plan_for(call: DecodeCall, dims: DecodeDims, *, ring_layout: str, cursor_table: bool,
             advance: bool, conv_kernel_size: int = 0) -> DecodePlan:
    """The library's plan for a validated call (``conv_kernel_size``: the pool's W when ``mixed_qkv`` is pre-conv)."""
    return plan_decode(problem_of(
        dims, state_dtype=call.initial_state.dtype, cache_dtype=call.d_cache.dtype, device=call.mixed_qkv.device,
        ring_layout=ring_layout, cursor_table=cursor_table, advance=advance,
        use_l2norm=bool(call.use_qk_l2norm_in_kernel), lower_bound=call.lower_bound,
        conv_kernel_size=conv_kernel_size))


def run_decode(call: DecodeCall, *, ring_layout: str, cursor_table: bool = False, advance: bool = False,
               plan: DecodePlan | None = None, guard: SlotGuard | None = None,
               where: str = "replayssm_decode", conv: FusedConv | None = None,
               num_q_heads: int | None = None) -> DecodeDims:
    """Validate and run one decode call in place (module docstring); returns its sizes.

    ``cursor_table``: ``call.write_pos`` is the pool's cursor table ``[S + 1]``; ``advance`` (with it) moves those
    cursors in the same launch, as :func:`tp_replayssm.kernels.cursor.advance` would right after it. ``plan``
    replaces the library's launch plan (benchmarks, tests); it must fit the call (:meth:`DecodePlan.check`).
    ``guard``: the pool's error record and this call's code (slot safety); the op passes none. ``conv``: the pool's
    conv, which this launch runs on the pre-conv ``mixed_qkv`` (the pool's path, where kernels run and the plan fuses
    it: ``plan.fused_conv``; :func:`tp_replayssm.pool.conv.decode_with_conv` decides). ``num_q_heads``: the pool's
    q/k heads, for the checks (:func:`~tp_replayssm.validation.validate_decode`)."""
    if advance and not cursor_table:
        raise ValueError(f"{where}: advance=True needs the pool's cursor table [S + 1] as `write_pos`")
    dims = validate_decode_once(call, ring_layout=ring_layout, cursor_table=cursor_table, where=where,
                                num_q_heads=num_q_heads)
    device = call.mixed_qkv.device
    kernel = runs_kernel(device, where)
    W = 0 if conv is None else conv.weight.shape[1]
    if plan is not None and not isinstance(plan, DecodePlan):
        raise ValueError(f"{where}: `plan` must be a DecodePlan or None; got {type(plan).__name__}")
    if plan is not None:  # (checked on the PyTorch path too, which runs none: a wrong plan is a caller's bug)
        problem = problem_of(
            dims, state_dtype=call.initial_state.dtype, cache_dtype=call.d_cache.dtype, device=device,
            ring_layout=ring_layout, cursor_table=cursor_table, advance=advance,
            use_l2norm=bool(call.use_qk_l2norm_in_kernel), lower_bound=call.lower_bound, conv_kernel_size=W)
        plan.check(problem, device_code=kernel)
    if conv is not None and (not kernel or (plan is not None and not plan.fused_conv)):
        raise ValueError(f"{where}: a fused conv runs in the kernel with a plan that fuses it (plan.fused_conv)")
    if dims.batch == 0:
        return dims
    if not kernel:
        from ..reference import decode_rows

        decode_rows(call, dims, ring_layout=ring_layout, cursor_table=cursor_table, advance=advance, guard=guard)
        return dims
    if plan is None:
        plan = plan_for(call, dims, ring_layout=ring_layout, cursor_table=cursor_table, advance=advance,
                        conv_kernel_size=W)
    launch_decode(call, dims, plan, guard or spare_guard(device), conv)
    return dims


def launch_decode(call: DecodeCall, dims: DecodeDims, plan: DecodePlan, guard: SlotGuard,
                  conv: FusedConv | None = None) -> None:
    """Launch the kernel for a validated call with ``plan`` (no checks; ``conv`` with ``plan.fused_conv``)."""
    device = call.mixed_qkv.device
    force = no_flush(dims.batch, device) if call.force_flush is None else call.force_flush
    scale = resolve_scale(call.scale, dims.key_dim)
    inputs = (*call[:5], *call[6:13], force, *guard)  # the call's tensors (CALL_TENSORS order), then the guard's
    key: tuple = (plan,)
    if conv is not None:  # then the conv's (args.CONV_INPUTS); the layer decides the window offset the launch passes
        inputs += conv.inputs()
        key = (plan, int(conv.layer), conv.bias is None)
    config = plan.config
    DIRECT_PLANS.launch(
        decode_kernel_for(config), config, lambda: decode_kernel_args(call, dims, plan, scale, force, guard, conv),
        inputs, device,
        key, {"scale": scale, "lower_bound": 0.0 if call.lower_bound is None else float(call.lower_bound)},
        None if plan.maxnreg is None else {"maxnreg": plan.maxnreg})
