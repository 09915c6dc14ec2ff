"""benchmarks/bench_spec.py's host-side parts, on any machine: the cursor cycle its rows walk, the byte floor of a
verify + commit step, and the ``--override`` plan variants it times."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_spec  # noqa: E402
from plan_args import verify_override_arg  # noqa: E402


def test_cycle_of_three_accepted_drafts_of_four() -> None:
    """L = 16, T = 4, 3 accepted: the cursor walks 3, 6, 9, 12 (12 + 4 > 15 folds: 0 + 3) and repeats; one step in
    four folds."""
    assert bench_spec.cycle(16, 4, 3) == [(3, False), (6, False), (9, False), (12, True)]


def test_verify_bytes_counts_the_checkpoint_once_and_the_fold_at_its_share() -> None:
    """HV = H = 32, B = 32, bf16 checkpoint: the checkpoint read is B*HV*V*K*2 bytes, the fold writes it once in four
    steps; the parts add up to the total."""
    m = bench_spec.verify_bytes(32, 32, 32, 128, 128, 16, 4, 3, 2)
    ckpt = 32 * 32 * 128 * 128 * 2
    assert m["checkpoint_read"] == ckpt and m["fold_share"] == 0.25 and m["fold_write"] == ckpt / 4
    assert m["mean_cursor"] == 7.5
    parts = m["checkpoint_read"] + m["fold_write"] + m["ring_read"] + m["ring_write"] + m["io"]
    assert m["bytes"] == pytest.approx(parts)
    assert 55e6 < m["bytes"] < 57e6  # 55.86 MB: the floor bench_spec prints for this shape


def test_override_names_plan_fields_and_times_the_library_plan_first() -> None:
    assert verify_override_arg("value_chunk=32, num_warps=8") == {"value_chunk": 32, "num_warps": 8}
    assert verify_override_arg("tree=off") == {"tree": False}
    with pytest.raises(argparse.ArgumentTypeError, match="field one of.*operand_parts"):
        verify_override_arg("warps=8")
    with pytest.raises(argparse.ArgumentTypeError, match="value_chunk: expected an int"):
        verify_override_arg("value_chunk=wide")
    args = bench_spec.parse_args(["--batch", "8,32", "--heads", "32", "--state", "bf16", "--override",
                                  "operand_parts=2"])
    assert [(s["B"], s["override"]) for s in bench_spec.shapes(args)] == [
        (8, {}), (8, {"operand_parts": 2}), (32, {}), (32, {"operand_parts": 2})]
