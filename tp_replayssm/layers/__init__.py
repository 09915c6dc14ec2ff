"""Model layers on the state pool: :class:`TPKimiDeltaAttention`, one rank's shard of a Kimi Delta Attention layer.

- :class:`TPKimiDeltaAttention` (:mod:`.kda`): built from flash-linear-attention's ``KimiDeltaAttention``
  (:meth:`~TPKimiDeltaAttention.from_fla`) or a state dict with FLA's or Kimi-Linear's names
  (:meth:`~TPKimiDeltaAttention.from_state_dict`, slices only); ``layer(hidden, slots)`` decodes,
  ``layer(hidden, slots, cu_seqlens)`` prefills, ``layer(hidden, slots, verify=True, parents=None)`` verifies draft
  tokens (speculative decoding; the caller commits with ``pool.commit``).
- :class:`KDALayerConfig` (:mod:`.config`): the layer's global geometry and options.
- :func:`end_prefill` (:mod:`.prefill`): the cursors of a prefill step go to 0 once every layer prefilled.
- :mod:`.weights`: the sharding of every parameter; :mod:`.kda_torch`: the PyTorch prefill math.

flash-linear-attention is optional (the ``[fla]`` extra): nothing here imports it until a CUDA prefill looks for
its ``chunk_kda``. The contract: docs/layers.md.
"""

from __future__ import annotations

from .config import KDALayerConfig
from .kda import TPKimiDeltaAttention, gated_rms_norm
from .prefill import end_prefill
from .weights import FLA_NAMES, KIMI_NAMES, ShardWeights, read_shard

__all__ = ["FLA_NAMES", "KIMI_NAMES", "KDALayerConfig", "ShardWeights", "TPKimiDeltaAttention", "end_prefill",
           "gated_rms_norm", "read_shard"]
