"""Shared pytest setup.

Calls on CPU tensors run the library's PyTorch path by default. The tests also run the Helion kernels themselves in
Triton's interpreter (one case per kernel path): the ``interpreter`` fixture switches the CPU backend for a test.
Triton decides at import time whether it interprets, so ``TRITON_INTERPRET=1`` is set here, before anything imports
triton, on machines without CUDA. With ``TP_REPLAYSSM_FAIL_LOG=PATH`` every failure is appended to ``PATH`` as it
happens (tests/_fail_log.py), so a run cut by a time limit keeps its tracebacks.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from _fail_log import pytest_runtest_logreport  # noqa: E402, F401 - the hook, registered by its name here


@pytest.fixture
def interpreter():  # noqa: ANN201 - a pytest fixture
    """Run the Helion kernels in Triton's interpreter for calls on CPU tensors during the test."""
    from tp_replayssm.kernels.backend import use_cpu_backend

    with use_cpu_backend("interpreter"):
        yield


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest hook
    """Skip ``gpu`` tests without CUDA and ``multigpu`` tests with fewer than two GPUs."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the device)"))
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs at least two CUDA GPUs"))
