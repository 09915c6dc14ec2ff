"""A request's state as it leaves a pool: :class:`StateShard`.

``pool.export_state(slots)`` gives one :class:`StateShard` per rank: the materialized state of those slots over the
rank's heads (checkpoint plus replayed ring, fp32, every layer), their conv windows, the GLOBAL head ranges they
cover and the pool they came from. ``pool.import_state(slots, shards)`` takes shards of any tensor-parallel size
that together cover the importing rank's heads, so state moves between tp sizes, to CPU and back, and between
processes: a shard pickles (``pickle``, ``torch.distributed``'s object collectives) and ``torch.save``s; importing
this module registers the class with ``torch.serialization.add_safe_globals``, so ``torch.load(...,
weights_only=True)`` reads it back.

The conv channels of a shard are laid out as the pool's ``mixed_qkv`` columns of its heads: ``[q of its q/k heads |
k of its q/k heads | v of its value heads]``, ``conv_q_channels`` (= K) columns per q/k head in each of the first two
blocks and ``conv_v_channels`` (= V) per value head in the third; :meth:`StateShard.conv_columns` gives the columns of
one global head, which is how a pool of another tp size re-slices them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..tp.heads import KDAHeads
from ..validation import describe

__all__ = ["StateShard"]


@dataclasses.dataclass(frozen=True, eq=False)
class StateShard:
    """The state of ``n`` requests on one rank's heads, outside any pool.

    Tensors: ``states [num_layers, n, HV_s, V, K]`` fp32, the true state of each layer (what ``read_state`` gives),
    value heads ``[v_head_start, v_head_end)`` of ``heads`` (``HV_s`` of them, in global order); ``conv_states
    [num_layers, n, D_s, W-1]`` in ``conv_dtype`` (oldest input first), ``D_s = 2*H_s*K + HV_s*V`` channels of the
    q/k heads ``[q_head_start, q_head_end)`` and the value heads above (module docstring), or None when the pool had
    no conv state (``conv_kernel_size == 0``).

    Metadata of the pool it came from: the GLOBAL ``heads``, ``tp_rank`` of ``tp_size``, ``num_layers``,
    ``ring_length``, ``ring_layout``, ``state_dtype``, ``cache_dtype``, ``conv_kernel_size``, ``conv_dtype`` (None
    without conv state), the conv channels per head (``conv_q_channels``, ``conv_k_channels`` per q/k head,
    ``conv_v_channels`` per value head) and the exported ``source_slots``. ``copy_done`` is the CUDA event of an
    asynchronous export (``export_state(..., non_blocking=True)``): :meth:`wait` blocks until the copy is done;
    pickling waits first and stores no event.
    """

    heads: KDAHeads
    tp_rank: int
    tp_size: int
    v_head_start: int
    v_head_end: int
    q_head_start: int
    q_head_end: int
    num_layers: int
    ring_length: int
    ring_layout: str
    state_dtype: torch.dtype
    cache_dtype: torch.dtype
    conv_kernel_size: int
    conv_dtype: torch.dtype | None
    conv_q_channels: int
    conv_k_channels: int
    conv_v_channels: int
    source_slots: tuple[int, ...]
    states: torch.Tensor
    conv_states: torch.Tensor | None
    copy_done: Any = dataclasses.field(default=None, repr=False, compare=False)

    # ---- geometry -------------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """``n``: the requests (exported slots) the shard holds."""
        return len(self.source_slots)

    @property
    def v_heads(self) -> range:
        """The global value heads the shard covers."""
        return range(self.v_head_start, self.v_head_end)

    @property
    def q_heads(self) -> range:
        """The global q/k heads whose conv channels the shard covers (one replicated head when ``H < tp``)."""
        return range(self.q_head_start, self.q_head_end)

    @property
    def conv_channels(self) -> int:
        """``D_s``: conv channels of the shard's heads."""
        H_s, HV_s = len(self.q_heads), len(self.v_heads)
        return H_s * (self.conv_q_channels + self.conv_k_channels) + HV_s * self.conv_v_channels

    def conv_columns(self, kind: str, head: int) -> slice:
        """The columns of ``conv_states`` that hold global head ``head``'s channels of ``kind`` ("q", "k": a q/k
        head; "v": a value head)."""
        H_s = len(self.q_heads)
        if kind in ("q", "k"):
            if head not in self.q_heads:
                raise ValueError(f"StateShard.conv_columns: q/k head {head} is not in this shard's q/k heads "
                                 f"[{self.q_head_start}, {self.q_head_end})")
            width = self.conv_q_channels if kind == "q" else self.conv_k_channels
            start = (0 if kind == "q" else H_s * self.conv_q_channels) + (head - self.q_head_start) * width
        elif kind == "v":
            if head not in self.v_heads:
                raise ValueError(f"StateShard.conv_columns: value head {head} is not in this shard's value heads "
                                 f"[{self.v_head_start}, {self.v_head_end})")
            width = self.conv_v_channels
            start = H_s * (self.conv_q_channels + self.conv_k_channels) + (head - self.v_head_start) * width
        else:
            raise ValueError(f"StateShard.conv_columns: `kind` must be 'q', 'k' or 'v'; got {kind!r}")
        return slice(start, start + width)

    def describe(self) -> str:
        """One line: the source rank, heads, layers, requests and head ranges (what error messages print)."""
        return (f"rank {self.tp_rank}/{self.tp_size} of heads {self.heads}, {self.num_layers} layers, "
                f"{self.num_requests} request(s), value heads [{self.v_head_start}, {self.v_head_end}), q/k heads "
                f"[{self.q_head_start}, {self.q_head_end}), conv_kernel_size {self.conv_kernel_size}")

    # ---- the asynchronous copy --------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True when the tensors are complete (an asynchronous export's copy has finished); does not block."""
        return self.copy_done is None or bool(self.copy_done.query())

    def wait(self) -> StateShard:
        """Block until an asynchronous export's copy is done (at once when there is none); returns ``self``."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
        return self

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> StateShard:
        """The same shard with its tensors on ``device`` (waits for a pending copy first). ``non_blocking`` from a
        CUDA shard: an asynchronous copy whose result carries its event (``ready``, ``wait()``)."""
        self.wait()
        move = (lambda t: None if t is None else t.to(device, non_blocking=non_blocking))  # noqa: E731
        states, conv_states = move(self.states), move(self.conv_states)
        copy_done = None
        src = self.states.device
        if non_blocking and src.type == "cuda" and states.device != src:  # (to the CPU: pinned, asynchronous)
            copy_done = torch.cuda.Event()
            copy_done.record(torch.cuda.current_stream(src))
        return dataclasses.replace(self, states=states, conv_states=conv_states, copy_done=copy_done)

    # ---- printing and pickling ------------------------------------------------------------------

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            parts.append(f"{f.name}={_tensor_text(value) if isinstance(value, torch.Tensor) else repr(value)}")
        parts.append(f"ready={self.ready}")
        return f"StateShard({', '.join(parts)})"

    def __getstate__(self) -> dict[str, Any]:
        self.wait()
        return {**self.__dict__, "copy_done": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)


def _tensor_text(t: torch.Tensor) -> str:
    pinned = t.device.type == "cpu" and t.is_pinned()
    return f"{describe(t)}{' pinned' if pinned else ''}"


torch.serialization.add_safe_globals([StateShard, KDAHeads])
