"""The decode launch's grid: its programs' value tile, value chunk, warps, register cap, tensor-core chunks and load
hints, and the Helion config they make.

The rules weigh a grid in waves: rounds of resident programs (:data:`PROGRAMS_PER_SM` one-warp programs per SM,
:data:`CAPPED_PROGRAMS_PER_SM` under the register cap) over the device's SMs. A launch has one program per
(row, value head) pair and value tile; its ``[value_tile, K]`` slice of the state streams through in
``[value_chunk, K]`` chunks. :func:`tp_replayssm.kernels.plan.plan_decode` calls :func:`_grid` and
:func:`_vector_tiles` and puts their choices in the :class:`~tp_replayssm.kernels.plan.DecodePlan`; the H200
measurements behind each constant are in ``docs/tuning.md``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

import helion

if TYPE_CHECKING:
    from .plan import DecodeProblem

# (row, value head) pairs below which the kernel takes its latency path (whole-ring loads, reverse scan)
TINY_BATCH_BELOW = 16
# one-warp programs from this many (row, value head) pairs up (K <= 128): sglang layout / pre-decayed layout
ONE_WARP_FROM = 96
ONE_WARP_FROM_PREDECAYED = TINY_BATCH_BELOW
# tensor-core chunks (bf16 checkpoint and ring) from this many pairs up
TENSOR_CORE_CHUNKS_FROM = 1024
# resident one-warp programs per SM at K = 128: uncapped, and under the register cap
PROGRAMS_PER_SM = 8
CAPPED_PROGRAMS_PER_SM = 12
REGISTER_CAP = 168
# software-pipeline stages of the tensor-core chunk loop (cp.async copies of the next chunks)
MMA_CHUNK_STAGES = 3
# positions of the checkpoint-chunk loads in Helion's list of the kernel's loads (``load_eviction_policies``), on the
# register chunk path of the wide-key (K > 128) 4-warp programs, the only ones that pin the hint: with per-row
# cursors, and with the pool's cursor table (its load of the call's slots comes first, its cursor read by slot later);
# on the tiny-batch path the row's input loads come before the first (launch_config's ``early_loads``)
STATE_LOADS = (1, 13, 16)
STATE_LOADS_CURSOR_TABLE = (2, 15, 18)
# the H200's multiprocessors: the plan of a device that is not a GPU here (the interpreter, the tests of GPU plans)
H200_SMS = 132


def launch_config(vt: int, warps: int, evict_state_first: bool = False, chunk_stages: int = 0,
                  cursor_table: bool = False, early_loads: int = 0) -> helion.Config:
    """The Helion config of a plan: one cached object per distinct choice (compiled kernels are cached by config
    identity). ``range_num_stages`` by Helion's loop index: 1 is the append rows' chunk loop (pipelined only on the
    tensor-core chunk path), 2 the flush loop; the flush's replay loop (non-bf16 rings) takes the padding.
    ``early_loads``: the row's input loads the tiny-batch path issues ahead of the first checkpoint chunk (q, k, a, b;
    a and b with the conv fused), which move that chunk's place in the list of loads; the later ones keep theirs."""
    return _launch_config(vt, warps, evict_state_first, chunk_stages, cursor_table and evict_state_first,
                          early_loads if evict_state_first else 0)


@functools.lru_cache(maxsize=None)
def _launch_config(vt: int, warps: int, evict_state_first: bool, chunk_stages: int,
                   cursor_table: bool, early_loads: int) -> helion.Config:
    extra: dict[str, object] = {}
    if evict_state_first:
        first, *later = STATE_LOADS_CURSOR_TABLE if cursor_table else STATE_LOADS
        loads = (first + early_loads, *later)
        extra["load_eviction_policies"] = ["first" if i in loads else "" for i in range(max(loads) + 1)]
    return helion.Config(block_sizes=[vt], indexing="pointer", num_warps=warps, num_stages=1,
                         range_num_stages=[0, chunk_stages, 0], **extra)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (:data:`H200_SMS` where it is not a visible GPU)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_SMS


