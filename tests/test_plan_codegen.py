"""What a decode launch plan compiles to, read from Helion's generated Triton code on CPU.

``load_eviction_policies`` addresses the kernel's loads by position in Helion's list and ``range_num_stages`` its
loops by Helion's loop index; a change of the kernel can move them. These tests generate the Triton code of kernel
specializations (cursor per row or per slot, batch or tiny-batch path, both state dtypes) and check where the policy,
the tensor-core products, the pipeline stages and the PDL wait land.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

import helion
from _plan_helpers import BF16, FP32, _plan
from tp_replayssm.kernels import cursor, decode
from tp_replayssm.kernels.args import decode_kernel_args
from tp_replayssm.kernels.grid import launch_config
from tp_replayssm.kernels.guard import spare_guard
from tp_replayssm.kernels.plan import DecodePlan

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))
from kernel_regs import example_call  # noqa: E402


def _codegen_plan(**changes: object) -> DecodePlan:
    """A plan of the sglang layout for ``kernel_regs.example_call``'s shapes (K = V = 128, L = 16, 8 heads), on the
    register chunks in ``[Vc, K]`` tiles, per-row cursors, the batch path; then ``changes``."""
    base = dataclasses.replace(_plan(64, 8), value_chunk=16, vector_tiles=0, tensor_core_chunks=False, chunk_stages=0,
                               tiny_batch=False, evict_state_first=False, maxnreg=None)
    return dataclasses.replace(base, **changes)


def _kernel_code(p: DecodePlan, state_dtype: torch.dtype = FP32, ring_dtype: torch.dtype = BF16) -> str:
    """Helion's generated module for the decode kernel with plan ``p`` and ``example_call``'s arguments (rings of
    ``ring_dtype``), from a fresh kernel object (bound code is cached per object)."""
    call, dims = example_call(p, "fp32" if state_dtype == FP32 else "bf16")
    call = call._replace(d_cache=call.d_cache.to(ring_dtype), k_cache=call.k_cache.to(ring_dtype))
    args = decode_kernel_args(call, dims, p, 0.1, call.force_flush, spare_guard(torch.device("cpu"))).values
    return helion.kernel(decode.replayssm_decode_kernel, config=p.config, **decode._SETTINGS).bind(
        args).to_triton_code(p.config)


def _device_lines(code: str) -> list[str]:
    """The Triton kernel's lines of Helion's generated module, without the comments that quote the source
    (the host function after it repeats the kernel's Python statements)."""
    device = code.split("\ndef replayssm_decode_kernel(")[0]
    return [line for line in device.splitlines() if not line.strip().startswith("#")]


# (state dtype, cursor per slot, tiny-batch path): every constexpr path once (codegen takes seconds a case)
CASES = [(FP32, False, False), (FP32, True, False), (FP32, False, True), (BF16, True, False), (BF16, True, True)]


@pytest.mark.parametrize("state_dtype,by_slot,tiny", CASES,
                         ids=["fp32-row-batch", "fp32-slot-batch", "fp32-row-tiny", "bf16-slot-batch",
                              "bf16-slot-tiny"])
def test_the_state_eviction_policy_lands_on_the_checkpoint_loads(state_dtype: torch.dtype, by_slot: bool,
                                                                 tiny: bool) -> None:
    evicting = _codegen_plan(value_tile=128, num_warps=4, evict_state_first=True, cursor_table=by_slot,
                             tiny_batch=tiny)
    code = _kernel_code(evicting, state_dtype)
    loads = [line.strip() for line in code.splitlines() if "tl.load(" in line]
    evicted = [line for line in loads if "evict_first" in line]
    assert len(evicted) == 3, evicted  # the first chunk, the append loop's and the flush loop's prefetch
    assert all(re.search(r"tl\.load\(state_rows \+", line) for line in evicted), evicted
    state_loads = [line for line in loads if re.search(r"tl\.load\(state_rows \+", line)]
    assert state_loads == evicted  # every checkpoint load, and nothing else
    if (state_dtype, by_slot, tiny) == CASES[0]:
        plain = _kernel_code(dataclasses.replace(evicting, evict_state_first=False), state_dtype)
        assert "evict_first" not in plain


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32-state", "bf16-state"])
def test_flush_product_on_tensor_cores_only_for_bf16_rings(state_dtype: torch.dtype) -> None:
    """A bf16 ring's flush is three bf16 MMAs (the decayed keys as hi + mid + lo parts); any other ring
    dtype keeps the rank-1 replay loop (a bf16 split of its deltas would round them)."""
    p = _codegen_plan(value_tile=128, num_warps=1)
    for ring_dtype, dots in ((BF16, 3), (FP32, 0), (torch.float16, 0)):
        code = _kernel_code(p, state_dtype, ring_dtype)
        assert code.count("tl.dot(") == dots, (ring_dtype, code.count("tl.dot("))
        # k ring loads: the prologue's [Lb, K] tile, plus one row per replayed entry without the MMAs
        assert code.count("tl.load(k_rows") == (1 if dots else 2), (ring_dtype, code.count("tl.load(k_rows"))


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32-state", "bf16-state"])
def test_tensor_core_chunks_only_for_bf16_operands(state_dtype: torch.dtype) -> None:
    """``chunks_on_tensor_cores`` changes the code only for a bf16 checkpoint with a bf16 ring: the append
    loop's two MMAs (checkpoint and ring products) and no first-chunk loads ahead of the prologue (the
    pipeline streams the chunks); an fp32 checkpoint (its bf16 rounding would lose precision) or an fp32
    ring keeps the register path."""
    p = _codegen_plan(value_tile=128, num_warps=1, chunk_stages=3)
    for ring_dtype in (BF16, FP32):
        plain = _kernel_code(p, state_dtype, ring_dtype)
        code = _kernel_code(dataclasses.replace(p, tensor_core_chunks=True), state_dtype, ring_dtype)
        flush_dots = 3 if ring_dtype == BF16 else 0
        assert plain.count("tl.dot(") == flush_dots
        taken = state_dtype == ring_dtype == BF16
        assert code.count("tl.dot(") == flush_dots + (2 if taken else 0), (state_dtype, ring_dtype)
        assert (_device_lines(code) == _device_lines(plain)) == (not taken)
        if taken:
            stages = [ln for ln in code.splitlines() if "tl.range(" in ln]
            assert sum("num_stages=3" in ln for ln in stages) == 1, stages
            # the checkpoint's loads: the pipelined chunk, then the flush loop's first chunk and prefetch
            assert code.count("tl.load(state_rows") == 3 == plain.count("tl.load(state_rows")


def test_configs_with_nested_lists_compile_to_the_same_config() -> None:
    """``loop_orders`` is a list of lists: the compiled-kernel cache key must still hash, and the kernel
    must get back exactly the config it was asked for."""
    config = helion.Config(**{**launch_config(128, 4, evict_state_first=True).config, "loop_orders": [[1, 2, 0, 3]]})
    kern = decode.decode_kernel_for(config)
    assert kern.configs[0].config == config.config
    assert decode.decode_kernel_for(config) is kern


@pytest.mark.parametrize("capability", [(9, 0), None], ids=["sm90", "no-gpu"])
def test_pdl_waits_before_any_load(capability: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch (decode and cursor-advance kernels): for an sm_90 target the kernel is
    launched with ``launch_pdl`` and its first statement waits for the previous kernel (``gdc_wait``)
    before any load, then lets the next one launch; without a capability (CPU, interpreter) neither is
    emitted. A load ahead of the wait could read what the previous kernel has not written yet."""
    import helion._compiler.compile_environment as compile_environment

    monkeypatch.setattr(compile_environment, "target_device_capability", lambda device=None: capability)
    cached = cursor.advance_kernel_for(32, 4)  # a fresh kernel object: bound code is cached per object
    advance = helion.kernel(cursor.cursor_advance_kernel, config=cached.configs[0], **cursor._SETTINGS)
    cursors, slots = torch.zeros(9, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    codes = [_kernel_code(_codegen_plan(value_tile=32, num_warps=4)),
             advance.bind((cursors, slots, torch.zeros(4, dtype=torch.int32), torch.zeros(20, dtype=torch.int32),
                           torch.zeros(1, dtype=torch.int32), 4)).to_triton_code(advance.configs[0])]
    for code in codes:
        lines = code.splitlines()
        wait = [i for i, line in enumerate(lines) if "gdc_wait()" in line]
        trigger = [i for i, line in enumerate(lines) if "gdc_launch_dependents()" in line]
        loads = [i for i, line in enumerate(lines) if "tl.load(" in line]
        assert loads
        if capability is None:
            assert not wait and not trigger and "launch_pdl" not in code
        else:
            assert len(wait) == 1 and len(trigger) == 1 and wait[0] < trigger[0] < loads[0]
            assert "launch_pdl=True" in code


@pytest.mark.parametrize("lower_bound, capped", [(-5.0, False), (None, False), (None, True)],
                         ids=["mode1-bounded", "mode2-rebase-flush-branch", "mode3-rebase-pass"])
def test_predecayed_modes_pipeline_the_append_chunk_loop(lower_bound: float | None, capped: bool) -> None:
    """``range_num_stages`` goes by Helion's loop index: a loop added to the kernel can move the 3 stages off the
    tensor-core append loop (a rebase loop once did: +13% at HV8 B128 bf16 on the H200). In every pre-decayed
    kernel (``predecayed_ring`` 1, 2 and 3) the first chunk loop, the append rows', is the pipelined one."""
    mode = 1 if lower_bound is not None else 3 if capped else 2
    p = _codegen_plan(value_tile=128, num_warps=1, chunk_stages=3, tensor_core_chunks=True, predecayed_ring=mode,
                      use_lower_bound=lower_bound is not None, maxnreg=168 if capped else None)
    code = _kernel_code(p, BF16, BF16)
    stages = [ln for ln in code.splitlines() if "tl.range(" in ln]
    assert "num_stages=3" in stages[0] and sum("num_stages=3" in ln for ln in stages) == 1, stages
    assert ("tl.debug_barrier()" in code) == (lower_bound is None)  # the rebase's barrier only where it can fire
