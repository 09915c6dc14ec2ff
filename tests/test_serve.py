"""The serving job, ``launch/serve.py``, end to end under torchrun on CPU/gloo ranks: requests of different prompt
lengths are admitted, prefilled in chunks, decoded and retired, and their greedy tokens and logits match the plain
float64 model on rank 0; a corrupted weight on one rank makes every rank fail the check."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVE = REPO / "launch" / "serve.py"


def _torchrun(log_dir: Path, nproc: int, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """torchrun in its own process group, each rank's lines prefixed ``[default<rank>]:``; on timeout the whole
    group is killed (a hang fails the test and leaves nothing behind)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TP_REPLAYSSM_PLACEMENT_TIMEOUT_S": "20"}
    env.pop("TRITON_INTERPRET", None)  # the job needs no environment variable on CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--tee", "3", "--log-dir", str(log_dir),
           str(SERVE), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"serve.py hung (> {timeout} s):\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _results(out: str, nproc: int) -> list[list[str]]:
    return [re.findall(rf"^\[default{r}\]:\s*(RESULT: .*)$", out, flags=re.M) for r in range(nproc)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [1, 2])
def test_serve_end_to_end(tmp_path: Path, nproc: int) -> None:
    """Every request finishes; prefill (in chunks of 5 tokens) and decode report tokens/s; the check against the
    plain float64 model passes with fp32 rings (tight tolerance); only rank 0 prints the summary."""
    run = _torchrun(tmp_path, nproc, "--requests", "7", "--batch", "3", "--prompt-len", "2", "13", "--new-tokens",
                    "1", "6", "--prefill-chunk", "5", "--seed", "3")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert _results(out, nproc) == [["RESULT: OK"]] + [[]] * (nproc - 1), out[-4000:]
    assert re.search(r"requests 7: prompts \d+ tokens, generated \d+ tokens", out), out[-3000:]
    assert re.search(r"prefill: \d+ tokens in [0-9.]+ s = [0-9.]+ tokens/s \(\d+ packed steps, chunk 5\)", out)
    assert re.search(r"decode: \d+ tokens in [0-9.]+ s = [0-9.]+ tokens/s \(\d+ steps of 3 rows", out)
    m = re.search(r"check against the plain float64 model.*: (\d+) tokens, max logits rel err ([0-9.e+-]+) \(tol "
                  r"1e-04\), 0 greedy mismatches", out)
    assert m and float(m.group(2)) < 1e-4, out[-3000:]
    for r in range(nproc):
        assert re.search(rf"rank {r} cpu: pool [0-9.]+ KiB", out), out[-3000:]
    assert "[serve] requests" not in out  # no progress line when stderr is not a terminal


@pytest.mark.timeout(240)
def test_serve_corrupted_weight_fails(tmp_path: Path) -> None:
    """The last rank scales its shard of one o_proj: every rank prints one RESULT: FAIL line naming the check, and
    the job exits non-zero."""
    run = _torchrun(tmp_path, 2, "--requests", "4", "--batch", "2", "--new-tokens", "2", "4", "--corrupt-weight")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    lines = _results(out, 2)
    assert all(len(rl) == 1 and rl[0].startswith("RESULT: FAIL RuntimeError: logits rel err") for rl in lines), lines
    assert "RESULT: OK" not in out


def test_serve_help_and_bad_arguments() -> None:
    """--help shows the commands and defaults without importing torch's distributed stack; bad options exit 2."""
    run = subprocess.run([sys.executable, str(SERVE), "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "torchrun --standalone --nproc-per-node 2 launch/serve.py" in run.stdout
    assert "(default: 8)" in run.stdout  # --prefill-chunk
    for bad in (["--prompt-len", "5", "3"], ["--reference", "fla"], ["--batch", "0"]):
        run = subprocess.run([sys.executable, str(SERVE), *bad], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, (bad, run.stderr)
