"""Pinned launch choices for the decode kernel, per device kind and batch regime.

A choice is a Helion config plus the kernel's ``value_chunk`` and ``chunks_on_tensor_cores`` constants
and an optional register cap (:class:`LaunchChoice`). The config's ``block_sizes[0]`` is the value tile
``vt`` of one program (the grid is ``B * HV * V/vt`` programs); ``value_chunk`` (``vc``) is how many value
rows of the checkpoint the program's inner loops hold at a time (``[vc, K]``, with the next chunk's
loads already in flight). Only the tensor-core chunk loop is software-pipelined (3 stages); the others
are not (``range_num_stages`` 0): the flush rows' ring-replay loop, which only non-bf16 rings still run,
was pipelined with two stages until the tenth session; one stage measured the same or faster (up to
4.6% at B = 8) on the kernel of that time. Grid sizes are weighed in waves: how many rounds of resident
programs (8 one-warp programs per SM, 12 under the register cap) the device's SMs need for the grid.
GPU choices come from sweeps on an H200
(``benchmarks/tune_decode.py``; ``benchmarks/RESULTS.md``). Every call gets the same Config object for
the same choice (the op caches compiled kernels by config identity). The CPU choice serves the Triton
interpreter (``TRITON_INTERPRET=1``): pointer indexing, because the interpreter cannot run
``tensor_descriptor`` indexing, and the tensor-core chunks whenever checkpoint and ring are bf16, so
the CPU tests run both chunk paths.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

import helion

from ._validation import DecodeDims


class LaunchChoice(NamedTuple):
    """One launch of the decode kernel: the Helion ``config``, the kernel's ``value_chunk`` constant,
    ``maxnreg``, a ptxas cap on registers per thread (None: no cap), and ``mma_chunks``, the kernel's
    ``chunks_on_tensor_cores`` constant (the every-step chunk products as bf16 MMAs on chunks that
    Triton's software pipeline streams through shared memory; the kernel takes that path only for a bf16
    checkpoint and bf16 rings). Helion 1.5.0 accepts ``maxnreg`` in a config only with a persistent grid,
    so the cap travels beside the config and reaches Triton as a launcher option
    (:meth:`tp_replayssm.direct_launch.PlanCache.launch`)."""

    config: helion.Config
    value_chunk: int
    maxnreg: int | None = None
    mma_chunks: bool = False


# Set by benchmarks/tune_decode.py to time a candidate; None in normal use.
FORCED: LaunchChoice | None = None
# Set by tests and benchmarks/tune_decode.py to force the tiny-batch code path; None in normal use.
FORCED_TINY_BATCH: bool | None = None
# Set by benchmarks/tune_decode.py to force the pre-decayed rebase's form (rebase_pass); None in normal use.
FORCED_REBASE_PASS: bool | None = None
# Set by tests and benchmarks to force the kernel's vector tiles (vector_tiles: 0, 1 or 2); None in normal use.
FORCED_VECTOR_TILES: int | None = None
# Set by tests and benchmarks to force where the fused advance counts (count_after_loads); None in normal use.
FORCED_COUNT_AFTER_LOADS: bool | None = None
# count_after_loads's rule is off until its masked-store form passes the GPU tests (see there).
COUNT_AFTER_LOADS_ON = False

# The tiny-batch path below this many (row, value head) pairs. H200, 2026-11-29 (fourth session), us/step:
# whole-ring loads HV8 B1 4.54 -> 4.37, HV32 B1 5.32 -> 5.32, HV8 B8 6.51 -> 7.20, HV32 B8 12.75 -> 13.14;
# reverse-scan suffix sums HV8 B1 4.37 (forward 4.56), HV32 B8 12.76 (forward 11.93)
TINY_BATCH_BELOW = 16


# One-warp programs from this many (row, value head) pairs up (K <= 128) in the SPEC layout; below, 4-warp programs
# (from 64 pairs over 64 value rows in two chunks, the second loaded after the ring prologue; from 16 pairs over 32
# rows in one chunk). The pre-decayed layout takes one-warp programs from ONE_WARP_FROM_PREDECAYED pairs, with
# 16-row value tiles up to one wave (_one_wave_value_tile): one chunk per program, loaded before the ring prologue.
# The SPEC layout's one-warp programs take 16-row tiles too (up to one wave) for a bf16 checkpoint, 32 rows for fp32.
# H200, us/step, bf16 / fp32 state, vt:vc:warps; the pre-decayed pool step with the fused advance (bench_decode.py
# --ring-layout predecayed --fused-advance):
# - eighteenth session (on a variant whose last reader stored the cursor at its program's end): 64 pairs (HV8 B8,
#   HV32 B2, HV16 B4, HV4 B16): 64:32:4 4.9 / 5.1 at HV8 and 5.0 / 5.1 at the other three; 32:32:4 4.2 / 4.6-4.7
#   at all four; 32:32:2 4.3 / 4.8; 32:16:1 4.7 / 4.9 (HV8); 96 pairs (HV12 B8): 64:32:4 5.5 / 6.0, 32:32:4
#   5.2 / 6.1, 32:32:2 5.0 / 5.8, 32:16:1 5.0 / 5.4; the SPEC layout's op + advance 7.8 / 8.2 (thirteenth session)
#   -> 7.4 / 7.9 with one warp; the SPEC layout at HV8 B8 with 32:32:4: the op alone on per-row cursors 6.81 /
#   7.45 against the thirteenth session's 5.7 / 5.6 with 64:32:4 (one sample, not explained);
# - nineteenth session, the library's choice of the time -> 16:16:1 (two calls at HV12 / HV8 B8, 0.06 us apart):
#   32 pairs HV32 B1 3.79 / 4.02 -> 3.65 / 3.73 (16:16:4 - / 3.85, 16:16:2 - / 3.87, 32:32:2 - / 4.41), HV4 B8
#   3.80 / 3.96 -> 3.65 / 3.77; 16 pairs HV16 B1 3.70 / 3.84 -> 3.65 / 3.58; 64 pairs HV8 B8 4.20 / 4.64 -> 3.86 /
#   4.11 (16:16:2 4.66 / 4.96); 96 pairs HV12 B8 (32:16:1) 5.12 / 5.00 -> 4.72 / 5.22 (16:16:2 4.78 / 5.07); 128
#   pairs (32:16:1) HV16 B8 4.92 / 5.59 -> 4.82 / 5.34, HV4 B32 4.93 / 5.54 -> 4.75 / 5.32. Below 16 pairs (the
#   tiny-batch path, 16:16:4) one warp was 0.1-0.3 us slower (HV12 / HV8 / HV4 B1 3.2-3.3 -> 3.4-3.5);
# - twentieth session, the SPEC layout, op alone (tune_decode.py), library choice -> 16:16:1, bf16 / fp32: 96 pairs
#   HV12 B8 (32:16:1) 6.62 / 6.68 -> 6.20 / 6.87, 128 pairs HV16 B8 (32:16:1) 6.89 / 7.02 -> 6.31 / 7.21, so a bf16
#   checkpoint takes 16-row tiles there too; below 96 pairs one warp lost: HV8 B8 (64:32:4) 4.72 / 5.12 -> 5.60 / 5.81,
#   HV32 B1 (32:32:4) 3.77 / 4.04 -> 5.39 / 5.58, HV16 B1 3.69 / 3.87 -> 5.38 / 5.43.
ONE_WARP_FROM = 96
ONE_WARP_FROM_PREDECAYED = TINY_BATCH_BELOW

# Positions of the checkpoint-chunk loads (the first chunk's, then the prefetches in the append and the
# flush loops) in Helion's list of the kernel's loads (``load_eviction_policies``) on the register chunk
# path, the only one that pins the hint (the 4-warp choices of keys wider than 128); tests/test_configs.py
# checks them against the generated code of every kernel specialization.
STATE_LOADS = (1, 13, 16)

# Software-pipeline stages of the tensor-core chunk loop (LaunchChoice.mma_chunks): cp.async copies of the next
# MMA_CHUNK_STAGES - 1 chunks in flight through shared memory
MMA_CHUNK_STAGES = 3


def launch_config(vt: int, warps: int, programs_per_sm: int | None = None,
                  evict_state_first: bool = False, chunk_stages: int = 0) -> helion.Config:
    """The Helion config of a launch choice: one cached object per distinct choice, however the arguments are
    spelled (positional or keyword, defaults given or left out; the op caches compiled kernels by config
    identity). ``programs_per_sm`` makes the grid persistent (``programs_per_sm`` programs per SM, each looping
    over tiles).
    ``evict_state_first`` loads the checkpoint chunks with ``evict_first`` (each is read once per step;
    the L2 keeps the ring entries and inputs instead). The programs stay batch-major (consecutive
    programs take consecutive rows of one head): head-major order was 14% slower with fp32 state
    (benchmarks/RESULTS.md, sixth session). ``chunk_stages`` software-pipelines the append rows' chunk loop
    (Triton's ``num_stages``: cp.async copies of the next ``chunk_stages - 1`` chunks into shared memory),
    which only the tensor-core chunk path wants (its loop has no hand prefetch)."""
    return _launch_config(vt, warps, programs_per_sm, evict_state_first, chunk_stages)


@functools.lru_cache(maxsize=None)
def _launch_config(vt: int, warps: int, programs_per_sm: int | None, evict_state_first: bool,
                   chunk_stages: int) -> helion.Config:
    extra: dict[str, object] = {}
    if evict_state_first:
        extra["load_eviction_policies"] = ["first" if i in STATE_LOADS else "" for i in range(max(STATE_LOADS) + 1)]
    if programs_per_sm is not None:
        extra.update(pid_type="persistent_interleaved", num_sm_multiplier=programs_per_sm)
    # range_num_stages, by Helion's loop index: 1 is the append rows' chunk loop, 2 the flush loop (the
    # flush's replay loop, which only non-bf16 rings have, takes the padding)
    return helion.Config(block_sizes=[vt], indexing="pointer", num_warps=warps, num_stages=1,
                         range_num_stages=[0, chunk_stages, 0], **extra)


# Resident one-warp programs per SM on the H200 at K = 128: 8 uncapped (~246-255 registers a thread), 12
# under the 168-register cap (benchmarks/RESULTS.md, eleventh session). Narrower keys need fewer registers
# and fit more programs; the wave rules below do not model that (no such shape was measured).
PROGRAMS_PER_SM = 8
CAPPED_PROGRAMS_PER_SM = 12


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (132, the H200's, where CUDA is absent: tests of the GPU choices)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _programs(pairs: int, value_dim: int, vt: int) -> int:
    """One-warp programs of a grid: one per (row, value head) pair and value tile of ``vt`` rows."""
    return pairs * -(-value_dim // vt)


def _waves(programs: int, per_sm: int, sms: int) -> int:
    return -(-programs // (per_sm * sms))


def _one_wave_value_tile(pairs: int, value_dim: int, sms: int, narrowest: int) -> int:
    """The one-warp programs' value tile: the narrowest of ``narrowest`` (16 in the pre-decayed layout and for a
    bf16 checkpoint, else 32) / 32 / 64 / 128 whose grid (``pairs`` programs per value tile) still fits one wave of
    ``PROGRAMS_PER_SM`` per SM, else 128: as many programs in flight as fit, and no second, partial wave (the 16-row
    tiles' data: ``ONE_WARP_FROM``). H200 (132 SMs, one wave = 1056), us/step: HV12 B32 (384 pairs) vt 32 (1536
    programs) fp32 15.20 / bf16 13.78, vt 64 (768) 12.20 / 10.37, vt 128 (384) 14.52 / 11.92; HV16 B32 (512 pairs)
    vt 64 13.18 / 11.04, vt 128 16.53 / 13.60, vt 32 16.78 (fp32) (twelfth session). The rule keeps the earlier
    choices at 256 pairs (vt 32) and 1024+ (vt 128; seventh session)."""
    for vt in (16, 32, 64):
        if vt >= narrowest and _programs(pairs, value_dim, vt) <= PROGRAMS_PER_SM * sms:
            return vt
    return 128


def _capped_waves_fewer(programs: int, sms: int) -> bool:
    """Whether the 168-register cap (12 programs per SM instead of 8) runs the tensor-core grid in fewer
    waves. H200 (132 SMs), us/step uncapped / capped, with the waves uncapped / capped: 1024 programs (1 / 1)
    HV8 B128 16.5 / 20.9; 1536 (2 / 1) HV12 B128 33.46 / 26.17; 2048 (2 / 2) HV16 B128 36.58 / 39.36
    (twelfth session); 4096 (4 / 3) HV8 B512 71.4 / 69.0, HV32 B128 70.6 / 68.0; 16384 (16 / 11) HV32 B512
    275.6 / 259.7 (eleventh session)."""
    return _waves(programs, CAPPED_PROGRAMS_PER_SM, sms) < _waves(programs, PROGRAMS_PER_SM, sms)


def _capped_one_wave(programs: int, sms: int) -> bool:
    """Whether the register path's grid needs two or more waves uncapped and one capped (1057-1584 programs on
    the H200). There, with fp32 state, 8-row chunks under the 168-register cap (159-168 registers, at most 40 B
    of stack) win; with more waves left they lose. H200, sixteenth session, op alone, us/step, pinned ->
    capped with 8-row chunks: HV12 B128 (1536 programs; 2 waves -> 1) pre-decayed softplus 39.16 -> 36.13,
    lower_bound -5 38.60 -> 36.52, SPEC layout 44.26 -> 39.62; HV32 B128 (4096; 4 -> 3) 88.28 -> 91.23 (SPEC
    97.38 -> 104.75), HV12 B512 126.99 -> 132.05, HV16 B512 171.33 -> 175.43, HV32 B512 332.32 -> 335.21, HV8
    B128 (1024, one wave either way) 24.13 -> 29.85. The 16-row chunks spill under the cap (352-400 B)."""
    return _waves(programs, CAPPED_PROGRAMS_PER_SM, sms) == 1 < _waves(programs, PROGRAMS_PER_SM, sms)


def select_config(dims: DecodeDims, state_dtype: torch.dtype, device: torch.device,
                  ring_dtype: torch.dtype = torch.bfloat16, predecayed: bool = False) -> LaunchChoice:
    """The pinned launch choice for one call (see the module docstring); ``ring_dtype`` is the d ring's,
    ``predecayed`` the pre-decayed ring layout's call. The same choice serves both ring layouts and every
    pre-decayed mode but at 16-132 (row, head) pairs (``ONE_WARP_FROM``, ``ONE_WARP_FROM_PREDECAYED``)."""
    bf16_operands = state_dtype == torch.bfloat16 and ring_dtype == torch.bfloat16  # exact MMA operands
    if device.type != "cuda":  # the interpreter runs both chunk paths: tensor cores when the operands allow
        return LaunchChoice(launch_config(32, 4), 16, None, bf16_operands)
    if FORCED is not None:
        return FORCED
    programs_full = dims.batch * dims.num_v_heads  # programs when one program covers all of V
    evict = False
    # One warp per program from ONE_WARP_FROM (96; 128 until the eighteenth session) (row, head) pairs up, and in the
    # pre-decayed layout from ONE_WARP_FROM_PREDECAYED (16; the nineteenth session) with 16-row tiles where they fit: no
    # cross-warp reductions or scans, and 8 KiB fp32 chunks in flight per warp. A [16, K] fp32 tile is 64 registers
    # per thread at K = 128 (~255 in all, 8 programs per SM; only the flush loop spills, 16 B), so wider keys keep
    # the 4-warp programs.
    # The value tile: see _one_wave_value_tile. H200, 2026-11-30 (seventh session), us/step against the
    # 4-warp choices: HV32 B512 fp32 524 -> 400, bf16 460 -> 312; HV8 B512 fp32 139 -> 104, bf16
    # 121 -> 80; HV32 B16 20.0 (vt 128) -> 14.9 (vt 64); HV32 B8 12.5 -> 10.5 (vt 32); below 128 pairs
    # one warp was slower (HV8 B8 6.6 -> 7.2, B = 1 up to 2x). Evict-first checkpoint loads: -1% to -3%
    # at 4096+ pairs, +12% at 512 (HV32 B16, vt 128); with the tensor-core flush (tenth session) they
    # helped a bf16 checkpoint only (HV32 B512 288.8 -> 287.6; fp32 385.3 -> 387.6), and with the
    # tensor-core chunks (eleventh session) not even that (258.6 against 259.7, HV8 B512 69.3 / 69.0,
    # HV32 B128 67.9 / 68.0): one-warp programs load without hints.
    #
    # A bf16 checkpoint from 1024 pairs up takes the tensor-core chunks (LaunchChoice.mma_chunks): 3 pipeline
    # stages (2 chunks in flight through shared memory), and a cap of 168 registers where it saves a wave
    # (_capped_waves_fewer): the cap leaves the every-step path spill-free and fits 12 programs per SM
    # instead of 8 (the flush path spills). H200, 2026-11-30 (eleventh session), us/step, register chunks
    # -> tensor-core chunks: HV32 B512 286.8 -> 259.7, HV8 B512 72.1 -> 69.0, HV32 B128 71.7 -> 68.0
    # (uncapped: 275.6, 71.4, 70.6), HV8 B128 18.6 -> 16.5 (capped: 20.9); HV32 B8 (256 pairs) 8.0 -> 8.7,
    # so smaller grids keep the register path and its first-chunk prefetch ahead of the ring prologue.
    one_warp = dims.key_dim <= 128
    mma, maxnreg = False, None
    if one_warp and programs_full >= (ONE_WARP_FROM_PREDECAYED if predecayed else ONE_WARP_FROM):
        chunk, warps = 16, 1
        sms = _sm_count(device)
        # 16-row tiles in the pre-decayed layout, and in the SPEC layout for a bf16 checkpoint (ONE_WARP_FROM)
        narrowest = 16 if predecayed or state_dtype == torch.bfloat16 else 32
        vt = _one_wave_value_tile(programs_full, dims.value_dim, sms, narrowest)
        mma = programs_full >= 1024 and bf16_operands
        # The pre-decayed layout's rebase-check kernel keeps the cap too: under it, the rebase is a pass of its
        # own (ops.predecayed_mode 3; 5 spill operations on the every-step path, triton 3.6). H200, sixteenth
        # session, softplus gate, op alone, us/step uncapped -> capped: HV12 B128 bf16 28.9 -> 23.2, HV12 B512
        # 91.4 -> 86.0, HV32 B512 235.4 -> 224.0, HV16 B512 121.2 -> 117.5, HV8 B512 63.0 -> 61.8, HV32 B128
        # 62.3 -> 61.0
        programs = _programs(programs_full, dims.value_dim, vt)
        if mma and _capped_waves_fewer(programs, sms):
            maxnreg = 168
        elif not mma and state_dtype == torch.float32 and _capped_one_wave(programs, sms):
            chunk, maxnreg = 8, 168
    elif programs_full >= 512:  # wide keys: one 4-warp program streams all of V in 8 KiB chunks
        vt, chunk, warps = 128, max(16, 8192 // (dims.key_dim * state_dtype.itemsize)), 4
        evict = True
    elif programs_full >= 128:
        vt, chunk, warps = 64, 16, 2
    elif programs_full >= 64:  # the SPEC layout and wide keys: two chunks (ONE_WARP_FROM)
        vt, chunk, warps = 64, 32, 4
    elif programs_full >= 16:  # one chunk: the whole tile is loaded before the ring prologue
        vt, chunk, warps = 32, 32, 4
    else:
        vt, chunk, warps = 16, 16, 4
    vt = min(vt, 1 << (dims.value_dim - 1).bit_length())
    stages = MMA_CHUNK_STAGES if mma else 0
    return LaunchChoice(launch_config(vt, warps, evict_state_first=evict, chunk_stages=stages), min(chunk, vt),
                        maxnreg, mma)


def rebase_pass(choice: LaunchChoice) -> bool:
    """Whether the pre-decayed layout's rebase check, where it is compiled in, runs the rebase as a pass of its
    own after the append loop (``ops.predecayed_mode`` 3) instead of through the flush branch (2): in programs
    under a register cap, where the flush branch's data-dependent choice of loop spilled on every step.
    ``FORCED_REBASE_PASS`` overrides it (benchmarks)."""
    if FORCED_REBASE_PASS is not None:
        return FORCED_REBASE_PASS
    return choice.maxnreg is not None


def vector_tiles(choice: LaunchChoice, state_dtype: torch.dtype, key_dim: int) -> int:
    """The kernel's constexpr ``vector_tiles``: 0, or 1 when the register append loop reads the checkpoint as
    ``[Ko, Vc, Ki, kv]`` vector tiles (``ops._vector_tiles_view``): a value row's dot products then sum in its thread
    and over ``Ko`` lanes, and the d ring loads put the value rows across the lanes, instead of 4-5 shuffle rounds per
    row. One-warp programs without tensor-core chunks, except fp32 checkpoints over value tiles below 64 rows; keys
    of a power-of-two width only (Triton's tiles are powers of two: ``K // kv`` must split into them exactly).
    H200, twenty-first session, the op alone (tune_decode.py), us/step [Vc, K] -> vector tiles: bf16 pre-decayed
    HV4 B128 (64:16:1) 8.72 -> 8.22, HV16 B32 8.73 -> 8.25, HV8 B32 (32:16:1) 5.88 -> 5.65, HV32 B1 (16:16:1) 3.00
    -> 2.81, HV12 B8 4.18 -> 4.15; fp32 SPEC HV8 B128 (128:16:1) 26.57 -> 25.68, pre-decayed HV12 B128 (128:8:1,
    168-register cap) 36.58 -> 34.75, HV32 B512 335.0 -> 330.1, HV4 B128 (64:16:1) 11.14 -> 11.05; slower: fp32
    pre-decayed HV12 B8 (16:16:1) 4.43 -> 4.82, SPEC HV32 B8 (32:16:1) 8.90 -> 9.57, and the 4-warp programs (HV8 B1
    16:16:4 2.34 -> 2.62 bf16, 3.57 -> 3.76 fp32; 32:32:4 4.04 -> 4.11; 64:32:4 5.12 -> 5.20).
    2 where a program has one chunk (value tile = value chunk): the pre-decayed prologue also reads the ring keys as
    ``[Ko, Lb, Ki, kv]`` tiles for ``wk``, ``wq`` (sm_90, triton 3.6: the 16:16:1 bf16 program 1617 -> 1361 SASS
    instructions on its every-step path; over 4 chunks (64:16:1) the chunk loop then spilled, 68 spill operations).
    ``FORCED_VECTOR_TILES`` (0, 1 or 2) overrides it (tests, benchmarks); never on tensor-core chunks."""
    if key_dim & (key_dim - 1):
        return 0
    if FORCED_VECTOR_TILES is not None:
        return 0 if choice.mma_chunks else int(FORCED_VECTOR_TILES)
    if choice.mma_chunks or choice.config.config["num_warps"] != 1:
        return 0
    vt = choice.config.config["block_sizes"][0]
    if state_dtype == torch.float32 and vt < 64:
        return 0
    return 2 if vt == choice.value_chunk else 1


def tiny_batch(dims: DecodeDims) -> bool:
    """Whether a call takes the kernel's latency path (constexpr ``tiny_batch``): fewer than
    ``TINY_BATCH_BELOW`` (row, value head) pairs, so one program's latency is the whole step. That path
    loads each program's whole ring (all ``L`` entries) without waiting for the cursor and masks the
    entries past it afterwards, one dependent memory round trip less, and takes the ring's suffix sums
    as a reverse scan. Elsewhere the kernel loads only the live entries and uses the forward scan (fewer
    bytes, registers and instructions); both choices were measured (see ``TINY_BATCH_BELOW``)."""
    if FORCED_TINY_BATCH is not None:
        return FORCED_TINY_BATCH
    return dims.batch * dims.num_v_heads < TINY_BATCH_BELOW


def count_after_loads(dims: DecodeDims) -> bool:
    """Where a fused cursor advance (``ops.cursor_readers`` programs per row) takes each program's count: after its
    ring and input loads are out, the cursor read first with a relaxed load (True), or as the read itself, an
    atomic whose result the ring loads wait for (False; kernel module docstring). The rule: at most 8 rows and 64
    (row, value head) pairs, and only while ``COUNT_AFTER_LOADS_ON`` (off: below). ``FORCED_COUNT_AFTER_LOADS``
    overrides both (tests, benchmarks).
    H200, twenty-third session, the fused step (bench_decode.py --ring-layout predecayed --fused-advance, bf16
    checkpoint), us/step atomic read -> count after the loads:
    - faster: B = 1 HV32 3.32 -> 3.15, HV12 3.35 -> 3.30, HV8 3.31 -> 3.20; B = 8 HV8 3.77 -> 3.41, HV4 3.51 -> 3.15,
      HV16 4.47 -> 4.41;
    - slower: B = 8 HV32 6.36 -> 6.42, HV12 4.32 -> 4.35; B = 32 HV32 14.63 -> 14.75, HV16 8.82 -> 8.85, HV8 6.31 ->
      6.42; B = 128 HV16 32.10 -> 32.37, HV4 8.76 -> 8.84; B = 512 HV4 32.93 -> 33.24;
    - even: HV12 B32 8.48 -> 8.47, B128 23.08 -> 23.01.
    That form stored the moved cursor under an ``if``. The branch parted the gate math's products from their sums
    (no FMA), so the pre-decayed layout's fused launch was no longer bit-identical to decode + advance: its GPU
    tests failed, though the results passed the benchmark's reference check. The masked store that replaced it
    compiles to the same f32 operations as the decode without the advance (sm_90 PTX, six launch choices;
    ``tests/test_kernel_regs.py``) but has not run on a GPU yet."""
    if FORCED_COUNT_AFTER_LOADS is not None:
        return FORCED_COUNT_AFTER_LOADS
    return COUNT_AFTER_LOADS_ON and dims.batch <= 8 and dims.batch * dims.num_v_heads <= 64
