"""The library's exception types, in one place.

- :class:`PlacementError` (a ``ValueError``): a pool tensor or an input is on the wrong device, or the ranks of a
  tensor-parallel group disagree. In a group every rank raises the same text (:mod:`tp_replayssm.tp.placement`).
- :class:`SlotError` (a ``ValueError``): a call named a slot that is out of range, not allocated, or repeated
  within the call. The row was treated as padding (nothing written); ``pool.check()`` reports it.
- :class:`RankMismatchError` (a ``ValueError``): in debug mode, the ranks of a tensor-parallel group called the pool
  with different step arguments (slots, batch, drafts, accepted counts...). Every rank raises the same text.
- :class:`PoolExhaustedError` (a ``RuntimeError``): ``alloc(n)`` asked for more slots than are free; nothing was
  allocated.
"""

from __future__ import annotations

__all__ = ["PlacementError", "PoolExhaustedError", "RankMismatchError", "SlotError"]


class PlacementError(ValueError):
    """A pool tensor or decode input is misplaced, or the ranks of a group disagree.

    The text names each offending rank, the tensor names, the expected and the actual device; in a group, every
    rank raises the same text.
    """


class SlotError(ValueError):
    """A call named bad slots: out of range, not allocated, or repeated within the call.

    The text names the method, the layer (where there is one), the rows and their slot ids. Those rows were treated
    as padding rows: zero output, and no byte of any slot's state changed.
    """


class RankMismatchError(ValueError):
    """Debug mode: the ranks of a group called the pool with different arguments (every rank must pass the same
    step arguments). The text names the call, each argument that differs and which ranks passed which value; every
    rank raises the same text, before the call writes anything."""


class PoolExhaustedError(RuntimeError):
    """``alloc(n)`` asked for more slots than are free; nothing was allocated."""
