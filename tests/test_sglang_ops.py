"""benchmarks/sglang_ops.py, on any machine: SGLang's kernel file is loaded by path and a missing one is named, and
the op-signature wrapper hands SGLang's kernel the shapes and flags its KDA decode path passes (a stand-in module
records the call; SGLang's own file is not part of the repository)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sglang_ops  # noqa: E402

NAME = "sglang_fused_recurrent_linear_replayssm"


@pytest.fixture
def no_loaded_module() -> Iterator[None]:
    """No kernel module loaded before the test, and none left after it."""
    before = sys.modules.pop(NAME, None)
    yield
    sys.modules.pop(NAME, None)
    if before is not None:
        sys.modules[NAME] = before


def test_a_missing_kernel_file_is_named(no_loaded_module: None, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.py"
    with pytest.raises(FileNotFoundError, match=r"nowhere\.py is missing: DEVELOPERS\.md"):
        sglang_ops.load_kernel_module(missing)


def test_the_kernel_file_loads_by_path_once(no_loaded_module: None, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``$SGLANG_KDA_FILE`` names the file; a second call returns the same module without reading it again."""
    file = tmp_path / "kernel.py"
    file.write_text("LOADS = []\nLOADS.append(1)\ndef fused_recurrent_linear_replayssm_decode(*a, **k):\n    pass\n")
    monkeypatch.setenv("SGLANG_KDA_FILE", str(file))
    first = sglang_ops.load_kernel_module()
    file.write_text("raise RuntimeError('read twice')\n")
    assert sglang_ops.load_kernel_module() is first and first.LOADS == [1]


@pytest.mark.parametrize("scale", [None, 0.25])
def test_the_wrapper_passes_sglangs_shapes_and_flags(scale: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``a [B, HV*K]`` -> ``[B, HV, K]``, ``dt_bias [HV*K]`` -> ``[HV, K]``, None scale -> ``K ** -0.5``, ``is_kda``
    on, the l2norm flag and lower bound through; every other tensor is handed over as it is."""
    calls: list[tuple[tuple, dict]] = []
    fake = types.ModuleType(NAME)
    fake.fused_recurrent_linear_replayssm_decode = lambda *a, **k: calls.append((a, k)) or (a[10], a[6])
    monkeypatch.setitem(sys.modules, NAME, fake)
    B, H, HV, K, V, S, L = 3, 2, 4, 16, 8, 5, 4
    mixed = torch.randn(B, 2 * H * K + HV * V)
    a, b = torch.randn(B, HV * K), torch.randn(B, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    state = torch.randn(S, HV, V, K)
    d, k, g = torch.randn(S, HV, L, V), torch.randn(S, H, L, K), torch.randn(S, HV, L, K)
    out = torch.empty(B, 1, HV, V)
    slots, wp, ff = (torch.arange(B, dtype=torch.int32) for _ in range(3))
    got = sglang_ops.sglang_linear(mixed, a, b, A_log, dt_bias, scale, state, d, k, g, out, slots, wp, ff,
                                   use_qk_l2norm_in_kernel=True, lower_bound=-5.0)
    assert got[0] is out and got[1] is state
    (args, kwargs), = calls
    assert args[1].shape == (B, HV, K) and torch.equal(args[1].reshape(B, -1), a)
    assert args[4].shape == (HV, K) and torch.equal(args[4].reshape(-1), dt_bias)
    assert args[5] == (K ** -0.5 if scale is None else scale)
    for i, t in {0: mixed, 2: b, 3: A_log, 6: state, 7: d, 8: k, 9: g, 10: out, 11: slots, 12: wp, 13: ff}.items():
        assert args[i] is t, i
    assert kwargs == dict(lower_bound=-5.0, use_qk_l2norm_in_kernel=True, is_kda=True)
