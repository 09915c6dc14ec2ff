"""The decode kernel's launch plan: every compile-time choice of one launch, made in one place.

:func:`plan_decode` maps a :class:`DecodeProblem` (the call's sizes, dtypes, device, ring layout, cursor kind,
fused advance and gate) to a frozen :class:`DecodePlan`: the Helion config (value tile, warps, pipeline stages,
load hints), the register cap, and every constexpr of :func:`tp_replayssm.kernels.decode.replayssm_decode_kernel`.
Nothing else decides how the kernel is compiled; a benchmark or a test that wants another launch passes its own
plan (``dataclasses.replace(plan_decode(problem), value_tile=64)``), which :meth:`DecodePlan.check` validates.

The grid (value tile, chunk, warps, register cap, tensor-core chunks, load hints) comes from
:mod:`tp_replayssm.kernels.grid`; the rules here add the rest: the fused conv's mode, the slot checks' forms, the
fused advance's count. The H200 measurements behind each constant are in ``docs/tuning.md``; the names match it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import helion

from ..validation import PREDECAYED_MAX_LOG_DECAY, DecodeDims
from .grid import MMA_CHUNK_STAGES, TINY_BATCH_BELOW, _grid, _sm_count, _vector_tiles, launch_config

__all__ = ["FUSE_CONV_FROM", "DecodePlan", "DecodeProblem", "conv_readers", "fusable", "fused_conv_mode",
           "early_qk_rule", "late_count_rule", "plan_decode", "problem_of"]

# rows of the pool's count of the rows naming a slot that one load covers (one load up to this batch)
NAMED_BLOCK = 512
# (row, value head) pairs from which the library fuses the pool's conv into the decode launch; below, the conv's own
# launch (form "once") then the decode is faster (docs/tuning.md, "The conv: fused or its own launch")
FUSE_CONV_FROM = 256
# the plain decode's q/k before the slot's verdict (early_qk_rule) up to this many (row, value head) pairs
EARLY_QK_UPTO = 1024


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """What a launch plan depends on. ``gate_bounded``: a ``lower_bound`` gate that cannot take a pre-decayed
    cumulative gate past the rebase bound within a ring cycle (``(L-1) * |lower_bound| <= 75``)."""

    batch: int
    num_q_heads: int
    num_v_heads: int
    key_dim: int
    value_dim: int
    ring_length: int
    state_dtype: torch.dtype
    cache_dtype: torch.dtype
    device_type: str  # "cuda" for a GPU launch; anything else plans for the Triton interpreter
    sm_count: int
    ring_layout: str  # "predecayed" or "sglang"
    cursor_table: bool  # cursors read by slot from the pool's table [S + 1] (else one per row)
    advance: bool  # the launch also moves the cursor table (the fused advance)
    use_l2norm: bool
    use_lower_bound: bool
    gate_bounded: bool
    conv_kernel_size: int = 0  # W of the pool's conv when mixed_qkv is pre-conv (the launch may fuse it), else 0


def problem_of(dims: DecodeDims, *, state_dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device,
               ring_layout: str, cursor_table: bool, advance: bool, use_l2norm: bool,
               lower_bound: float | None, conv_kernel_size: int = 0) -> DecodeProblem:
    """The :class:`DecodeProblem` of a validated call (``conv_kernel_size``: the pool's W when ``mixed_qkv`` is
    pre-conv)."""
    bounded = lower_bound is not None and (dims.ring_length - 1) * abs(lower_bound) <= PREDECAYED_MAX_LOG_DECAY
    return DecodeProblem(dims.batch, dims.num_q_heads, dims.num_v_heads, dims.key_dim, dims.value_dim,
                         dims.ring_length, state_dtype, cache_dtype, device.type, _sm_count(device), ring_layout,
                         bool(cursor_table), bool(advance), bool(use_l2norm), lower_bound is not None, bounded,
                         int(conv_kernel_size))


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Every compile-time choice of one decode launch (``str(plan)`` prints them all).

    Grid: one program per (row, q/k head, value head of it, value tile of ``value_tile`` rows), ``num_warps`` warps
    each, walking its tile ``value_chunk`` rows at a time. The rest are the kernel's constexprs of the same names
    (``tensor_core_chunks`` is its ``chunks_on_tensor_cores``, ``advance_readers`` its ``advance_cursors``)."""

    value_tile: int
    value_chunk: int
    num_warps: int
    maxnreg: int | None  # ptxas register cap, passed as a Triton launcher option beside the Helion config
    chunk_stages: int  # software-pipeline stages of the tensor-core chunk loop (0: none)
    evict_state_first: bool  # checkpoint-chunk loads with evict_first (STATE_LOADS, STATE_LOADS_CURSOR_TABLE)
    tensor_core_chunks: bool
    tiny_batch: bool
    vector_tiles: int  # 0, 1 (append loop on [Ko, Vc, Ki, kv] tiles), 2 (and the pre-decayed keys)
    predecayed_ring: int  # 0 sglang layout; pre-decayed: 1 no rebase possible, 2 rebase via flush, 3 rebase pass
    advance_readers: int  # 0, or the programs that read one row's cursor (the fused advance counts them)
    named_block: int  # rows per step of the scan that finds slots named twice (the pool's calls)
    on_gpu: bool  # device code (inline PTX allowed), or the Triton interpreter
    cursor_table: bool
    ring_length: int
    ring_block: int
    use_l2norm: bool
    use_lower_bound: bool
    fused_conv: int = 0  # 0: no conv in this launch; 1: the conv fused, each program owns its q/k windows; 2: fused,
    # the last of a q/k head's programs writes its windows (counted); see fused_conv_mode
    conv_readers: int = 0  # fused_conv == 2: the programs of one (row, q/k head), HV/H * ceil(V / value_tile)
    late_count: bool = False  # the fused advance reads the cursor with a plain load and takes its reader count once
    # the row's loads are out (else the read is the count); see late_count_rule
    early_qk: bool = False  # the decode loads q and k beside the slot and normalizes them while the cursor loads,
    # not after the slot's verdict (with fused_conv: the conv's windows, inputs and taps, and its math); see
    # early_qk_rule
    pinned_loads: bool = False  # the row's loads (first checkpoint chunk, last gate row, inputs, the gate's
    # parameters) kept above the slot's verdict branch, which ptxas otherwise sinks them into: a plan edit, slower on
    # the H200 at three of four shapes, so no rule sets it (docs/tuning.md, "Slot checks")
    relaxed_conv_count: bool = False  # fused_conv 2 with early_qk: the q/k windows' reader count without the fences,
    # ordered by a dependency on the windows read (docs/conv.md, "The count without fences"); set
    # wherever the plan has both (plan_decode): the H200 measured it 0.3-0.6 us faster a layer step at B <= 8

    def __str__(self) -> str:
        return "DecodePlan(" + ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)) + ")"

    @property
    def config(self) -> helion.Config:
        """The Helion config (one object per distinct config: compiled kernels are cached by it)."""
        return launch_config(self.value_tile, self.num_warps, self.evict_state_first, self.chunk_stages,
                             self.cursor_table, early_loads=(2 if self.fused_conv else 4) if self.tiny_batch else 0)

    def constexprs(self) -> dict[str, object]:
        """The kernel's constexpr arguments, by name."""
        return dict(ring_length=self.ring_length, ring_block=self.ring_block, value_chunk=self.value_chunk,
                    use_l2norm=self.use_l2norm, use_lower_bound=self.use_lower_bound,
                    cursors_by_slot=self.cursor_table, tiny_batch=self.tiny_batch,
                    chunks_on_tensor_cores=self.tensor_core_chunks, predecayed_ring=self.predecayed_ring,
                    advance_cursors=self.advance_readers, vector_tiles=self.vector_tiles, named_block=self.named_block,
                    on_gpu=self.on_gpu, fused_conv=self.fused_conv, conv_readers=self.conv_readers,
                    late_count=self.late_count, early_qk=self.early_qk, pinned_loads=self.pinned_loads,
                    relaxed_conv_count=self.relaxed_conv_count)

    def without_conv(self) -> DecodePlan:
        """This plan with the conv in a launch of its own (``fused_conv`` 0 and the fused conv's fields off)."""
        return dataclasses.replace(self, fused_conv=0, conv_readers=0, relaxed_conv_count=False)

    def check(self, problem: DecodeProblem, *, device_code: bool = True) -> None:
        """``ValueError`` unless this plan can run ``problem`` (a plan built for another call, or edited into a
        combination the kernel does not have). ``device_code=False``: the call runs no kernel (the PyTorch path), so
        whether the plan was made for a GPU or the interpreter does not matter."""
        self._check_values(problem)
        want = plan_decode(problem)
        names = ["cursor_table", "ring_length", "ring_block", "use_l2norm", "use_lower_bound", "named_block"]
        for name in names + (["on_gpu"] if device_code else []):
            if getattr(self, name) != getattr(want, name):
                raise ValueError(f"DecodePlan: `{name}` is {getattr(self, name)!r} but this call needs "
                                 f"{getattr(want, name)!r} ({self})")
        if (self.predecayed_ring == 0) != (problem.ring_layout == "sglang"):
            raise ValueError(f"DecodePlan: `predecayed_ring` {self.predecayed_ring} does not match the call's "
                             f"{problem.ring_layout!r} ring layout")
        if self.predecayed_ring == 1 and not problem.gate_bounded:
            raise ValueError("DecodePlan: `predecayed_ring` 1 compiles the rebase check out, but this call's gate can "
                             "pass the rebase bound (no lower_bound, or (L-1) * |lower_bound| > 75): use 2 or 3")
        if (self.advance_readers != 0) != problem.advance:
            raise ValueError(f"DecodePlan: `advance_readers` {self.advance_readers} does not match advance="
                             f"{problem.advance}")
        if problem.advance and self.advance_readers != cursor_readers(problem, self.value_tile):
            raise ValueError(f"DecodePlan: `advance_readers` must be {cursor_readers(problem, self.value_tile)} "
                             f"for value tiles of {self.value_tile} rows; got {self.advance_readers}")
        if self.late_count and not self.advance_readers:
            raise ValueError("DecodePlan: `late_count` is a form of the fused advance: it needs `advance_readers`")
        if self.late_count and self.on_gpu and self.num_warps != 1:  # docs/kernel_design.md, the fused advance
            raise ValueError(f"DecodePlan: `late_count` needs one-warp programs on a GPU (a warp's cursor load must "
                             f"return before its count); got num_warps={self.num_warps}")
        for name in ("early_qk", "pinned_loads"):
            if getattr(self, name) and self.evict_state_first:
                raise ValueError(f"DecodePlan: `{name}` needs no evict_state_first (whose load positions it would "
                                 f"move); got {self}")
        if self.vector_tiles and self.tensor_core_chunks:
            raise ValueError("DecodePlan: `vector_tiles` and `tensor_core_chunks` exclude each other")
        if self.vector_tiles and problem.key_dim & (problem.key_dim - 1):  # K must split into power-of-two tiles
            raise ValueError(f"DecodePlan: `vector_tiles` {self.vector_tiles} needs a power-of-two key dim; got "
                             f"K={problem.key_dim}")
        self._check_fused_conv(problem)

    def _check_values(self, problem: DecodeProblem) -> None:
        """The fields that take a value from a fixed set or range (an edit such as ``value_tile=24`` would
        otherwise fail inside Helion's compile, or ``predecayed_ring=7`` compile a kernel of no form)."""
        tile, chunk = self.value_tile, self.value_chunk
        if tile < 1 or tile & (tile - 1):
            raise ValueError(f"DecodePlan: `value_tile` must be a power of two; got {tile}")
        if chunk < 1 or chunk & (chunk - 1) or chunk > tile:
            raise ValueError(f"DecodePlan: `value_chunk` must be a power of two of at most value_tile={tile}; got "
                             f"{chunk}")
        choices = dict(num_warps=(1, 2, 4, 8), vector_tiles=(0, 1, 2), predecayed_ring=(0, 1, 2, 3))
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"DecodePlan: `{name}` must be one of {allowed}; got {getattr(self, name)!r}")
        if self.tensor_core_chunks and not problem.state_dtype == problem.cache_dtype == torch.bfloat16:
            raise ValueError(f"DecodePlan: `tensor_core_chunks` needs a bf16 checkpoint and bf16 rings; got "
                             f"{problem.state_dtype} and {problem.cache_dtype}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"DecodePlan: `maxnreg` must be None or a register cap in ptxas's [24, 255]; got "
                             f"{self.maxnreg}")

    def _check_fused_conv(self, problem: DecodeProblem) -> None:
        """The fused conv's fields against ``problem`` (:func:`fused_conv_mode`)."""
        if self.fused_conv not in (0, 1, 2):
            raise ValueError(f"DecodePlan: `fused_conv` must be 0, 1 or 2; got {self.fused_conv}")
        if not self.fused_conv:
            if self.conv_readers:
                raise ValueError(f"DecodePlan: `conv_readers` must be 0 without a fused conv; got {self.conv_readers} "
                                 f"(DecodePlan.without_conv() is the two-launch plan)")
        else:
            self._check_conv_mode(problem)
        if self.relaxed_conv_count and not (self.fused_conv == 2 and self.early_qk):
            raise ValueError(f"DecodePlan: `relaxed_conv_count` is a form of the counted conv before the verdict: it "
                             f"needs fused_conv 2 and early_qk; got fused_conv={self.fused_conv}, "
                             f"early_qk={self.early_qk} (an edit that turns either off sets relaxed_conv_count=False "
                             f"too; DecodePlan.without_conv() does for two launches)")

    def _check_conv_mode(self, problem: DecodeProblem) -> None:
        if not fusable(problem):
            raise ValueError(f"DecodePlan: `fused_conv` {self.fused_conv} needs a pre-conv call with a window (W >= 2) "
                             f"on the pool's cursor table with power-of-two K and V (conv_kernel_size={problem.conv_kernel_size}, "
                             f"cursor_table={problem.cursor_table}, K={problem.key_dim}, V={problem.value_dim})")
        readers = conv_readers(problem, self.value_tile)
        if self.fused_conv == 1 and readers != 1:
            raise ValueError(f"DecodePlan: `fused_conv` 1 needs one program per (row, q/k head); value tiles of "
                             f"{self.value_tile} rows give {readers}: use 2")
        if self.fused_conv == 2 and self.conv_readers != readers:
            raise ValueError(f"DecodePlan: `conv_readers` must be {readers} for value tiles of {self.value_tile} "
                             f"rows; got {self.conv_readers}")

