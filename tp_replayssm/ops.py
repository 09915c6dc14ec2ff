"""``replayssm_decode``: the Helion ReplaySSM decode op (SPEC section 1, fixed signature).

Validates every argument (``ValueError`` before anything is written), builds the kernel's views
without copying any cache, and launches the kernel of :mod:`tp_replayssm.kernel` on
the inputs' device, whatever the current device is. There is no fallback to the reference: on a machine
without CUDA the kernel runs only under an interpreter (``TRITON_INTERPRET=1``).
:func:`replayssm_decode_predecayed` is the same op on the pool's pre-decayed ring layout (any gate).
"""

from __future__ import annotations

import math
import os
import weakref

import torch

from . import direct_launch
from . import kernel as _kernel
from ._interpreter import install_libdevice_shim
from ._validation import PREDECAYED_MAX_LOG_DECAY, DecodeDims, resolve_scale, validate_decode_inputs_once
from .configs import count_after_loads, rebase_pass, select_config, tiny_batch, vector_tiles


def _rows_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Overlapping ``[span, last]`` view of a 4-D tensor with contiguous last dim, and its outer strides.

    Row ``r`` of the view is the ``last`` contiguous elements starting at element ``r`` of ``t``, so
    element ``[i, j, l, :]`` of ``t`` is row ``i*s0 + j*s1 + l*s2``. Cached per tensor object (the caches
    are the same tensors every step): the entry dies with the tensor and is rebuilt if its data pointer,
    shape or strides changed.
    """
    key = id(t)
    meta = (t.data_ptr(), t.shape, t.stride())
    hit = _ROWS_VIEWS.get(key)
    if hit is not None and hit[0]() is t and hit[1] == meta:
        return hit[2]
    s0, s1, s2, _ = t.stride()
    span = sum((n - 1) * s for n, s in zip(t.shape[:3], (s0, s1, s2))) + 1
    # from a detached alias, so the cached view does not keep the key tensor alive
    view = t.detach().as_strided((span, t.shape[3]), (1, 1), t.storage_offset()), (s0, s1, s2)
    _ROWS_VIEWS[key] = (weakref.ref(t, lambda _, key=key: _ROWS_VIEWS.pop(key, None)), meta, view)
    return view


def _vector_tiles_view(rows: torch.Tensor, K: int, element_size: int) -> torch.Tensor:
    """A rows view ``[span, K]`` (the checkpoint's, or the k ring's split like it) as ``[Ko, span, Ki, kv]``, the same
    elements: ``K = Ko*Ki*kv`` split into ``kv``-element vectors (16 bytes of ``element_size``, the checkpoint's),
    ``Ki = VECTORS_PER_LANE`` of them per thread. The kernel's append loop loads its ``[Ko, Vc, Ki, kv]`` tiles from
    it (and the pre-decayed prologue its ``[Ko, Lb, Ki, kv]`` key tiles), which Triton lays out with ``Ko`` lanes
    along K and the rows across the other lanes of the warp: a row's dot product is then summed in its thread and
    over ``Ko`` lanes (log2(Ko) shuffles), not over the 16 or 32 lanes of a ``[rows, K]`` tile."""
    kv = math.gcd(K, 16 // element_size)
    ki = math.gcd(K // kv, VECTORS_PER_LANE)
    ko = K // kv // ki
    return rows.as_strided((ko, rows.shape[0], ki, kv), (ki * kv, 1, kv, 1), rows.storage_offset())


# 16-byte vectors of a checkpoint row per thread in the append loop's tiles (_vector_tiles_view). sm_90, triton 3.6,
# HV4 B128 bf16 pre-decayed (64:16:1): the chunk loop 764 SASS instructions with [Vc, K] tiles, 510 with 4 vectors
# (8 lanes per row), 492-751 with 2 or 8 of them (spills); fp32 128:16:1: 661 -> 450 (4 vectors, 0 spills)
VECTORS_PER_LANE = 4


# id(tensor) -> (weakref to it, (data_ptr, shape, strides), (rows view, outer strides))
_ROWS_VIEWS: dict[int, tuple] = {}


def _interpreter_or_cuda(device: torch.device) -> None:
    if device.type == "cuda":
        return
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("HELION_INTERPRET") == "1":
        return
    raise ValueError(
        f"replayssm_decode: the Helion kernel needs CUDA tensors, got tensors on {device}; on a machine "
        "without a GPU set TRITON_INTERPRET=1 (before importing torch/helion) to run it in the Triton "
        "interpreter, or call tp_replayssm.reference.replayssm_decode explicitly"
    )


_ZERO_FLAGS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _no_flush(batch: int, device: torch.device) -> torch.Tensor:
    """A cached all-zero ``force_flush`` for callers that passed None (never written)."""
    key = (device, batch)
    t = _ZERO_FLAGS.get(key)
    if t is None:
        t = _ZERO_FLAGS[key] = torch.zeros(batch, dtype=torch.int32, device=device)
    return t


def replayssm_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor,
    d_cache: torch.Tensor,
    k_cache: torch.Tensor,
    g_cache: torch.Tensor,
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    write_pos: torch.Tensor,
    force_flush: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA ReplaySSM decode, one token per row, in place. Returns ``(out, initial_state)``.

    Shapes: ``mixed_qkv [B, 2HK+HV*V]``, ``a [B, HV*K]`` or ``[B, HV, K]``, ``b [B, HV]``,
    ``A_log [HV]``, ``dt_bias [HV*K]`` or ``[HV, K]``, ``initial_state [S, HV, V, K]``,
    ``d_cache [S, HV, L, V]``, ``k_cache [S, H, L, K]``, ``g_cache [S, HV, L, K]``,
    ``out [B, 1, HV, V]``, ``ssm_state_indices``/``write_pos``/``force_flush [B]`` int32.
    """
    return _decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
                   ssm_state_indices, write_pos, force_flush, use_qk_l2norm_in_kernel, lower_bound, False)


