"""Input validation shared by the Helion op and the PyTorch reference.

Every check runs on metadata only (shape, dtype, stride, device): nothing here syncs with the device,
and nothing is written before all checks passed. Each failure is a ``ValueError`` that names the
argument, the expected value and the actual one. The op runs the tensor checks once per metadata signature
(:func:`validate_decode_inputs_once`); the reference runs them on every call.
"""

from __future__ import annotations

import dataclasses
import math

import torch

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The pre-decayed ring layout (:func:`check_predecayed_layout`) stores keys ``k_j * exp(-G_j)``; a (row, value
# head) whose cumulative gate ``G_c`` would fall below -75 in any key lane rebases
# its ring instead of appending (``reference.replayssm_decode_predecayed``). fp32 and bf16 reach exp(88.7), so
# 75 leaves keys up to exp(13.7) ~ 9e5 in magnitude (l2-normalized keys are at most 1); and where exp(G_c)
# underflows (G_c < -87.3) a stored key times it loses at most exp(75 - 87.3) ~ 4.4e-6 of |k|
PREDECAYED_MAX_LOG_DECAY = 75.0
PREDECAYED_CACHE_DTYPES = (torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class DecodeDims:
    """Sizes of one decode call (all local to the shard the call runs on)."""

    batch: int  # B
    num_q_heads: int  # H
    num_v_heads: int  # HV
    key_dim: int  # K
    value_dim: int  # V
    ring_length: int  # L
    num_slots: int  # S

    @property
    def group(self) -> int:
        """r = HV // H: value heads per q/k head."""
        return self.num_v_heads // self.num_q_heads


def _fail(arg: str, expected: str, actual: object) -> ValueError:
    return ValueError(f"replayssm_decode: `{arg}` must be {expected}; got {actual}")


def check_predecayed_layout(cache_dtype: torch.dtype, where: str) -> None:
    """The pre-decayed ring layout stores keys up to ``exp(PREDECAYED_MAX_LOG_DECAY)`` times ``k``: a bf16 or fp32
    ring (fp16 tops out at exp(11)); ``ValueError`` naming the argument otherwise."""
    if cache_dtype not in PREDECAYED_CACHE_DTYPES:
        raise ValueError(f"{where}: the pre-decayed ring layout needs a cache dtype in "
                         f"{list(PREDECAYED_CACHE_DTYPES)} (its keys reach exp({PREDECAYED_MAX_LOG_DECAY:g})); "
                         f"got {cache_dtype}")


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _check_tensor(
    name: str,
    t: object,
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    *,
    last_contiguous: bool = True,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(t).__name__)
    if tuple(t.shape) not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise _fail(name, f"of shape {expected}", _shape(t))
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise _fail(name, f"of dtype {expected}", t.dtype)
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise _fail(name, "contiguous in its last dim (stride(-1) == 1)", f"strides {list(t.stride())}")
    return t


def validate_decode_inputs(
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
    force_flush: torch.Tensor | None,
    lower_bound: float | None,
    *,
    cursors_by_slot: bool = False,
    predecayed: bool = False,
) -> DecodeDims:
    """Check every argument of ``replayssm_decode`` against SPEC section 1; return the sizes.

    ``cursors_by_slot``: ``write_pos`` is a cursor table ``[S + 1]`` indexed by slot (the pool's), not
    one cursor per row ``[B]``. ``predecayed``: the pre-decayed ring layout (``ops.replayssm_decode_predecayed``):
    ``k_cache [S, HV, L, K]`` (H then comes from ``mixed_qkv``'s width) and a bf16 or fp32 ring."""
    if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4:
        raise _fail("initial_state", "a 4-D tensor [S, HV, V, K]", _describe(initial_state))
    S, HV, V, K = initial_state.shape
    if not isinstance(d_cache, torch.Tensor) or d_cache.dim() != 4:
        raise _fail("d_cache", "a 4-D tensor [S, HV, L, V]", _describe(d_cache))
    L = d_cache.shape[2]
    if L < 1:
        raise _fail("d_cache", "a ring of length L >= 1 (dim 2)", f"L = {L}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise _fail("k_cache", f"a 4-D tensor [S, {'HV' if predecayed else 'H'}, L, K]", _describe(k_cache))
    if S < 1 or HV < 1 or K < 1 or V < 1:
        raise _fail("initial_state", "non-empty [S, HV, V, K]", _shape(initial_state))
    if predecayed:  # the k ring is per value head: the q/k heads come from mixed_qkv's width 2*H*K + HV*V
        if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2:
            raise _fail("mixed_qkv", "a 2-D tensor [B, 2*H*K + HV*V]", _describe(mixed_qkv))
        qk_width = mixed_qkv.shape[1] - HV * V
        H = qk_width // (2 * K)
        if qk_width < 2 * K or qk_width % (2 * K) != 0 or HV % H != 0:
            raise _fail("mixed_qkv", f"of width 2*H*K + HV*V with HV % H == 0 (HV = {HV}, K = {K}, V = {V} "
                        f"from initial_state)", f"width {mixed_qkv.shape[1]}")
    else:
        H = k_cache.shape[1]
        if H < 1 or HV % H != 0:
            raise _fail("k_cache", f"[S, H, L, K] with HV % H == 0 (HV = {HV} from initial_state)", f"H = {H}")
    _check_tensor("initial_state", initial_state, ((S, HV, V, K),), STATE_DTYPES)
    _check_tensor("d_cache", d_cache, ((S, HV, L, V),), CACHE_DTYPES)
    _check_tensor("k_cache", k_cache, ((S, HV if predecayed else H, L, K),), (d_cache.dtype,))
    _check_tensor("g_cache", g_cache, ((S, HV, L, K),), (torch.float32,))

    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2:
        raise _fail("mixed_qkv", f"a 2-D tensor [B, 2*H*K + HV*V] = [B, {2 * H * K + HV * V}]", _describe(mixed_qkv))
    B = mixed_qkv.shape[0]
    _check_tensor("mixed_qkv", mixed_qkv, ((B, 2 * H * K + HV * V),), ACTIVATION_DTYPES)
    _check_tensor("a", a, ((B, HV * K), (B, HV, K)), ACTIVATION_DTYPES)
    _check_tensor("b", b, ((B, HV),), ACTIVATION_DTYPES)
    _check_tensor("A_log", A_log, ((HV,),), (torch.float32,))
    _check_tensor("dt_bias", dt_bias, ((HV * K,), (HV, K)), (torch.float32,))
    _check_tensor("out", out, ((B, 1, HV, V),), (mixed_qkv.dtype,))
    _check_tensor("ssm_state_indices", ssm_state_indices, ((B,),), (torch.int32,), last_contiguous=False)
    if cursors_by_slot:
        _check_tensor("cursors", write_pos, ((S + 1,),), (torch.int32,), last_contiguous=False)
    else:
        _check_tensor("write_pos", write_pos, ((B,),), (torch.int32,), last_contiguous=False)
    if force_flush is not None:
        _check_tensor("force_flush", force_flush, ((B,),), (torch.int32,), last_contiguous=False)
    _check_scalars(scale, lower_bound)
    if predecayed:
        check_predecayed_layout(d_cache.dtype, "replayssm_decode_predecayed")

    tensors = {
        "mixed_qkv": mixed_qkv,
        "a": a,
        "b": b,
        "A_log": A_log,
        "dt_bias": dt_bias,
        "initial_state": initial_state,
        "d_cache": d_cache,
        "k_cache": k_cache,
        "g_cache": g_cache,
        "out": out,
        "ssm_state_indices": ssm_state_indices,
        "write_pos": write_pos,
    }
    if force_flush is not None:
        tensors["force_flush"] = force_flush
    check_same_device(tensors, mixed_qkv.device, reference_name="mixed_qkv")
    return DecodeDims(batch=B, num_q_heads=H, num_v_heads=HV, key_dim=K, value_dim=V, ring_length=L, num_slots=S)


def _check_scalars(scale: float | None, lower_bound: float | None) -> None:
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise _fail("scale", "None or a finite float", repr(scale))
    if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and math.isfinite(lower_bound)):
        raise _fail("lower_bound", "None or a finite float", repr(lower_bound))


# Metadata signatures of the calls validate_decode_inputs has accepted, with their sizes (see
# validate_decode_inputs_once). Emptied when full: a server's batch buckets and layers repeat a few signatures.
_ACCEPTED: dict[tuple, DecodeDims] = {}
ACCEPTED_MAX = 4096


def validate_decode_inputs_once(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    scale: float | None, initial_state: torch.Tensor, d_cache: torch.Tensor, k_cache: torch.Tensor,
    g_cache: torch.Tensor, out: torch.Tensor, ssm_state_indices: torch.Tensor, write_pos: torch.Tensor,
    force_flush: torch.Tensor | None, lower_bound: float | None, *, cursors_by_slot: bool = False,
    predecayed: bool = False,
) -> DecodeDims:
    """:func:`validate_decode_inputs`, run in full only for a call whose metadata it has not accepted before.

    Every tensor check there depends only on each argument's type, dtype, shape, strides and device, the
    presence of ``force_flush`` and the two flags: together, the call's signature. A call whose signature was
    accepted before gets the same sizes back after checking only ``scale`` and ``lower_bound``; any other call
    (a new shape, a wrong dtype, a tensor on another device, a non-tensor) runs the full checks, which raise
    as they always do. The op calls this on every eager step: on this project's CPU machine (decode shapes of
    13 tensors) the full checks take 15-17 us of host time per call, a repeat 7 us."""
    try:
        signature = (cursors_by_slot, predecayed) + tuple(
            None if t is None else (type(t), t.dtype, t.shape, t.stride(), t.device)
            for t in (mixed_qkv, a, b, A_log, dt_bias, initial_state, d_cache, k_cache, g_cache, out,
                      ssm_state_indices, write_pos, force_flush))
    except (AttributeError, TypeError):  # not tensors: the full checks name the argument
        signature = None
    dims = _ACCEPTED.get(signature) if signature is not None else None
    if dims is not None:
        _check_scalars(scale, lower_bound)
        return dims
    dims = validate_decode_inputs(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache,
                                  out, ssm_state_indices, write_pos, force_flush, lower_bound,
                                  cursors_by_slot=cursors_by_slot, predecayed=predecayed)
    if signature is not None:
        if len(_ACCEPTED) >= ACCEPTED_MAX:
            _ACCEPTED.clear()
        _ACCEPTED[signature] = dims
    return dims


def check_same_device(tensors: dict[str, torch.Tensor], device: torch.device, *, reference_name: str) -> None:
    """Raise one ``ValueError`` naming every tensor not on ``device`` and where it is instead."""
    wrong = [f"{name} ({t.device})" for name, t in tensors.items() if t.device != device]
    if wrong:
        raise ValueError(
            f"replayssm_decode: every tensor must be on {reference_name}'s device {device}; "
            f"not on it: {', '.join(wrong)}"
        )


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"shape {_shape(t)}"
    return type(t).__name__


def resolve_scale(scale: float | None, key_dim: int) -> float:
    """``scale`` or the default ``K ** -0.5``."""
    return float(key_dim) ** -0.5 if scale is None else float(scale)
