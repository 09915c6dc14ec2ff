"""Pinned Helion configs for the decode kernel, per device kind, state dtype and batch regime.

GPU configs come from a hand sweep on an H200 (``benchmarks/tune_decode.py``; ``benchmarks/RESULTS.md``):
the same value-tile rule won for fp32 and bf16 checkpoints. Every call gets the same Config object for
the same choice (the op caches compiled kernels by config identity). The CPU config serves the Triton
interpreter (``TRITON_INTERPRET=1``): pointer indexing, because the interpreter cannot run
``tensor_descriptor`` indexing.
"""

from __future__ import annotations

import functools

import torch

import helion

from ._validation import DecodeDims

# Set by benchmarks/tune_decode.py to time a candidate config; None in normal use.
FORCED_CONFIG: helion.Config | None = None

_CPU_INTERPRETER = helion.Config(block_sizes=[32], indexing="pointer", num_warps=4, num_stages=1)


def select_config(dims: DecodeDims, state_dtype: torch.dtype,
                  device: torch.device) -> tuple[helion.Config, helion.Config]:
    """The pinned (step, flush) configs for one call: ``block_sizes[0]`` is the value-tile width."""
    if device.type != "cuda":
        return _CPU_INTERPRETER, _CPU_INTERPRETER
    step = FORCED_CONFIG if FORCED_CONFIG is not None else _gpu_config(dims, state_dtype)
    return step, _FLUSH_GPU


_FLUSH_GPU = helion.Config(block_sizes=[32], indexing="pointer", num_warps=4, num_stages=1)


def _gpu_config(dims: DecodeDims, state_dtype: torch.dtype) -> helion.Config:
    programs_full = dims.batch * dims.num_v_heads  # programs when one program covers all of V
    if programs_full >= 512:
        vt = 128
    elif programs_full >= 128:
        vt = 64
    else:
        vt = 32
    return _step_config(min(vt, 1 << (dims.value_dim - 1).bit_length()))


@functools.lru_cache(maxsize=None)
def _step_config(vt: int) -> helion.Config:
    return helion.Config(block_sizes=[vt], indexing="pointer", num_warps=4, num_stages=1)
