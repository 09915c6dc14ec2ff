"""Byte model of one KDA decode step: the fewest bytes it must move through device memory.

Pure arithmetic (no torch import, no device): the benchmarks, the launcher and the CPU tests share it.

ReplaySSM (docs/contract.md), averaged over one full cursor cycle of ``L`` phases. In phase ``c``
(``c = 0 .. L-1``; every row of the batch at the same phase, the step with ``c = L-1`` flushes):

- checkpoint read, every step: ``B * HV * V * K * state_bytes``;
- checkpoint write, flush step only (so ``1/L`` of it per step on average);
- valid ring entries read: ``c`` entries of ``d [V]`` (cache dtype) and ``g [K]`` (fp32) per value
  head, and ``k [K]`` (cache dtype) per q/k head; on average ``(L-1)/2`` entries per step;
- one ring entry written (same per-entry size) on every step but the flush step: ``(L-1)/L`` on
  average;
- inputs ``mixed_qkv [B, 2HK + HV*V]``, ``a [B, HV*K]``, ``b [B, HV]`` (activation dtype),
  ``ssm_state_indices [B]`` and ``write_pos [B]`` (int32; plus ``force_flush [B]`` when given);
- parameters ``A_log [HV]`` and ``dt_bias [HV*K]`` (fp32), read once per step;
- output ``out [B, 1, HV, V]`` (activation dtype).

A batch whose rows sit at staggered phases moves the same bytes on average (each row spends one
step in each phase per cycle), so the cycle mean is the floor for either schedule.

Packed decode (FLA's ``fused_recurrent_kda_fwd`` with ``inplace_final_state=True``): the whole state
is read and written every step, plus ``q, k, v`` (same bytes as ``mixed_qkv``), the raw gate ``g``
(= ``a``), ``beta`` (= ``b``), ``ssm_state_indices``, the same parameters and ``out``; no cursor.

``lower_bound`` does not change the byte count (the gate is computed in registers either way); it is
carried in :class:`DecodeConfig` only so that a config describes a benchmark row completely.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "ByteCount",
    "DecodeConfig",
    "dtype_bytes",
    "floor_us",
    "packed_bytes",
    "replay_bytes",
    "replay_phase_bytes",
]

_NAMED_BYTES = {
    "fp32": 4, "float32": 4, "float": 4, "f32": 4,
    "bf16": 2, "bfloat16": 2,
    "fp16": 2, "float16": 2, "half": 2, "f16": 2,
    "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int32": 4, "int64": 8,
}

GATE_CACHE_BYTES = 4  # g_cache is fp32 by contract
INDEX_BYTES = 4  # ssm_state_indices, write_pos, force_flush are int32
PARAM_BYTES = 4  # A_log, dt_bias are fp32


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a ``torch.dtype`` (anything with ``itemsize``), a name such as
    ``"bf16"`` / ``"float32"`` / ``"torch.bfloat16"``, or a positive int (taken as the size)."""
    if isinstance(dtype, bool):
        raise TypeError(f"dtype_bytes: expected a dtype, a dtype name or a byte size; got {dtype!r}")
    if isinstance(dtype, int):
        if dtype <= 0:
            raise ValueError(f"dtype_bytes: a byte size must be positive; got {dtype}")
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key not in _NAMED_BYTES:
            raise ValueError(f"dtype_bytes: unknown dtype name {dtype!r}; known: {sorted(_NAMED_BYTES)}")
        return _NAMED_BYTES[key]
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and itemsize > 0:
        return itemsize
    raise TypeError(f"dtype_bytes: expected a dtype, a dtype name or a byte size; got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """One decode call's sizes (local to one shard). Dtypes: torch dtypes, names or byte sizes."""

    batch: int
    num_q_heads: int
    num_v_heads: int
    key_dim: int = 128
    value_dim: int = 128
    ring_length: int = 16
    state_dtype: Any = "fp32"
    cache_dtype: Any = "bf16"
    act_dtype: Any = "bf16"
    lower_bound: float | None = None
    force_flush: bool = False  # a force_flush [B] int32 tensor is passed (and read)
    keys_per_value_head: bool = False  # the pre-decayed ring layout: one k ring entry per value head

    def __post_init__(self) -> None:
        for name in ("batch", "num_q_heads", "num_v_heads", "key_dim", "value_dim", "ring_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DecodeConfig: {name} must be an int >= 1; got {value!r}")
        if self.num_v_heads % self.num_q_heads != 0:
            raise ValueError(
                f"DecodeConfig: num_v_heads % num_q_heads must be 0; got HV={self.num_v_heads}, "
                f"H={self.num_q_heads}"
            )
        for name in ("state_dtype", "cache_dtype", "act_dtype"):
            dtype_bytes(getattr(self, name))  # raises on an unknown dtype

    # element sizes
    @property
    def state_bytes(self) -> int:
        return dtype_bytes(self.state_dtype)

    @property
    def cache_bytes(self) -> int:
        return dtype_bytes(self.cache_dtype)

    @property
    def act_bytes(self) -> int:
        return dtype_bytes(self.act_dtype)

    # sizes of the pieces, in bytes, for the whole batch
    @property
    def state_total(self) -> int:
        """One full read (or write) of the batch's states ``[B, HV, V, K]``."""
        return self.batch * self.num_v_heads * self.value_dim * self.key_dim * self.state_bytes

    @property
    def ring_entry_total(self) -> int:
        """One ring entry for every row: ``d [HV, V]``, ``k [H, K]`` (``[HV, K]`` with ``keys_per_value_head``;
        cache dtype), ``g [HV, K]`` (fp32)."""
        B, H, HV, K, V = self.batch, self.num_q_heads, self.num_v_heads, self.key_dim, self.value_dim
        kh = HV if self.keys_per_value_head else H
        return B * (HV * V * self.cache_bytes + kh * K * self.cache_bytes + HV * K * GATE_CACHE_BYTES)

    @property
    def activations_in(self) -> int:
        """``mixed_qkv`` + ``a`` + ``b`` (FLA's ``q, k, v, g, beta`` have the same bytes)."""
        B, H, HV, K, V = self.batch, self.num_q_heads, self.num_v_heads, self.key_dim, self.value_dim
        return B * (2 * H * K + HV * V + HV * K + HV) * self.act_bytes

    @property
    def params_in(self) -> int:
        """``A_log [HV]`` + ``dt_bias [HV*K]`` (fp32)."""
        return self.num_v_heads * (1 + self.key_dim) * PARAM_BYTES

    @property
    def out_total(self) -> int:
        return self.batch * self.num_v_heads * self.value_dim * self.act_bytes


@dataclasses.dataclass(frozen=True)
class ByteCount:
    """Bytes moved by one step (a cycle mean may be fractional)."""

    state_read: float
    state_write: float
    ring_read: float
    ring_write: float
    inputs: float  # activations + index tensors
    params: float
    outputs: float

    @property
    def total(self) -> float:
        return (self.state_read + self.state_write + self.ring_read + self.ring_write + self.inputs
                + self.params + self.outputs)

    def as_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        return d


def _replay_inputs(cfg: DecodeConfig) -> int:
    n_index = 3 if cfg.force_flush else 2  # ssm_state_indices, write_pos (, force_flush)
    return cfg.activations_in + n_index * cfg.batch * INDEX_BYTES


def replay_phase_bytes(cfg: DecodeConfig, cursor: int) -> ByteCount:
    """Bytes of one ReplaySSM step in which every row is at cursor ``cursor`` (no force_flush fired)."""
    L = cfg.ring_length
    if not 0 <= cursor <= L - 1:
        raise ValueError(f"replay_phase_bytes: cursor must be in [0, {L - 1}]; got {cursor}")
    flush = cursor == L - 1
    return ByteCount(
        state_read=float(cfg.state_total),
        state_write=float(cfg.state_total if flush else 0),
        ring_read=float(cursor * cfg.ring_entry_total),
        ring_write=float(0 if flush else cfg.ring_entry_total),
        inputs=float(_replay_inputs(cfg)),
        params=float(cfg.params_in),
        outputs=float(cfg.out_total),
    )


def replay_bytes(cfg: DecodeConfig) -> ByteCount:
    """Mean bytes per ReplaySSM step over one full cursor cycle (phases ``0 .. L-1``)."""
    L = cfg.ring_length
    return ByteCount(
        state_read=float(cfg.state_total),
        state_write=cfg.state_total / L,
        ring_read=cfg.ring_entry_total * (L - 1) / 2,  # mean of c over c = 0..L-1
        ring_write=cfg.ring_entry_total * (L - 1) / L,
        inputs=float(_replay_inputs(cfg)),
        params=float(cfg.params_in),
        outputs=float(cfg.out_total),
    )


def packed_bytes(cfg: DecodeConfig) -> ByteCount:
    """Bytes per step of packed decode (FLA in-place): state read + written every step, no ring."""
    return ByteCount(
        state_read=float(cfg.state_total),
        state_write=float(cfg.state_total),
        ring_read=0.0,
        ring_write=0.0,
        inputs=float(cfg.activations_in + cfg.batch * INDEX_BYTES),  # q,k,v,g,beta + ssm_state_indices
        params=float(cfg.params_in),
        outputs=float(cfg.out_total),
    )


def floor_us(nbytes: float, bandwidth_gbps: float) -> float:
    """Time in microseconds to move ``nbytes`` at ``bandwidth_gbps`` (GB/s, 1 GB = 1e9 bytes)."""
    if bandwidth_gbps <= 0:
        raise ValueError(f"floor_us: bandwidth must be positive; got {bandwidth_gbps}")
    return nbytes / (bandwidth_gbps * 1e9) * 1e6
