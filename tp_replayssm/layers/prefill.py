"""A prefill's recurrence on the chosen backend, and the end of a prefill step (:func:`end_prefill`).

Backends (``prefill_backend``): ``"fla"`` runs flash-linear-attention's ``chunk_kda`` (imported lazily, the first
time it is needed; the package is the optional ``[fla]`` extra); ``"torch"`` runs
:func:`tp_replayssm.layers.kda_torch.chunk_kda_torch`; ``"auto"`` picks ``"fla"`` for CUDA tensors when FLA is
importable, else ``"torch"`` (so CPU tensors always take the PyTorch path). Both take the same raw inputs and give the
same outputs: ``o`` in the activation dtype and the final states in fp32.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..pool.agreement import same_call_on_every_rank
from ..pool.slots import check_ids, refuse_bad_ids
from .kda_torch import chunk_kda_torch, kda_activations

if TYPE_CHECKING:
    from ..pool.pool import ReplaySSMStatePool

__all__ = ["PREFILL_BACKENDS", "end_prefill", "fla_chunk_kda", "prefill_backend_for", "prefill_recurrence"]

logger = logging.getLogger(__name__)

PREFILL_BACKENDS = ("auto", "fla", "torch")


@functools.lru_cache(maxsize=1)
def fla_chunk_kda() -> Callable[..., Any] | None:
    """``fla.ops.kda.chunk_kda``, or None when flash-linear-attention is not importable (tried once)."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        logger.info("flash-linear-attention is not importable (%s: %s); KDA prefills take the PyTorch path",
                    type(exc).__name__, exc)
        return None
    return chunk_kda


_LOGGED: set[tuple[str, str]] = set()


def prefill_backend_for(backend: str, device: torch.device) -> str:
    """The backend a prefill on ``device`` runs (``"fla"`` or ``"torch"``); logged once per device type."""
    if backend == "auto":
        backend = "fla" if device.type == "cuda" and fla_chunk_kda() is not None else "torch"
    elif backend == "fla" and fla_chunk_kda() is None:
        raise ValueError("prefill_backend='fla' needs flash-linear-attention 0.6.0 (pip install tp_replayssm[fla])")
    if (backend, device.type) not in _LOGGED:
        _LOGGED.add((backend, device.type))
        logger.info("KDA prefill on %s: %s", device.type,
                    "flash-linear-attention's chunk_kda" if backend == "fla" else "the PyTorch chunked recurrence")
    return backend


def prefill_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, initial_state: torch.Tensor,
                       cu_seqlens: list[int], *, lower_bound: float | None, safe_gate: bool,
                       backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of packed sequences from the layer's raw post-conv projections.

    ``q, k [T, H, K]``, ``v [T, HV, V]``, ``a [T, HV*K]`` forget-gate logits, ``b [T, HV]`` beta logits (all in the
    activation dtype); ``A_log [HV]``, ``dt_bias [HV*K]``, ``initial_state [n, HV, V, K]`` fp32; ``cu_seqlens``
    host ints ``[n+1]``; ``backend`` ``"fla"`` or ``"torch"``. Returns ``(o [T, HV, V]`` in ``v.dtype``,
    ``final_state [n, HV, V, K]`` fp32``)``: the l2-normalized, scaled q/k, the gate and ``sigmoid(b)`` as the
    decode computes them."""
    T, HV, K = a.shape[0], v.shape[1], q.shape[2]
    if backend == "fla":
        chunk_kda = fla_chunk_kda()
        cu = torch.tensor(cu_seqlens, dtype=torch.long)
        with torch.no_grad():
            o, final = chunk_kda(
                q=q.contiguous()[None], k=k.contiguous()[None], v=v.contiguous()[None],
                g=a.reshape(1, T, HV, K).contiguous(), beta=b.contiguous()[None], A_log=A_log, dt_bias=dt_bias,
                initial_state=initial_state.float().contiguous(), output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=lower_bound, safe_gate=safe_gate, state_v_first=True,
                cu_seqlens=cu.to(q.device), cu_seqlens_cpu=cu)
        return o[0].to(v.dtype), final.float()
    qa, ka, g, beta = kda_activations(q, k, a.reshape(T, HV, K), b, A_log, dt_bias, lower_bound=lower_bound)
    o, final = chunk_kda_torch(qa, ka, v.to(qa.dtype), g, beta, initial_state, cu_seqlens)
    return o.to(v.dtype), final.float()


def end_prefill(pool: ReplaySSMStatePool, slots: torch.Tensor) -> None:
    """End a prefill step: set the cursors of ``slots [n]`` (int32 or int64 on ``pool.device``) to 0.

    A layer's prefill leaves the slots' checkpoints at the state after the prompt and their rings of that layer empty,
    but it keeps the cursor, which every layer shares: the layers after it still read their rings up to it. Once every
    layer has prefilled the slots, this makes the cursors 0 (the next decode appends at ring position 0), so a
    prefill leaves each slot's ring empty and its cursor at 0. ``TPKimiDeltaAttention(..., advance=True)`` on the
    step's last layer calls it. Ids out of range, not allocated, given twice or in an open verify step raise
    :class:`~tp_replayssm.errors.SlotError` before anything is written (a host check: a prefill syncs anyway)."""
    where = "end_prefill"
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        same_call_on_every_rank(pool, where, slots=slots)
    check_ids(slots, where, pool.device, (torch.int32, torch.int64))
    ids = [int(i) for i in slots.tolist()]
    refuse_bad_ids(pool, ids, where, unique=True)
    if ids:
        pool.cursors.index_fill_(0, slots.long(), 0)
