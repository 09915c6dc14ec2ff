"""tests/_fail_log.py, loaded by tests/conftest.py: with ``TP_REPLAYSSM_FAIL_LOG`` set, a pytest run appends every
failure (call, setup or teardown) to that file as it happens; unset, it writes nothing. Checked on a throwaway suite
written to a temporary directory with copies of this folder's conftest.py and _fail_log.py, run in a subprocess
(serially, and on 2 pytest-xdist workers where xdist is installed: there the controller alone writes)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

THROWAWAY = '''
import logging

import pytest


def test_passes():
    assert True


def test_fails():
    logging.getLogger("throwaway").warning("a log line before the failure")
    assert 1 + 1 == 3, "arithmetic"


@pytest.fixture
def broken():
    yield
    raise RuntimeError("teardown broke")


def test_teardown_fails(broken):
    pass
'''


def _run(tmp_path: Path, log: Path | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TP_REPLAYSSM_FAIL_LOG"}
    if log is not None:
        env["TP_REPLAYSSM_FAIL_LOG"] = str(log)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_throwaway.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    for name in ("conftest.py", "_fail_log.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\nlog_level = INFO\n")
    (tmp_path / "test_throwaway.py").write_text(THROWAWAY)
    return tmp_path


def _records(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("===== FAILED ")]


@pytest.mark.parametrize("workers", [0, 2])
def test_failures_are_written_as_they_happen(suite: Path, workers: int) -> None:
    if workers and importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed")
    log = suite / "failures.log"
    run = _run(suite, log, *(["-n", str(workers)] if workers else []))
    assert run.returncode == 1, run.stdout + run.stderr
    records = _records(log)
    assert len(records) == 2, log.read_text()  # once each, also under xdist
    assert any("test_throwaway.py::test_fails (call," in r for r in records), records
    assert any("test_throwaway.py::test_teardown_fails (teardown," in r for r in records), records
    text = log.read_text()
    assert "AssertionError: arithmetic" in text and "RuntimeError: teardown broke" in text
    assert "a log line before the failure" in text  # the captured log section
    assert "test_passes" not in text


def test_nothing_is_written_without_the_variable(suite: Path) -> None:
    run = _run(suite, None)
    assert run.returncode == 1, run.stdout + run.stderr
    assert sorted(p.name for p in suite.iterdir() if p.suffix == ".log") == []
