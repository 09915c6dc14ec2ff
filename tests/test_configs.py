"""The pinned launch choices (:mod:`tp_replayssm.configs`), read from Helion's generated code on CPU.

``load_eviction_policies`` addresses the kernel's loads by position in Helion's list; a change of the
kernel can move them. These tests generate the Triton code of every kernel specialization (cursor per
row or per slot, batch or tiny-batch path, both state dtypes) and check that the policy lands on the two
checkpoint-chunk loads and nowhere else.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

import helion
from tp_replayssm import configs, kernel, ops
from tp_replayssm._validation import DecodeDims
from tp_replayssm.testing import example_kernel_args


def _device_lines(code: str) -> list[str]:
    """The Triton kernel's lines of Helion's generated module, without the comments that quote the source
    (the host function after it repeats the kernel's Python statements)."""
    device = code.split("\ndef replayssm_decode_kernel(")[0]
    return [line for line in device.splitlines() if not line.strip().startswith("#")]


def _kernel_code(config: helion.Config, **example_args: object) -> str:
    """Helion's generated module for the decode kernel at ``config`` and
    ``example_kernel_args(**example_args)``, from a fresh kernel object (bound code is cached per object)."""
    return helion.kernel(kernel.replayssm_decode_kernel, config=config, **kernel._SETTINGS).bind(
        example_kernel_args(**example_args)).to_triton_code(config)


def _generated_code(config: helion.Config, chunk: int, state_dtype: torch.dtype, by_slot: bool, tiny: bool) -> str:
    return _kernel_code(config, state_dtype=state_dtype, value_chunk=chunk, cursors_by_slot=by_slot, tiny=tiny)


# (state dtype, cursor per slot, tiny-batch path): every constexpr path once (codegen takes ~7 s a case)
CASES = [(torch.float32, False, False), (torch.float32, True, False), (torch.float32, False, True),
         (torch.bfloat16, True, False), (torch.bfloat16, True, True)]


@pytest.mark.parametrize("state_dtype,by_slot,tiny", CASES,
                         ids=["fp32-row-batch", "fp32-slot-batch", "fp32-row-tiny", "bf16-slot-batch",
                              "bf16-slot-tiny"])
def test_the_state_eviction_policy_lands_on_the_checkpoint_loads(state_dtype: torch.dtype, by_slot: bool,
                                                                 tiny: bool) -> None:
    config = configs.launch_config(128, 4, evict_state_first=True)
    code = _generated_code(config, 16, state_dtype, by_slot, tiny)
    loads = [line.strip() for line in code.splitlines() if "tl.load(" in line]
    evicted = [line for line in loads if "evict_first" in line]
    assert len(evicted) == 3, evicted  # the first chunk, the append loop's and the flush loop's prefetch
    assert all(re.search(r"tl\.load\(state_rows \+", line) for line in evicted), evicted
    state_loads = [line for line in loads if re.search(r"tl\.load\(state_rows \+", line)]
    assert state_loads == evicted  # every checkpoint load, and nothing else
    if (state_dtype, by_slot, tiny) == CASES[0]:
        plain = _generated_code(configs.launch_config(128, 4), 16, state_dtype, by_slot, tiny)
        assert "evict_first" not in plain


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
def test_flush_product_on_tensor_cores_only_for_bf16_rings(state_dtype: torch.dtype) -> None:
    """A bf16 ring's flush is three bf16 MMAs (the decayed keys as hi + mid + lo parts); any other ring
    dtype keeps the rank-1 replay loop (a bf16 split of its deltas would round them)."""
    config = configs.launch_config(128, 1)
    for ring_dtype, dots in ((torch.bfloat16, 3), (torch.float32, 0), (torch.float16, 0)):
        code = _kernel_code(config, state_dtype=state_dtype, value_chunk=16, ring_dtype=ring_dtype)
        assert code.count("tl.dot(") == dots, (ring_dtype, code.count("tl.dot("))
        # k ring loads: the prologue's [Lb, K] tile, plus one row per replayed entry without the MMAs
        assert code.count("tl.load(k_rows") == (1 if dots else 2), (ring_dtype, code.count("tl.load(k_rows"))


def test_only_wide_keys_pin_the_eviction_policy() -> None:
    """Evict-first checkpoint loads only on the 4-warp programs of keys wider than 128. One-warp programs
    load without hints: an fp32 checkpoint measured faster without them since the tensor-core flush, and
    a bf16 checkpoint from 1024 pairs up takes the tensor-core chunks, where they changed nothing."""
    dev = torch.device("cuda", 0)
    for batch, heads in ((512, 32), (512, 8), (128, 32), (64, 32), (16, 32), (8, 32), (1, 8)):
        dims = DecodeDims(batch, heads, heads, 128, 128, 16, batch)
        for state in (torch.float32, torch.bfloat16):
            config = configs.select_config(dims, state, dev).config
            assert "load_eviction_policies" not in config.config, (batch, heads, state)
    wide = configs.select_config(DecodeDims(512, 32, 32, 256, 128, 16, 512), torch.float32, dev).config
    assert [i for i, p in enumerate(wide.config["load_eviction_policies"]) if p] == list(configs.STATE_LOADS)
    cpu_config = configs.select_config(DecodeDims(512, 32, 32, 128, 128, 16, 512), torch.float32,
                                       torch.device("cpu")).config
    assert "load_eviction_policies" not in cpu_config.config  # the interpreter's choice is unchanged


# (batch, value heads) -> whether the tensor-core grid (one program per pair) is capped at 168 registers:
# where 12 programs per SM take fewer waves of the H200's 132 SMs than 8 do (1056 / 1584 programs a wave)
CAPPED_GRIDS = {(512, 32): True, (512, 12): True, (512, 8): True, (128, 32): True, (128, 16): False,
                (128, 12): True, (128, 8): False, (32, 32): False}


def test_tensor_core_chunks_regime() -> None:
    """The tensor-core chunk path (``mma_chunks``) from 1024 (row, head) pairs up, only when the checkpoint
    and the d ring are both bf16 (exact MMA operands), with its loop software-pipelined (3 stages) and a
    168-register cap where it saves a wave; every other choice keeps unpipelined loops and no cap, but the fp32
    register path's grids that the cap fits into one wave (HV12 B128: 1536 programs), which take it with 8-row
    chunks."""
    dev = torch.device("cuda", 0)
    small = ((32, 12), (64, 8), (16, 32), (8, 32), (1, 8))
    for batch, heads in [*CAPPED_GRIDS, *small]:
        dims = DecodeDims(batch, heads, heads, 128, 128, 16, batch)
        for state, ring in itertools.product((torch.float32, torch.bfloat16), (torch.float32, torch.bfloat16)):
            choice = configs.select_config(dims, state, dev, ring)
            mma = state == ring == torch.bfloat16 and batch * heads >= 1024
            assert choice.mma_chunks == mma, (batch, heads, state, ring)
            assert choice.config.config["range_num_stages"] == [0, 3 if mma else 0, 0]
            one_wave = not mma and state == torch.float32 and batch * heads == 1536
            capped = (mma and CAPPED_GRIDS[batch, heads]) or one_wave
            assert choice.maxnreg == (168 if capped else None), (batch, heads, state, ring)
            assert choice.value_chunk == (8 if one_wave else 16), (batch, heads, state, ring)
    wide = configs.select_config(DecodeDims(512, 32, 32, 256, 128, 16, 512), torch.bfloat16, dev)
    assert not wide.mma_chunks and wide.maxnreg is None


def test_launch_config_is_one_object_per_choice_however_spelled() -> None:
    """The op caches compiled kernels by config identity, so a choice named positionally, by keyword or with its
    defaults spelled out (``select_config``, the benchmarks' forced choices) must be the same object."""
    base = configs.launch_config(32, 1)
    assert base is configs.launch_config(32, 1, None, False, 0) is configs.launch_config(vt=32, warps=1, chunk_stages=0)
    assert base is configs.launch_config(32, 1, evict_state_first=False) is not configs.launch_config(32, 1, 2)
    assert configs.launch_config(64, 1, chunk_stages=3) is configs.launch_config(64, 1, None, False, 3)


def test_small_grids_one_chunk_per_program_one_warp_from_96_pairs_or_16_pre_decayed() -> None:
    """Below 16 (row, head) pairs the tiny-batch programs (16 value rows, 4 warps) in both layouts. The SPEC layout:
    from 16 pairs 4-warp programs of 32 value rows in one chunk, so all of a program's checkpoint loads leave before
    its ring prologue, from 64 pairs 64 rows in two chunks (as keys wider than 128 take in both layouts), from
    ``ONE_WARP_FROM`` (96) pairs one-warp programs: a bf16 checkpoint one 16-row tile each while that grid fits one
    wave (132 pairs on 132 SMs), fp32 16-row chunks over 32 rows. The pre-decayed layout: one-warp programs from
    ``ONE_WARP_FROM_PREDECAYED`` (16) pairs, one 16-row tile each while that grid fits one wave, then 32 rows."""
    assert configs.ONE_WARP_FROM == 96 and configs.ONE_WARP_FROM_PREDECAYED == configs.TINY_BATCH_BELOW == 16
    dev = torch.device("cuda", 0)
    tiny, one_chunk, two_chunks = (16, 16, 4), (32, 32, 4), (64, 32, 4)
    one_warp, one_row_tile = (32, 16, 1), (16, 16, 1)
    # (batch, heads): the SPEC layout with an fp32 / a bf16 checkpoint, then the pre-decayed layout (either state)
    expect = {(1, 8): (tiny,) * 3, (3, 5): (tiny,) * 3, (1, 16): (one_chunk, one_chunk, one_row_tile),
              (1, 32): (one_chunk, one_chunk, one_row_tile), (8, 4): (one_chunk, one_chunk, one_row_tile),
              (8, 8): (two_chunks, two_chunks, one_row_tile), (2, 32): (two_chunks, two_chunks, one_row_tile),
              (5, 19): (two_chunks, two_chunks, one_row_tile), (8, 12): (one_warp, one_row_tile, one_row_tile),
              (4, 24): (one_warp, one_row_tile, one_row_tile), (8, 16): (one_warp, one_row_tile, one_row_tile),
              (4, 33): (one_warp, one_row_tile, one_row_tile), (7, 19): (one_warp,) * 3, (8, 32): (one_warp,) * 3}
    cases = ((False, torch.float32), (False, torch.bfloat16), (True, torch.float32), (True, torch.bfloat16))
    for (batch, heads), (spec_fp32, spec_bf16, predecayed_any) in expect.items():
        for (predecayed, state), want in zip(cases, (spec_fp32, spec_bf16, predecayed_any, predecayed_any)):
            c = configs.select_config(DecodeDims(batch, heads, heads, 128, 128, 16, batch), state, dev,
                                      predecayed=predecayed)
            got = (c.config.config["block_sizes"][0], c.value_chunk, c.config.config["num_warps"])
            assert got == want and c.maxnreg is None and not c.mma_chunks, (batch, heads, predecayed, state, got)
    for predecayed in (False, True):
        wide = configs.select_config(DecodeDims(8, 8, 8, 256, 128, 16, 8), torch.float32, dev, predecayed=predecayed)
        assert (wide.config.config["block_sizes"][0], wide.value_chunk, wide.config.config["num_warps"]) == two_chunks


def test_grid_rules_count_waves_of_the_devices_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Value tile and register cap follow the device's multiprocessor count. With the H200's 132 SMs (one
    wave: 1056 uncapped one-warp programs, 1584 capped) 256 pairs take vt 32 and 2048 tensor-core programs
    no cap (two waves either way); with 66 SMs (528 / 792) vt 32 would make two waves, so 256 pairs take vt
    64, and 2048 programs take the cap (3 waves instead of 4). 1536 programs are capped on both; on the fp32
    register path only where the cap makes them one wave (132 SMs, not 66)."""
    dev = torch.device("cuda", 0)
    if not torch.cuda.is_available():
        assert configs._sm_count(dev) == 132  # the H200's, where no GPU answers

    def choice(batch: int, heads: int, state: torch.dtype = torch.bfloat16) -> tuple[int, int | None]:
        c = configs.select_config(DecodeDims(batch, heads, heads, 128, 128, 16, batch), state, dev)
        return c.config.config["block_sizes"][0], c.maxnreg

    for sms, expected in ((132, [(32, None), (128, None), (128, 168), (128, 168)]),
                          (66, [(64, None), (128, 168), (128, 168), (128, None)])):
        monkeypatch.setattr(configs, "_sm_count", lambda device, n=sms: n)
        assert [choice(32, 8, torch.float32), choice(128, 16), choice(128, 12), choice(128, 12, torch.float32)] \
            == expected, sms


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
def test_tensor_core_chunks_only_for_bf16_operands(state_dtype: torch.dtype) -> None:
    """``chunks_on_tensor_cores`` changes the code only for a bf16 checkpoint with a bf16 ring: the append
    loop's two MMAs (checkpoint and ring products) and no first-chunk loads ahead of the prologue (the
    pipeline streams the chunks); an fp32 checkpoint (its bf16 rounding would lose precision) or an fp32
    ring keeps the register path."""
    config = configs.launch_config(128, 1, chunk_stages=3)
    for ring_dtype in (torch.bfloat16, torch.float32):
        plain = _kernel_code(config, state_dtype=state_dtype, ring_dtype=ring_dtype)
        code = _kernel_code(config, state_dtype=state_dtype, ring_dtype=ring_dtype, mma_chunks=True)
        flush_dots = 3 if ring_dtype == torch.bfloat16 else 0
        assert plain.count("tl.dot(") == flush_dots
        taken = state_dtype == ring_dtype == torch.bfloat16
        assert code.count("tl.dot(") == flush_dots + (2 if taken else 0), (state_dtype, ring_dtype)
        assert (_device_lines(code) == _device_lines(plain)) == (not taken)
        if taken:
            stages = [ln for ln in code.splitlines() if "tl.range(" in ln]
            assert sum("num_stages=3" in ln for ln in stages) == 1, stages
            # the checkpoint's loads: the pipelined chunk, then the flush loop's first chunk and prefetch
            assert code.count("tl.load(state_rows") == 3 == plain.count("tl.load(state_rows")


def test_configs_with_nested_lists_compile_to_the_same_config() -> None:
    """``loop_orders`` is a list of lists: the compiled-kernel cache key must still hash, and the kernel
    must get back exactly the config it was asked for (the sixth session's sweep failed on this)."""
    config = helion.Config(**{**configs.launch_config(128, 4, evict_state_first=True).config,
                              "loop_orders": [[1, 2, 0, 3]]})
    kern = kernel.decode_kernel_for(config)
    assert kern.configs[0].config == config.config
    assert kernel.decode_kernel_for(config) is kern


def _device_code(kern, args: tuple, config: helion.Config) -> str:  # noqa: ANN001 - a Helion kernel
    return kern.bind(args).to_triton_code(config)


@pytest.mark.parametrize("capability", [(9, 0), None], ids=["sm90", "no-gpu"])
def test_pdl_waits_before_any_load(capability: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch (decode and cursor-advance kernels): for an sm_90 target the kernel is
    launched with ``launch_pdl`` and its first statement waits for the previous kernel (``gdc_wait``)
    before any load, then lets the next one launch; without a capability (CPU, interpreter) neither is
    emitted. A load ahead of the wait could read what the previous kernel has not written yet."""
    import helion._compiler.compile_environment as compile_environment

    from tp_replayssm import cursor_kernel

    monkeypatch.setattr(compile_environment, "target_device_capability", lambda device=None: capability)
    decode_config = configs.launch_config(32, 4)
    cached = cursor_kernel.advance_kernel_for(32, 4)  # a fresh kernel object: bound code is cached per object
    advance = helion.kernel(cursor_kernel.cursor_advance_kernel, config=cached.configs[0], **cursor_kernel._SETTINGS)
    cursors, slots = torch.zeros(9, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    codes = [_kernel_code(decode_config, value_chunk=16),
             _device_code(advance, (cursors, slots, torch.zeros(4, dtype=torch.int32), 4), advance.configs[0])]
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
    kernel (``ops.predecayed_mode`` 1, 2 and 3) the first chunk loop, the append rows', is the pipelined one."""
    code = _kernel_code(configs.launch_config(128, 1, chunk_stages=3), state_dtype=torch.bfloat16,
                        ring_dtype=torch.bfloat16, mma_chunks=True, predecayed=True, lower_bound=lower_bound,
                        rebase_pass=capped)
    stages = [ln for ln in code.splitlines() if "tl.range(" in ln]
    assert "num_stages=3" in stages[0] and sum("num_stages=3" in ln for ln in stages) == 1, stages
    assert ("tl.debug_barrier()" in code) == (lower_bound is None)  # the rebase's barrier only where it can fire


def test_rebase_pass_follows_the_register_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebase runs as a pass of its own exactly in the register-capped launches (``configs.rebase_pass``),
    unless a benchmark forces the form (``FORCED_REBASE_PASS``)."""
    dev = torch.device("cuda", 0)
    capped = configs.select_config(DecodeDims(512, 32, 32, 128, 128, 16, 512), torch.bfloat16, dev)
    plain = configs.select_config(DecodeDims(128, 8, 8, 128, 128, 16, 128), torch.bfloat16, dev)
    assert capped.maxnreg == 168 and plain.maxnreg is None
    assert configs.rebase_pass(capped) and not configs.rebase_pass(plain)
    for forced in (True, False):
        monkeypatch.setattr(configs, "FORCED_REBASE_PASS", forced)
        assert configs.rebase_pass(capped) == configs.rebase_pass(plain) == forced


def test_predecayed_mode_compiles_the_rebase_check_only_where_a_rebase_can_happen() -> None:
    """Mode 1 (no check) exactly when ``(L-1) * |lower_bound| <= 75``; the softplus gate and weaker bounds get the
    check, with the rebase through the flush branch (2) or, in register-capped programs, as a pass of its own (3).
    Every mode shares the launch choice, register cap included (``test_tensor_core_chunks_regime``)."""
    mode = ops.predecayed_mode
    assert mode(True, None, 16) == 2 and mode(True, -5.0, 16) == 1 and mode(False, None, 16) == 0
    assert mode(True, -5.4, 16) == 2 and mode(True, -10.0, 8) == 1 and mode(True, -10.8, 8) == 2
    assert mode(True, None, 16, True) == 3 and mode(True, -5.4, 16, True) == 3
    assert mode(True, -5.0, 16, True) == 1 and mode(False, None, 16, True) == 0
