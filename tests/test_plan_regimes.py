"""The library's decode launch plan per regime (:func:`tp_replayssm.kernels.plan.plan_decode`): value tile, chunk
and warps, the tiny-batch path, vector tiles, eviction hints, tensor-core chunks and the register cap, the grid
rules' count of the device's SMs, and the pre-decayed layout's rebase modes. The rules and the H200 measurements
behind them are in ``docs/tuning.md``; the GPU plans are planned here for an H200 (132 SMs where no GPU answers).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from _plan_helpers import BF16, CPU, CUDA, FP32, _grid, _plan, _problem
from tp_replayssm.kernels import grid, plan
from tp_replayssm.kernels.plan import DecodePlan, DecodeProblem, plan_decode


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
