"""The decode engine with oracle checks and fault injection, ``launch/decode.py``, run end to end under torchrun with 2
CPU/gloo ranks, and its command line."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = REPO / "launch" / "decode.py"


def _torchrun(*args: str, timeout: float = 150.0, script: Path = LAUNCHER,
              log_dir: Path | None = None) -> subprocess.CompletedProcess:
    """Run the launcher under torchrun in its own process group; on timeout kill that whole group
    (torchrun and its workers), so a hang fails the test and leaves nothing behind. ``log_dir``: torchrun keeps
    each rank's output there and tees it to the console with a ``[default<rank>]:`` prefix on every line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TP_REPLAYSSM_PLACEMENT_TIMEOUT_S": "20"}
    env.pop("TRITON_INTERPRET", None)  # CPU works by default: the launcher needs no environment variable
    env.pop("TP_REPLAYSSM_CPU_BACKEND", None)
    tee = ["--log-dir", str(log_dir), "--tee", "3"] if log_dir is not None else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *tee, str(script),
           *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"launcher hung (> {timeout} s):\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def result_lines(out: str, ranks: tuple[int, ...] = (0, 1)) -> list[list[str]]:
    """Per rank, its ``RESULT: ...`` lines (the output of a run with ``log_dir``, whose lines carry the rank)."""
    return [re.findall(rf"^\[default{rank}\]:(RESULT: .*)$", out, flags=re.M) for rank in ranks]


def placement_error_lines(out: str, ranks: tuple[int, ...] = (0, 1)) -> list[str | None]:
    """The first line of the ``PlacementError`` each rank reported in its one ``RESULT: FAIL`` line (None if the
    rank printed no such line, or more than one RESULT line)."""
    lines: list[str | None] = []
    for found in result_lines(out, ranks):
        m = re.fullmatch(r"RESULT: FAIL PlacementError: (.*)", found[0]) if len(found) == 1 else None
        lines.append(m.group(1) if m else None)
    return lines


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_launcher_end_to_end(layout: str) -> None:
    """Two gloo ranks decode with churn and check sampled rows against the float64 oracle; with
    ``--ring-layout predecayed`` (the default) the pools keep their rings pre-decayed (the log says which layout;
    the softplus gate), and the last layer's decode moves the cursors (``--fused-advance``: the sampled states
    after each step are read at the moved cursors). No environment variable is set: CPU works by default."""
    extra = ("--ring-length", "3", "--fused-advance") if layout == "predecayed" \
        else ("--ring-layout", "sglang", "--ring-length", "2")
    run = _torchrun("--steps", "4", "--batch", "3", "--seed", "1", *extra)
    out = run.stdout + run.stderr
    assert f"{layout} ring layout" in out, out[-4000:]
    advance = "fused into the last decode" if layout == "predecayed" else "by pool.advance"
    assert f"cursor advance {advance}" in out, out[-4000:]
    assert run.returncode == 0, out[-6000:]
    assert "RESULT: OK" in out, out[-4000:]
    assert re.search(r"throughput [0-9.]+ tokens/s", out) and re.search(r"state traffic [0-9.e+-]+ GB/s", out)
    # the CPU host times say what they include (the decode's own run on the PyTorch path, not the check alone)
    assert re.search(r"first call of a layer \(collective check\) [0-9.]+ ms vs later calls \(no check\) [0-9.]+ ms\n"
                     r" +\(on CPU both include the decode's run on the PyTorch path", out), out[-4000:]
    per_rank = re.findall(r"rank (\d) cpu: pool .* placement checks (\d+) .* sampled rows (\d+) max rel err "
                          r"([0-9.e+-]+), mismatches (\d+)", out)
    assert sorted(r[0] for r in per_rank) == ["0", "1"], out[-4000:]
    for _, checks, rows, err, bad in per_rank:
        assert int(checks) >= 3  # construction, verify_placement, first decode of each layer, ...
        assert int(rows) > 0 and int(bad) == 0 and float(err) < 2e-2


