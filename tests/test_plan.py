"""The decode launch plan (:mod:`tp_replayssm.kernels.plan`): the library's plan per regime, its checks, and what it
compiles to, read from Helion's generated code on CPU.

``plan_decode`` maps a call's problem to a frozen :class:`DecodePlan`; the rules and the H200 measurements behind them
are in ``docs/tuning.md``. The GPU plans are planned here for an H200 (132 SMs where no GPU answers).
``load_eviction_policies`` addresses the kernel's loads by position in Helion's list; a change of the kernel can move
them. The code tests generate the Triton code of kernel specializations (cursor per row or per slot, batch or
tiny-batch path, both state dtypes) and check where the policy, the tensor-core products, the pipeline stages and the
PDL wait land.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import sys
from pathlib import Path

import pytest
import torch

import helion
from tp_replayssm.kernels import cursor, decode, grid, plan
from tp_replayssm.kernels.args import decode_kernel_args
from tp_replayssm.kernels.guard import spare_guard
from tp_replayssm.kernels.grid import launch_config
from tp_replayssm.kernels.plan import DecodePlan, DecodeProblem, plan_decode, problem_of
from tp_replayssm.validation import DecodeDims

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))
from kernel_regs import example_call  # noqa: E402

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
BF16, FP32 = torch.bfloat16, torch.float32


def _problem(batch: int, heads: int, *, key_dim: int = 128, value_dim: int = 128, ring_length: int = 16,
             state: torch.dtype = FP32, ring: torch.dtype = BF16, layout: str = "sglang",
             device: torch.device = CUDA, lower_bound: float | None = None, cursor_table: bool = False,
             advance: bool = False, q_heads: int | None = None) -> DecodeProblem:
    """The problem of a call of ``batch`` rows over ``heads`` value heads (as many q/k heads unless ``q_heads``)."""
    dims = DecodeDims(batch, q_heads or heads, heads, key_dim, value_dim, ring_length, batch)
    return problem_of(dims, state_dtype=state, cache_dtype=ring, device=device, ring_layout=layout,
                      cursor_table=cursor_table, advance=advance, use_l2norm=True, lower_bound=lower_bound)


def _plan(batch: int, heads: int, **kwargs: object) -> DecodePlan:
    return plan_decode(_problem(batch, heads, **kwargs))


def _grid(p: DecodePlan) -> tuple[int, int, int]:
    """``(value tile, value chunk, warps)``, as the plan's config carries them."""
    assert p.config.config["block_sizes"] == [p.value_tile] and p.config.config["num_warps"] == p.num_warps
    return p.value_tile, p.value_chunk, p.num_warps


# ---------------------------------------------------------------- the plan per regime


def test_gpu_plan_is_stable_and_cached() -> None:
    """The value-tile rule of the GPU plans, and one object per plan and per config (compiled kernels are cached by
    config identity, so a fresh object per call would grow that cache forever)."""

    def tiles(batch: int, hv: int, v: int = 128, k: int = 128, state: torch.dtype = FP32) -> tuple[int, int, int]:
        p = _plan(batch, hv, value_dim=v, key_dim=k, state=state)
        again = _plan(batch, hv, value_dim=v, key_dim=k, state=state)
        assert p is again and p.config is again.config and (p.maxnreg is None or (p.tensor_core_chunks and
                                                                                 p.maxnreg == 168))
        assert p.tensor_core_chunks == (state == BF16 and batch * hv >= 1024 and k <= 128)
        vt, chunk, warps = _grid(p)
        assert chunk <= vt and vt % chunk == 0
        return vt, chunk, warps

    # (value tile, value chunk, warps) per regime of B * HV (docs/tuning.md); one-warp programs take the narrowest
    # value tile whose grid fits one wave (132 SMs x 8 = 1056 programs)
    assert [tiles(1, 8), tiles(1, 32), tiles(8, 8), tiles(8, 32), tiles(16, 32), tiles(32, 32),
            tiles(512, 32)] == [(16, 16, 4), (32, 32, 4), (64, 32, 4), (32, 16, 1), (64, 16, 1), (128, 16, 1),
                                (128, 16, 1)]
    # 384 pairs: vt 32 would make 1536 programs; 792 pairs: vt 64 would make 1584; 272: vt 32, 1088
    assert tiles(32, 12) == (64, 16, 1) and tiles(66, 12) == (128, 16, 1) and tiles(34, 8) == (64, 16, 1)
    assert tiles(512, 32, v=64) == (64, 16, 1)
    assert tiles(512, 32, state=BF16) == (128, 16, 1)
    # keys wider than 128 keep 4-warp programs (one warp's [16, K] tiles would spill), 8 KiB chunks
    assert tiles(512, 32, k=256) == (128, 16, 4) and tiles(512, 32, k=256, state=BF16) == (128, 16, 4)
    assert tiles(8, 32, k=256) == (64, 16, 2)
    cpu = plan_decode(_problem(4, 4, q_heads=2, key_dim=16, value_dim=16, ring_length=4, device=CPU))
    assert cpu.config.config["indexing"] == "pointer" and cpu.value_chunk < cpu.value_tile


