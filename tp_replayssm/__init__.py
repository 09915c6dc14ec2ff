"""tp_replayssm: tensor-parallel KDA ReplaySSM decode.

Public names (SPEC): :class:`KDAHeads`, :class:`ReplaySSMStatePool`, :class:`PlacementError`,
:class:`PoolExhaustedError`; the op is :func:`tp_replayssm.ops.replayssm_decode` and its PyTorch
reference :func:`tp_replayssm.reference.replayssm_decode`.
"""

from __future__ import annotations

from .heads import KDAHeads
from .placement import PlacementError
from .pool import PoolExhaustedError, ReplaySSMStatePool

__all__ = ["KDAHeads", "PlacementError", "PoolExhaustedError", "ReplaySSMStatePool"]
