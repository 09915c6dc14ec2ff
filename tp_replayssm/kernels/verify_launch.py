"""One entry for every verify launch: choose the path, plan, launch (:func:`run_verify`).

On CPU tensors the PyTorch path (:func:`tp_replayssm.reference_spec.verify_rows`) runs unless the interpreter backend
is chosen (:mod:`.backend`); otherwise the Helion verify kernel (:mod:`.verify`) with the call's
:class:`~.verify_plan.VerifyPlan`, through the direct launcher after a metadata key's first call.
"""

from __future__ import annotations

from .guard import SlotGuard
from ..reference_spec import verify_rows
from ..spec_validation import VerifyCall, VerifyDims
from .backend import runs_kernel

__all__ = ["check_verify_plan", "run_verify"]


def check_verify_plan(plan: object | None, call: VerifyCall, dims: VerifyDims, *, ring_layout: str,
                      where: str) -> None:
    """``plan`` checked against the call (on the PyTorch path too, which runs none: a wrong plan is a caller's bug):
    ``ValueError`` unless it is None or a :class:`~.verify_plan.VerifyPlan` that can run it. The pool calls it before
    its verify opens a step, so a wrong plan leaves nothing behind."""
    if plan is None:
        return
    from .verify_plan import VerifyPlan, problem_of

    if not isinstance(plan, VerifyPlan):
        raise ValueError(f"{where}: `plan` must be a VerifyPlan or None; got {type(plan).__name__}")
    plan.check(problem_of(call, dims, ring_layout))


def run_verify(call: VerifyCall, dims: VerifyDims, *, ring_layout: str, guard: SlotGuard, where: str,
               plan: object | None = None) -> None:
    """Run one validated verify call in place (``plan``: checked, :func:`check_verify_plan`)."""
    check_verify_plan(plan, call, dims, ring_layout=ring_layout, where=where)
    if dims.batch == 0:
        return
    if not runs_kernel(call.mixed_qkv.device, where):
        verify_rows(call, dims, ring_layout=ring_layout, guard=guard)
        return
    from .verify_args import launch_verify
    from .verify_plan import plan_verify, problem_of

    launch_verify(call, dims, plan if plan is not None else plan_verify(problem_of(call, dims, ring_layout)), guard)