def replayssm_decode_predecayed(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor,
    d_cache: torch.Tensor,
    k_cache: torch.Tensor,
    g_cache: torch.Tensor,
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    write_pos: torch.Tensor,
    force_flush: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`replayssm_decode` on the pre-decayed ring layout (the pool's ``ring_layout="predecayed"``;
    :func:`tp_replayssm.reference.replayssm_decode_predecayed` is its oracle and spells out the rebase):
    ``g_cache [S, HV, L, K]`` holds cumulative gates ``G_j = g_0 + ... + g_j`` since the last flush or rebase
    and ``k_cache [S, HV, L, K]`` (one per VALUE head) the keys ``k_j * exp(-G_j)``, so the ring needs no scan
    and no exp per entry. Any gate; a bf16 or fp32 ring."""
    return _decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
                   ssm_state_indices, write_pos, force_flush, use_qk_l2norm_in_kernel, lower_bound, False, True)


def decode_with_cursor_table(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    scale: float | None, initial_state: torch.Tensor, d_cache: torch.Tensor, k_cache: torch.Tensor,
    g_cache: torch.Tensor, out: torch.Tensor, ssm_state_indices: torch.Tensor, cursors: torch.Tensor,
    force_flush: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
    lower_bound: float | None = None, predecayed: bool = False, advance: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`replayssm_decode` (or with ``predecayed``, :func:`replayssm_decode_predecayed`) with the cursors
    read by slot from a table ``cursors [S + 1]`` int32 (the pool's; row ``b``'s cursor is
    ``cursors[ssm_state_indices[b]]``), so the caller gathers nothing. ``advance``: the same launch then moves
    the cursors of the rows' slots as :func:`tp_replayssm.cursor_kernel.advance` would after it (0 after a
    flush, else ``c + 1``; padding rows move nothing); the slots must be distinct (the kernel counts each
    slot's readers: the module docstring of :mod:`tp_replayssm.kernel`)."""
    return _decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
                   ssm_state_indices, cursors, force_flush, use_qk_l2norm_in_kernel, lower_bound, True, predecayed,
                   advance)


def _decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,  # noqa: ANN001
            ssm_state_indices, write_pos, force_flush, use_l2norm, lower_bound,
            cursors_by_slot: bool, predecayed: bool = False, advance: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    dims = validate_decode_inputs_once(
        mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out,
        ssm_state_indices, write_pos, force_flush, lower_bound, cursors_by_slot=cursors_by_slot,
        predecayed=predecayed,
    )
    device = mixed_qkv.device
    _interpreter_or_cuda(device)
    if dims.batch == 0:
        return out, initial_state
    launch(dims, mixed_qkv, a, b, A_log, dt_bias, resolve_scale(scale, dims.key_dim), initial_state,
           d_cache, k_cache, g_cache, out, ssm_state_indices, write_pos,
           _no_flush(dims.batch, device) if force_flush is None else force_flush,
           bool(use_l2norm), lower_bound, cursors_by_slot, predecayed, advance)
    return out, initial_state