def _programs(pairs: int, value_dim: int, vt: int) -> int:
    """Programs of a grid: one per (row, value head) pair and value tile of ``vt`` rows."""
    return pairs * -(-value_dim // vt)


def _waves(programs: int, per_sm: int, sms: int) -> int:
    return -(-programs // (per_sm * sms))


def _one_wave_value_tile(pairs: int, value_dim: int, sms: int, narrowest: int) -> int:
    """The one-warp programs' value tile: the narrowest of ``narrowest`` / 32 / 64 whose grid still fits one wave of
    :data:`PROGRAMS_PER_SM` per SM, else 128 (as many programs in flight as fit, and no partial second wave)."""
    for vt in (16, 32, 64):
        if vt >= narrowest and _programs(pairs, value_dim, vt) <= PROGRAMS_PER_SM * sms:
            return vt
    return 128


def _capped_waves_fewer(programs: int, sms: int) -> bool:
    """Whether the register cap runs the tensor-core grid in fewer waves (12 programs per SM instead of 8)."""
    return _waves(programs, CAPPED_PROGRAMS_PER_SM, sms) < _waves(programs, PROGRAMS_PER_SM, sms)


def _capped_one_wave(programs: int, sms: int) -> bool:
    """Whether the register path's grid takes two or more waves uncapped and one capped (1057-1584 programs on the
    H200): there fp32 checkpoints win with 8-row chunks under the cap."""
    return _waves(programs, CAPPED_PROGRAMS_PER_SM, sms) == 1 < _waves(programs, PROGRAMS_PER_SM, sms)


def _grid(problem: DecodeProblem) -> tuple[int, int, int, int | None, bool, bool]:
    """``(value_tile, value_chunk, warps, maxnreg, tensor_core_chunks, evict_state_first)`` (docs/tuning.md)."""
    bf16_operands = problem.state_dtype == torch.bfloat16 and problem.cache_dtype == torch.bfloat16
    if problem.device_type != "cuda":  # the interpreter: both chunk paths run, tensor cores when the operands allow
        return 32, 16, 4, None, bf16_operands, False
    pairs = problem.batch * problem.num_v_heads  # programs when one program covers all of V
    predecayed = problem.ring_layout == "predecayed"
    mma, maxnreg, evict = False, None, False
    if problem.key_dim <= 128 and pairs >= (ONE_WARP_FROM_PREDECAYED if predecayed else ONE_WARP_FROM):
        chunk, warps = 16, 1
        sms = problem.sm_count
        narrowest = 16 if predecayed or problem.state_dtype == torch.bfloat16 else 32
        vt = _one_wave_value_tile(pairs, problem.value_dim, sms, narrowest)
        mma = pairs >= TENSOR_CORE_CHUNKS_FROM and bf16_operands
        programs = _programs(pairs, problem.value_dim, vt)
        if mma and _capped_waves_fewer(programs, sms):
            maxnreg = REGISTER_CAP
        elif not mma and problem.state_dtype == torch.float32 and _capped_one_wave(programs, sms):
            chunk, maxnreg = 8, REGISTER_CAP
    elif pairs >= 512:  # wide keys: one 4-warp program streams all of V in 8 KiB chunks
        vt, chunk, warps = 128, max(16, 8192 // (problem.key_dim * problem.state_dtype.itemsize)), 4
        evict = True
    elif pairs >= 128:
        vt, chunk, warps = 64, 16, 2
    elif pairs >= 64:  # two chunks
        vt, chunk, warps = 64, 32, 4
    elif pairs >= 16:  # one chunk, loaded before the ring prologue
        vt, chunk, warps = 32, 32, 4
    else:
        vt, chunk, warps = 16, 16, 4
    vt = min(vt, 1 << (problem.value_dim - 1).bit_length())
    return vt, min(chunk, vt), warps, maxnreg, mma, evict


def _vector_tiles(problem: DecodeProblem, vt: int, chunk: int, warps: int, mma: bool) -> int:
    """1 where the one-warp register append loop reads the checkpoint as ``[Ko, Vc, Ki, kv]`` vector tiles (not for
    fp32 checkpoints over value tiles below 64 rows, where it lost); 2 where a program has one chunk (the
    pre-decayed prologue also reads its keys that way). Keys of a power-of-two width only."""
    if problem.key_dim & (problem.key_dim - 1) or mma or warps != 1:
        return 0
    if problem.state_dtype == torch.float32 and vt < 64:
        return 0
    return 2 if vt == chunk else 1
