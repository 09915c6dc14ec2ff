"""tp_replayssm: tensor-parallel KDA ReplaySSM decode.

Public names (SPEC): :class:`KDAHeads`, :class:`ReplaySSMStatePool`, :class:`PlacementError`,
:class:`PoolExhaustedError`; the op is :func:`tp_replayssm.ops.replayssm_decode` and its PyTorch
reference :func:`tp_replayssm.reference.replayssm_decode`. Sharding helpers: :func:`shard_heads`
(the rank's :class:`HeadShard`, with slicers for global tensors) and :func:`concat_outputs`;
memory planning: :func:`slots_that_fit`.
"""

from __future__ import annotations

from .heads import HeadShard, KDAHeads, concat_outputs, shard_heads
from .memory import PoolMemory, slots_that_fit
from .placement import PlacementError
from .pool import PoolExhaustedError, ReplaySSMStatePool

__all__ = [
    "HeadShard",
    "KDAHeads",
    "PlacementError",
    "PoolExhaustedError",
    "PoolMemory",
    "ReplaySSMStatePool",
    "concat_outputs",
    "shard_heads",
    "slots_that_fit",
]