def fusable(problem: DecodeProblem) -> bool:
    """Whether the launch can run the pool's conv itself: a pre-conv call with a window (``conv_kernel_size >= 2``)
    on the pool's cursor table, with power-of-two K and V (the conv's channel tiles)."""
    pow2 = all(n & (n - 1) == 0 for n in (problem.key_dim, problem.value_dim))
    return problem.conv_kernel_size >= 2 and problem.cursor_table and pow2


def conv_readers(problem: DecodeProblem, value_tile: int) -> int:
    """The programs that read one (row, q/k head)'s q and k windows: ``HV/H * ceil(V / value_tile)``."""
    return problem.num_v_heads // problem.num_q_heads * -(-problem.value_dim // value_tile)


def fused_conv_mode(problem: DecodeProblem, value_tile: int) -> tuple[int, int]:
    """``(fused_conv, conv_readers)`` of the library's plan: the conv fused wherever :func:`fusable`; mode 1 where
    one program reads a q/k head's windows (it writes them itself), else mode 2 (the last of the head's programs
    writes them, counted with an atomic)."""
    if not fusable(problem):
        return 0, 0
    readers = conv_readers(problem, value_tile)
    return (1, 0) if readers == 1 else (2, readers)


def late_count_rule(advance: bool, vector_tiles: int, tensor_core_chunks: bool, fused_conv: int) -> bool:
    """Whether the fused advance takes its reader count late (``DecodePlan.late_count``): on the one-key-tile
    programs (``vector_tiles == 2``) and the tensor-core chunk programs without a fused conv, where the H200 measured
    it faster (docs/tuning.md, "Slot checks"); the count-first read elsewhere (the tiny-batch path's 4-warp register
    programs, the ``vector_tiles == 1`` programs, fp32 checkpoints' register programs, the fused conv). In the
    interpreter (4-warp programs, tensor-core chunks wherever the operands are bf16) the same rule turns it on for
    bf16 checkpoints."""
    return advance and (vector_tiles == 2 or tensor_core_chunks) and not fused_conv


