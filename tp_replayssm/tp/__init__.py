"""The tensor-parallel side: head sharding, devices, placement checks and process groups.

- :mod:`.heads`: :class:`~.heads.KDAHeads` (a layer's global heads) and the sharding rule
  (:func:`~.heads.shard_heads` -> :class:`~.heads.HeadShard`, with slicers for global tensors).
- :mod:`.devices`: resolving a device argument to the rank's device.
- :mod:`.placement`: the collective placement check (every rank raises the same ``PlacementError``).
- :mod:`.distributed`: process-group setup from torchrun's environment, and teardown.
"""
