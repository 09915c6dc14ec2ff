"""Shared pytest setup.

On a machine without CUDA the Helion kernel runs in the Triton interpreter: ``TRITON_INTERPRET=1`` must
be set before helion/triton are imported, so it is set here, at conftest import time.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest hook
    """Skip ``gpu`` tests without CUDA and ``multigpu`` tests with fewer than two GPUs."""
    import pytest

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the device)"))
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs at least two CUDA GPUs"))
