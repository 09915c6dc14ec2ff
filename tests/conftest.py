"""Shared pytest setup.

Calls on CPU tensors run the library's PyTorch path by default. The tests also run the Helion kernels themselves in
Triton's interpreter (one case per kernel path): the ``interpreter`` fixture switches the CPU backend for a test.
Triton decides at import time whether it interprets, so ``TRITON_INTERPRET=1`` is set here, before anything imports
triton, on machines without CUDA. With ``TP_REPLAYSSM_FAIL_LOG=PATH`` every failure is appended to ``PATH`` as it
happens (tests/_fail_log.py), so a run cut by a time limit keeps its tracebacks. Under pytest-xdist each worker uses
its share of the host's cores for torch's CPU threads.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker's torch would start one CPU thread per core, so n workers oversubscribe the host's
# cores n times over (the float64 oracles and CPU references crawl); each worker takes its share of the cores instead.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

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