@pytest.mark.timeout(200)
def test_launcher_detects_a_wrong_output(tmp_path: Path) -> None:
    """The verification is live: one perturbed output on rank 1 makes the job exit non-zero, and every rank ends
    with one RESULT: FAIL line."""
    run = _torchrun("--steps", "1", "--layers", "1", "--corrupt-output", log_dir=tmp_path / "logs")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    assert "sampled rows MISMATCHED" in out and "mismatched the float64 reference" in out, out[-4000:]
    for found in result_lines(out):
        assert len(found) == 1 and found[0].startswith("RESULT: FAIL RuntimeError: "), out[-4000:]
    assert "RESULT: OK" not in out


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("fault", "expect"),
    [
        ("ring-length", "ring_length=5 (rank 0: 4)"),
        ("cache-device", "`d_cache` on meta, expected cpu"),
        ("activation-device", "`mixed_qkv` on meta, expected cpu"),
    ],
)
def test_launcher_fault_injection(tmp_path: Path, fault: str, expect: str) -> None:
    """Every rank raises the same PlacementError naming rank 1, prints it as ONE ``RESULT: FAIL PlacementError:``
    line (no traceback: that is logged at DEBUG level) and exits non-zero, well within the timeout."""
    t0 = time.monotonic()
    run = _torchrun("--inject-fault", fault, timeout=100.0, log_dir=tmp_path / "logs")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    assert time.monotonic() - t0 < 100.0
    lines = placement_error_lines(out)
    for line in lines:
        assert line is not None, out[-6000:]
        assert line.endswith("offending rank(s): 1"), line
    assert lines[0] == lines[1]  # the same text on every rank
    assert expect in out, out[-4000:]
    assert "RESULT: OK" not in out  # it never got to decode to the end
    worker_lines = "\n".join(line for line in out.splitlines() if line.startswith("[default"))
    assert "Traceback" not in worker_lines, worker_lines[-4000:]  # no rank printed a traceback
    for rank in (0, 1):  # the error's full text at most once per rank
        assert len(re.findall(rf"^\[default{rank}\]:.*ERROR decode: PlacementError", out, flags=re.M)) <= 1


