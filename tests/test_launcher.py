"""The main job, ``launch/decode.py``, run end to end under torchrun with 2 CPU/gloo ranks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = REPO / "launch" / "decode.py"


def _torchrun(*args: str, timeout: float = 150.0, script: Path = LAUNCHER) -> subprocess.CompletedProcess:
    """Run the launcher under torchrun in its own process group; on timeout kill that whole group
    (torchrun and its workers), so a hang fails the test and leaves nothing behind."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TP_REPLAYSSM_PLACEMENT_TIMEOUT_S": "20"}
    env.pop("TRITON_INTERPRET", None)  # the launcher must set it itself on a machine without CUDA
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"launcher hung (> {timeout} s):\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def placement_error_lines(out: str, ranks: tuple[int, ...] = (0, 1)) -> list[str | None]:
    """The first line of the ``PlacementError`` each rank raised, as torchrun printed it (None if absent)."""
    lines = [re.search(rf"^\[rank{rank}\]: tp_replayssm\.placement\.PlacementError: (.*)$", out, flags=re.M)
             for rank in ranks]
    return [m.group(1) if m else None for m in lines]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["spec", "predecayed"])
def test_launcher_end_to_end(layout: str) -> None:
    """Two gloo ranks decode with churn and check sampled rows against the float64 oracle; with
    ``--ring-layout predecayed`` the pools keep their rings pre-decayed (the log says which layout; the softplus
    gate, so the kernel's rebase check is compiled in), and the last layer's decode moves the cursors
    (``--fused-advance``: the sampled states after each step are read at the moved cursors)."""
    extra = ("--ring-layout", "predecayed", "--ring-length", "3", "--fused-advance") if layout == "predecayed" \
        else ("--ring-length", "2")
    run = _torchrun("--steps", "4", "--batch", "3", "--seed", "1", *extra)
    out = run.stdout + run.stderr
    assert f"{layout} ring layout" in out, out[-4000:]
    advance = "fused into the last decode" if layout == "predecayed" else "by pool.advance"
    assert f"cursor advance {advance}" in out, out[-4000:]
    assert run.returncode == 0, out[-6000:]
    assert "RESULT: OK" in out, out[-4000:]
    assert re.search(r"throughput [0-9.]+ tokens/s", out) and re.search(r"state traffic [0-9.e+-]+ GB/s", out)
    # the CPU host times say what they include (the interpreter's kernel run, not the check alone)
    assert re.search(r"first call of a layer \(collective check\) [0-9.]+ ms vs later calls \(no check\) [0-9.]+ ms\n"
                     r" +\(on CPU both include the kernel's run in the Triton interpreter", out), out[-4000:]
    per_rank = re.findall(r"rank (\d) cpu: pool .* placement checks (\d+) .* sampled rows (\d+) max rel err "
                          r"([0-9.e+-]+), mismatches (\d+)", out)
    assert sorted(r[0] for r in per_rank) == ["0", "1"], out[-4000:]
    for _, checks, rows, err, bad in per_rank:
        assert int(checks) >= 3  # construction, verify_placement, first decode of each layer, ...
        assert int(rows) > 0 and int(bad) == 0 and float(err) < 2e-2


@pytest.mark.timeout(200)
def test_launcher_detects_a_wrong_output() -> None:
    """The verification is live: one perturbed output on rank 1 makes the job exit non-zero."""
    run = _torchrun("--steps", "1", "--layers", "1", "--corrupt-output")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    assert "sampled rows MISMATCHED" in out and "mismatched the float64 reference" in out, out[-4000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("fault", "expect"),
    [
        ("ring-length", "ring_length=5 (rank 0: 4)"),
        ("cache-device", "`d_cache` on meta, expected cpu"),
        ("activation-device", "`mixed_qkv` on meta, expected cpu"),
    ],
)
def test_launcher_fault_injection(fault: str, expect: str) -> None:
    """Every rank raises the same PlacementError naming rank 1; torchrun reports it and exits non-zero."""
    run = _torchrun("--inject-fault", fault, timeout=100.0)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    for line in placement_error_lines(out):
        assert line is not None, out[-6000:]
        assert line.endswith("offending rank(s): 1"), line
    assert expect in out, out[-4000:]
    assert "RESULT" not in out  # it never got to decode to the end


@pytest.mark.timeout(200)
def test_placement_benchmark_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/bench_placement.py (the README's check-cost numbers) runs and reports every rank."""
    import json

    monkeypatch.setenv("OUT", str(tmp_path))
    run = _torchrun("--reps", "5", script=REPO / "benchmarks" / "bench_placement.py")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    ranks = json.loads((tmp_path / "bench_placement.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["backend"] == "gloo" and r["check_us"] > 0 and r["host_first_us"] > r["host_later_us"] > 0
