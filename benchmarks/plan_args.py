"""Launch plans from a command line: the library's plan for a shape, with fields overridden by name.

A benchmark times another launch by passing a plan (``tp_replayssm.kernels.plan.DecodePlan``), never by setting
globals. ``--override`` takes ``field=value`` pairs separated by commas, e.g. ``value_tile=64,vector_tiles=0`` or
``maxnreg=168,value_chunk=8`` (``maxnreg=none`` removes a cap); the names are ``DecodePlan``'s fields, checked when
the arguments are parsed, and ``DecodePlan.check`` rejects a plan the call cannot run.

Fields that the library derives from others follow an override of those others unless they are overridden too:
``value_chunk`` (at most ``value_tile``), ``advance_readers`` (from ``value_tile``, with the fused advance),
``vector_tiles`` (from the tile, chunk, warps and ``tensor_core_chunks``), ``chunk_stages`` (from
``tensor_core_chunks``), the pre-decayed rebase form ``predecayed_ring`` 2/3 (from ``maxnreg``) and, for a call with
the conv (``conv_kernel_size``), ``fused_conv`` (from ``value_tile``), ``conv_readers`` (from both) and
``relaxed_conv_count`` (mode 2 with ``early_qk``). So ``--override value_tile=64`` is the launch the library would
make if it chose 64-row value tiles, and ``--override early_qk=false`` the conv after the verdict with its fenced
count.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

__all__ = ["build_plan", "override_arg", "problem", "verify_override_arg"]


def _fields(plan_type: type | None = None) -> dict[str, type]:
    """The fields of ``plan_type`` (a plan dataclass; default ``DecodePlan``)."""
    if plan_type is None:
        from tp_replayssm.kernels.plan import DecodePlan

        plan_type = DecodePlan
    return {f.name: f.type for f in dataclasses.fields(plan_type)}


def override_arg(text: str, plan_type: type | None = None) -> dict[str, Any]:
    """``argparse`` type of ``--override``: ``field=value[,field=value...]`` of ``plan_type``'s fields (default
    ``DecodePlan``) -> dict, each value read as its field's type (``bool``: true/false/on/off; ``int``; ``int |
    None``: an int or ``none``)."""
    import difflib

    if not text:
        return {}
    fields = _fields(plan_type)
    out: dict[str, Any] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            near = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise argparse.ArgumentTypeError(f"expected field=value with field one of {sorted(fields)}; got "
                                             f"{item!r}{hint}")
        kind, v = str(fields[name]).replace(" ", ""), value.strip().lower()
        if "=" in v or " " in v:
            raise argparse.ArgumentTypeError(f"{name}: one field=value per item, items separated by commas; got "
                                             f"{item!r}")
        if kind == "bool":
            if v not in ("true", "false", "on", "off"):
                raise argparse.ArgumentTypeError(f"{name}: expected true or false; got {value!r}")
            out[name] = v in ("true", "on")
        elif v in ("none", "null") and "None" in kind:
            out[name] = None
        else:
            try:
                out[name] = int(v)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name}: expected an int{' or none' if 'None' in kind else ''}; "
                                                 f"got {value!r}") from None
    return out


def verify_override_arg(text: str) -> dict[str, Any]:
    """:func:`override_arg` for the fields of ``VerifyPlan`` (``benchmarks/bench_spec.py --override``)."""
    from tp_replayssm.kernels.verify_plan import VerifyPlan

    return override_arg(text, VerifyPlan)


def replace_verify(plan: Any, fields: dict[str, Any], value_dim: int) -> Any:
    """``plan`` (a ``VerifyPlan``) with ``fields`` replaced, and the fields that follow them where not given:
    ``tile_readers`` follows ``value_tile``; ``merged_sums`` (a form of the batched reductions) goes off with
    ``batched_reductions``."""
    fields = dict(fields)
    if "value_tile" in fields:
        fields.setdefault("tile_readers", -(-value_dim // fields["value_tile"]))
    if fields.get("batched_reductions") is False:
        fields.setdefault("merged_sums", False)
    return dataclasses.replace(plan, **fields)


def problem(*, batch: int, heads: int, q_heads: int | None = None, key_dim: int = 128, value_dim: int = 128,
            ring_length: int = 16, state: str = "fp32", cache: str = "bf16", layout: str = "predecayed",
            lower_bound: float | None = None, advance: bool = False, cursor_table: bool | None = None,
            use_l2norm: bool = True, device: str = "cuda", conv_kernel_size: int = 0) -> Any:
    """The ``DecodeProblem`` of a benchmark shape (an H200 plan when ``device`` is "cuda" on any machine;
    ``conv_kernel_size``: the pool's conv W when ``mixed_qkv`` is pre-conv)."""
    import torch

    from tp_replayssm.kernels.grid import H200_SMS
    from tp_replayssm.kernels.plan import DecodeProblem
    from tp_replayssm.validation import PREDECAYED_MAX_LOG_DECAY

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" and \
        torch.cuda.is_available() else H200_SMS
    bounded = lower_bound is not None and (ring_length - 1) * abs(lower_bound) <= PREDECAYED_MAX_LOG_DECAY
    return DecodeProblem(batch, q_heads or heads, heads, key_dim, value_dim, ring_length, dt[state], dt[cache],
                         device, sms, layout, advance if cursor_table is None else cursor_table, advance, use_l2norm,
                         lower_bound is not None, bounded, conv_kernel_size)


def build_plan(*, override: str | dict[str, Any] = "", fuse_conv: bool | None = None,
               **problem_kwargs: Any) -> Any:
    """The library's plan for ``problem(**problem_kwargs)`` (``fuse_conv``: as :func:`plan_decode`'s; None is the
    library's choice) with ``override`` applied and checked."""
    from tp_replayssm.kernels.plan import plan_decode

    prob = problem(**problem_kwargs)
    changes = override_arg(override) if isinstance(override, str) else dict(override)
    plan = dataclasses.replace(plan_decode(prob, fuse_conv=fuse_conv), **changes)
    plan = dataclasses.replace(plan, **_derived(prob, plan, changes))
    plan.check(prob)
    return plan


def _derived(prob: Any, plan: Any, changes: dict[str, Any]) -> dict[str, Any]:
    """The derived fields (module docstring) of ``plan`` recomputed after ``changes``, except those ``changes``
    names itself."""
    from tp_replayssm.kernels.grid import MMA_CHUNK_STAGES, _vector_tiles
    from tp_replayssm.kernels.plan import conv_readers, cursor_readers, fused_conv_mode

    out: dict[str, Any] = {}

    def follow(field: str, inputs: tuple[str, ...], value: Any) -> None:
        if field not in changes and any(name in changes for name in inputs):
            out[field] = value() if callable(value) else value

    follow("value_chunk", ("value_tile",), lambda: min(plan.value_chunk, plan.value_tile))
    chunk = out.get("value_chunk", plan.value_chunk)
    follow("chunk_stages", ("tensor_core_chunks",), MMA_CHUNK_STAGES if plan.tensor_core_chunks else 0)
    follow("vector_tiles", ("value_tile", "value_chunk", "num_warps", "tensor_core_chunks"),
           lambda: _vector_tiles(prob, plan.value_tile, chunk, plan.num_warps, plan.tensor_core_chunks))
    if prob.advance:
        follow("advance_readers", ("value_tile",), lambda: cursor_readers(prob, plan.value_tile))
    if plan.predecayed_ring in (2, 3):  # unbounded gates: the rebase pass (3) goes with a register cap
        follow("predecayed_ring", ("maxnreg",), 3 if plan.maxnreg is not None else 2)
    if prob.conv_kernel_size:  # the fused conv's mode follows the value tile; its reader count the mode
        follow("fused_conv", ("value_tile",), lambda: fused_conv_mode(prob, plan.value_tile)[0])
        fused = out.get("fused_conv", plan.fused_conv)
        follow("conv_readers", ("value_tile", "fused_conv"),
               lambda: conv_readers(prob, plan.value_tile) if fused == 2 else 0)
        follow("relaxed_conv_count", ("value_tile", "fused_conv", "early_qk"),
               lambda: fused == 2 and plan.early_qk)
    return out