def _load_launcher(monkeypatch: pytest.MonkeyPatch, script: Path = LAUNCHER) -> object:
    """The launcher (or another script of launch/) as a module (its ``main`` does not run)."""
    monkeypatch.syspath_prepend(str(script.parent))  # its sibling modules
    spec = importlib.util.spec_from_file_location(f"launch_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # registered, as an import would be
    spec.loader.exec_module(module)
    return module


def test_launcher_help_lists_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--help`` shows the description's command lines as written and every option's default; every option has a
    help text; the ring layout defaults to the pool's default, "predecayed"."""
    run = subprocess.run([sys.executable, str(LAUNCHER), "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())  # argparse wraps the help texts
    assert "torchrun --standalone --nproc-per-node 2 launch/decode.py" in run.stdout
    assert "--ring-layout {predecayed,sglang}" in text
    for default in ("(default: predecayed)", "(default: cpu)", "(default: tiny)", "(default: 4)",
                    "(default: bfloat16)", "(default: 300.0)", "(default: None)", "(default: False)"):
        assert default in text, (default, run.stdout)
    parser = _load_launcher(monkeypatch).build_parser()  # type: ignore[attr-defined]
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        assert action.help and action.help.strip(), action.option_strings
        assert f"{action.option_strings[0]}" in run.stdout
    assert parser.get_default("ring_layout") == "predecayed"
    from tp_replayssm.validation import RING_LAYOUTS

    assert {a.dest: a.choices for a in options}["ring_layout"] == RING_LAYOUTS  # the library's layouts


def test_launcher_bad_options_exit_2() -> None:
    """Options out of range are usage errors naming the option (exit 2) before any rank starts: a chance outside
    [0, 1], negative check counts, no logging interval, a timeout that is not a positive number, and the output
    self-test with no rows to check (it would pass without checking anything)."""
    for bad in (["--arrival", "1.5"], ["--check-rows", "-1"], ["--check-every", "-2"], ["--log-every", "0"],
                ["--timeout", "0"], ["--timeout", "nan"], ["--corrupt-output", "--check-rows", "0"],
                ["--corrupt-output", "--check-every", "0"]):
        run = subprocess.run([sys.executable, str(LAUNCHER), *bad], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2 and f"error: {bad[0]}" in run.stderr, (bad, run.stderr)
    # a shape the ranks cannot share (WORLD_SIZE: torchrun's) is a usage error naming it, not a failure on every rank
    for bad, world in (([], "3"), (["--shape", "kimi-linear"], "3"), (["--shape", "kimi-linear"], "64")):
        run = subprocess.run([sys.executable, str(LAUNCHER), *bad], cwd=REPO, capture_output=True, text=True,
                             timeout=60, env={**os.environ, "WORLD_SIZE": world})
        text = f"error: --shape {bad[1] if bad else 'tiny'} ("
        assert run.returncode == 2 and text in run.stderr and f"over {world} ranks" in run.stderr, (bad, run.stderr)


@pytest.mark.parametrize("script", ["decode.py", "serve.py"])
def test_launcher_help_shows_every_default_and_help(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """Both launchers: every option has a help text, and its help (as ``--help`` prints it) ends with its default."""
    parser = _load_launcher(monkeypatch, REPO / "launch" / script).build_parser()  # type: ignore[attr-defined]
    formatter = parser._get_formatter()
    text = "".join(parser.format_help().split())  # argparse wraps the help texts (at spaces and hyphens)
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        assert action.help and action.help.strip(), action.option_strings
        shown = formatter._expand_help(action)
        assert shown.endswith(f"(default: {action.default})"), (action.option_strings, shown)
        assert "".join(shown.split()) in text, (action.option_strings, parser.format_help())


@pytest.mark.parametrize("script", ["decode.py", "serve.py"])
def test_launcher_failure_is_one_result_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                             caplog: pytest.LogCaptureFixture, script: str) -> None:
    """An error on a rank (here: a multi-line one from the distributed set-up) ends ``main`` with status 1 and ONE
    ``RESULT: FAIL <type>: <first line>`` line on stdout: no traceback printed; the whole text is logged once at
    ERROR level, the traceback only at DEBUG level."""
    import contextlib
    import logging

    from tp_replayssm.tp import distributed

    @contextlib.contextmanager
    def failing_session(*args: object, **kwargs: object):  # noqa: ANN202 - a context manager
        raise ValueError("first line of the failure\n  rank 1: the details")
        yield  # pragma: no cover

    monkeypatch.setattr(distributed, "distributed_session", failing_session)
    module = _load_launcher(monkeypatch, REPO / "launch" / script)
    with caplog.at_level(logging.INFO):
        status = module.main([])  # type: ignore[attr-defined]
    out = capsys.readouterr()
    assert status == 1
    assert out.out.splitlines().count("RESULT: FAIL ValueError: first line of the failure") == 1, out.out
    assert len(re.findall(r"RESULT:", out.out + out.err)) == 1, out
    assert "Traceback" not in out.out + out.err
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "rank 1: the details" in errors[0].getMessage(), caplog.text
    assert not any(r.exc_info for r in caplog.records if r.levelno > logging.DEBUG), caplog.text


def _unresolved_imports(script: Path) -> list[str]:
    """The ``tp_replayssm`` names ``script`` imports that this checkout does not have."""
    missing = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tp_replayssm"):
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                missing.append(node.module)
                continue
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{node.module}.{alias.name}")
    return missing


@pytest.mark.timeout(200)
def test_placement_benchmark_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/bench_placement.py (the cost of the collective placement check) runs and reports every rank."""
    import json

    script = REPO / "benchmarks" / "bench_placement.py"
    missing = _unresolved_imports(script)
    if missing:
        pytest.skip(f"benchmarks/bench_placement.py is not migrated to the package layout yet (imports {missing})")
    monkeypatch.setenv("OUT", str(tmp_path))
    run = _torchrun("--reps", "5", script=script)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    ranks = json.loads((tmp_path / "bench_placement.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["backend"] == "gloo" and r["check_us"] > 0 and r["host_first_us"] > r["host_later_us"] > 0


@pytest.mark.timeout(200)
def test_launcher_forks_and_preempts_requests() -> None:
    """``--fork-prob`` and ``--preempt-prob`` on two gloo ranks: new requests fork running ones (``pool.fork``),
    running requests are exported to CPU, freed and resumed in new slots (``export_state`` / ``import_state``), and
    the float64 oracle, which follows every request through its forks and preemptions, still agrees on every sampled
    row, forked and resumed requests among them. In debug mode: every pool call (alloc, free, fork, export, import,
    load_state, decode) also agrees across the ranks."""
    run = _torchrun("--steps", "10", "--batch", "4", "--seed", "3", "--fork-prob", "0.5", "--preempt-prob", "0.25",
                    "--check-rows", "4", "--debug")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "RESULT: OK" in out, out[-4000:]
    m = re.search(r"lifecycle: forks (\d+) .*preemptions (\d+) and resumptions (\d+) .* sampled rows of forked or "
                  r"resumed requests (\d+)", out)
    assert m, out[-4000:]
    forks, preempted, resumed, lineage_rows = map(int, m.groups())
    assert forks > 0 and preempted > 0 and resumed > 0 and lineage_rows > 0, m.group(0)
    per_rank = re.findall(r"rank (\d) cpu: .* sampled rows (\d+) max rel err ([0-9.e+-]+), mismatches (\d+)", out)
    assert sorted(r[0] for r in per_rank) == ["0", "1"], out[-4000:]
    for _, rows, err, bad in per_rank:
        assert int(rows) > 0 and int(bad) == 0 and float(err) < 2e-2


def test_launcher_bad_slot_is_refused_and_reported(tmp_path: Path) -> None:
    """``--inject-fault bad-slot``: step 1 names a slot past the pool on every rank; the kernels refuse the row and the
    launcher's ``pool.check()`` after the step makes every rank print the same ``RESULT: FAIL SlotError`` line."""
    run = _torchrun("--inject-fault", "bad-slot", timeout=100.0, log_dir=tmp_path / "logs")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    fails = re.findall(r"RESULT: FAIL (.*)", out)
    assert len(fails) == 2 and fails[0] == fails[1], fails
    assert fails[0].startswith("SlotError: ReplaySSMStatePool.decode(layer=0): 1 row(s)") and "slot 11" in fails[0]
    assert "RESULT: OK" not in out


@pytest.mark.parametrize("debug", [True, False], ids=["debug", "default"])
def test_launcher_rank_mismatch(tmp_path: Path, debug: bool) -> None:
    """``--inject-fault rank-mismatch``: the last rank passes step 1's slots shifted by a row. With ``--debug`` every
    rank raises the same RankMismatchError at that decode, naming `slots` and each rank's order; without it the
    ranks decode each other's rows and the sampled rows' check fails."""
    run = _torchrun("--inject-fault", "rank-mismatch", *(["--debug"] if debug else []), timeout=100.0,
                    log_dir=tmp_path / "logs")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    fails = re.findall(r"RESULT: FAIL (.*)", out)
    assert len(fails) == 2 and fails[0] == fails[1], fails
    if debug:
        assert fails[0].startswith("RankMismatchError: ReplaySSMStatePool.decode(layer=0): the ranks passed "
                                   "different arguments: `slots`: "), fails[0]
    else:
        assert fails[0].startswith("RuntimeError: ") and "sampled rows mismatched" in fails[0], fails[0]
    assert "RESULT: OK" not in out
