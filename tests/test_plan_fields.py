"""The :class:`DecodePlan` object (:mod:`tp_replayssm.kernels.plan`): one object per problem and per launch config,
every field reaching the launch's config or the kernel, where ``late_count`` and ``early_qk`` are on, its ``str``,
and ``DecodePlan.check`` refusing a plan that does not fit a call, naming the field, before anything is written.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _plan_helpers import BF16, CPU, FP32, _plan, _problem
from tp_replayssm.kernels import decode, plan
from tp_replayssm.kernels.grid import launch_config
from tp_replayssm.kernels.plan import DecodePlan, plan_decode


def test_plan_decode_returns_the_same_object_for_the_same_problem() -> None:
    problem = _problem(8, 16, state=BF16, layout="predecayed", cursor_table=True, advance=True)
    twin = dataclasses.replace(problem)  # equal, another object
    assert twin is not problem and plan_decode(twin) is plan_decode(problem)
    assert plan_decode(dataclasses.replace(problem, batch=9)) is not plan_decode(problem)


# the DecodePlan fields that make the Helion config or the launch (launch_config, the register cap), not a constexpr;
# the kernel's constexprs that take another field's name (field -> constexpr)
CONFIG_FIELDS = {"value_tile", "num_warps", "maxnreg", "chunk_stages", "evict_state_first"}
RENAMED = {"cursor_table": "cursors_by_slot", "tensor_core_chunks": "chunks_on_tensor_cores",
           "advance_readers": "advance_cursors"}


def test_every_plan_field_reaches_the_kernel() -> None:
    """A field of ``DecodePlan`` is either part of the launch's config or one of the kernel's constexprs
    (``DecodePlan.constexprs()``), and every constexpr is a parameter of ``replayssm_decode_kernel``: the launch's
    argument builder passes only the kernel's parameters, so a field left out of ``constexprs()`` or a constexpr the
    kernel does not take would be dropped without an error (DEVELOPERS.md, "Plan choices timed on the device")."""
    import inspect

    params = set(inspect.signature(decode.replayssm_decode_kernel).parameters)
    fields = {f.name for f in dataclasses.fields(DecodePlan)}
    for p in (_plan(8, 32, state=BF16, layout="predecayed", cursor_table=True),
              plan_decode(dataclasses.replace(_problem(8, 32, state=BF16, layout="predecayed", cursor_table=True),
                                              advance=True, conv_kernel_size=4), fuse_conv=True)):
        constexprs = p.constexprs()
        assert set(constexprs) <= params, sorted(set(constexprs) - params)
        routed = {RENAMED.get(name, name) for name in fields - CONFIG_FIELDS}
        assert routed == set(constexprs), (sorted(routed - set(constexprs)), sorted(set(constexprs) - routed))


def test_launch_config_is_one_object_per_choice_however_spelled() -> None:
    """Compiled kernels are cached by config identity, so a config named positionally, by keyword or with its
    defaults spelled out (``DecodePlan.config``, the benchmarks' edited plans) must be the same object."""
    base = launch_config(32, 1)
    assert base is launch_config(32, 1, False, 0) is launch_config(vt=32, warps=1, chunk_stages=0)
    assert base is launch_config(32, 1, evict_state_first=False) is not launch_config(32, 1, True)
    assert launch_config(64, 1, chunk_stages=3) is launch_config(64, 1, False, 3)
    p = _plan(8, 32)
    assert dataclasses.replace(p).config is p.config is launch_config(p.value_tile, p.num_warps)


def test_late_count_where_the_h200_measured_it_faster() -> None:
    """``DecodePlan.late_count`` (the fused advance reads the cursor with a plain load and counts its readers once the
    row's loads are out): on the bf16 one-key-tile programs (``vector_tiles == 2``) and the tensor-core chunk
    programs; not on the tiny-batch path, the ``vector_tiles == 1`` programs, fp32 checkpoints, a fused conv, or a
    decode without the advance (docs/tuning.md, "Slot checks")."""
    def late(batch: int, heads: int, **kwargs: object) -> DecodePlan:
        return _plan(batch, heads, layout="predecayed", cursor_table=True, **kwargs)

    for batch, heads in ((1, 32), (8, 8), (32, 32), (128, 32), (512, 8)):
        p = late(batch, heads, state=BF16, advance=True)
        assert p.late_count and (p.vector_tiles == 2 or p.tensor_core_chunks), p
    for batch, heads in ((1, 8), (8, 32), (32, 8)):  # the tiny path, then value tiles of 32 rows (vector_tiles 1)
        p = late(batch, heads, state=BF16, advance=True)
        assert not p.late_count and (p.tiny_batch or p.vector_tiles == 1), p
    assert not late(128, 32, state=FP32, advance=True).late_count
    assert not late(128, 32, state=BF16).late_count
    conv = dataclasses.replace(_problem(128, 32, state=BF16, layout="predecayed", cursor_table=True, advance=True),
                               conv_kernel_size=4)
    assert plan_decode(conv, fuse_conv=True).fused_conv and not plan_decode(conv, fuse_conv=True).late_count
    assert plan_decode(conv, fuse_conv=False).late_count
    assert plan_decode(_problem(8, 8, state=BF16, layout="predecayed", cursor_table=True, advance=True,
                                device=CPU)).late_count  # the interpreter's bf16 plan: its tests run the late count


def test_early_qk_where_the_h200_measured_it_faster() -> None:
    """``DecodePlan.early_qk`` (the plain decode loads q and k beside the slot and normalizes them while the cursor
    loads): the pool's pre-decayed calls with a bf16 checkpoint on the batch path's one-warp programs up to
    ``EARLY_QK_UPTO`` (row, value head) pairs; not with the fused advance, on the tiny-batch path, with an fp32
    checkpoint, the sglang layout, the op's per-row cursors, a lower bound, or above that size (docs/tuning.md,
    "Slot checks"); every plan with a fused conv (its loads and math before the verdict, docs/conv.md) but one that
    pins the checkpoint loads' eviction."""
    def early(batch: int, heads: int, **kwargs: object) -> DecodePlan:
        return _plan(batch, heads, layout="predecayed", cursor_table=True, **kwargs)

    for batch, heads in ((1, 32), (8, 32), (32, 8), (32, 32)):  # the shapes measured (32 to 1024 pairs)
        p = early(batch, heads, state=BF16)
        assert p.early_qk and p.num_warps == 1 and not p.tiny_batch, p
    assert plan.EARLY_QK_UPTO == 32 * 32
    assert not early(64, 32, state=BF16).early_qk  # 2048 pairs
    assert not early(1, 8, state=BF16).early_qk  # the tiny path
    assert not early(8, 32, state=FP32).early_qk
    assert not early(8, 32, state=BF16, advance=True).early_qk
    assert not _plan(8, 32, state=BF16, layout="sglang", cursor_table=True).early_qk
    assert not _plan(8, 32, state=BF16, layout="predecayed").early_qk  # the op's cursors, one per row
    assert not early(8, 32, state=BF16, lower_bound=-5.0).early_qk
    conv = dataclasses.replace(_problem(32, 32, state=BF16, layout="predecayed", cursor_table=True), conv_kernel_size=4)
    fused = plan_decode(conv, fuse_conv=True)
    assert fused.fused_conv and fused.early_qk
    dataclasses.replace(fused, early_qk=False).check(conv)  # the conv after the verdict: a plan edit
    assert plan_decode(conv, fuse_conv=False).early_qk
    for problem in (dataclasses.replace(conv, state_dtype=FP32, advance=True, batch=1),  # the tiny path, fp32
                    dataclasses.replace(conv, ring_layout="sglang"),
                    dataclasses.replace(conv, use_lower_bound=True, gate_bounded=True, batch=128)):
        p = plan_decode(problem, fuse_conv=True)
        assert p.fused_conv and p.early_qk, p
    wide = dataclasses.replace(conv, key_dim=256, value_dim=256, state_dtype=FP32, batch=128)
    p = plan_decode(wide, fuse_conv=True)
    assert p.fused_conv and p.evict_state_first and not p.early_qk, p  # its pinned load positions
    assert plan_decode(_problem(8, 8, state=BF16, layout="predecayed", cursor_table=True,
                                device=CPU)).early_qk  # the interpreter's bf16 plan: its tests run it


def test_str_names_every_field() -> None:
    p = _plan(512, 32, state=BF16, layout="predecayed", cursor_table=True, advance=True)
    text = str(p)
    for field in dataclasses.fields(DecodePlan):
        assert f"{field.name}={getattr(p, field.name)}" in text, (field.name, text)


BASE = _problem(8, 16, layout="predecayed", cursor_table=True, advance=True)
BASE_BF16 = dataclasses.replace(BASE, state_dtype=BF16)
# case (named by the field the error must name) -> (the problem whose plan is taken, edits of it, the problem it meets)
MISMATCHES = {
    "cursor_table": (BASE, dict(cursor_table=False), BASE),
    "ring_length": (BASE, dict(ring_length=8), BASE),
    "ring_length-of-another-call": (BASE, {}, dataclasses.replace(BASE, ring_length=32)),
    "ring_block": (BASE, dict(ring_block=32), BASE),
    "use_l2norm": (BASE, dict(use_l2norm=False), BASE),
    "use_lower_bound-of-another-call": (BASE, {}, dataclasses.replace(BASE, use_lower_bound=True, gate_bounded=True)),
    "predecayed_ring-of-another-layout": (BASE, {}, dataclasses.replace(BASE, ring_layout="sglang")),
    "advance_readers": (BASE, dict(advance_readers=0), BASE),
    "advance_readers-count": (BASE, dict(advance_readers=7), BASE),
    "vector_tiles-with-tensor-cores": (BASE_BF16, dict(vector_tiles=1, tensor_core_chunks=True), BASE_BF16),
    "vector_tiles-key-width": (_problem(8, 16, key_dim=24), dict(vector_tiles=1), _problem(8, 16, key_dim=24)),
    "late_count-without-advance": (dataclasses.replace(BASE, advance=False), dict(late_count=True),
                                   dataclasses.replace(BASE, advance=False)),
    "late_count-four-warps": (dataclasses.replace(BASE, state_dtype=BF16), dict(num_warps=4),
                              dataclasses.replace(BASE, state_dtype=BF16)),
    "early_qk-evict-first": (BASE, dict(early_qk=True, evict_state_first=True), BASE),
    # values outside the field's set or range
    "value_tile-not-a-power-of-two": (BASE, dict(value_tile=24), BASE),
    "value_chunk-zero": (BASE, dict(value_chunk=0), BASE),
    "value_chunk-wider-than-the-tile": (BASE, dict(value_chunk=64), BASE),
    "num_warps": (BASE, dict(num_warps=3), BASE),
    "vector_tiles-value": (BASE, dict(vector_tiles=5), BASE),
    "predecayed_ring-value": (BASE, dict(predecayed_ring=7), BASE),
    "tensor_core_chunks-fp32-checkpoint": (BASE, dict(tensor_core_chunks=True, vector_tiles=0), BASE),
    "maxnreg": (BASE, dict(maxnreg=17), BASE),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_check_refuses_a_plan_that_does_not_fit_naming_the_field(case: str) -> None:
    """``DecodePlan.check``: a ``ValueError`` naming the field, for a plan edited into a combination the kernel
    does not have or met with another call's problem; the library's own plan passes."""
    source, changes, problem = MISMATCHES[case]
    own = plan_decode(source)
    own.check(source)
    with pytest.raises(ValueError, match=f"`{case.split('-')[0]}`"):
        dataclasses.replace(own, **changes).check(problem)


def test_a_plan_for_another_call_is_refused_before_anything_is_written() -> None:
    """``run_decode(..., plan=)`` checks the plan against the call first (on every path, the torch one included); a
    ``plan`` that is not a DecodePlan is a ValueError naming it."""
    from tp_replayssm.kernels.launch import plan_for, run_decode
    from tp_replayssm.testing import random_decode_inputs, random_head_params, random_ring_caches
    from tp_replayssm.validation import DecodeCall, validate_decode

    B, H, HV, K, V, L, S = 2, 1, 2, 16, 16, 3, 3
    gen = torch.Generator().manual_seed(0)
    inp = random_decode_inputs(B, H, HV, K, V, generator=gen)
    p = random_head_params(HV, K, generator=gen)
    caches = random_ring_caches(S, H, HV, K, V, L, generator=gen)
    out = torch.full((B, 1, HV, V), 7.0, dtype=inp.mixed_qkv.dtype)
    call = DecodeCall(inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, None, *caches, out,
                      torch.tensor([0, 2], dtype=torch.int32), torch.tensor([L - 1, 0], dtype=torch.int32), None,
                      True, None)
    dims = validate_decode(call)
    other = dataclasses.replace(plan_for(call, dims, ring_layout="sglang", cursor_table=False, advance=False),
                                use_l2norm=False)
    before = [t.clone() for t in (*caches, out)]
    with pytest.raises(ValueError, match="`use_l2norm`"):
        run_decode(call, ring_layout="sglang", plan=other)
    with pytest.raises(ValueError, match=r"replayssm_decode: `plan` must be a DecodePlan or None; got str"):
        run_decode(call, ring_layout="sglang", plan="fast")
    assert all(torch.equal(a, b) for a, b in zip(before, (*caches, out)))
