"""The serving job, ``launch/serve.py``, end to end under torchrun on CPU/gloo ranks: requests of different prompt
lengths are admitted, prefilled in chunks, decoded and retired, and their greedy tokens and logits match the plain
float64 model (or FLA's layers in Triton's interpreter) on rank 0; speculative decoding, forks and preemptions keep
the stream's tokens; a corrupted weight on one rank makes every rank fail the check, a bad slot id the step's
``pool.check()``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _fla_cpu

REPO = Path(__file__).resolve().parent.parent
SERVE = REPO / "launch" / "serve.py"


def _torchrun(log_dir: Path, nproc: int, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """torchrun in its own process group, each rank's lines prefixed ``[default<rank>]:``. On timeout every rank
    first writes its Python stack (SIGABRT, faulthandler on), then torchrun's group and every process under it (the
    ranks run in sessions of their own) are killed: a hang fails the test with the place it hung at and leaves
    nothing behind."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TP_REPLAYSSM_PLACEMENT_TIMEOUT_S": "20", "PYTHONFAULTHANDLER": "1"}
    env.pop("TRITON_INTERPRET", None)  # the job needs no environment variable on CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--tee", "3", "--log-dir", str(log_dir),
           str(SERVE), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ranks = _descendants(proc.pid)
        for pid in ranks:
            _signal(pid, signal.SIGABRT)
        time.sleep(3)  # the stacks reach torchrun's tee
        for pid in ranks:
            _signal(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"serve.py did not finish in {timeout} s; each rank's stack at that moment (innermost call "
                    f"first):\n{_stacks(err, nproc)}\nstdout:\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _stacks(err: str, nproc: int, lines: int = 40) -> str:
    """The first ``lines`` lines of each rank's faulthandler dump in torchrun's stderr."""
    out = []
    for r in range(nproc):
        mine = [line for line in err.splitlines() if line.startswith(f"[default{r}]:")]
        start = next((i for i, line in enumerate(mine) if "most recent call first" in line), len(mine))
        out += mine[start:start + lines]
    return "\n".join(out)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux ``/proc``), children before their children."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


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
    assert re.search(r"prefill: \d+ tokens in [0-9.]+ s = [0-9.]+ tokens/s \(\d+ packed steps, chunk 5[;)]", out)
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
    for opt in ("--fork-prob P", "--preempt-prob P", "--inject-bad-slot", "--debug", "--inject-rank-mismatch"):
        assert opt in run.stdout, opt
    assert re.search(r"--fork-prob P\s+chance that a free slot takes a fork.*?\(default: 0\.0\)", run.stdout, re.S)
    for bad in (["--prompt-len", "5", "3"], ["--fork-prob", "1.5"], ["--preempt-prob", "-0.1"], ["--batch", "0"],
                ["--timeout", "0"], ["--timeout", "nan"], ["--timeout", "inf"]):
        run = subprocess.run([sys.executable, str(SERVE), *bad], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and f"error: {bad[0]}" in run.stderr, (bad, run.stderr)
    # under torchrun every rank parses the command line: rank 0 prints the error, the others only exit 2
    run = subprocess.run([sys.executable, str(SERVE), "--batch", "0"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RANK": "1"})
    assert run.returncode == 2 and run.stderr == "" and run.stdout == "", run
    # heads the ranks cannot share: refused naming the flags, before any rank starts (WORLD_SIZE: torchrun's)
    for bad, world, text in ((["--v-heads", "3"], "1", "--v-heads must be a multiple of --heads; got --heads 2"),
                             ([], "3", "--v-heads must split evenly over the 3 ranks (--nproc-per-node); got 4"),
                             (["--heads", "3", "--v-heads", "6"], "2", "--heads must split evenly over the 2 ranks"),
                             (["--heads", "3", "--v-heads", "6"], "3", "--ffn must split evenly over the 3 ranks")):
        run = subprocess.run([sys.executable, str(SERVE), *bad], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "WORLD_SIZE": world})
        assert run.returncode == 2 and text in run.stderr, (bad, world, run.stderr)


SPEC_ARGS = ("--requests", "7", "--batch", "3", "--prompt-len", "2", "13", "--new-tokens", "4", "14",
             "--prefill-chunk", "5", "--seed", "3", "--ring-length", "6", "--vocab", "8")


def _digest(out: str) -> str:
    m = re.search(r"generated tokens: crc32 ([0-9a-f]{8})", out)
    assert m, out[-3000:]
    return m.group(1)


_PLAIN: dict[int, subprocess.CompletedProcess] = {}


def _plain_run(log_dir: Path, nproc: int) -> subprocess.CompletedProcess:
    """The job with SPEC_ARGS and no options, once per rank count (the speculative and lifecycle tests compare
    against it)."""
    if nproc not in _PLAIN:
        _PLAIN[nproc] = _torchrun(log_dir, nproc, *SPEC_ARGS)
    return _PLAIN[nproc]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [1, 2])
def test_serve_speculative_same_tokens(tmp_path: Path, nproc: int) -> None:
    """--spec-tokens 3 (4 tokens verified per step, ring length 6: rows fold) gives RESULT: OK and the same greedy
    tokens as the plain decode (the checksum of every request's tokens), in fewer decode steps; the summary reports
    the acceptance rate and how many rows accepted 0..3 drafts (a vocabulary of 8 makes the greedy tokens repeat, so
    every count occurs with this seed)."""
    plain = _plain_run(tmp_path / "plain", nproc)
    spec = _torchrun(tmp_path / "spec", nproc, *SPEC_ARGS, "--spec-tokens", "3")
    outs = [run.stdout + run.stderr for run in (plain, spec)]
    for run, out in zip((plain, spec), outs):
        assert run.returncode == 0, out[-6000:]
        assert _results(out, nproc) == [["RESULT: OK"]] + [[]] * (nproc - 1), out[-4000:]
        assert re.search(r"check against the plain float64 model.*\(tol 1e-04\), 0 greedy mismatches, 0 near ties",
                         out), out[-3000:]
    assert _digest(outs[0]) == _digest(outs[1])
    assert "speculative:" not in outs[0]
    steps = [int(re.search(r"decode: (\d+) tokens in [0-9.]+ s = [0-9.]+ tokens/s \((\d+) steps of 3 rows",
                           out).group(2)) for out in outs]
    m = re.search(r"speculative: 3 draft tokens per request and step \(n-gram lookup\), (\d+) proposed, (\d+) "
                  r"accepted: acceptance rate ([0-9.]+)%, ([0-9.]+) tokens per request and step; rows accepting 0..3 "
                  r"drafts: \[(\d+), (\d+), (\d+), (\d+)\]", outs[1])
    assert m, outs[1][-3000:]
    proposed, accepted = int(m.group(1)), int(m.group(2))
    hist = [int(m.group(i)) for i in range(5, 9)]
    assert proposed == 3 * sum(hist) and accepted == sum(n * c for n, c in enumerate(hist))
    assert abs(float(m.group(3)) - 100 * accepted / proposed) < 0.06
    assert all(c > 0 for c in hist), hist
    assert steps[1] < steps[0], steps


def test_serve_spec_tokens_option() -> None:
    """--spec-tokens T needs T + 1 <= ring length - 1 (the next input token and T drafts in one verify)."""
    for bad in (["--spec-tokens", "3"], ["--spec-tokens", "-1"], ["--spec-tokens", "4", "--ring-length", "5"]):
        run = subprocess.run([sys.executable, str(SERVE), *bad], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and "--spec-tokens must be 0 (off) or T with T + 1 <=" in run.stderr, (bad, run)
    run = subprocess.run([sys.executable, str(SERVE), "--help"], capture_output=True, text=True, timeout=60)
    assert "--spec-tokens T" in run.stdout and "0: off (default: 0)" in run.stdout


def test_serve_spec_drafts_and_acceptance() -> None:
    """The prompt-lookup draft continues the latest earlier occurrence of the longest suffix (periodic histories
    continue their period; no occurrence repeats the last token); the accepted drafts are the longest prefix equal
    to the greedy tokens of the positions before them."""
    import torch

    sys.path.insert(0, str(REPO / "launch"))
    from serve_spec import accepted_drafts, propose

    assert propose([1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]
    assert propose([5, 6, 7], 3) == [7, 7, 7]
    assert propose([4], 2) == [4, 4]
    assert propose([9, 1, 9, 2, 9, 5, 1, 9], 2) == [2, 9]  # the 2-gram (1, 9), not the later 1-gram (9) -> 5
    tokens = torch.tensor([[10, 1, 2, 3], [10, 1, 2, 3], [10, 5, 2, 3], [10, 1, 2, 3]])
    greedy = torch.tensor([[1, 2, 3, 4], [1, 2, 0, 4], [1, 2, 3, 4], [1, 9, 3, 4]])
    n = accepted_drafts(tokens, greedy)
    assert n.dtype == torch.int32 and n.tolist() == [3, 2, 0, 1]


LIFE_ARGS = ("--fork-prob", "0.4", "--preempt-prob", "0.15")


def _lifecycle_counts(out: str) -> tuple[int, int, int, int]:
    m = re.search(r"lifecycle: forks (\d+) \(--fork-prob 0\.4; they generated (\d+) tokens\), preemptions (\d+) of "
                  r"\d+ requests, resumptions (\d+) \(--preempt-prob 0\.15\); pool\.fork [0-9.]+ ms, export_state "
                  r"[0-9.]+ ms, import_state [0-9.]+ ms in all", out)
    assert m, out[-3000:]
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [1, 2])
def test_serve_forks_and_preemptions(tmp_path: Path, nproc: int) -> None:
    """--fork-prob and --preempt-prob, alone and with --spec-tokens 3: RESULT: OK with every token of every request
    (forks included: their prompt is the shared prefix) checked against the plain float64 model, forks, preemptions
    and resumptions counted (all > 0, each preemption resumed), forks counted among the requests, and the stream's
    7 requests generate exactly the tokens of the run without the options (their checksum equals its checksum of
    every request); the forks change the checksum of all requests. The speculative run is in debug mode: every pool
    call (alloc, free, fork, export, import, load_state, verify, commit) agrees across the ranks."""
    plain = _plain_run(tmp_path / "plain", nproc)
    life = _torchrun(tmp_path / "life", nproc, *SPEC_ARGS, *LIFE_ARGS)
    spec = _torchrun(tmp_path / "spec", nproc, *SPEC_ARGS, *LIFE_ARGS, "--spec-tokens", "3", "--debug")
    want = _digest(plain.stdout + plain.stderr)
    for run in (life, spec):
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        assert _results(out, nproc) == [["RESULT: OK"]] + [[]] * (nproc - 1), out[-4000:]
        assert re.search(r"check against the plain float64 model.*\(tol 1e-04\), 0 greedy mismatches, 0 near ties",
                         out), out[-3000:]
        forks, fork_tokens, preempted, resumed = _lifecycle_counts(out)
        assert forks > 0 and fork_tokens >= forks and preempted > 0 and resumed == preempted, out[-3000:]
        assert re.search(rf"requests {7 + forks}: prompts \d+ tokens", out), out[-3000:]
        m = re.search(r"generated tokens: crc32 ([0-9a-f]{8}) \(every request's tokens in request order\); the "
                      r"stream's 7 requests \(forks left out\): crc32 ([0-9a-f]{8})", out)
        assert m and m.group(2) == want and m.group(1) != want, (want, out[-3000:])
    assert "speculative:" in spec.stdout + spec.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec", [False, True])
def test_serve_bad_slot_fails_at_its_step(tmp_path: Path, spec: bool) -> None:
    """--inject-bad-slot names a slot out of range in decode step 1 on every rank: that step's pool.check() (not
    the one at the end of the run) raises SlotError naming the decode (or, with --spec-tokens, the verify), every
    rank prints one RESULT: FAIL line and the job exits non-zero before its summary."""
    extra = ("--spec-tokens", "3", "--ring-length", "6") if spec else ()
    run = _torchrun(tmp_path, 2, "--requests", "4", "--batch", "3", "--new-tokens", "2", "4", "--inject-bad-slot",
                    *extra)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    method = "verify" if spec else "decode"
    for r, lines in enumerate(_results(out, 2)):
        assert len(lines) == 1 and lines[0].startswith(f"RESULT: FAIL SlotError: ReplaySSMStatePool.{method}("), lines
        assert re.search(rf"\[rank {r}\] ERROR serve: pool\.check\(\) in decode step 1 found bad slots", out)
    assert "serve summary" not in out and "RESULT: OK" not in out


@pytest.mark.timeout(240)
def test_serve_rank_mismatch_fails_at_its_step_in_debug_mode(tmp_path: Path) -> None:
    """--inject-rank-mismatch: the last rank passes decode step 1's slots shifted by a row. With --debug every rank
    raises the same RankMismatchError at that decode (naming `slots` and each rank's order) and exits non-zero
    before the summary; without it the run goes on, and only the tokens' check at the end fails."""
    args = ("--requests", "4", "--batch", "3", "--new-tokens", "2", "4", "--inject-rank-mismatch")
    debug = _torchrun(tmp_path / "debug", 2, *args, "--debug")
    out = debug.stdout + debug.stderr
    assert debug.returncode != 0, out[-4000:]
    lines = _results(out, 2)
    assert all(len(r) == 1 for r in lines) and lines[0] == lines[1], lines
    assert lines[0][0].startswith("RESULT: FAIL RankMismatchError: TPKimiDeltaAttention(layer=0): the ranks "
                                  "passed different arguments: `slots`: "), lines
    assert "serve summary" not in out and "RESULT: OK" not in out
    plain = _torchrun(tmp_path / "plain", 2, *args)
    out = plain.stdout + plain.stderr
    assert plain.returncode != 0 and "serve summary" in out, out[-4000:]
    assert re.search(r"RESULT: FAIL RuntimeError: logits rel err .* greedy tokens differ", out), out[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _fla_cpu.FLA_AVAILABLE, reason=_fla_cpu.SKIP_REASON)
def test_serve_fla_reference_on_cpu(tmp_path: Path) -> None:
    """--reference fla on a CPU: the greedy tokens and logits of 2 gloo ranks (forks and preemptions included)
    equal those of the same model run on rank 0 through FLA 0.6.0's KimiDeltaAttention layers, fp32 in Triton's
    interpreter (the job sets TRITON_INTERPRET itself). Tiny sizes: FLA's kernels are interpreted."""
    run = _torchrun(tmp_path, 2, "--reference", "fla", "--layers", "1", "--heads", "1", "--v-heads", "2",
                    "--requests", "4", "--batch", "2", "--prompt-len", "2", "6", "--new-tokens", "1", "4",
                    "--fork-prob", "0.5", "--preempt-prob", "0.2", "--seed", "1")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert _results(out, 2) == [["RESULT: OK"], []], out[-4000:]
    m = re.search(r"check against the FLA KimiDeltaAttention layers, fp32, one rank, Triton's interpreter "
                  r"\([0-9.]+ s\): (\d+) tokens, max logits rel err ([0-9.e+-]+) \(tol 1e-04\), 0 greedy mismatches",
                  out)
    assert m and int(m.group(1)) > 0 and float(m.group(2)) < 1e-4, out[-3000:]


@pytest.mark.gpu
@pytest.mark.timeout(450)
def test_serve_on_one_gpu_with_nccl(tmp_path: Path) -> None:
    """The main job on one GPU: one NCCL rank, bf16 activations and rings, K = V = 128 (the Helion kernels run, and
    FLA's chunk_kda where importable), 4 q/k and 8 value heads, 4 rows (the conv in a launch of its own); every
    request finishes and the check against the plain float64 model passes at the bf16 tolerance. Its first steps
    compile the Helion kernels and autotune FLA's chunk_kda kernels (dozens of Triton configs), minutes on a busy
    machine: the limit leaves room for that, and a run past it fails with the rank's stack."""
    run = _torchrun(tmp_path, 1, "--device", "cuda", "--dtype", "bfloat16", "--head-dim", "128", "--heads", "4",
                    "--v-heads", "8", "--hidden", "256", "--requests", "6", "--batch", "4", "--seed", "5",
                    "--reference", "plain", timeout=420.0)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert _results(out, 1) == [["RESULT: OK"]], out[-4000:]
    assert re.search(r"rank 0 cuda:0: pool [0-9.]+ [KMG]iB", out), out[-3000:]
    assert re.search(r"check against the plain float64 model.*, 0 greedy mismatches", out), out[-3000:]


def test_rates_leave_out_the_first_step() -> None:
    """The summary's tokens/s leave out each kind's first step (it compiles and tunes kernels) and say so; a kind
    with one step reports it as it is."""
    sys.path.insert(0, str(REPO / "launch"))
    from serve_report import steady_rate

    stats = dict(decode_tokens=30, decode_s=12.0, decode_steps=3)
    rate, words = steady_rate(stats, (10, 10.0), "decode")
    assert rate == 10.0 and words == "; the rate leaves out the first step, 10 tokens in 10.000 s"
    rate, words = steady_rate(dict(prefill_tokens=8, prefill_s=2.0, prefill_steps=1), (8, 2.0), "prefill")
    assert rate == 4.0 and words == ""
