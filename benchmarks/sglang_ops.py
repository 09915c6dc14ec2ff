"""SGLang's KDA ReplaySSM decode kernel as a ``bench_decode.py --replay-op``, loaded from SGLang's own source file.

SGLang's Triton kernel (``fused_recurrent_linear_replayssm_decode`` in
``python/sglang/kernels/ops/attention/fla/fused_recurrent_linear_replayssm.py``) imports only ``math``, ``torch`` and
``triton``, so it runs without an SGLang install: this module loads that one file by path. The file is not part of
this repository; DEVELOPERS.md ("SGLang's kernel beside ours") says which commit to take it from and where to put it.

    SGLANG_KDA_FILE=.devwheels/sglang/fused_recurrent_linear_replayssm.py \\
        python3 benchmarks/bench_decode.py --replay-op sglang=sglang_ops:sglang_linear ...

``sglang_linear`` has the op's signature (``tp_replayssm.ops.replayssm_decode``) and calls SGLang's kernel in its
linear-ring mode (the one SGLang's KDA decode path runs): rings ``d [S, HV, L, V]``, ``k [S, H, L, K]`` (l2-normalized
keys), ``g [S, HV, L, K]`` fp32 per-step log gates, the row's cursor advanced by the caller (to 0 after the flush at
``L - 1``), the same layout as this library's ``"sglang"`` ring layout. SGLang's circular pre-decayed mode needs an
fp32 checkpoint, one key head per value head and a bounded gate, and a cursor rule of its own, so it is not wrapped.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["DEFAULT_FILE", "load_kernel_module", "sglang_linear"]

DEFAULT_FILE = Path(__file__).resolve().parents[1] / ".devwheels" / "sglang" / "fused_recurrent_linear_replayssm.py"


def load_kernel_module(path: str | os.PathLike[str] | None = None) -> ModuleType:
    """SGLang's kernel file as a module (``$SGLANG_KDA_FILE``, else :data:`DEFAULT_FILE`), loaded once."""
    name = "sglang_fused_recurrent_linear_replayssm"
    if name in sys.modules:
        return sys.modules[name]
    file = Path(path or os.environ.get("SGLANG_KDA_FILE") or DEFAULT_FILE)
    if not file.is_file():
        raise FileNotFoundError(f"SGLang's kernel file {file} is missing: DEVELOPERS.md says where to get it "
                                "(or set SGLANG_KDA_FILE)")
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sglang_linear(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor, scale: float | None, initial_state: torch.Tensor, d_cache: torch.Tensor,
                  k_cache: torch.Tensor, g_cache: torch.Tensor, out: torch.Tensor, ssm_state_indices: torch.Tensor,
                  write_pos: torch.Tensor, force_flush: torch.Tensor | None = None,
                  use_qk_l2norm_in_kernel: bool = False,
                  lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA decode step through SGLang's linear-ring kernel, in place; returns ``(out, initial_state)``.

    The op's shapes (``a [B, HV*K]`` or ``[B, HV, K]``, ``dt_bias [HV*K]`` or ``[HV, K]``, ``scale`` None for
    ``K ** -0.5``); SGLang takes ``a [B, HV, K]``, ``dt_bias [HV, K]`` and an explicit scale."""
    B = mixed_qkv.shape[0]
    _, HV, _, K = initial_state.shape
    kernel = load_kernel_module().fused_recurrent_linear_replayssm_decode
    return kernel(mixed_qkv, a.reshape(B, HV, K), b, A_log, dt_bias.reshape(HV, K),
                  K ** -0.5 if scale is None else scale, initial_state, d_cache, k_cache, g_cache, out,
                  ssm_state_indices, write_pos, force_flush, lower_bound=lower_bound,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, is_kda=True)