def launch(dims: DecodeDims, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float, initial_state: torch.Tensor,
           d_cache: torch.Tensor, k_cache: torch.Tensor, g_cache: torch.Tensor, out: torch.Tensor,
           slots: torch.Tensor, write_pos: torch.Tensor, force_flush: torch.Tensor,
           use_l2norm: bool, lower_bound: float | None, cursors_by_slot: bool = False,
           predecayed: bool = False, advance: bool = False) -> None:
    """Launch the kernel on inputs that :func:`validate_decode_inputs` accepted (``dims``); ``advance`` (with
    ``cursors_by_slot`` only) fuses the cursor advance (:func:`decode_with_cursor_table`). On CUDA a repeated
    call of the same metadata goes straight to the compiled kernel (:mod:`.direct_launch`)."""
    install_libdevice_shim()
    choice = select_config(dims, initial_state.dtype, mixed_qkv.device, d_cache.dtype, predecayed)
    config, value_chunk, maxnreg, mma_chunks = choice
    tiny = tiny_batch(dims)
    rebase = rebase_pass(choice)
    tiles = vector_tiles(choice, initial_state.dtype, dims.key_dim)
    readers = cursor_readers(dims, config) if advance else 0
    late_count = bool(advance) and count_after_loads(dims)
    if advance and not cursors_by_slot:
        raise ValueError("replayssm_decode: advance=True needs the pool's cursor table [S + 1] (cursors_by_slot=True); "
                         f"got per-row cursors `write_pos` {tuple(write_pos.shape)}")
    inputs = (mixed_qkv, a, b, A_log, dt_bias, initial_state, d_cache, k_cache, g_cache, out,
              slots, write_pos, force_flush)
    DIRECT_PLANS.launch(
        _kernel.decode_kernel_for(config), config,
        lambda: kernel_args(dims, mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache,
                            out, slots, write_pos, force_flush, use_l2norm, lower_bound, value_chunk,
                            cursors_by_slot, tiny, mma_chunks, predecayed, rebase, readers, tiles, late_count),
        inputs, mixed_qkv.device,
        (value_chunk, use_l2norm, lower_bound, cursors_by_slot, tiny, mma_chunks, predecayed, rebase, readers, tiles,
         late_count),
        KERNEL_ARG_INPUTS,
        {"scale": scale, "lower_bound": _lower_bound_arg(lower_bound)}, KERNEL_SCALAR_ARGS,
        None if maxnreg is None else {"maxnreg": maxnreg})


def _lower_bound_arg(lower_bound: float | None) -> float:
    return 0.0 if lower_bound is None else float(lower_bound)


# Direct-launch plans of the decode kernel
DIRECT_PLANS = direct_launch.PlanCache("replayssm_decode")
# For each position of kernel_args' tuple: the index, in launch()'s ``inputs``, of the tensor it is a
# view of (q3/k3/v3 of mixed_qkv, a3 of a, ..., the cache row views of their caches); None = scalar
KERNEL_ARG_INPUTS: tuple[int | None, ...] = (0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 5, 7, 9, 10, 11, 12) + (None,) * 26
# positions of the runtime scalars in kernel_args' tuple
KERNEL_SCALAR_ARGS = {17: "scale", 18: "lower_bound"}