def early_qk_rule(problem: DecodeProblem, tiny_batch: bool, fused_conv: int, num_warps: int,
                  evict_state_first: bool) -> bool:
    """Whether the decode loads q and k beside the slot and normalizes them while the cursor loads
    (``DecodePlan.early_qk``), the programs the H200 measured faster (docs/tuning.md, "Slot checks" and "The conv"):

    - with a fused conv, every plan but those pinning the checkpoint loads' eviction (``evict_state_first``, whose
      load positions the early loads would move): the conv's windows, inputs and taps loaded and its math done
      before the slot's verdict, mode 2 counted right after the conv (docs/conv.md);
    - without, the pool's calls (cursor table) on the pre-decayed layout with a bf16 checkpoint and no lower bound,
      on the batch path's one-warp programs up to :data:`EARLY_QK_UPTO` (row, value head) pairs, without the fused
      advance. The interpreter's programs (4 warps) follow the same rule."""
    if fused_conv:
        return not evict_state_first
    return (not problem.advance and not tiny_batch and not evict_state_first
            and problem.cursor_table and problem.ring_layout == "predecayed" and not problem.use_lower_bound
            and problem.state_dtype == torch.bfloat16 and (num_warps == 1 or problem.device_type != "cuda")
            and problem.batch * problem.num_v_heads <= EARLY_QK_UPTO)


