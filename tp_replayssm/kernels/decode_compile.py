"""The decode kernel pinned to a Helion config: :func:`decode_kernel_for` (one compiled kernel object per distinct
config), the settings it compiles with, and the fused advance's count unit :data:`CURSOR_READER`;
:mod:`tp_replayssm.kernels.decode` exports them with the kernel."""

from __future__ import annotations

import functools

import torch

import helion

__all__ = ["CURSOR_READER", "decode_kernel_for"]

# The fused advance's count unit: a cursor table entry holds the cursor in its low 16 bits and, during a launch
# with ``advance_cursors``, the number of the row's programs that have read it above them
CURSOR_READER = 1 << 16

# The every-step reductions are fp32 sums in registers; the flush's bf16 MMAs take exact operands (no tf32).
_SETTINGS = dict(static_shapes=True, index_dtype=torch.int64)


@functools.lru_cache(maxsize=None)
def _compiled(config_items: tuple[tuple[str, object], ...]) -> helion.Kernel:
    from .decode import replayssm_decode_kernel  # (decode imports this module: no import at the top)

    config = helion.Config(**{k: _as_lists(v) for k, v in config_items})
    return helion.kernel(replayssm_decode_kernel, config=config, **_SETTINGS)


def _as_tuples(v: object) -> object:  # nested lists (``loop_orders=[[...]]``) -> hashable tuples
    return tuple(_as_tuples(x) for x in v) if isinstance(v, list) else v


def _as_lists(v: object) -> object:
    return [_as_lists(x) for x in v] if isinstance(v, tuple) else v


def _key(config: helion.Config) -> tuple[tuple[str, object], ...]:
    return tuple(sorted((k, _as_tuples(v)) for k, v in config.config.items()))


# hot-path cache by config object identity (the pinned configs are module constants); the config is
# kept in the value so its id cannot be reused by another object
_BY_CONFIG: dict[int, tuple[helion.Config, helion.Kernel]] = {}


def decode_kernel_for(config: helion.Config) -> helion.Kernel:
    """The decode kernel pinned to ``config`` (one compiled kernel object per distinct config)."""
    hit = _BY_CONFIG.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    kern = _compiled(_key(config))
    _BY_CONFIG[id(config)] = (config, kern)
    return kern
