"""A tensor-parallel Kimi Delta Attention layer on a :class:`~tp_replayssm.ReplaySSMStatePool`.

:class:`TPKimiDeltaAttention` is one rank's shard of a KDA layer (flash-linear-attention's ``KimiDeltaAttention``;
sharding in :mod:`tp_replayssm.layers.weights`). ``layer(hidden, slots)`` decodes one token per slot through the
pool; ``layer(hidden, slots, cu_seqlens)`` prefills packed sequences, one per slot, continuing each slot's state;
``layer(hidden, slots, verify=True, parents=None)`` verifies ``T`` draft tokens per slot (speculative decoding: the
pool's ``verify``; the caller commits once per model step with ``pool.commit``).
The output is the row-parallel ``o_proj``'s sum over ``group`` (with no group, this rank's partial sum).

One token of one value head ``hv`` (``h = hv // (HV // H)`` its q/k head)::

    q, k, v   = silu(conv(x @ W_q^T)), silu(conv(x @ W_k^T)), silu(conv(x @ W_v^T))     (the pool's conv window)
    g         = -exp(A_log[hv]) * softplus(x @ W_fa^T @ W_fb^T + dt_bias)     (or the bounded gate)
    beta      = sigmoid(x @ W_b^T)
    o         = the delta-rule recurrence of the pool (l2-normalized q, k; q scaled by K^-0.5)
    o         = o * rsqrt(mean(o^2) + eps) * w_norm * sigmoid(x @ W_ga^T @ W_gb^T + b_gb)    (per head, over V)
    y         = sum over ranks of o_local @ W_o_local^T
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..pool.agreement import same_call_on_every_rank, shape_of, slot_ids
from ..pool.slots import check_ids, refuse_bad_ids
from ..tp.heads import shard_heads
from ..validation import ACTIVATION_DTYPES, describe
from .config import KDALayerConfig
from .kda_torch import packed_conv
from .prefill import PREFILL_BACKENDS, end_prefill, prefill_backend_for, prefill_recurrence
from .weights import ShardWeights, read_shard

if TYPE_CHECKING:
    from ..pool.pool import ReplaySSMStatePool

__all__ = ["TPKimiDeltaAttention", "gated_rms_norm"]

logger = logging.getLogger(__name__)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """FLA's ``FusedRMSNormGated`` with a sigmoid gate, per head: ``o [.., HV, V]``, ``gate [.., HV, V]``,
    ``weight [V]`` -> ``o * rsqrt(mean(o^2 over V) + eps) * weight * sigmoid(gate)`` as ``[.., HV*V]`` in ``o.dtype``
    (fp32 math). Heads never mix, so a rank normalizes its own heads with no reduction."""
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * torch.sigmoid(gate.float())
    return y.to(o.dtype).flatten(-2)


class TPKimiDeltaAttention(torch.nn.Module):
    """This rank's shard of a KDA layer over ``pool``'s layer ``layer_idx``.

    Build it with :meth:`from_fla` (an FLA layer) or :meth:`from_state_dict` (FLA's or Kimi-Linear's parameter names,
    read slice by slice). The parameters live on ``pool.device`` in ``dtype`` (``A_log`` and ``dt_bias`` in fp32):
    ``in_proj [D_l + HV_l + 2R, hidden]`` (rows: q, k, v of the rank's heads, b, then the replicated low-rank first
    halves f_a and g_a: one GEMM per call), ``conv_weight [D_l, W]``, ``conv_bias [D_l]``, ``f_b [HV_l*K, R]``,
    ``g_b [HV_l*V, R]``, ``g_b_bias``, ``A_log [HV_l]``, ``dt_bias [HV_l*K]``, ``norm_weight [V]``,
    ``o_proj [hidden, HV_l*V]``. ``group``: the process group ``o_proj``'s partial sums are all-reduced over (None:
    the caller reduces). ``prefill_backend``: ``"auto"``, ``"fla"`` or ``"torch"`` (:mod:`.prefill`).
    """

    def __init__(self, config: KDALayerConfig, weights: ShardWeights, *, pool: ReplaySSMStatePool, layer_idx: int,
                 group: object | None = None, dtype: torch.dtype | None = None,
                 prefill_backend: str = "auto") -> None:
        super().__init__()
        where = "TPKimiDeltaAttention"
        _check_pool(config, pool, layer_idx, where)
        dtype = weights.q.dtype if dtype is None else dtype
        if dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"{where}: `dtype` must be one of {list(ACTIVATION_DTYPES)} (the decode's activation "
                             f"dtypes); got {dtype}")
        if prefill_backend not in PREFILL_BACKENDS:
            raise ValueError(f"{where}: `prefill_backend` must be one of {list(PREFILL_BACKENDS)}; got "
                             f"{prefill_backend!r}")
        self.config, self.pool, self.layer_idx, self.group = config, pool, layer_idx, group
        if group is None and pool.tp_size > 1:
            logger.warning("%s(layer_idx=%d): no `group` on a pool sharded over %d ranks: the outputs are this "
                           "rank's partial sums, for the caller to all-reduce (pass group= to reduce in the layer)",
                           where, layer_idx, pool.tp_size)
        self.shard = pool.shard
        self.prefill_backend = prefill_backend
        loc = pool.local_heads
        self.H_l, self.HV_l, self.K, self.V = loc.num_q_heads, loc.num_v_heads, loc.key_dim, loc.value_dim
        self.D_l, self.R = loc.qkv_width, config.gate_rank
        self._split = (self.D_l, self.HV_l, self.R, self.R)

        def param(t: torch.Tensor | None, dt: torch.dtype = dtype) -> torch.nn.Parameter | None:
            if t is None:
                return None
            return torch.nn.Parameter(t.detach().to(device=pool.device, dtype=dt).contiguous(), requires_grad=False)

        w = weights
        self.in_proj = param(torch.cat([w.q, w.k, w.v, w.b, w.f_a, w.g_a]))
        self.conv_weight, self.conv_bias = param(w.conv), param(w.conv_bias)
        self.f_b, self.g_b, self.g_b_bias = param(w.f_b), param(w.g_b), param(w.g_b_bias)
        self.A_log, self.dt_bias = param(w.A_log, torch.float32), param(w.dt_bias, torch.float32)
        self.norm_weight, self.o_proj = param(w.norm), param(w.o)

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_fla(cls, fla_layer: Any, *, pool: ReplaySSMStatePool, layer_idx: int, group: object | None = None,
                 tp_rank: int | None = None, tp_size: int | None = None, dtype: torch.dtype | None = None,
                 prefill_backend: str = "auto") -> TPKimiDeltaAttention:
        """This rank's shard of an ``fla.layers.KimiDeltaAttention`` (flash-linear-attention 0.6.0): its config
        (:meth:`KDALayerConfig.from_fla`) and slices of its ``state_dict()``. ``tp_rank``/``tp_size`` default to
        ``group``'s rank and size, else the pool's; they must be the pool's. ``dtype`` defaults to the FLA layer's."""
        config = KDALayerConfig.from_fla(fla_layer)
        return cls._from_tensors(fla_layer.state_dict(), config, pool=pool, layer_idx=layer_idx, prefix="",
                                 group=group, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype,
                                 prefill_backend=prefill_backend, where="TPKimiDeltaAttention.from_fla")

    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, Any], config: KDALayerConfig, *, pool: ReplaySSMStatePool,
                        layer_idx: int, prefix: str = "", group: object | None = None, tp_rank: int | None = None,
                        tp_size: int | None = None, dtype: torch.dtype | None = None,
                        prefill_backend: str = "auto") -> TPKimiDeltaAttention:
        """This rank's shard from a state dict with FLA's or Kimi-Linear's names (``f_a_proj``/``f_b_proj``/
        ``g_a_proj``/``g_b_proj``, ``A_log [1, 1, HV, 1]``), each name after ``prefix``. Only the rank's slices are
        read (:func:`~tp_replayssm.layers.weights.read_shard`), so ``tensors`` may hold lazy slices of a checkpoint
        (safetensors' ``get_slice``). ``dtype`` defaults to that of ``q_proj.weight``."""
        return cls._from_tensors(tensors, config, pool=pool, layer_idx=layer_idx, prefix=prefix, group=group,
                                 tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, prefill_backend=prefill_backend,
                                 where="TPKimiDeltaAttention.from_state_dict")

    @classmethod
    def _from_tensors(cls, tensors: Mapping[str, Any], config: KDALayerConfig, *, pool: ReplaySSMStatePool,
                      layer_idx: int, prefix: str, group: object | None, tp_rank: int | None, tp_size: int | None,
                      dtype: torch.dtype | None, prefill_backend: str, where: str) -> TPKimiDeltaAttention:
        """:meth:`from_state_dict`, its errors starting with ``where`` (the public constructor called)."""
        if not isinstance(config, KDALayerConfig):
            raise ValueError(f"{where}: `config` must be a KDALayerConfig; got {type(config).__name__}")
        _check_pool(config, pool, layer_idx, where)
        tp_rank, tp_size = _tp_coords(group, tp_rank, tp_size, pool, where)
        shard = shard_heads(config.heads, tp_size, tp_rank, where=where)
        weights = read_shard(tensors, config, shard, prefix=prefix)
        return cls(config, weights, pool=pool, layer_idx=layer_idx, group=group, dtype=dtype,
                   prefill_backend=prefill_backend)

    # ---- the call -------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.in_proj.dtype

    def forward(self, hidden: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                advance: bool = False, force_flush: torch.Tensor | None = None, verify: bool = False,
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """Decode (``cu_seqlens`` None), prefill (``cu_seqlens`` given) or verify draft tokens (``verify=True``) of
        ``hidden`` for ``slots``.

        Decode: ``hidden [B, hidden_size]``, one token per row; ``slots [B]`` int32 (``< 0``: padding rows, zero
        output); ``force_flush [B]`` int32 or None as in ``pool.decode``. The cursors do not move: call
        ``pool.advance(slots, force_flush)`` once per model step after every layer, or pass ``advance=True`` to the
        step's last layer (fused into its decode). No host sync: a decode step can be captured in a CUDA graph.

        Prefill: ``hidden [T, hidden_size]`` or ``[1, T, hidden_size]``, ``n`` packed sequences; ``cu_seqlens [n+1]``
        int32 (``[0, T_1, T_1+T_2, ..., T]``, every sequence at least one token); ``slots [n]`` int32 or int64,
        allocated, distinct. Each sequence continues its slot's state (checkpoint plus ring) and conv window; the
        layer then holds the state after the sequence as the slot's checkpoint, its ring empty, the conv window the
        sequence's last inputs. The shared cursor stays until ``advance=True`` on the step's last layer (or
        :func:`~tp_replayssm.layers.end_prefill`) sets it to 0. Syncs with the host (it checks the ids).

        Verify: ``hidden [B, T, hidden_size]``, ``T`` draft tokens per row, ``1 <= T <= ring_length - 1``; ``slots
        [B]`` int32 (``< 0``: padding rows); ``parents [B, T]`` int32 on the pool's device or None (a chain): a tree,
        ``parents[b, t]`` in ``[-1, t-1]``, ``-1`` = the slot's committed state. Output ``t`` is what ``T`` decode
        steps of this layer would give for token ``t`` after the slot's committed state and the tokens before it (a
        chain) or its ancestors, root first (a tree). The pool's conv runs over the tokens continuing the committed
        window. Nothing a reader sees changes until the caller's ``pool.commit(slots, num_accepted, path=...)``, once
        per model step after every layer's verify with the same ``slots``, ``T`` and ``parents``; that commit moves
        the cursors, so ``advance`` and ``force_flush`` do not apply. No host sync.

        Returns ``[.., hidden_size]`` (``hidden``'s shape) in the layer's dtype: summed over ``group``, or this
        rank's partial sum without one."""
        if self.pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
            same_call_on_every_rank(
                self.pool, f"TPKimiDeltaAttention(layer={self.layer_idx})",
                call="verify" if verify else "decode" if cu_seqlens is None else "prefill",
                hidden=shape_of(hidden), slots=slot_ids(slots), cu_seqlens=cu_seqlens,
                parents=parents, advance=bool(advance), force_flush=force_flush)
        if verify:
            for name, given in (("cu_seqlens", cu_seqlens is not None), ("advance", bool(advance)),
                                ("force_flush", force_flush is not None)):
                if given:
                    raise ValueError(f"TPKimiDeltaAttention.verify(layer={self.layer_idx}): `{name}` does not apply "
                                     "to a verify (pool.commit moves the cursors once per model step)")
            return self._verify(hidden, slots, parents)
        if parents is not None:
            raise ValueError(f"TPKimiDeltaAttention(layer={self.layer_idx}): `parents` applies to a verify only "
                             "(pass verify=True)")
        if cu_seqlens is None:
            return self._decode(hidden, slots, bool(advance), force_flush)
        if force_flush is not None:
            raise ValueError("TPKimiDeltaAttention (prefill): `force_flush` applies to decode only (a prefill leaves "
                             "the ring empty)")
        return self._prefill(hidden, slots, cu_seqlens, bool(advance))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [.., hidden]`` -> ``(mixed_qkv [.., D_l]`` pre-conv, ``a [.., HV_l*K]``, ``b [.., HV_l]``,
        ``gate [.., HV_l*V])``: one GEMM for every input projection, then the low-rank second halves."""
        mixed, b, f_a, g_a = F.linear(x, self.in_proj).split(self._split, dim=-1)
        return mixed, F.linear(f_a, self.f_b), b, F.linear(g_a, self.g_b, self.g_b_bias)

    def _output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``o [.., HV_l, V]``, ``gate [.., HV_l*V]`` -> ``[.., hidden]``: gated norm, ``o_proj``, the reduction."""
        y = F.linear(gated_rms_norm(o, gate.view(o.shape), self.norm_weight, self.config.norm_eps), self.o_proj)
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(y, group=self.group)
        return y

    def _check_hidden(self, hidden: object, shapes: str, ok: bool, where: str) -> None:
        if not ok:
            raise ValueError(f"{where}: `hidden` must be {shapes} with hidden_size={self.config.hidden_size}, "
                             f"dtype {self.dtype}, on {self.pool.device}; got {describe(hidden)}")

    def _decode(self, hidden: torch.Tensor, slots: torch.Tensor, advance: bool,
                force_flush: torch.Tensor | None) -> torch.Tensor:
        where = f"TPKimiDeltaAttention.decode(layer={self.layer_idx})"
        self._check_hidden(hidden, "[B, hidden_size]", _is_act(hidden, self, 2), where)
        check_ids(slots, where, self.pool.device, (torch.int32,))
        if slots.shape[0] != hidden.shape[0]:
            raise ValueError(f"{where}: `slots` must have one id per row of `hidden` ({hidden.shape[0]}); got "
                             f"{describe(slots)}")
        mixed, a, b, gate = self._project(hidden)
        if self.conv_weight is None:
            mixed = F.silu(mixed)
        out = self.pool.decode(self.layer_idx, mixed, a, b, self.A_log, self.dt_bias, slots,
                               lower_bound=self.config.lower_bound, force_flush=force_flush, advance=advance,
                               conv_weight=self.conv_weight, conv_bias=self.conv_bias)
        return self._output(out[:, 0], gate)

    def _verify(self, hidden: torch.Tensor, slots: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
        where = f"TPKimiDeltaAttention.verify(layer={self.layer_idx})"
        self._check_hidden(hidden, "[B, T, hidden_size]", _is_act(hidden, self, 3), where)
        check_ids(slots, where, self.pool.device, (torch.int32,))
        if slots.shape[0] != hidden.shape[0]:
            raise ValueError(f"{where}: `slots` must have one id per row of `hidden` ({hidden.shape[0]}); got "
                             f"{describe(slots)}")
        mixed, a, b, gate = self._project(hidden)  # [B, T, ..]: the pool checks T against its ring and `parents`
        if self.conv_weight is None:
            mixed = F.silu(mixed)
        out = self.pool.verify(self.layer_idx, mixed, a, b, self.A_log, self.dt_bias, slots, parents=parents,
                               lower_bound=self.config.lower_bound, conv_weight=self.conv_weight,
                               conv_bias=self.conv_bias)
        return self._output(out, gate)

    def _prefill(self, hidden: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                 advance: bool) -> torch.Tensor:
        where = f"TPKimiDeltaAttention.prefill(layer={self.layer_idx})"
        ok = _is_act(hidden, self, 2) or (_is_act(hidden, self, 3) and hidden.shape[0] == 1)
        self._check_hidden(hidden, "[T, hidden_size] or [1, T, hidden_size]", ok, where)
        check_ids(slots, where, self.pool.device, (torch.int32, torch.int64))
        x = hidden.reshape(-1, hidden.shape[-1])
        cu = _host_cu_seqlens(cu_seqlens, x.shape[0], slots.shape[0], where)
        pool, layer = self.pool, self.layer_idx
        pool.check()  # an earlier call's bad rows first, as the pool's syncing methods do
        refuse_bad_ids(pool, [int(i) for i in slots.tolist()], where, unique=True)
        mixed, a, b, gate = self._project(x)
        if not cu[-1]:  # no sequence (n = 0): nothing to run or write, an empty output (every rank reduces it too)
            return self._output(mixed.new_zeros(0, self.HV_l, self.V), gate).reshape(hidden.shape)
        states = pool.read_state(layer, slots)
        if self.conv_weight is not None:
            mixed, windows = packed_conv(mixed, pool.read_conv_state(layer, slots), self.conv_weight,
                                         self.conv_bias, cu)
        else:
            mixed, windows = F.silu(mixed), None
        HK = self.H_l * self.K
        q = mixed[:, :HK].unflatten(-1, (self.H_l, self.K))
        k = mixed[:, HK:2 * HK].unflatten(-1, (self.H_l, self.K))
        v = mixed[:, 2 * HK:].unflatten(-1, (self.HV_l, self.V))
        backend = prefill_backend_for(self.prefill_backend, x.device)
        o, final = prefill_recurrence(q, k, v, a, b, self.A_log, self.dt_bias, states, cu,
                                      lower_bound=self.config.lower_bound, safe_gate=self.config.safe_gate,
                                      backend=backend)
        pool.load_state(layer, slots, final, conv_states=windows)
        if advance:
            end_prefill(pool, slots)
        return self._output(o, gate).reshape(hidden.shape)

    def extra_repr(self) -> str:
        s = self.shard
        return (f"rank {s.tp_rank}/{s.tp_size}, layer {self.layer_idx}, q/k heads {s.q_head_start}..{s.q_head_end - 1}"
                f", value heads {s.v_head_start}..{s.v_head_end - 1} of {self.config}, dtype={self.dtype}, "
                f"reduce={'group' if self.group is not None else 'caller'}, prefill_backend={self.prefill_backend!r}")


# ---- helpers ----------------------------------------------------------------------------------------


def _is_act(t: object, layer: TPKimiDeltaAttention, dims: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dim() == dims and t.shape[-1] == layer.config.hidden_size
            and t.dtype == layer.dtype and t.device == layer.pool.device)


def _check_pool(config: KDALayerConfig, pool: ReplaySSMStatePool, layer_idx: int, where: str) -> None:
    from ..pool.pool import ReplaySSMStatePool

    if not isinstance(pool, ReplaySSMStatePool):
        raise ValueError(f"{where}: `pool` must be a ReplaySSMStatePool; got {type(pool).__name__}")
    if pool.heads != config.heads:
        raise ValueError(f"{where}: the pool's heads {pool.heads} differ from the layer's {config.heads}")
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or not 0 <= layer_idx < pool.num_layers:
        raise ValueError(f"{where}: `layer_idx` must be an int in [0, pool.num_layers={pool.num_layers}); got "
                         f"{layer_idx!r}")
    if config.conv_size and pool.conv_kernel_size != config.conv_size:
        raise ValueError(f"{where}: the layer's short convolutions have kernel size {config.conv_size}: build the "
                         f"pool with conv_kernel_size={config.conv_size}; got conv_kernel_size={pool.conv_kernel_size}")


def _tp_coords(group: object | None, tp_rank: int | None, tp_size: int | None, pool: ReplaySSMStatePool,
               where: str) -> tuple[int, int]:
    """The rank's ``(tp_rank, tp_size)``: as given, else ``group``'s, else the pool's; they must be the pool's."""
    if group is not None:
        import torch.distributed as dist

        tp_rank = dist.get_rank(group) if tp_rank is None else tp_rank
        tp_size = dist.get_world_size(group) if tp_size is None else tp_size
    tp_rank = pool.tp_rank if tp_rank is None else tp_rank
    tp_size = pool.tp_size if tp_size is None else tp_size
    if (tp_rank, tp_size) != (pool.tp_rank, pool.tp_size):
        raise ValueError(f"{where}: tp_rank/tp_size = {tp_rank}/{tp_size} but the pool holds the shard of rank "
                         f"{pool.tp_rank}/{pool.tp_size}")
    return tp_rank, tp_size


def _host_cu_seqlens(cu_seqlens: object, total: int, n: int, where: str) -> list[int]:
    """``cu_seqlens`` as host ints after checking it: 1-D int32/int64 ``[n+1]``, 0 first, ``total`` last, strictly
    increasing (one host sync)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.shape[0] != n + 1:
        raise ValueError(f"{where}: `cu_seqlens` must be a 1-D int32 or int64 tensor [n+1] = [{n + 1}] (one "
                         f"sequence per slot); got {describe(cu_seqlens)}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != total or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{where}: `cu_seqlens` must start at 0, end at the token count {total} and increase "
                         f"strictly (every sequence at least one token); got {cu}")
    return cu
