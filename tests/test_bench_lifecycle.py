"""benchmarks/bench_lifecycle.py's CPU smoke mode: its checks pass and it writes one record per configuration."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_lifecycle_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    """benchmarks/bench_lifecycle.py's CPU smoke mode (tiny shapes, eager timings): its checks pass and it writes
    one record per configuration."""
    import json

    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_lifecycle.py"), "--smoke", "--out",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    data = json.loads((tmp_path / "bench_lifecycle.json").read_text())
    kinds = {r["kind"] for r in data["records"]}
    assert {"fork", "export", "import", "copy"} <= kinds, kinds
    assert all(r["check"] == "ok" for r in data["records"] if "check" in r), data["records"]
    assert re.search(r"^== bench_lifecycle", run.stdout, flags=re.M), run.stdout[-2000:]
