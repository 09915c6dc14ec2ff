"""PLACEHOLDER (helper A replaces this): the per-rank state pool."""
from __future__ import annotations


class PoolExhaustedError(RuntimeError):
    pass


class ReplaySSMStatePool:  # placeholder
    pass
