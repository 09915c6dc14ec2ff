"""``tp_replayssm.layers.TPKimiDeltaAttention``'s argument checks and slot safety: bad arguments and bad slots raise
(or become padding rows) before anything is written, and the package imports and runs without ``fla``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _layer_helpers as lh
from _layer_case_helpers import CONFIGS, _pool
from tp_replayssm import ReplaySSMStatePool, SlotError
from tp_replayssm.layers import TPKimiDeltaAttention, end_prefill

REPO = Path(__file__).resolve().parent.parent


def _layer(cfg_name: str = "gva") -> tuple[TPKimiDeltaAttention, ReplaySSMStatePool]:
    cfg = CONFIGS[cfg_name]
    pool = _pool(cfg, 0, 2)
    return TPKimiDeltaAttention.from_state_dict(lh.random_weights(cfg, 1), cfg, pool=pool, layer_idx=0), pool


def _snapshot(pool: ReplaySSMStatePool) -> list[torch.Tensor]:
    return [t.clone() for t in (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache, pool.cursors,
                                pool.conv_state)]


def test_bad_arguments_raise_before_writing() -> None:
    layer, pool = _layer()
    slots = pool.alloc(2)
    before = _snapshot(pool)
    x = torch.randn(5, 64)
    cases = [
        (lambda: layer(torch.randn(2, 63), slots), r"`hidden` must be \[B, hidden_size\] with hidden_size=64"),
        (lambda: layer(torch.randn(2, 64, dtype=torch.bfloat16), slots), "dtype torch.float32"),
        (lambda: layer(torch.randn(2, 64), slots.long()), "`slots` must be a 1-D torch.int32"),
        (lambda: layer(torch.randn(3, 64), slots), "one id per row"),
        (lambda: layer(x, slots, torch.tensor([0.0, 2.0, 5.0])), "`cu_seqlens` must be a 1-D int32"),
        (lambda: layer(x, slots, torch.tensor([0, 2], dtype=torch.int32)), r"\[n\+1\] = \[3\]"),
        (lambda: layer(x, slots, torch.tensor([1, 2, 5], dtype=torch.int32)), "must start at 0"),
        (lambda: layer(x, slots, torch.tensor([0, 2, 4], dtype=torch.int32)), "end at the token count 5"),
        (lambda: layer(x, slots, torch.tensor([0, 0, 5], dtype=torch.int32)), "at least one token"),
        (lambda: layer(torch.randn(2, 5, 64), slots, torch.tensor([0, 2, 5], dtype=torch.int32)),
         r"\[1, T, hidden_size\]"),
        (lambda: layer(x, slots, torch.tensor([0, 2, 5], dtype=torch.int32), force_flush=slots), "decode only"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
    for a, b in zip(before, _snapshot(pool)):
        assert torch.equal(a, b)


def test_bad_slots() -> None:
    """A prefill naming a free slot raises SlotError before anything is written; a decode row naming one is a padding
    row (zero output, nothing written) recorded for pool.check(); a padding row (-1) is zero and unrecorded."""
    layer, pool = _layer()
    slots = pool.alloc(3)
    x = torch.randn(5, 64)
    layer(x, slots[:2], torch.tensor([0, 2, 5], dtype=torch.int32), advance=True)
    pool.free(slots[2:])
    before = _snapshot(pool)
    for bad in (torch.tensor([int(slots[0]), int(slots[2])], dtype=torch.int32),
                torch.tensor([int(slots[0]), int(slots[0])], dtype=torch.int32),
                torch.tensor([int(slots[0]), 9], dtype=torch.int32)):
        with pytest.raises(SlotError):
            layer(x, bad, torch.tensor([0, 2, 5], dtype=torch.int32))
        for a, b in zip(before, _snapshot(pool)):
            assert torch.equal(a, b)
    rows = torch.tensor([int(slots[2]), -1], dtype=torch.int32)
    y = layer(torch.randn(2, 64), rows)
    assert bool((y == 0).all())
    for a, b in zip(before, _snapshot(pool)):
        assert torch.equal(a, b)
    with pytest.raises(SlotError, match="decode"):
        pool.check()
    with pytest.raises(SlotError):
        end_prefill(pool, slots[2:])


def test_imports_and_runs_without_fla() -> None:
    """With ``fla`` unimportable the package imports, a CPU prefill and decode run, and prefill_backend='fla' is a
    ValueError saying what to install."""
    code = (
        "import sys; sys.modules['fla'] = None\n"
        "import torch, _layer_helpers as lh\n"
        "from tp_replayssm import ReplaySSMStatePool\n"
        "from tp_replayssm.layers import KDALayerConfig, TPKimiDeltaAttention\n"
        "cfg = KDALayerConfig(32, 2, 2, 16, 16, 16)\n"
        "pool = ReplaySSMStatePool(cfg.heads, num_layers=1, num_slots=2, ring_length=2, conv_kernel_size=4)\n"
        "w = lh.random_weights(cfg, 0)\n"
        "layer = TPKimiDeltaAttention.from_state_dict(w, cfg, pool=pool, layer_idx=0)\n"
        "s = pool.alloc(1)\n"
        "y = layer(torch.randn(3, 32), s, torch.tensor([0, 3], dtype=torch.int32), advance=True)\n"
        "y = layer(torch.randn(1, 32), s, advance=True)\n"
        "assert torch.isfinite(y).all()\n"
        "layer = TPKimiDeltaAttention.from_state_dict(w, cfg, pool=pool, layer_idx=0, prefill_backend='fla')\n"
        "try:\n"
        "    layer(torch.randn(3, 32), s, torch.tensor([0, 3], dtype=torch.int32))\n"
        "except ValueError as e:\n"
        "    assert 'tp_replayssm[fla]' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "print('OK')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TP_REPLAYSSM_CPU_BACKEND")}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{REPO / 'tests'}"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr
