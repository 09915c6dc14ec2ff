"""The verify kernels' launch plan: every compile-time choice of one verify launch, made in one place.

:func:`plan_verify` maps a :class:`VerifyProblem` (sizes, dtypes, device, ring layout, tree or chain, gate) to a frozen
:class:`VerifyPlan`: which kernel (the tensor-core form, :mod:`tp_replayssm.kernels.verify_mma`, or the CUDA-core
form, :mod:`tp_replayssm.kernels.verify`), its value tile, value chunk and warps, and every constexpr. A test or a
benchmark that wants another launch passes its own plan (``dataclasses.replace(plan_verify(problem), value_tile=64)``),
which :meth:`VerifyPlan.check` validates.

The rules (sm_90 register counts from ``benchmarks/spec_regs.py``; times from ``benchmarks/bench_spec.py``,
docs/spec.md):

- the tensor-core form wherever it can run (:func:`tensor_core_refusal`: pre-decayed bf16 rings, power-of-two
  widths, at most :data:`MMA_MAX_DRAFTS` drafts; bf16 and fp32 checkpoints; on the
  H200 it is 1.9-3.9x faster than the CUDA-core form, docs/spec.md): :data:`MMA_WARPS`-warp programs over
  :data:`MMA_VALUE_CHUNK`-row chunks, the narrowest value tile of 32 / 64 rows whose grid fits one wave of
  :data:`MMA_PROGRAMS_PER_SM` programs per SM (with a bf16 checkpoint, failing that, :data:`MMA_BF16_STATE_WAVES`
  waves), else all of ``V``; two bf16 parts per fp32 operand, three where both the checkpoint and the outputs
  are fp32;
- in the tensor-core form, a fold's checkpoint rows stored from the chunk loop (``fold_in_chunks``) with a bf16
  checkpoint, and with fp32 where one value tile covers V; a register cap (``maxnreg``): :data:`MMA_BF16_STATE_MAXNREG`
  with a bf16 checkpoint, :data:`MMA_FP32_STATE_MAXNREG` with fp32 where the grid passes :data:`MMA_FP32_CAP_WAVES`
  waves;
- in the tensor-core form, ``batched_reductions`` (the prologue's sums over ``K`` as reductions over tuples: 75
  fewer CTA barriers per program at T = 4; 5-8% faster verify + commit steps on the H200) and chunk loads
  prefetched during the previous chunk's math (``chunk_prefetch``; loads at each chunk's start were 6-14% slower)
  (docs/tuning.md, "The verify form"); with them ``merged_sums`` (the norms, the drafts' couplings and the rebase
  test as one reduction: 3.2-5.5% faster verify + commit steps on the H200 up to B = 32, 7-9% in an 8-layer model
  step);
- elsewhere the CUDA-core form: 4-warp programs (a program holds the drafts' ``[Tb, K]`` fp32 tiles and, per chunk
  step, ``[Vc, Tb, K]`` products, which one warp cannot keep in registers), the same value-tile rule with
  :data:`PROGRAMS_PER_SM`, value chunks of ``32 / Tb`` rows (168 registers per thread at ``T = 4``, K = 128).

One field no rule sets (DEVELOPERS.md, "Plan choices timed on the device"): ``early_params`` (timed, not faster;
docs/tuning.md, "The verify form").
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import helion

from ..spec_validation import VerifyCall, VerifyDims
from ..validation import PREDECAYED_MAX_LOG_DECAY
from .grid import H200_SMS, _sm_count
from .plan import NAMED_BLOCK

__all__ = ["VerifyPlan", "VerifyProblem", "plan_verify", "problem_of", "tensor_core_refusal"]

# resident 4-warp verify programs per SM (168 registers per thread: 3 CTAs of 128 threads in 64K registers)
PROGRAMS_PER_SM = 3
# value rows x draft rows per chunk step: the [Vc, Tb, K] products of a step stay at 8 rows x 4 drafts, 168 registers
# with 4 warps at K = 128 (16 x 4 took 255; sm_90, triton 3.6, benchmarks/spec_regs.py)
CHUNK_DRAFT_ROWS = 32
NUM_WARPS = 4
# the tensor-core form (kernels/verify_mma.py): its fp32 operands' bf16 parts. Two give products to ~2^-16 relative,
# far below the rounding of a bf16 checkpoint and of bf16 / fp16 outputs (the bf16 rings' too): 9-37% faster than
# three with a bf16 checkpoint and 6-13% with fp32 on the H200 (docs/spec.md). Three (~2^-24, fp32-accurate
# products) where both the checkpoint and the outputs are fp32. Its most drafts
MMA_OPERAND_PARTS = 2
MMA_OPERAND_PARTS_FP32 = 3
MMA_MAX_DRAFTS = 15
# its programs: 4 warps over 32-row chunks (each warp an 8-column slice of the [N, 32] products; 16-row chunks made
# every warp compute all of them; one warp spilled). MMA_PROGRAMS_PER_SM is the wave rules' programs per SM, measured
# as the rule on the H200 (docs/tuning.md); uncapped, the programs take 114-142 registers per thread with a bf16
# checkpoint, 216 with fp32 and two parts, 255 with three, no spills (K = 128, T = 4; sm_90, triton 3.6,
# benchmarks/spec_regs.py); the register caps below raise the programs resident per SM
MMA_WARPS = 4
MMA_VALUE_CHUNK = 32
MMA_PROGRAMS_PER_SM = 2
# with a bf16 checkpoint (two operand parts), where no value tile's grid fits one wave: the narrowest whose grid fits
# this many waves, else all of V (HV32 B8 on the H200: 64-row tiles, 512 programs, 15.77 us a verify + commit step
# against 16.92 with one 128-row tile; with an fp32 checkpoint 64-row tiles were slower, 26.50 against 24.42;
# docs/tuning.md, "The verify form")
MMA_BF16_STATE_WAVES = 2
# a folding row's checkpoint rows stored from the chunk loop (``fold_in_chunks``) rather than in a pass over the tile
# before it, under a register cap. With a bf16 checkpoint always, capped at MMA_BF16_STATE_MAXNREG registers per thread,
# 4 programs per SM (uncapped the chunk-loop form takes 138-140, 3 per SM; capped it keeps nothing on the stack since
# the fold's product accumulates onto the checkpoint rows). Verify + commit on the H200 against the uncapped plans
# before the cap (the fold's pass, the chunk loop at HV32 B32): HV32 B1 / 8 / 32 / 128 6.76 / 14.97 / 35.47 / 118.01 us
# against 6.91 / 15.75 / 38.29 / 123.02 (with that product form 14.68 / 34.45 / 115.08 at B8 / 32 / 128); HV8 B8 / 32
# 8.72 / 15.22 against 9.04 / 16.02. With an fp32 checkpoint where one value tile covers V (B8 / 32 / 128: 14-22% faster
# than the pass; at B1, 32-row tiles, 7.95 us against the pass's 7.50), the 216-register programs (2 per SM) capped at
# MMA_FP32_STATE_MAXNREG (3 per SM, 88 B on the stack) where the grid passes MMA_FP32_CAP_WAVES waves of 2 per SM: B128
# 169.58 us against 175.99; B32 (3.9 waves) 52.47 against 52.22, B8 (one wave) 19.35 against 16.81 (docs/tuning.md, "The
# verify form")
MMA_BF16_STATE_MAXNREG = 128
MMA_FP32_STATE_MAXNREG = 168
MMA_FP32_CAP_WAVES = 4
# value rows per step of a folding program's pass over its tile: [16, K] tiles whatever the chunk loop's size, so
# the rare fold keeps the registers of the every-step loop free (32-row fold steps spilled on sm_90)
MMA_FOLD_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class VerifyProblem:
    """What a verify launch plan depends on. ``gate_bounded``: a ``lower_bound`` gate that cannot take a pre-decayed
    cumulative gate past the rebase bound within a ring (``(L-1) * |lower_bound| <= 75``)."""

    batch: int
    drafts: int
    num_q_heads: int
    num_v_heads: int
    key_dim: int
    value_dim: int
    ring_length: int
    state_dtype: torch.dtype
    cache_dtype: torch.dtype
    device_type: str
    sm_count: int
    ring_layout: str
    tree: bool
    use_l2norm: bool
    use_lower_bound: bool
    gate_bounded: bool
    activation_dtype: torch.dtype  # mixed_qkv's: the values' and the outputs'


@dataclasses.dataclass(frozen=True)
class VerifyPlan:
    """Every compile-time choice of one verify launch (``str(plan)`` prints them all). Grid: one program per (row,
    q/k head, value head of it, value tile of ``value_tile`` rows), ``num_warps`` warps, ``value_chunk`` rows per
    step. The rest are the kernel's constexprs of the same names."""

    value_tile: int
    value_chunk: int
    num_warps: int
    tensor_cores: bool  # the tensor-core kernel (kernels/verify_mma.py), else the CUDA-core one (kernels/verify.py)
    operand_parts: int  # tensor cores: bf16 parts per fp32 operand (2: ~2^-16, 3: ~2^-24 relative)
    draft_block: int
    predecayed_ring: int  # 0 sglang layout; pre-decayed: 1 no rebase possible, 2 rebases
    tree: bool
    tile_readers: int
    named_block: int
    on_gpu: bool
    ring_length: int
    ring_block: int
    use_l2norm: bool
    use_lower_bound: bool
    batched_reductions: bool = False  # tensor cores: the prologue's per-draft sums over K (norms, couplings, the
    # rebase test's minima) as one reduction over a tuple each (one barrier across the warps, not one per sum)
    chunk_prefetch: bool = True  # tensor cores: each chunk's loads issued during the previous chunk's math (False:
    # at the chunk's start, fewer registers per thread)
    fold_in_chunks: bool = False  # tensor cores: a folding row's checkpoint rows stored from the chunk loop (the
    # drafts' products read the committed state as S0 and the ring, as a row that does not fold), not in a pass
    # over the tile before it
    maxnreg: int | None = None  # ptxas register cap per thread, a Triton launcher option beside the Helion config
    early_params: bool = False  # tensor cores: the gate's parameters (dt_bias row, A_log) loaded beside the drafts'
    # inputs, not after the norms' reduction and its barriers (a plan edit: -1.7% to +0.4% on the H200, not adopted;
    # docs/tuning.md)
    merged_sums: bool = False  # tensor cores with batched_reductions: the norms, the drafts' couplings and the rebase
    # test summed in one reduction (the couplings on the raw inputs, scaled by the norms after it; the rebase test a
    # count: verify_math.merged_terms), not three (on wherever batched_reductions is: 3.2-5.5% faster on the H200
    # up to B = 32; docs/tuning.md)

    def __str__(self) -> str:
        return "VerifyPlan(" + ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)) + ")"

    @property
    def kernel(self) -> helion.Kernel:
        """The compiled kernel object of this plan's form and launch shape."""
        if self.tensor_cores:
            from .verify_mma import verify_mma_kernel_for

            return verify_mma_kernel_for(self.value_tile, self.num_warps)
        from .verify import verify_kernel_for

        return verify_kernel_for(self.value_tile, self.num_warps)

    @property
    def config(self) -> helion.Config:
        """The Helion config (the compiled kernel is cached by ``(form, value_tile, num_warps)``)."""
        return self.kernel.configs[0]

    def constexprs(self) -> dict[str, object]:
        """The kernel's constexpr arguments, by name."""
        common = dict(draft_block=self.draft_block, ring_length=self.ring_length, ring_block=self.ring_block,
                      value_chunk=self.value_chunk, use_l2norm=self.use_l2norm, use_lower_bound=self.use_lower_bound,
                      predecayed_ring=self.predecayed_ring, tree=self.tree, tile_readers=self.tile_readers,
                      named_block=self.named_block, on_gpu=self.on_gpu)
        if self.tensor_cores:
            return dict(common, columns=self.columns, operand_parts=self.operand_parts, fold_chunk=MMA_FOLD_CHUNK,
                        batched_reductions=self.batched_reductions, chunk_prefetch=self.chunk_prefetch,
                        fold_in_chunks=self.fold_in_chunks, early_params=self.early_params,
                        merged_sums=self.merged_sums)
        return dict(common, doubling_steps=self.draft_block.bit_length() - 1)

    @property
    def columns(self) -> int:
        """The tensor-core products' columns ``N``: every draft's k and q product, a power of two >= 16."""
        return max(16, 1 << (2 * self.draft_block - 1).bit_length())

    def check(self, problem: VerifyProblem) -> None:
        """``ValueError`` unless this plan can run ``problem``."""
        want = plan_verify(problem)
        for name in ("draft_block", "predecayed_ring", "tree", "named_block", "on_gpu", "ring_length", "ring_block",
                     "use_l2norm", "use_lower_bound"):
            if getattr(self, name) != getattr(want, name):
                raise ValueError(f"VerifyPlan: `{name}` is {getattr(self, name)!r} but this call needs "
                                 f"{getattr(want, name)!r} ({self})")
        if self.tile_readers != -(-problem.value_dim // self.value_tile):
            raise ValueError(f"VerifyPlan: `tile_readers` must be ceil(V / value_tile) = "
                             f"{-(-problem.value_dim // self.value_tile)}; got {self.tile_readers}")
        if self.value_chunk < 1 or self.value_chunk & (self.value_chunk - 1) or self.value_chunk > self.value_tile:
            raise ValueError(f"VerifyPlan: `value_chunk` must be a power of two in [1, value_tile]; got "
                             f"{self.value_chunk}")
        if self.tensor_cores:
            why = tensor_core_refusal(problem)
            if why:
                raise ValueError(f"VerifyPlan: `tensor_cores` cannot run this call: {why}")
            if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
                raise ValueError(f"VerifyPlan: `maxnreg` must be None or in [24, 255]; got {self.maxnreg}")
            if self.value_chunk < 16 or self.operand_parts not in (2, 3):
                raise ValueError(f"VerifyPlan: the tensor-core form needs `value_chunk` >= 16 and `operand_parts` "
                                 f"2 or 3; got {self.value_chunk} and {self.operand_parts}")
            if self.merged_sums and not self.batched_reductions:
                raise ValueError("VerifyPlan: `merged_sums` is a form of the batched reductions: it needs "
                                 "`batched_reductions` (replace both: batched_reductions=False, merged_sums=False)")
        else:
            for name, default in (("batched_reductions", False), ("chunk_prefetch", True), ("fold_in_chunks", False),
                                  ("maxnreg", None), ("early_params", False), ("merged_sums", False)):
                if getattr(self, name) != default:
                    raise ValueError(f"VerifyPlan: `{name}` is a choice of the tensor-core form; this plan is the "
                                     "CUDA-core form (tensor_cores=False)")


def problem_of(call: VerifyCall, dims: VerifyDims, ring_layout: str) -> VerifyProblem:
    """The :class:`VerifyProblem` of a validated call."""
    lb = call.lower_bound
    bounded = lb is not None and (dims.ring_length - 1) * abs(lb) <= PREDECAYED_MAX_LOG_DECAY
    device = call.mixed_qkv.device
    return VerifyProblem(dims.batch, dims.drafts, dims.num_q_heads, dims.num_v_heads, dims.key_dim, dims.value_dim,
                         dims.ring_length, call.initial_state.dtype, call.d_cache.dtype, device.type,
                         _sm_count(device), ring_layout, call.parents is not None,
                         bool(call.use_qk_l2norm_in_kernel), lb is not None, bounded, call.mixed_qkv.dtype)


def tensor_core_refusal(problem: VerifyProblem) -> str:
    """Why the tensor-core form cannot run ``problem`` ('' when it can): it takes pre-decayed bf16 rings (exact MMA
    operands), power-of-two key and value widths of at least 16 (MMA tiles) and at most :data:`MMA_MAX_DRAFTS`
    drafts (32 product columns)."""
    if problem.ring_layout != "predecayed":
        return f"the {problem.ring_layout!r} ring layout (it runs the pre-decayed one)"
    if problem.cache_dtype != torch.bfloat16:
        return f"a {problem.cache_dtype} ring cache (it needs bf16)"
    for name, n in (("key_dim", problem.key_dim), ("value_dim", problem.value_dim)):
        if n < 16 or n & (n - 1):
            return f"`{name}` {n} (a power of two >= 16)"
    if problem.drafts > MMA_MAX_DRAFTS:
        return f"{problem.drafts} drafts (at most {MMA_MAX_DRAFTS})"
    return ""


def _one_wave_tile(candidates: tuple[int, ...], full: int, pairs: int, V: int, wave: int) -> int:
    """The narrowest value tile of ``candidates`` (below ``full``) whose grid of ``pairs * ceil(V / tile)`` programs
    fits one wave of ``wave`` programs, else ``full``."""
    return next((c for c in candidates if c < full and pairs * -(-V // c) <= wave), full)


def _register_cap(problem: VerifyProblem, programs: int, sms: int) -> int | None:
    """The tensor-core form's ``maxnreg`` (:data:`MMA_BF16_STATE_MAXNREG`, :data:`MMA_FP32_STATE_MAXNREG`); None on a
    CPU (the interpreter has no registers)."""
    if problem.device_type != "cuda":
        return None
    if problem.state_dtype != torch.float32:
        return MMA_BF16_STATE_MAXNREG
    return MMA_FP32_STATE_MAXNREG if programs > MMA_FP32_CAP_WAVES * MMA_PROGRAMS_PER_SM * sms else None


@functools.lru_cache(maxsize=4096)
def plan_verify(problem: VerifyProblem, *, tensor_cores: bool | None = None) -> VerifyPlan:
    """The launch plan of ``problem`` (module docstring). ``tensor_cores``: None takes the tensor-core form wherever
    it can run; False the CUDA-core form; True the tensor-core form (``ValueError`` with the reason where it cannot
    run)."""
    why = tensor_core_refusal(problem)
    if tensor_cores and why:
        raise ValueError(f"plan_verify: the tensor-core form cannot run this call: {why}")
    V = problem.value_dim
    full = max(16, 1 << (V - 1).bit_length())
    pairs = problem.batch * problem.num_v_heads
    sms = problem.sm_count if problem.device_type == "cuda" else H200_SMS
    if problem.device_type == "cuda":
        vt = _one_wave_tile((16, 32, 64), full, pairs, V, PROGRAMS_PER_SM * sms)
    else:  # the interpreter: small tiles, so tests reach the multi-tile paths
        vt = min(full, 16)
    if problem.ring_layout == "sglang":
        mode = 0
    elif problem.gate_bounded:
        mode = 1
    else:
        mode = 2
    draft_block = max(2, 1 << (problem.drafts - 1).bit_length())
    mma = not why if tensor_cores is None else tensor_cores
    parts = MMA_OPERAND_PARTS_FP32  # (the CUDA-core form has no parts)
    if mma:  # 4-warp programs of 32-row chunks; the narrowest value tile of at least a chunk whose grid fits one wave
        warps = MMA_WARPS
        if problem.device_type == "cuda":
            vt = _one_wave_tile((32, 64), full, pairs, V, MMA_PROGRAMS_PER_SM * sms)
            if vt == full and problem.state_dtype == torch.bfloat16:
                vt = _one_wave_tile((32, 64), full, pairs, V, MMA_BF16_STATE_WAVES * MMA_PROGRAMS_PER_SM * sms)
        vt = max(16, min(vt, full))
        chunk = min(vt, MMA_VALUE_CHUNK)
        if problem.state_dtype != torch.float32 or problem.activation_dtype != torch.float32:
            parts = MMA_OPERAND_PARTS
    else:
        warps, chunk = NUM_WARPS, min(vt, max(1, CHUNK_DRAFT_ROWS // draft_block))
    return VerifyPlan(
        value_tile=vt, value_chunk=chunk, num_warps=warps, tensor_cores=mma, operand_parts=parts,
        batched_reductions=mma, merged_sums=mma,
        fold_in_chunks=mma and (problem.state_dtype != torch.float32 or vt >= V),
        maxnreg=_register_cap(problem, pairs * -(-V // vt), sms) if mma else None,
        draft_block=draft_block, predecayed_ring=mode, tree=problem.tree,
        tile_readers=-(-V // vt),
        named_block=min(NAMED_BLOCK, max(16, 1 << (problem.batch - 1).bit_length())),
        on_gpu=problem.device_type == "cuda", ring_length=problem.ring_length,
        ring_block=max(16, 1 << (problem.ring_length - 1).bit_length()), use_l2norm=problem.use_l2norm,
        use_lower_bound=problem.use_lower_bound)
