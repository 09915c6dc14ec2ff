"""The verify call of speculative decoding as one structure, and the checks of verify's and commit's arguments.

:class:`VerifyCall` bundles what one layer's ``pool.verify`` hands its kernel (or the PyTorch path): the drafts'
activations, the layer's caches, the cursor table and the pool's two small spec tensors. :func:`validate_verify`
checks the caller's arguments by metadata only (no device sync) and returns the call's sizes
(:class:`VerifyDims`); :func:`validate_commit` does the same for ``pool.commit``. A failure is a ``ValueError``
naming the argument, the expected value and the actual one, raised before anything is written.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .validation import ACTIVATION_DTYPES, _batch, _check_scalars, check_tensor, describe

__all__ = ["VerifyCall", "VerifyDims", "validate_commit", "validate_verify"]


class VerifyCall(NamedTuple):
    """One layer's verify of ``T`` draft tokens per row (shapes local to the shard).

    ``mixed_qkv [B, T, 2*H*K + HV*V]`` (post-conv), ``a [B, T, HV*K]`` or ``[B, T, HV, K]``, ``b [B, T, HV]``,
    ``A_log [HV]``, ``dt_bias [HV*K]`` or ``[HV, K]``, the layer's ``initial_state [S, HV, V, K]``, ``d_cache
    [S, HV, L, V]``, ``k_cache [S, HV or H, L, K]``, ``g_cache [S, HV, L, K]``, ``out [B, T, HV, V]``, ``slots [B]``
    int32, the pool's ``cursors [S + 1]``, ``parents [B, T]`` int32 or None (a chain), the layer's ``folded [S + 1]``
    int32 (1: the slot's committed ring was folded by this step's verify, until commit) and the pool's ``counters
    [S + 1, HV + H]`` int32 (zero between launches; the kernel's per-head reader counts)."""

    mixed_qkv: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    scale: float | None
    initial_state: torch.Tensor
    d_cache: torch.Tensor
    k_cache: torch.Tensor
    g_cache: torch.Tensor
    out: torch.Tensor
    slots: torch.Tensor
    cursors: torch.Tensor
    parents: torch.Tensor | None
    folded: torch.Tensor
    counters: torch.Tensor
    use_qk_l2norm_in_kernel: bool = True
    lower_bound: float | None = None


@dataclasses.dataclass(frozen=True)
class VerifyDims:
    """Sizes of one verify call (local to the shard)."""

    batch: int  # B
    drafts: int  # T
    num_q_heads: int  # H
    num_v_heads: int  # HV
    key_dim: int  # K
    value_dim: int  # V
    ring_length: int  # L
    num_slots: int  # S

    @property
    def group(self) -> int:
        """``r = HV // H``: value heads per q/k head."""
        return self.num_v_heads // self.num_q_heads


def _fail(where: str, arg: str, expected: str, actual: object) -> ValueError:
    return ValueError(f"{where}: `{arg}` must be {expected}; got {actual}")


def validate_verify(mixed_qkv: object, a: object, b: object, A_log: object, dt_bias: object, slots: object,
                    parents: object, out: object, scale: object, lower_bound: object, *, num_q_heads: int,
                    num_v_heads: int, key_dim: int, value_dim: int, ring_length: int, num_slots: int,
                    device: torch.device, where: str, use_l2norm: object = True) -> VerifyDims:
    """Check the caller's arguments of one verify (the pool's own tensors are right by construction)."""
    H, HV, K, V, L = num_q_heads, num_v_heads, key_dim, value_dim, ring_length
    D = 2 * H * K + HV * V
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 3 or mixed_qkv.shape[2] != D:
        raise _fail(where, "mixed_qkv", f"a 3-D tensor [B, T, D] with D = 2*H*K + HV*V = {D} (this rank's "
                    "columns)", describe(mixed_qkv))
    # the batch most per-row tensors share (the slots' on a tie): the error names the tensor that disagrees
    B, T = _batch(where, {"mixed_qkv": mixed_qkv, "a": a, "b": b, "slots": slots, "parents": parents,
                          "out": out}), mixed_qkv.shape[1]
    if not 1 <= T <= L - 1:
        raise _fail(where, "mixed_qkv", f"[B, T, D] with 1 <= T <= ring_length - 1 = {L - 1} draft tokens",
                    f"T = {T} (shape {list(mixed_qkv.shape)})")
    check_tensor(where, "mixed_qkv", mixed_qkv, ((B, T, D),), ACTIVATION_DTYPES)
    check_tensor(where, "a", a, ((B, T, HV * K), (B, T, HV, K)), ACTIVATION_DTYPES)
    check_tensor(where, "b", b, ((B, T, HV),), ACTIVATION_DTYPES)
    check_tensor(where, "A_log", A_log, ((HV,),), (torch.float32,))
    check_tensor(where, "dt_bias", dt_bias, ((HV * K,), (HV, K)), (torch.float32,))
    check_tensor(where, "slots", slots, ((B,),), (torch.int32,), last_contiguous=False)
    if parents is not None:
        check_tensor(where, "parents", parents, ((B, T),), (torch.int32,))
    if out is not None:
        check_tensor(where, "out", out, ((B, T, HV, V),), (mixed_qkv.dtype,))
    _check_scalars(where, scale, lower_bound, use_l2norm)
    for name, t in (("mixed_qkv", mixed_qkv), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias),
                    ("slots", slots), ("parents", parents), ("out", out)):
        if t is not None and t.device != device:
            raise _fail(where, name, f"on the pool's device {device}", t.device)
    return VerifyDims(batch=B, drafts=T, num_q_heads=H, num_v_heads=HV, key_dim=K, value_dim=V, ring_length=L,
                      num_slots=num_slots)


def validate_commit(slots: object, num_accepted: object, path: object, *, batch: int, drafts: int,
                    device: torch.device, where: str) -> None:
    """``slots [B]`` and ``num_accepted [B]`` int32, ``path [B, T]`` int32 or None, all on the pool's device, with the
    ``B`` and ``T`` of the step's verify."""
    for name, t, shape in (("slots", slots, (batch,)), ("num_accepted", num_accepted, (batch,)),
                           ("path", path, (batch, drafts))):
        if name == "path" and t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.int32 \
                or t.device != device:
            raise _fail(where, name, f"an int32 tensor of shape {list(shape)} on {device} (B = {batch} rows and "
                        f"T = {drafts} drafts of this step's verify)", describe(t))
