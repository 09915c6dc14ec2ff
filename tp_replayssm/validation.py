"""The decode call as one structure, and the checks of its arguments.

:class:`DecodeCall` bundles the arguments of ``replayssm_decode`` (the op, the reference, and the pool's internal
calls all pass it on instead of re-spelling sixteen arguments). :func:`validate_decode` checks it and returns the
call's sizes (:class:`DecodeDims`).

Every check reads metadata only (shape, dtype, stride, device): nothing here syncs with the device, and nothing
is written before every check passed. A failure is a ``ValueError`` naming the argument, the expected value and
the actual one. :func:`validate_decode_once` runs the tensor checks in full once per metadata signature.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import NamedTuple

import torch

__all__ = [
    "ACTIVATION_DTYPES", "CACHE_DTYPES", "PREDECAYED_CACHE_DTYPES", "PREDECAYED_MAX_LOG_DECAY", "RING_LAYOUTS",
    "STATE_DTYPES", "DecodeCall", "DecodeDims", "check_ring_layout", "check_tensor", "describe", "resolve_scale",
    "validate_decode", "validate_decode_once",
]

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The two ring layouts. "predecayed" (the pool's default) stores cumulative gates and keys pre-decayed by them, one
# key per value head; "sglang" stores per-step gates and keys, one key per q/k head (the layout SGLang's kernels use).
RING_LAYOUTS = ("predecayed", "sglang")

# The pre-decayed layout stores keys ``k_j * exp(-G_j)``; a (row, value head) whose cumulative gate ``G_c`` would
# fall below -75 in any key lane rebases its ring instead of appending. fp32 and bf16 reach exp(88.7), so 75 leaves
# keys up to exp(13.7) ~ 9e5 in magnitude (l2-normalized keys are at most 1); where exp(G_c) underflows
# (G_c < -87.3) a stored key times it loses at most exp(75 - 87.3) ~ 4.4e-6 of |k|.
PREDECAYED_MAX_LOG_DECAY = 75.0
PREDECAYED_CACHE_DTYPES = (torch.bfloat16, torch.float32)


class DecodeCall(NamedTuple):
    """The arguments of one ``replayssm_decode`` call (same names and order as the op's signature).

    Shapes: ``mixed_qkv [B, 2*H*K + HV*V]``, ``a [B, HV*K]`` or ``[B, HV, K]``, ``b [B, HV]``, ``A_log [HV]``,
    ``dt_bias [HV*K]`` or ``[HV, K]``, ``initial_state [S, HV, V, K]``, ``d_cache [S, HV, L, V]``, ``k_cache
    [S, H, L, K]`` (``[S, HV, L, K]`` in the pre-decayed layout), ``g_cache [S, HV, L, K]``, ``out [B, 1, HV, V]``,
    ``ssm_state_indices [B]`` int32, ``write_pos [B]`` int32 (or, on the pool's path, the cursor table ``[S + 1]``),
    ``force_flush [B]`` int32 or None.
    """

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
    ssm_state_indices: torch.Tensor
    write_pos: torch.Tensor
    force_flush: torch.Tensor | None = None
    use_qk_l2norm_in_kernel: bool = False
    lower_bound: float | None = None


# The tensors of a call, in DecodeCall order (the direct launcher addresses kernel arguments by these names)
CALL_TENSORS = ("mixed_qkv", "a", "b", "A_log", "dt_bias", "initial_state", "d_cache", "k_cache", "g_cache", "out",
                "ssm_state_indices", "write_pos", "force_flush")


@dataclasses.dataclass(frozen=True)
class DecodeDims:
    """Sizes of one decode call (local to the shard the call runs on)."""

    batch: int  # B
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


def describe(t: object) -> str:
    """``shape [..] dtype .. device ..`` of a tensor, else its type and value (for error texts)."""
    if isinstance(t, torch.Tensor):
        return f"tensor shape {list(t.shape)} dtype {t.dtype} device {t.device}"
    text = repr(t)
    return f"{type(t).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _fail(where: str, arg: str, expected: str, actual: object) -> ValueError:
    return ValueError(f"{where}: `{arg}` must be {expected}; got {actual}")


def check_tensor(where: str, name: str, t: object, shapes: tuple[tuple[int, ...], ...],
                 dtypes: tuple[torch.dtype, ...], *, last_contiguous: bool = True) -> torch.Tensor:
    """``t`` must be a tensor of one of ``shapes`` and ``dtypes`` (and contiguous in its last dim)."""
    if not isinstance(t, torch.Tensor):
        raise _fail(where, name, "a torch.Tensor", type(t).__name__)
    if tuple(t.shape) not in shapes:
        raise _fail(where, name, f"of shape {' or '.join(str(list(s)) for s in shapes)}", list(t.shape))
    if t.dtype not in dtypes:
        raise _fail(where, name, f"of dtype {' or '.join(str(d) for d in dtypes)}", t.dtype)
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise _fail(where, name, "contiguous in its last dim (stride(-1) == 1)", f"strides {list(t.stride())}")
    return t


def check_ring_layout(ring_layout: object, cache_dtype: torch.dtype, where: str) -> None:
    """``ring_layout`` must be one of :data:`RING_LAYOUTS`; the pre-decayed one stores keys up to
    ``exp(PREDECAYED_MAX_LOG_DECAY)`` times ``k`` and needs a bf16 or fp32 ring (fp16 tops out at exp(11))."""
    if ring_layout not in RING_LAYOUTS:
        raise ValueError(f"{where}: `ring_layout` must be one of {list(RING_LAYOUTS)}; got {ring_layout!r}")
    if ring_layout == "predecayed" and cache_dtype not in PREDECAYED_CACHE_DTYPES:
        raise ValueError(f"{where}: `ring_layout` 'predecayed' needs a cache dtype (`cache_dtype`, `d_cache`) in "
                         f"{list(PREDECAYED_CACHE_DTYPES)} (its keys reach exp({PREDECAYED_MAX_LOG_DECAY:g})); got "
                         f"{cache_dtype}")


def validate_decode(call: DecodeCall, *, ring_layout: str = "sglang", cursor_table: bool = False,
                    where: str = "replayssm_decode", num_q_heads: int | None = None) -> DecodeDims:
    """Check every argument of a decode call; return its sizes.

    ``cursor_table``: ``write_pos`` is the pool's cursor table ``[S + 1]`` indexed by slot, not one cursor per row
    ``[B]``. In the pre-decayed layout ``k_cache`` is ``[S, HV, L, K]`` and the q/k head count comes from
    ``mixed_qkv``'s width, unless the caller knows it (``num_q_heads``: the pool's shard), so that a wrong width is
    reported with the width expected."""
    (mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out, slots, write_pos,
     force_flush, _, lower_bound) = call
    predecayed = ring_layout == "predecayed"
    if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4:
        raise _fail(where, "initial_state", "a 4-D tensor [S, HV, V, K]", describe(initial_state))
    S, HV, V, K = initial_state.shape
    if S < 1 or HV < 1 or K < 1 or V < 1:
        raise _fail(where, "initial_state", "non-empty [S, HV, V, K]", list(initial_state.shape))
    if not isinstance(d_cache, torch.Tensor) or d_cache.dim() != 4:
        raise _fail(where, "d_cache", "a 4-D tensor [S, HV, L, V]", describe(d_cache))
    # L and S: the ring length most of the rings share, the slot count most of the state and rings share (d_cache's
    # and the state's on a tie), so an error names the odd tensor
    L = _majority((d_cache, k_cache, g_cache), 2)
    if L < 1:
        raise _fail(where, "d_cache", "a ring of length L >= 1 (dim 2)", f"L = {L}")
    S = _majority((initial_state, d_cache, k_cache, g_cache), 0)
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise _fail(where, "k_cache", f"a 4-D tensor [S, {'HV' if predecayed else 'H'}, L, K]", describe(k_cache))
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2:
        raise _fail(where, "mixed_qkv", "a 2-D tensor [B, 2*H*K + HV*V]", describe(mixed_qkv))
    if predecayed and num_q_heads is not None:
        H = num_q_heads
    elif predecayed:  # the k ring is per value head: the q/k heads come from mixed_qkv's width 2*H*K + HV*V
        qk_width = mixed_qkv.shape[1] - HV * V
        H = qk_width // (2 * K)
        if qk_width < 2 * K or qk_width % (2 * K) != 0 or HV % H != 0:
            raise _fail(where, "mixed_qkv", f"of width 2*H*K + HV*V with HV % H == 0 (HV = {HV}, K = {K}, V = {V} "
                        "from initial_state)", f"width {mixed_qkv.shape[1]}")
    else:
        H = k_cache.shape[1]
        if H < 1 or HV % H != 0:
            raise _fail(where, "k_cache", f"[S, H, L, K] with HV % H == 0 (HV = {HV} from initial_state)", f"H = {H}")
        qk_width = mixed_qkv.shape[1] - HV * V  # the q/k heads mixed_qkv's width gives, where it gives a valid count
        if qk_width != 2 * H * K and qk_width > 0 and qk_width % (2 * K) == 0 and HV % (qk_width // (2 * K)) == 0:
            raise ValueError(f"{where}: `mixed_qkv`'s width {mixed_qkv.shape[1]} = 2*H*K + HV*V gives H = "
                             f"{qk_width // (2 * K)} q/k heads, but `k_cache` [S, H, L, K] has H = {H} (HV = {HV}, "
                             f"K = {K}, V = {V}): one of the two is wrong")
    check_tensor(where, "initial_state", initial_state, ((S, HV, V, K),), STATE_DTYPES)
    check_tensor(where, "d_cache", d_cache, ((S, HV, L, V),), CACHE_DTYPES)
    check_tensor(where, "k_cache", k_cache, ((S, HV if predecayed else H, L, K),), (d_cache.dtype,))
    check_tensor(where, "g_cache", g_cache, ((S, HV, L, K),), (torch.float32,))
    B = _batch(where, {"mixed_qkv": mixed_qkv, "a": a, "b": b, "out": out,
                       ("slots" if cursor_table else "ssm_state_indices"): slots,
                       "force_flush": force_flush, **({} if cursor_table else {"write_pos": write_pos})})
    check_tensor(where, "mixed_qkv", mixed_qkv, ((B, 2 * H * K + HV * V),), ACTIVATION_DTYPES)
    check_tensor(where, "a", a, ((B, HV * K), (B, HV, K)), ACTIVATION_DTYPES)
    check_tensor(where, "b", b, ((B, HV),), ACTIVATION_DTYPES)
    check_tensor(where, "A_log", A_log, ((HV,),), (torch.float32,))
    check_tensor(where, "dt_bias", dt_bias, ((HV * K,), (HV, K)), (torch.float32,))
    check_tensor(where, "out", out, ((B, 1, HV, V),), (mixed_qkv.dtype,))
    # the pool's calls name the row slots `slots` (its argument), the op `ssm_state_indices`
    check_tensor(where, "slots" if cursor_table else "ssm_state_indices", slots, ((B,),), (torch.int32,),
                 last_contiguous=False)
    if cursor_table:
        check_tensor(where, "cursors", write_pos, ((S + 1,),), (torch.int32,), last_contiguous=False)
    else:
        check_tensor(where, "write_pos", write_pos, ((B,),), (torch.int32,), last_contiguous=False)
    if force_flush is not None:
        check_tensor(where, "force_flush", force_flush, ((B,),), (torch.int32,), last_contiguous=False)
    _check_scalars(where, scale, lower_bound, call.use_qk_l2norm_in_kernel)
    check_ring_layout(ring_layout, d_cache.dtype, where)
    devices = {name: getattr(call, name).device for name in CALL_TENSORS if getattr(call, name) is not None}
    if cursor_table:  # the pool's calls: its state fixes the device, and the caller's tensors are named against it
        device, owner = initial_state.device, "the pool's device"
    else:  # the op: the device most of its tensors share (the state's on a tie), so the error names the odd ones
        votes = collections.Counter(devices.values())
        device = max(votes, key=lambda d: (votes[d], d == initial_state.device))
        owner = "one device; most are on"
    wrong = [f"{_USER_NAMES.get(name, name) if cursor_table else name} ({d})" for name, d in devices.items()
             if d != device]
    if wrong:
        raise ValueError(f"{where}: every tensor must be on {owner} {device}; not on it: {', '.join(wrong)}")
    for name in WRITTEN:  # what the call writes in place: checked here, so nothing is written before an error
        _check_writable(where, "checkpoint" if cursor_table and name == "initial_state" else name, getattr(call, name))
    return DecodeDims(batch=B, num_q_heads=H, num_v_heads=HV, key_dim=K, value_dim=V, ring_length=L, num_slots=S)


def _majority(tensors: tuple[object, ...], dim: int) -> int:
    """The size along ``dim`` that most of the 4-D ``tensors`` share; on a tie the first tensor's (a 4-D tensor)."""
    sizes = [t.shape[dim] for t in tensors if isinstance(t, torch.Tensor) and t.dim() == 4]
    return max(set(sizes), key=lambda n: (sizes.count(n), n == tensors[0].shape[dim]))


# the tensors a decode writes in place (the cursor table too, but the pool's own; the op's write_pos is read)
WRITTEN = ("out", "initial_state", "d_cache", "k_cache", "g_cache")


def _check_writable(where: str, name: str, t: torch.Tensor) -> None:
    """A tensor the call writes in place: not one autograd tracks, not an inference tensor outside inference mode
    (torch refuses both writes, after the call's earlier writes), and no stride 0 over a dim of size > 1 (an expanded
    view: a write to one slot or row would write them all)."""
    if t.requires_grad:
        raise _fail(where, name, "a tensor that does not require grad (the call writes it in place)",
                    "requires_grad=True")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise _fail(where, name, "written inside torch.inference_mode() (it is an inference tensor)",
                    "a call outside inference mode")
    aliased = [d for d in range(t.dim()) if t.stride(d) == 0 and t.shape[d] > 1]
    if aliased:
        raise _fail(where, name, "free of aliased elements (no stride 0 over a dim of size > 1: an expanded view)",
                    f"strides {list(t.stride())} for shape {list(t.shape)}")


# the pool's calls name the row slots `slots` and the cursor table `cursors` (the op's ssm_state_indices, write_pos)
_USER_NAMES = {"ssm_state_indices": "slots", "write_pos": "cursors"}


def _batch(where: str, per_row: dict[str, object]) -> int:
    """The call's batch ``B``: the dim-0 size most of the per-row tensors share (the row slots' on a tie),
    so that the error names the tensor that disagrees, not its neighbour."""
    sizes = {n: t.shape[0] for n, t in per_row.items() if isinstance(t, torch.Tensor) and t.dim() >= 1}
    if not sizes:
        return 0
    votes = [n for n in sizes.values()]
    best = max(votes.count(n) for n in votes)
    tied = {n for n in votes if votes.count(n) == best}
    rows = sizes.get("ssm_state_indices", sizes.get("slots"))
    B = rows if rows in tied else next(iter(tied))
    for name, n in sizes.items():
        if n != B:
            shape = list(per_row[name].shape)
            agree = ", ".join(m for m, k in sizes.items() if k == B)
            raise _fail(where, name, f"of shape {[B, *shape[1:]]} (batch B = {B} in dim 0, as {agree})",
                        f"shape {shape}")
    return B


def _check_scalars(where: str, scale: float | None, lower_bound: float | None, use_l2norm: object = True) -> None:
    if not isinstance(use_l2norm, bool):
        raise _fail(where, "use_qk_l2norm_in_kernel", "a bool", repr(use_l2norm))
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale)):
        raise _fail(where, "scale", "None or a finite float", repr(scale))
    if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and math.isfinite(lower_bound)
                                        and lower_bound <= 0):  # the gate lower_bound * sigmoid(.) is a log-decay
        raise _fail(where, "lower_bound", "None or a finite float <= 0 (the gate is lower_bound * sigmoid(...), a "
                    "log-decay)", repr(lower_bound))