def test_tiny_batch_path_only_below_the_threshold() -> None:
    batch = grid.TINY_BATCH_BELOW // 4 - 1  # 4 value heads a row
    assert _plan(batch, 4, q_heads=2).tiny_batch
    assert not _plan(grid.TINY_BATCH_BELOW // 4, 4, q_heads=2).tiny_batch


def test_vector_tiles_only_for_one_warp_register_chunks() -> None:
    """``DecodePlan.vector_tiles``: one-warp programs without tensor-core chunks (2, the pre-decayed key tiles too,
    where a program has one chunk), except fp32 checkpoints over value tiles below 64 rows (slower there on the
    H200), and keys of a power-of-two width only. An edited plan may put them on other programs, but never on
    tensor-core chunks or on such keys (``DecodePlan.check``)."""
    def tiles(vt: int, warps: int, dtype: torch.dtype, mma: bool = False, K: int = 128) -> int:
        return grid._vector_tiles(_problem(64, 8, key_dim=K, state=dtype), vt, 16, warps, mma)

    assert [tiles(64, 1, BF16), tiles(32, 1, BF16), tiles(16, 1, BF16)] == [1, 1, 2]
    assert [tiles(128, 1, FP32), tiles(64, 1, FP32), tiles(32, 1, FP32), tiles(16, 1, FP32)] == [1, 1, 0, 0]
    assert tiles(16, 1, BF16, K=64) == 2 and tiles(16, 1, BF16, K=96) == 0
    assert tiles(16, 4, BF16) == tiles(64, 2, BF16) == tiles(128, 1, BF16, mma=True) == 0

    def edited(problem: DecodeProblem, tiles: int) -> DecodePlan:
        p = dataclasses.replace(plan_decode(problem), vector_tiles=tiles)
        p.check(problem)
        return p

    four_warps = _problem(1, 8, state=FP32)
    assert plan_decode(four_warps).num_warps == 4 and edited(four_warps, 2).vector_tiles == 2
    mma = _problem(512, 32, state=BF16)
    assert plan_decode(mma).tensor_core_chunks
    with pytest.raises(ValueError, match="`vector_tiles` and `tensor_core_chunks`"):
        edited(mma, 2)
    with pytest.raises(ValueError, match=r"`vector_tiles`.*K=24"):
        edited(_problem(1, 8, key_dim=24, state=FP32), 2)
    one_warp = _problem(8, 16, state=BF16)
    assert plan_decode(one_warp).vector_tiles == 2 and edited(one_warp, 0).vector_tiles == 0


def test_only_wide_keys_pin_the_eviction_policy() -> None:
    """Evict-first checkpoint loads only on the 4-warp programs of keys wider than 128. One-warp programs
    load without hints: with the tensor-core flush an fp32 checkpoint measures faster without them, and a bf16
    checkpoint from 1024 pairs up takes the tensor-core chunks, where they change nothing."""
    for batch, heads in ((512, 32), (512, 8), (128, 32), (64, 32), (16, 32), (8, 32), (1, 8)):
        for state in (FP32, BF16):
            p = _plan(batch, heads, state=state)
            assert not p.evict_state_first and "load_eviction_policies" not in p.config.config, (batch, heads, state)
    wide = _plan(512, 32, key_dim=256).config
    assert [i for i, policy in enumerate(wide.config["load_eviction_policies"]) if policy] == list(grid.STATE_LOADS)
    cpu_config = _plan(512, 32, device=CPU).config
    assert "load_eviction_policies" not in cpu_config.config  # the interpreter's plan is unchanged


# (batch, value heads) -> whether the tensor-core grid (one program per pair) is capped at 168 registers:
# where 12 programs per SM take fewer waves of the H200's 132 SMs than 8 do (1056 / 1584 programs a wave)
CAPPED_GRIDS = {(512, 32): True, (512, 12): True, (512, 8): True, (128, 32): True, (128, 16): False,
                (128, 12): True, (128, 8): False, (32, 32): False}


def test_tensor_core_chunks_regime() -> None:
    """The tensor-core chunk path (``tensor_core_chunks``) from 1024 (row, head) pairs up, only when the checkpoint
    and the d ring are both bf16 (exact MMA operands), with its loop software-pipelined (3 stages) and a
    168-register cap where it saves a wave; every other plan keeps unpipelined loops and no cap, but the fp32
    register path's grids that the cap fits into one wave (HV12 B128: 1536 programs), which take it with 8-row
    chunks."""
    small = ((32, 12), (64, 8), (16, 32), (8, 32), (1, 8))
    for batch, heads in [*CAPPED_GRIDS, *small]:
        for state, ring in itertools.product((FP32, BF16), (FP32, BF16)):
            p = _plan(batch, heads, state=state, ring=ring)
            mma = state == ring == BF16 and batch * heads >= 1024
            assert p.tensor_core_chunks == mma, (batch, heads, state, ring)
            assert p.config.config["range_num_stages"] == [0, 3 if mma else 0, 0]
            one_wave = not mma and state == FP32 and batch * heads == 1536
            capped = (mma and CAPPED_GRIDS[batch, heads]) or one_wave
            assert p.maxnreg == (168 if capped else None), (batch, heads, state, ring)
            assert p.value_chunk == (8 if one_wave else 16), (batch, heads, state, ring)
    wide = _plan(512, 32, key_dim=256, state=BF16)
    assert not wide.tensor_core_chunks and wide.maxnreg is None


# the DecodePlan fields that make the Helion config or the launch (launch_config, the register cap), not a constexpr;
# the kernel's constexprs that take another field's name (field -> constexpr)
CONFIG_FIELDS = {"value_tile", "num_warps", "maxnreg", "chunk_stages", "evict_state_first"}
RENAMED = {"cursor_table": "cursors_by_slot", "tensor_core_chunks": "chunks_on_tensor_cores",
           "advance_readers": "advance_cursors"}


def test_every_plan_field_reaches_the_kernel() -> None:
    """A field of ``DecodePlan`` is either part of the launch's config or one of the kernel's constexprs
    (``DecodePlan.constexprs()``), and every constexpr is a parameter of ``replayssm_decode_kernel``: the launch's
    argument builder passes only the kernel's parameters, so a field left out of ``constexprs()`` or a constexpr the
    kernel does not take would be dropped without an error (DEVELOPERS.md, "Plan choices that wait for the H200")."""
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


def test_small_grids_one_chunk_per_program_one_warp_from_96_pairs_or_16_pre_decayed() -> None:
    """Below 16 (row, head) pairs the tiny-batch programs (16 value rows, 4 warps) in both layouts. The sglang
    layout: from 16 pairs 4-warp programs of 32 value rows in one chunk, so all of a program's checkpoint loads leave
    before its ring prologue, from 64 pairs 64 rows in two chunks (as keys wider than 128 take in both layouts), from
    ``ONE_WARP_FROM`` (96) pairs one-warp programs: a bf16 checkpoint one 16-row tile each while that grid fits one
    wave (132 pairs on 132 SMs), fp32 16-row chunks over 32 rows. The pre-decayed layout: one-warp programs from
    ``ONE_WARP_FROM_PREDECAYED`` (16) pairs, one 16-row tile each while that grid fits one wave, then 32 rows."""
    assert grid.ONE_WARP_FROM == 96 and grid.ONE_WARP_FROM_PREDECAYED == grid.TINY_BATCH_BELOW == 16
    tiny, one_chunk, two_chunks = (16, 16, 4), (32, 32, 4), (64, 32, 4)
    one_warp, one_row_tile = (32, 16, 1), (16, 16, 1)
    # (batch, heads): the sglang layout with an fp32 / a bf16 checkpoint, then the pre-decayed layout (either state)
    expect = {(1, 8): (tiny,) * 3, (3, 5): (tiny,) * 3, (1, 16): (one_chunk, one_chunk, one_row_tile),
              (1, 32): (one_chunk, one_chunk, one_row_tile), (8, 4): (one_chunk, one_chunk, one_row_tile),
              (8, 8): (two_chunks, two_chunks, one_row_tile), (2, 32): (two_chunks, two_chunks, one_row_tile),
              (5, 19): (two_chunks, two_chunks, one_row_tile), (8, 12): (one_warp, one_row_tile, one_row_tile),
              (4, 24): (one_warp, one_row_tile, one_row_tile), (8, 16): (one_warp, one_row_tile, one_row_tile),
              (4, 33): (one_warp, one_row_tile, one_row_tile), (7, 19): (one_warp,) * 3, (8, 32): (one_warp,) * 3}
    cases = (("sglang", FP32), ("sglang", BF16), ("predecayed", FP32), ("predecayed", BF16))
    for (batch, heads), (sglang_fp32, sglang_bf16, predecayed_any) in expect.items():
        for (layout, state), want in zip(cases, (sglang_fp32, sglang_bf16, predecayed_any, predecayed_any)):
            p = _plan(batch, heads, state=state, layout=layout)
            got = _grid(p)
            assert got == want and p.maxnreg is None and not p.tensor_core_chunks, (batch, heads, layout, state, got)
    for layout in ("sglang", "predecayed"):
        assert _grid(_plan(8, 8, key_dim=256, layout=layout)) == two_chunks


def test_grid_rules_count_waves_of_the_devices_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Value tile and register cap follow the device's multiprocessor count. With the H200's 132 SMs (one
    wave: 1056 uncapped one-warp programs, 1584 capped) 256 pairs take vt 32 and 2048 tensor-core programs
    no cap (two waves either way); with 66 SMs (528 / 792) vt 32 would make two waves, so 256 pairs take vt
    64, and 2048 programs take the cap (3 waves instead of 4). 1536 programs are capped on both; on the fp32
    register path only where the cap makes them one wave (132 SMs, not 66)."""
    if not torch.cuda.is_available():
        assert grid._sm_count(CUDA) == grid.H200_SMS == 132  # the H200's, where no GPU answers

    def choice(batch: int, heads: int, state: torch.dtype = BF16) -> tuple[int, int | None]:
        p = _plan(batch, heads, state=state)
        return p.value_tile, p.maxnreg

    for sms, expected in ((132, [(32, None), (128, None), (128, 168), (128, 168)]),
                          (66, [(64, None), (128, 168), (128, 168), (128, None)])):
        monkeypatch.setattr(plan, "_sm_count", lambda device, n=sms: n)
        assert [choice(32, 8, FP32), choice(128, 16), choice(128, 12), choice(128, 12, FP32)] == expected, sms


def test_rebase_pass_follows_the_register_cap() -> None:
    """Where a rebase can happen, it runs as a pass of its own (``predecayed_ring`` 3) exactly in the
    register-capped plans, else through the flush branch (2); a benchmark that wants the other form edits the plan,
    which the call accepts either way."""
    capped = _problem(512, 32, state=BF16, layout="predecayed")
    plain = _problem(128, 8, state=BF16, layout="predecayed")
    assert plan_decode(capped).maxnreg == 168 and plan_decode(plain).maxnreg is None
    assert plan_decode(capped).predecayed_ring == 3 and plan_decode(plain).predecayed_ring == 2
    for problem in (capped, plain):
        for mode in (2, 3):
            dataclasses.replace(plan_decode(problem), predecayed_ring=mode).check(problem)


def test_predecayed_mode_compiles_the_rebase_check_only_where_a_rebase_can_happen() -> None:
    """Mode 1 (no check) exactly when ``(L-1) * |lower_bound| <= 75``; the softplus gate and weaker bounds get the
    check, with the rebase through the flush branch (2) or, in register-capped programs, as a pass of its own (3).
    Every mode shares the launch grid, register cap included (``test_tensor_core_chunks_regime``)."""
    def mode(predecayed: bool, lower_bound: float | None, ring_length: int, capped: bool = False) -> int:
        batch, heads = (512, 32) if capped else (128, 8)
        p = _plan(batch, heads, state=BF16, layout="predecayed" if predecayed else "sglang",
                  lower_bound=lower_bound, ring_length=ring_length)
        sglang = _plan(batch, heads, state=BF16, lower_bound=lower_bound, ring_length=ring_length)
        assert (p.maxnreg is not None) == capped and (p.maxnreg, p.value_tile) == (sglang.maxnreg, sglang.value_tile)
        return p.predecayed_ring

    assert mode(True, None, 16) == 2 and mode(True, -5.0, 16) == 1 and mode(False, None, 16) == 0
    assert mode(True, -5.4, 16) == 2 and mode(True, -10.0, 8) == 1 and mode(True, -10.8, 8) == 2
    assert mode(True, None, 16, True) == 3 and mode(True, -5.4, 16, True) == 3
    assert mode(True, -5.0, 16, True) == 1 and mode(False, None, 16, True) == 0


# ---------------------------------------------------------------- DecodePlan itself


def test_plan_decode_returns_the_same_object_for_the_same_problem() -> None:
    problem = _problem(8, 16, state=BF16, layout="predecayed", cursor_table=True, advance=True)
    twin = dataclasses.replace(problem)  # equal, another object
    assert twin is not problem and plan_decode(twin) is plan_decode(problem)
    assert plan_decode(dataclasses.replace(problem, batch=9)) is not plan_decode(problem)


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
    """``run_decode(..., plan=)`` checks the plan against the call first (on every path, the torch one included)."""
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
    assert all(torch.equal(a, b) for a, b in zip(before, (*caches, out)))


# ---------------------------------------------------------------- what a plan compiles to


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
