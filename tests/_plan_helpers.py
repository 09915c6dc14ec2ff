"""What the decode-plan test modules share: the devices and dtypes, a call's :class:`DecodeProblem` and the library's
plan for it (the GPU plans planned for an H200, 132 SMs, where no GPU answers), and a plan's launch grid.
"""

from __future__ import annotations

import torch

from tp_replayssm.kernels.plan import DecodePlan, DecodeProblem, plan_decode, problem_of
from tp_replayssm.validation import DecodeDims

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
