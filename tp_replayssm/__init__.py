"""tp_replayssm: tensor-parallel KDA ReplaySSM decode state pools with Helion kernels.

Public names: :class:`KDAHeads` (a layer's global heads), :class:`ReplaySSMStatePool` (one rank's pool),
:class:`PlacementError`, :class:`SlotError`, :class:`RankMismatchError`, :class:`PoolExhaustedError`; :class:`StateShard` (a request's
state exported from a pool, for ``import_state`` into a pool of any tp size); the sharding helpers
:func:`shard_heads` (the rank's :class:`HeadShard`, with slicers for global tensors) and :func:`concat_outputs`;
memory planning with :func:`slots_that_fit` and :class:`PoolMemory`. The op is
:func:`tp_replayssm.ops.replayssm_decode` and its PyTorch reference :func:`tp_replayssm.reference.replayssm_decode`.
The package's folders: ``kernels/`` (the Helion kernels and their launch plan), ``pool/`` (the state pool), ``tp/``
(sharding, placement, process groups). The contract: docs/contract.md.
"""

from __future__ import annotations

from .errors import PlacementError, PoolExhaustedError, RankMismatchError, SlotError
from .pool.memory import PoolMemory, slots_that_fit
from .pool.pool import ReplaySSMStatePool
from .pool.shard import StateShard
from .tp.heads import HeadShard, KDAHeads, concat_outputs, shard_heads

__all__ = [
    "HeadShard",
    "KDAHeads",
    "PlacementError",
    "PoolExhaustedError",
    "PoolMemory",
    "RankMismatchError",
    "ReplaySSMStatePool",
    "SlotError",
    "StateShard",
    "concat_outputs",
    "shard_heads",
    "slots_that_fit",
]
