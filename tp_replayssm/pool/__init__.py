"""The per-rank state pool and its accounting.

- :mod:`.pool`: :class:`~.pool.ReplaySSMStatePool`, the pool (its storage, decode step and cursors).
- :mod:`.slots`: the host-side free list and the checks of slot-id arguments.
- :mod:`.state`: ``load_state`` / ``read_state``.
- :mod:`.lifecycle`: ``fork``, ``export_state``, ``import_state``; :mod:`.shard`: :class:`~.shard.StateShard`.
- :mod:`.spec`: speculative decoding, ``verify`` and ``commit`` (docs/spec.md).
- :mod:`.memory`: bytes per slot, per layer and in total; ``slots_that_fit``.
"""