def cursor_readers(dims: DecodeDims, config: object) -> int:
    """The kernel's ``advance_cursors`` for a fused advance: how many programs read one row's cursor (one per
    value head and value tile: ``HV * ceil(V / vt)``, ``vt`` the config's ``block_sizes[0]``). The count lives in
    the cursor table entry's upper 15 bits (:data:`tp_replayssm.kernel.CURSOR_READER`)."""
    vt = config.config["block_sizes"][0]  # type: ignore[attr-defined]
    readers = dims.num_v_heads * -(-dims.value_dim // vt)
    if readers >= 1 << 15 or dims.ring_length > _kernel.CURSOR_READER:
        raise ValueError(f"replayssm_decode: advance=True counts at most {(1 << 15) - 1} programs per row and "
                         f"rings of at most {_kernel.CURSOR_READER} entries; got {readers} programs "
                         f"(HV={dims.num_v_heads}, V={dims.value_dim}, value tile {vt}), L={dims.ring_length}")
    return readers


def kernel_args(dims: DecodeDims, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float, initial_state: torch.Tensor,
                d_cache: torch.Tensor, k_cache: torch.Tensor, g_cache: torch.Tensor, out: torch.Tensor,
                slots: torch.Tensor, write_pos: torch.Tensor, force_flush: torch.Tensor,
                use_l2norm: bool, lower_bound: float | None, value_chunk: int,
                cursors_by_slot: bool = False, tiny: bool = False, mma_chunks: bool = False,
                predecayed: bool = False, rebase_pass: bool = False, advance_cursors: int = 0,
                vector_tiles: int = 0, count_after_loads: bool = False) -> tuple:
    """The positional arguments of :func:`tp_replayssm.kernel.replayssm_decode_kernel`: views only,
    no copies (also used by ``benchmarks/kernel_regs.py`` to compile the kernel without a GPU).
    ``mma_chunks`` is the kernel's ``chunks_on_tensor_cores`` (:class:`tp_replayssm.configs.LaunchChoice`);
    ``predecayed`` (:func:`replayssm_decode_predecayed`) and ``rebase_pass`` (:func:`configs.rebase_pass`) set its
    ``predecayed_ring`` (:func:`predecayed_mode`); ``advance_cursors`` is :func:`cursor_readers` or 0;
    ``vector_tiles`` is :func:`configs.vector_tiles`, ``count_after_loads`` :func:`configs.count_after_loads` (with
    ``advance_cursors`` only)."""
    B, H, HV, K, V, L = dims.batch, dims.num_q_heads, dims.num_v_heads, dims.key_dim, dims.value_dim, dims.ring_length
    # one as_strided per view (a slice plus an unflatten costs twice the host time; eager decode pays it
    # on every call): q3/k3 [B, H, K] and v3 [B, HV, V] over mixed_qkv's columns, a3 [B, HV, K], out [B, HV, V]
    row, off = mixed_qkv.stride(0), mixed_qkv.storage_offset()
    q3 = mixed_qkv.as_strided((B, H, K), (row, K, 1), off)
    k3 = mixed_qkv.as_strided((B, H, K), (row, K, 1), off + H * K)
    v3 = mixed_qkv.as_strided((B, HV, V), (row, V, 1), off + 2 * H * K)
    a3 = a if a.dim() == 3 else a.as_strided((B, HV, K), (a.stride(0), K, 1), a.storage_offset())
    dt2 = dt_bias if dt_bias.dim() == 2 else dt_bias.as_strided((HV, K), (K, 1), dt_bias.storage_offset())
    out3 = out.as_strided((B, HV, V), (out.stride(0), out.stride(2), 1), out.storage_offset())
    state_rows, st = _rows_view(initial_state)
    d_rows, dr = _rows_view(d_cache)
    k_rows, kr = _rows_view(k_cache)
    g_rows, gr = _rows_view(g_cache)
    state_vecs = _vector_tiles_view(state_rows, K, initial_state.element_size())
    k_vecs = _vector_tiles_view(k_rows, K, initial_state.element_size())  # the checkpoint's split (ak's tiles)
    ring_block = max(16, 1 << (L - 1).bit_length())
    lb = _lower_bound_arg(lower_bound)
    return (q3, k3, v3, a3, b, A_log, dt2, state_rows, d_rows, k_rows, g_rows, state_vecs, k_vecs, out3,
            slots, write_pos, force_flush, scale, lb, *st, *dr, *kr, *gr,
            L, ring_block, value_chunk, use_l2norm, lower_bound is not None, cursors_by_slot, tiny, mma_chunks,
            predecayed_mode(predecayed, lower_bound, L, rebase_pass), advance_cursors, vector_tiles, count_after_loads)


def predecayed_mode(predecayed: bool, lower_bound: float | None, ring_length: int,
                    rebase_pass: bool = False) -> int:
    """The kernel's ``predecayed_ring``: 0 for the SPEC layout. For the pre-decayed one, 1 when the gate cannot
    take a cumulative gate past the rebase bound within a ring cycle (``lower_bound`` with ``(L-1) * |lower_bound|
    <= PREDECAYED_MAX_LOG_DECAY``): the rebase check is compiled out. Else the check is compiled in, and a
    rebasing head takes the flush branch (2), or, with ``rebase_pass`` (``configs.rebase_pass``: programs under
    a register cap), runs the append loop and then a rebase pass of its own (3). H200, sixteenth session
    (benchmarks/RESULTS.md): the flush branch's data-dependent choice spilled on the every-step path of the
    168-register programs (24 spill operations, triton 3.6; the pass: 5), and the pass took 2.5-6.6% off their
    steps; in the uncapped programs the pass was the slower one (fp32 B512 +3.5-5.8%, bf16 HV8 / HV16 B128 +4% /
    +2.7%)."""
    if not predecayed:
        return 0
    bounded = lower_bound is not None and (ring_length - 1) * abs(lower_bound) <= PREDECAYED_MAX_LOG_DECAY
    return 1 if bounded else 3 if rebase_pass else 2
