"""Where a call runs: the Helion kernels on CUDA tensors; on CPU tensors the PyTorch path, or the interpreter.

On CPU tensors the library runs its PyTorch reference implementation (:mod:`tp_replayssm.reference`: vectorized over
rows and heads, the same contract as the kernels), so a unit test that builds a pool with ``device="cpu"`` works with
no environment variable and no import order. That choice is logged once per process.

The Helion kernels themselves run on CPU in Triton's interpreter, which the tests use to check the kernels without a
GPU. Triton decides at import time whether it interprets (``TRITON_INTERPRET=1`` must be set before triton is first
imported), so the interpreter is opt-in: ``TP_REPLAYSSM_CPU_BACKEND=interpreter`` or
``with use_cpu_backend("interpreter"):``. Asking for it in a process whose triton was imported without
``TRITON_INTERPRET=1`` raises a ``ValueError`` that says so, before anything is written.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator

import torch

__all__ = ["CPU_BACKENDS", "cpu_backend", "interpreter_ready", "runs_kernel", "use_cpu_backend"]

log = logging.getLogger(__name__)

CPU_BACKEND_ENV = "TP_REPLAYSSM_CPU_BACKEND"
CPU_BACKENDS = ("torch", "interpreter")
_override: list[str] = []


def cpu_backend() -> str:
    """``"torch"`` (the default) or ``"interpreter"``: what runs calls on CPU tensors."""
    if _override:
        return _override[-1]
    name = os.environ.get(CPU_BACKEND_ENV, "").strip().lower() or "torch"  # (unset or empty: the default)
    if name not in CPU_BACKENDS:
        raise ValueError(f"{CPU_BACKEND_ENV} must be one of {list(CPU_BACKENDS)}; got {name!r}")
    return name


@contextlib.contextmanager
def use_cpu_backend(name: str) -> Iterator[None]:
    """Run calls on CPU tensors with ``name`` (``"torch"`` or ``"interpreter"``) inside the block."""
    if name not in CPU_BACKENDS:
        raise ValueError(f"use_cpu_backend: `name` must be one of {list(CPU_BACKENDS)}; got {name!r}")
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


def interpreter_ready() -> bool:
    """Whether this process's triton was imported in interpreter mode (``TRITON_INTERPRET=1`` set before)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def runs_kernel(device: torch.device, where: str) -> bool:
    """True when a call on ``device`` launches the Helion kernel (CUDA, or CPU with the interpreter backend), False
    when it runs the PyTorch path. ``ValueError`` for other devices, or for the interpreter when triton was imported
    without it."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        raise ValueError(f"{where}: tensors must be on a CUDA device or the CPU; got {device}")
    if cpu_backend() == "torch":
        _log_cpu_path()
        return False
    if not interpreter_ready():
        raise ValueError(
            f"{where}: the interpreter backend ({CPU_BACKEND_ENV}=interpreter) needs TRITON_INTERPRET=1 set before "
            "triton is first imported (this process imported it without); use the default torch backend on CPU, "
            "or set the variable at the start of the process")
    from .interpreter import install_libdevice_shim

    install_libdevice_shim()
    return True


@functools.lru_cache(maxsize=1)
def _log_cpu_path() -> None:
    log.info("tp_replayssm: calls on CPU tensors run the PyTorch reference path (%s=interpreter runs the Helion "
             "kernels in Triton's interpreter)", CPU_BACKEND_ENV)
