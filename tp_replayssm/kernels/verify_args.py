"""The verify kernels' arguments (views of the call's tensors, each tagged with the input it views) and its launch.

Caches are passed as the decode kernel's row views (:func:`tp_replayssm.kernels.args.rows_view`; packed for the
tensor-core form, whose offsets are then int32 where every argument has fewer than 2^31 elements); the
activations as one ``as_strided`` view each (``q4``, ``k4 [B, T, H, K]``, ``v4 [B, T, HV, V]`` over ``mixed_qkv``'s
columns, ``a4 [B, T, HV, K]``). The launch goes through the direct launcher (:mod:`.direct`) keyed by the plan.
"""

from __future__ import annotations

import inspect

import torch

from .guard import SlotGuard
from ..spec_validation import VerifyCall, VerifyDims
from ..validation import resolve_scale
from . import direct
from .args import state_args
from .verify import replayssm_verify_kernel
from .verify_mma import replayssm_verify_mma_kernel
from .verify_plan import VerifyPlan

__all__ = ["DIRECT_PLANS", "launch_verify", "verify_kernel_args"]

DIRECT_PLANS = direct.PlanCache("replayssm_verify")
# the positional parameters of each form's kernel (tensor_cores -> names)
_PARAMS = {False: tuple(inspect.signature(replayssm_verify_kernel).parameters),
           True: tuple(inspect.signature(replayssm_verify_mma_kernel).parameters)}
INPUTS = ("mixed_qkv", "a", "b", "A_log", "dt_bias", "initial_state", "d_cache", "k_cache", "g_cache", "out",
          "slots", "cursors", "parents", "folded", "counters", "slot_errors", "call_code")
_SOURCE = {name: i for i, name in enumerate(INPUTS)}
_NO_PARENTS: dict[torch.device, torch.Tensor] = {}


def _no_parents(device: torch.device) -> torch.Tensor:
    """A ``[1, 1]`` int32 stand-in for the ``parents`` of a chain (the kernel does not read it)."""
    t = _NO_PARENTS.get(device)
    if t is None:
        t = _NO_PARENTS[device] = torch.full((1, 1), -1, dtype=torch.int32, device=device)
    return t


def _inputs(call: VerifyCall, guard: SlotGuard) -> tuple[torch.Tensor, ...]:
    parents = _no_parents(call.slots.device) if call.parents is None else call.parents
    return (call.mixed_qkv, call.a, call.b, call.A_log, call.dt_bias, call.initial_state, call.d_cache, call.k_cache,
            call.g_cache, call.out, call.slots, call.cursors, parents, call.folded, call.counters, guard.errors,
            guard.code)


def verify_kernel_args(call: VerifyCall, dims: VerifyDims, plan: VerifyPlan, guard: SlotGuard) -> direct.LaunchArgs:
    """The kernel's positional arguments for a validated call, with their sources in :data:`INPUTS`."""
    B, T, H, HV, K, V = dims.batch, dims.drafts, dims.num_q_heads, dims.num_v_heads, dims.key_dim, dims.value_dim
    x, a = call.mixed_qkv, call.a
    if x.stride(-1) != 1:  # the column views below assume it (the caller's tensor is validated; this guards ours)
        raise ValueError(f"replayssm_verify: `mixed_qkv` must have a contiguous last dim; got strides {x.stride()}")
    s0, s1, off = x.stride(0), x.stride(1), x.storage_offset()
    common, strides = state_args(call, HV, K, packed=plan.tensor_cores)
    inputs = _inputs(call, guard)
    tensors = {
        **common,
        "q4": (x.as_strided((B, T, H, K), (s0, s1, K, 1), off), "mixed_qkv"),
        "k4": (x.as_strided((B, T, H, K), (s0, s1, K, 1), off + H * K), "mixed_qkv"),
        "v4": (x.as_strided((B, T, HV, V), (s0, s1, V, 1), off + 2 * H * K), "mixed_qkv"),
        "a4": (a if a.dim() == 4 else a.as_strided((B, T, HV, K), (a.stride(0), a.stride(1), K, 1),
                                                   a.storage_offset()), "a"),
        "b3": (call.b, "b"),
        "out4": (call.out, "out"),
        "slots": (call.slots, "slots"),
        "cursors": (call.cursors, "cursors"),
        "parents": (inputs[_SOURCE["parents"]], "parents"),
        "folded": (call.folded, "folded"),
        "counters": (call.counters.view(-1), "counters"),
        "slot_errors": (guard.errors, "slot_errors"),
        "call_code": (guard.code, "call_code"),
    }
    scale = resolve_scale(call.scale, K)
    values = {"scale": scale, "num_slots": dims.num_slots,
              "lower_bound": 0.0 if call.lower_bound is None else float(call.lower_bound),
              **strides, **plan.constexprs()}
    return direct.ordered_args(_PARAMS[plan.tensor_cores], tensors, values, _SOURCE)


def launch_verify(call: VerifyCall, dims: VerifyDims, plan: VerifyPlan, guard: SlotGuard) -> None:
    """Launch the verify kernel for a validated call with ``plan`` (no checks)."""
    kernel = plan.kernel
    scale = resolve_scale(call.scale, dims.key_dim)
    DIRECT_PLANS.launch(
        kernel, kernel.configs[0], lambda: verify_kernel_args(call, dims, plan, guard), _inputs(call, guard),
        call.mixed_qkv.device, (plan,),
        {"scale": scale, "lower_bound": 0.0 if call.lower_bound is None else float(call.lower_bound)},
        None if plan.maxnreg is None else {"maxnreg": plan.maxnreg})
