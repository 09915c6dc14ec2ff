"""flash-linear-attention 0.6.0 as the layer tests' peer: its ``KimiDeltaAttention`` and ``Cache``, made to run on
CPU in Triton's interpreter (test-only workarounds, never in library code).

``fla`` is optional (``pip install -e .[test,fla]``); :data:`SKIP_REASON` says why FLA tests skip without it.
On a machine without CUDA, FLA's Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, which
tests/conftest.py sets before triton is imported) with two workarounds, both applied by :func:`load`:

- Triton's autotuner benchmarks its configs through a GPU driver even in the interpreter ("0 active drivers"): its
  config list is cut to the first config, so nothing is benchmarked.
- In the interpreter ``range(...)`` inside a kernel yields Python ints, and FLA's chunk kernels call ``.to(tl.int64)``
  on the loop index: ``fla.ops.common.chunk_delta_h`` gets a ``range`` whose ints accept ``.to`` (a no-op).

FLA's interpreted decode step costs about 0.1-0.2 s: keep the shapes tiny and the calls few. Run FLA in fp32 here:
in the interpreter ``chunk_kda`` on bf16 inputs returns values off by orders of magnitude (its fp32 results and its
bf16 results on a GPU are right), so a bf16 FLA layer on a CPU is no reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from typing import Any

import torch

def _found(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


FLA_CORE_AVAILABLE = _found("fla", "einops")  # fla-core: the ops (chunk_kda, fused_recurrent_kda)
FLA_AVAILABLE = FLA_CORE_AVAILABLE and _found("transformers")  # flash-linear-attention's layers need transformers
SKIP_REASON = ("flash-linear-attention 0.6.0 (with transformers) is not installed (pip install -e .[test,fla]); the "
               "FLA-peer tests of the layer skip, the float64 plain reimplementation still checks it")
SKIP_REASON_CORE = "fla-core 0.6.0 is not installed (pip install -e .[test,fla]): no chunk_kda prefill to test"


class _IntWithTo(int):
    def to(self, *args: Any, **kwargs: Any) -> "_IntWithTo":
        return self


class _RangeWithTo:
    def __init__(self, *args: int) -> None:
        self._r = range(*args)

    def __iter__(self):  # noqa: ANN204 - an iterator of _IntWithTo
        return (_IntWithTo(i) for i in self._r)

    def __len__(self) -> int:
        return len(self._r)


@functools.lru_cache(maxsize=1)
def load() -> Any:
    """Import FLA (with the interpreter workarounds on a machine without CUDA); returns the ``fla`` module."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
    if interpreting:
        import triton.runtime.autotuner as autotuner

        original = autotuner.Autotuner.prune_configs

        def first_config(self: Any, kwargs: Any, *args: Any, **kw: Any) -> Any:
            return original(self, kwargs, *args, **kw)[:1]

        autotuner.Autotuner.prune_configs = first_config
    import fla
    import fla.layers  # noqa: F401
    import fla.models.utils  # noqa: F401

    if interpreting:
        import fla.ops.common.chunk_delta_h as chunk_delta_h

        chunk_delta_h.range = _RangeWithTo
    return fla


def kda_layer(seed: int, **kwargs: Any) -> Any:
    """An ``fla.layers.KimiDeltaAttention`` (fp32, eval) with seeded weights; its norm weight, output-gate bias and
    conv biases made non-trivial (FLA initializes them to ones / zeros)."""
    fla = load()
    torch.manual_seed(seed)
    layer = fla.layers.KimiDeltaAttention(layer_idx=0, **kwargs).eval()
    with torch.no_grad():
        layer.o_norm.weight.add_(0.2 * torch.randn_like(layer.o_norm.weight))
        if layer.g_proj[1].bias is not None:
            layer.g_proj[1].bias.normal_(0, 0.3)
        for conv in (getattr(layer, n, None) for n in ("q_conv1d", "k_conv1d", "v_conv1d")):
            if conv is not None and conv.bias is not None:
                conv.bias.normal_(0, 0.3)
    for p in layer.parameters():
        p.requires_grad_(False)
    return layer


def new_cache() -> Any:
    """An empty FLA ``Cache`` (its layers' recurrent and conv states)."""
    return load().models.utils.Cache()


def run(layer: Any, x: torch.Tensor, cache: Any, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """FLA's layer with its own cache: ``x [1, T, hidden]`` packed with ``cu_seqlens`` (a prefill of several
    sequences) or ``[N, 1, hidden]`` (one decode token per sequence). Returns the output of ``x``'s shape."""
    kw = {} if cu_seqlens is None else {"cu_seqlens": torch.tensor(cu_seqlens, dtype=torch.long, device=x.device)}
    with torch.no_grad():
        out, _, _ = layer(x, past_key_values=cache, use_cache=True, **kw)
    return out