# Metadata signatures of the calls validate_decode has accepted, with their sizes (validate_decode_once). Emptied
# when full: a server's batch buckets and layers repeat a few signatures.
_ACCEPTED: dict[tuple, DecodeDims] = {}
ACCEPTED_MAX = 4096


def validate_decode_once(call: DecodeCall, *, ring_layout: str = "sglang", cursor_table: bool = False,
                         where: str = "replayssm_decode", num_q_heads: int | None = None) -> DecodeDims:
    """:func:`validate_decode`, run in full only for a call whose metadata it has not accepted before.

    Every tensor check depends only on each argument's type, dtype, shape, strides and device, the presence of
    ``force_flush``, the layout and the cursor kind, and for the tensors written in place whether they require grad
    or are inference tensors (and whether inference mode is on): together, the call's signature. A repeat of an accepted
    signature checks only ``scale`` and ``lower_bound``; any other call runs the full checks. The eager op calls
    this on every step, where the full checks cost 15-17 us of host time and a repeat 7 us (2-core CPU machine)."""
    try:
        signature = (ring_layout, cursor_table, where, num_q_heads, torch.is_inference_mode_enabled()) + tuple(
            (t.requires_grad, t.is_inference()) for t in (getattr(call, name) for name in WRITTEN)) + tuple(
            None if t is None else (type(t), t.dtype, t.shape, t.stride(), t.device)
            for t in (call.mixed_qkv, call.a, call.b, call.A_log, call.dt_bias, call.initial_state, call.d_cache,
                      call.k_cache, call.g_cache, call.out, call.ssm_state_indices, call.write_pos, call.force_flush))
    except (AttributeError, TypeError):  # not tensors: the full checks name the argument
        signature = None
    dims = _ACCEPTED.get(signature) if signature is not None else None
    if dims is not None:
        _check_scalars(where, call.scale, call.lower_bound, call.use_qk_l2norm_in_kernel)
        return dims
    dims = validate_decode(call, ring_layout=ring_layout, cursor_table=cursor_table, where=where,
                           num_q_heads=num_q_heads)
    if signature is not None:
        if len(_ACCEPTED) >= ACCEPTED_MAX:
            _ACCEPTED.clear()
        _ACCEPTED[signature] = dims
    return dims


def resolve_scale(scale: float | None, key_dim: int) -> float:
    """``scale`` or the default ``K ** -0.5``."""
    return float(key_dim) ** -0.5 if scale is None else float(scale)
