"""KDA head geometry and the tensor-parallel sharding rule (docs/contract.md, sharding).

:class:`KDAHeads` describes the global (unsharded) heads of one KDA layer. :func:`shard_heads` is the
one place where the sharding rule lives: it maps ``(heads, tp_size, tp_rank)`` to a frozen
:class:`HeadShard` with the rank's q/k head range, value head range and local counts. The slicing
helpers on :class:`HeadShard` take GLOBAL tensors and return the rank's local ones, and
:func:`concat_outputs` is their inverse for the per-rank outputs, so engines and tests never compute
column offsets by hand.

Rule (``H`` q/k heads, ``HV`` value heads, ``tp`` ranks, ``HV % tp == 0``):

* rank ``t`` owns value heads ``[t*HV/tp, (t+1)*HV/tp)``;
* if ``H % tp == 0`` it owns q/k heads ``[t*H/tp, (t+1)*H/tp)``;
* else if ``tp % H == 0`` it holds the single q/k head ``t*H // tp`` (replicated on ``tp/H`` ranks);
* anything else is a ``ValueError`` printing ``H``, ``HV`` and ``tp``.

Either way value head ``hv`` of the rank reads its local q/k head ``hv // r_local`` exactly as the
global value head reads global q/k head ``hv // r``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = ["HeadShard", "KDAHeads", "all_shards", "concat_outputs", "concat_qkv", "shard_heads"]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class KDAHeads:
    """Global head geometry of one KDA layer: ``H`` q/k heads, ``HV`` value heads, dims ``K``, ``V``.

    Requires positive integers and ``HV % H == 0`` (value head ``hv`` reads q/k head ``hv // r``,
    ``r = HV // H``). Errors print every factor.
    """

    num_q_heads: int
    num_v_heads: int
    key_dim: int
    value_dim: int

    def __post_init__(self) -> None:
        desc = (f"num_q_heads (H)={self.num_q_heads!r}, num_v_heads (HV)={self.num_v_heads!r}, "
                f"key_dim (K)={self.key_dim!r}, value_dim (V)={self.value_dim!r}")
        for name in ("num_q_heads", "num_v_heads", "key_dim", "value_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"KDAHeads: `{name}` must be a positive int; got {value!r} ({desc})")
        if self.num_v_heads % self.num_q_heads != 0:
            raise ValueError(
                f"KDAHeads: num_v_heads must be a multiple of num_q_heads (HV % H == 0); got "
                f"HV % H = {self.num_v_heads % self.num_q_heads} ({desc})"
            )

    @property
    def group(self) -> int:
        """``r = HV // H``: value heads per q/k head."""
        return self.num_v_heads // self.num_q_heads

    @property
    def qkv_width(self) -> int:
        """Columns of ``mixed_qkv``: ``2*H*K + HV*V``."""
        return 2 * self.num_q_heads * self.key_dim + self.num_v_heads * self.value_dim


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """The heads rank ``tp_rank`` of ``tp_size`` owns; build it with :func:`shard_heads`.

    ``q_heads = range(q_head_start, q_head_end)`` (global q/k head ids, possibly one replicated head),
    ``v_heads = range(v_head_start, v_head_end)`` (global value head ids). ``local`` is the rank's
    :class:`KDAHeads` (``H_local``, ``HV_local``, same ``K``, ``V``), the geometry of its pool and op.
    """

    heads: KDAHeads
    tp_size: int
    tp_rank: int
    q_head_start: int
    q_head_end: int
    v_head_start: int
    v_head_end: int

    @property
    def num_q_heads_local(self) -> int:
        return self.q_head_end - self.q_head_start

    @property
    def num_v_heads_local(self) -> int:
        return self.v_head_end - self.v_head_start

    @property
    def q_heads(self) -> range:
        return range(self.q_head_start, self.q_head_end)

    @property
    def v_heads(self) -> range:
        return range(self.v_head_start, self.v_head_end)

    @property
    def qk_replicated(self) -> bool:
        """True when fewer q/k heads than ranks: this rank's q/k head is also held by other ranks."""
        return self.heads.num_q_heads < self.tp_size

    @property
    def local(self) -> KDAHeads:
        """The rank's local geometry ``KDAHeads(H_local, HV_local, K, V)``."""
        return KDAHeads(self.num_q_heads_local, self.num_v_heads_local, self.heads.key_dim, self.heads.value_dim)

    # ---- slicing helpers: GLOBAL tensors in, this rank's local tensors out ----------------------

    @property
    def qkv_ranges(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """The global ``mixed_qkv`` columns (conv channels) this rank holds, in its local order: ``(start, end)`` of
        the q of its q/k heads, the k of them, and the v of its value heads."""
        h = self.heads
        H, K, V = h.num_q_heads, h.key_dim, h.value_dim
        return ((self.q_head_start * K, self.q_head_end * K),
                (H * K + self.q_head_start * K, H * K + self.q_head_end * K),
                (2 * H * K + self.v_head_start * V, 2 * H * K + self.v_head_end * V))

    def _channels(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The rank's channels of ``t`` along ``dim`` (a new contiguous tensor)."""
        return torch.cat([t.narrow(dim, a, b - a) for a, b in self.qkv_ranges], dim=dim)

    def slice_mixed_qkv(self, mixed_qkv: torch.Tensor) -> torch.Tensor:
        """``[..., 2*H*K + HV*V]`` -> ``[..., 2*H_l*K + HV_l*V]`` = ``[q of its q/k heads | k of them | v
        of its value heads]`` (a new contiguous tensor)."""
        _check_last(mixed_qkv, "mixed_qkv", self.heads.qkv_width)
        return self._channels(mixed_qkv, -1)

    def slice_conv_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The short convolution's depthwise weight ``[2*H*K + HV*V, W]`` (or ``[D, 1, W]``, the shape of an
        ``nn.Conv1d``'s such as FLA's ``ShortConvolution``) -> this rank's ``[2*H_l*K + HV_l*V, W]``: its channels in
        ``mixed_qkv``'s column order, as :meth:`slice_mixed_qkv` takes the columns (a new contiguous tensor)."""
        D = self.heads.qkv_width
        if isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.shape[0] == D and weight.shape[1] == 1:
            weight = weight[:, 0]
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
            raise ValueError(f"slice_conv_weight: `weight` must be [2*H*K + HV*V, W] = [{D}, W] or [{D}, 1, W]; got "
                             f"{_describe(weight)}")
        return self._channels(weight, 0)

    def slice_conv_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """The short convolution's bias ``[2*H*K + HV*V]`` -> this rank's ``[2*H_l*K + HV_l*V]`` (a new tensor)."""
        D = self.heads.qkv_width
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (D,):
            raise ValueError(f"slice_conv_bias: `bias` must be [2*H*K + HV*V] = [{D}]; got {_describe(bias)}")
        return self._channels(bias, 0)

    def slice_conv_state(self, states: torch.Tensor) -> torch.Tensor:
        """Global conv windows ``[n, 2*H*K + HV*V, W-1]`` -> this rank's ``[n, 2*H_l*K + HV_l*V, W-1]`` (what
        ``pool.load_state(..., conv_states=)`` takes; a new contiguous tensor)."""
        D = self.heads.qkv_width
        if not isinstance(states, torch.Tensor) or states.dim() != 3 or states.shape[1] != D:
            raise ValueError(f"slice_conv_state: `states` must be [n, 2*H*K + HV*V, W-1] = [n, {D}, W-1]; got "
                             f"{_describe(states)}")
        return self._channels(states, 1)

    def slice_a(self, a: torch.Tensor) -> torch.Tensor:
        """Gate logits ``[B, HV*K]`` -> ``[B, HV_l*K]`` or ``[B, HV, K]`` -> ``[B, HV_l, K]`` (a view)."""
        K, HV = self.heads.key_dim, self.heads.num_v_heads
        if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[1] == HV * K:
            return a[:, self.v_head_start * K : self.v_head_end * K]
        if isinstance(a, torch.Tensor) and a.dim() == 3 and tuple(a.shape[1:]) == (HV, K):
            return a[:, self.v_head_start : self.v_head_end]
        raise ValueError(f"slice_a: `a` must be [B, HV*K] = [B, {HV * K}] or [B, HV, K] = [B, {HV}, {K}]; "
                         f"got {_describe(a)}")

    def slice_b(self, b: torch.Tensor) -> torch.Tensor:
        """Beta logits ``[B, HV]`` -> ``[B, HV_l]`` (a view)."""
        HV = self.heads.num_v_heads
        if not isinstance(b, torch.Tensor) or b.dim() != 2 or b.shape[1] != HV:
            raise ValueError(f"slice_b: `b` must be [B, HV] = [B, {HV}]; got {_describe(b)}")
        return b[:, self.v_head_start : self.v_head_end]

    def slice_A_log(self, A_log: torch.Tensor) -> torch.Tensor:
        """``A_log [HV]`` -> ``[HV_l]`` (a view)."""
        HV = self.heads.num_v_heads
        if not isinstance(A_log, torch.Tensor) or tuple(A_log.shape) != (HV,):
            raise ValueError(f"slice_A_log: `A_log` must be [HV] = [{HV}]; got {_describe(A_log)}")
        return A_log[self.v_head_start : self.v_head_end]

    def slice_dt_bias(self, dt_bias: torch.Tensor) -> torch.Tensor:
        """``dt_bias [HV*K]`` -> ``[HV_l*K]`` or ``[HV, K]`` -> ``[HV_l, K]`` (a view)."""
        K, HV = self.heads.key_dim, self.heads.num_v_heads
        if isinstance(dt_bias, torch.Tensor) and tuple(dt_bias.shape) == (HV * K,):
            return dt_bias[self.v_head_start * K : self.v_head_end * K]
        if isinstance(dt_bias, torch.Tensor) and tuple(dt_bias.shape) == (HV, K):
            return dt_bias[self.v_head_start : self.v_head_end]
        raise ValueError(f"slice_dt_bias: `dt_bias` must be [HV*K] = [{HV * K}] or [HV, K] = [{HV}, {K}]; "
                         f"got {_describe(dt_bias)}")

    def slice_state(self, state: torch.Tensor) -> torch.Tensor:
        """Global state ``[n, HV, V, K]`` -> ``[n, HV_l, V, K]`` (a view)."""
        h = self.heads
        expected = (h.num_v_heads, h.value_dim, h.key_dim)
        if not isinstance(state, torch.Tensor) or state.dim() != 4 or tuple(state.shape[1:]) != expected:
            raise ValueError(f"slice_state: `state` must be [n, HV, V, K] = [n, {', '.join(map(str, expected))}]; "
                             f"got {_describe(state)}")
        return state[:, self.v_head_start : self.v_head_end]


def shard_heads(heads: KDAHeads, tp_size: int, tp_rank: int, *, where: str = "shard_heads") -> HeadShard:
    """The sharding rule (docs/contract.md): the heads rank ``tp_rank`` of ``tp_size`` owns.

    Raises ``ValueError`` (printing ``H``, ``HV`` and ``tp``; ``where`` first: the caller's name, e.g. the pool's
    constructor) when ``HV % tp != 0`` or neither ``H % tp == 0`` nor ``tp % H == 0``, and when ``tp_rank`` is not in
    ``[0, tp_size)``.
    """
    if not isinstance(heads, KDAHeads):
        raise ValueError(f"{where}: `heads` must be a KDAHeads; got {type(heads).__name__}")
    H, HV = heads.num_q_heads, heads.num_v_heads
    if not _is_int(tp_size) or tp_size < 1:
        raise ValueError(f"{where}: `tp_size` must be a positive int; got {tp_size!r} (H={H}, HV={HV})")
    if not _is_int(tp_rank) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"{where}: `tp_rank` must be an int in [0, tp_size={tp_size}); got {tp_rank!r} "
                         f"(H={H}, HV={HV}, tp={tp_size})")
    desc = f"H={H} q/k heads, HV={HV} value heads, tp={tp_size}"
    if HV % tp_size != 0:
        raise ValueError(f"{where}: value heads must split evenly over ranks (HV % tp == 0); got {desc}")
    hv_local = HV // tp_size
    if H % tp_size == 0:
        h_local = H // tp_size
        q_start = tp_rank * h_local
        q_end = q_start + h_local
    elif tp_size % H == 0:
        q_start = tp_rank * H // tp_size
        q_end = q_start + 1
    else:
        raise ValueError(
            f"{where}: q/k heads must split evenly over ranks (H % tp == 0) or be replicated "
            f"(tp % H == 0); got {desc}"
        )
    return HeadShard(heads=heads, tp_size=tp_size, tp_rank=tp_rank, q_head_start=q_start, q_head_end=q_end,
                     v_head_start=tp_rank * hv_local, v_head_end=(tp_rank + 1) * hv_local)


def all_shards(heads: KDAHeads, tp_size: int) -> list[HeadShard]:
    """``[shard_heads(heads, tp_size, t) for t in range(tp_size)]``."""
    return [shard_heads(heads, tp_size, t) for t in range(tp_size)]


def concat_outputs(outs: Sequence[torch.Tensor], *, dim: int = -2) -> torch.Tensor:
    """Inverse of the head split for per-rank outputs: concatenate rank-ordered ``out [B, 1, HV_l, V]``
    (or any tensors whose value-head axis is ``dim``) into the global ``[B, 1, HV, V]``."""
    if len(outs) == 0:
        raise ValueError("concat_outputs: `outs` must hold one tensor per rank; got an empty sequence")
    first = outs[0]
    nd = first.dim()
    axis = dim % nd
    for t, o in enumerate(outs):
        if o.dim() != nd or any(o.shape[i] != first.shape[i] for i in range(nd) if i != axis):
            raise ValueError(f"concat_outputs: rank {t}'s output has shape {list(o.shape)}; expected the "
                             f"shape of rank 0's {list(first.shape)} except along dim {dim}")
    return torch.cat(list(outs), dim=axis)


def concat_qkv(heads: KDAHeads, parts: Sequence[torch.Tensor], *, dim: int = -1) -> torch.Tensor:
    """Inverse of :meth:`HeadShard.slice_mixed_qkv` (and of the conv slicers) for per-rank tensors whose channel axis
    ``dim`` holds a rank's ``2*H_l*K + HV_l*V`` channels in its local order: rank-ordered ``parts`` (one per rank,
    ``tp = len(parts)``) -> the global ``2*H*K + HV*V`` channels in ``mixed_qkv``'s order, e.g. every rank's conv
    outputs ``[B, D_l]`` -> ``[B, D]`` or windows ``[n, D_l, W-1]`` -> ``[n, D, W-1]`` (``dim=1``). A q/k head held by
    several ranks (``tp % H == 0``) is taken from the first of them; its copies are not compared."""
    if len(parts) == 0:
        raise ValueError("concat_qkv: `parts` must hold one tensor per rank; got an empty sequence")
    shards = all_shards(heads, len(parts))
    width = shards[0].local.qkv_width
    for t, p in enumerate(parts):
        if not isinstance(p, torch.Tensor) or p.dim() == 0 or p.shape[dim] != width:
            raise ValueError(f"concat_qkv: rank {t}'s part must have {width} channels (2*H_l*K + HV_l*V) along dim "
                             f"{dim}; got {_describe(p)}")
    pieces: list[list[torch.Tensor]] = [[], [], []]  # q, k, v blocks in global order
    done: list[set[int]] = [set(), set(), set()]
    for shard, part in zip(shards, parts):
        offset = 0
        for kind, (a, b) in enumerate(shard.qkv_ranges):
            if a not in done[kind]:
                done[kind].add(a)
                pieces[kind].append(part.narrow(dim, offset, b - a))
            offset += b - a
    return torch.cat(pieces[0] + pieces[1] + pieces[2], dim=dim)


def _check_last(t: object, name: str, width: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[-1] != width:
        raise ValueError(f"slice_{name}: `{name}` must be [..., 2*H*K + HV*V] = [..., {width}]; got {_describe(t)}")


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"shape {list(t.shape)}"
    return type(t).__name__