def cursor_readers(problem: DecodeProblem, value_tile: int) -> int:
    """The programs that read one row's cursor (``HV * ceil(V / value_tile)``): the fused advance counts them in
    the cursor word's upper 15 bits, so at most 32767 of them and a cursor in the lower 16 bits (the pool's own
    limit, L <= 65534, is lower still: a free slot's cursor is 65535)."""
    readers = problem.num_v_heads * -(-problem.value_dim // value_tile)
    if readers >= 1 << 15 or problem.ring_length >= 1 << 16:
        raise ValueError(f"replayssm_decode: the fused advance counts at most {(1 << 15) - 1} programs per row and "
                         f"rings of at most {(1 << 16) - 1} entries; got {readers} programs (HV="
                         f"{problem.num_v_heads}, V={problem.value_dim}, value tile {value_tile}), "
                         f"L={problem.ring_length}")
    return readers


@functools.lru_cache(maxsize=4096)
def plan_decode(problem: DecodeProblem, *, fuse_conv: bool | None = None) -> DecodePlan:
    """The launch plan of ``problem`` (module docstring; each rule's measurement is in docs/tuning.md). A plan that
    fuses the conv runs the pool's conv in the decode launch wherever :func:`fusable` (:func:`fused_conv_mode`);
    otherwise a decode with the conv takes two launches (the conv's, then the decode's). ``fuse_conv=None`` (the
    library's choice) fuses from :data:`FUSE_CONV_FROM` (row, value head) pairs, where the H200 measured the fused
    launch faster; ``True``/``False`` force it either way."""
    if problem.advance and not problem.cursor_table:
        raise ValueError("replayssm_decode: the fused advance needs the pool's cursor table [S + 1]")
    vt, chunk, warps, maxnreg, mma, evict = _grid(problem)
    if problem.ring_layout == "sglang":
        mode = 0
    elif problem.gate_bounded:
        mode = 1  # no rebase can happen: the check is compiled out
    else:
        mode = 3 if maxnreg is not None else 2  # under the register cap the flush branch's choice spilled
    if fuse_conv is None:
        fuse_conv = problem.batch * problem.num_v_heads >= FUSE_CONV_FROM
    fused, readers = fused_conv_mode(problem, vt) if fuse_conv else (0, 0)
    vector_tiles = _vector_tiles(problem, vt, chunk, warps, mma)
    tiny = problem.batch * problem.num_v_heads < TINY_BATCH_BELOW
    early_qk = early_qk_rule(problem, tiny, fused, warps, evict)
    return DecodePlan(
        value_tile=vt, value_chunk=chunk, num_warps=warps, maxnreg=maxnreg,
        chunk_stages=MMA_CHUNK_STAGES if mma else 0, evict_state_first=evict, tensor_core_chunks=mma,
        tiny_batch=tiny,
        vector_tiles=vector_tiles, predecayed_ring=mode,
        advance_readers=cursor_readers(problem, vt) if problem.advance else 0,
        named_block=min(NAMED_BLOCK, max(16, 1 << (problem.batch - 1).bit_length())) if problem.cursor_table else 16,
        on_gpu=problem.device_type == "cuda", cursor_table=problem.cursor_table,
        ring_length=problem.ring_length, ring_block=max(16, 1 << (problem.ring_length - 1).bit_length()),
        use_l2norm=problem.use_l2norm, use_lower_bound=problem.use_lower_bound, fused_conv=fused,
        conv_readers=readers, late_count=late_count_rule(problem.advance, vector_tiles, mma, fused),
        early_qk=early_qk, relaxed_conv_count=fused == 2 and early_qk)
