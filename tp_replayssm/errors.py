"""The library's exception types, in one place.

- :class:`PlacementError` (a ``ValueError``): a pool tensor or an input is on the wrong device, or the ranks of a
  tensor-parallel group disagree. In a group every rank raises the same text (:mod:`tp_replayssm.tp.placement`).
- :class:`SlotError` (a ``ValueError``): a call named a slot that is out of range, not allocated, or repeated
  within the call. The row was treated as padding (nothing written); ``pool.check()`` reports it.
- :class:`PoolExhaustedError` (a ``RuntimeError``): ``alloc(n)`` asked for more slots than are free; nothing was
  allocated.
"""

from __future__ import annotations

__all__ = ["PlacementError", "PoolExhaustedError", "SlotError"]


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


class PoolExhaustedError(RuntimeError):
    """``alloc(n)`` asked for more slots than are free; nothing was allocated."""
