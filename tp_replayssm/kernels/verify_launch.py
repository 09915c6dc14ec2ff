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

__all__ = ["run_verify"]


def run_verify(call: VerifyCall, dims: VerifyDims, *, ring_layout: str, guard: SlotGuard, where: str,
               plan: object | None = None) -> None:
    """Run one validated verify call in place."""
    if dims.batch == 0:
        return
    if not runs_kernel(call.mixed_qkv.device, where):
        verify_rows(call, dims, ring_layout=ring_layout, guard=guard)
        return
    from .verify_args import launch_verify
    from .verify_plan import plan_verify, problem_of

    problem = problem_of(call, dims, ring_layout)
    if plan is None:
        plan = plan_verify(problem)
    else:
        plan.check(problem)
    launch_verify(call, dims, plan, guard)
