"""benchmarks/bench_layer.py's CPU smoke run: end to end on a CPU, every part of the layer step recorded."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_layer_smoke_on_cpu(tmp_path: Path) -> None:
    """benchmarks/bench_layer.py runs end to end on a CPU (wall-clock, no graphs, no FLA) and records every part."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_layer

    rc = bench_layer.main(["--device", "cpu", "--hidden", "32", "--heads", "2", "--head-dim", "16", "--tp", "1,2",
                           "--batch", "2", "--ring-length", "2", "--max-sets", "1", "--inputs", "2", "--no-fla",
                           "--out", str(tmp_path)])
    assert rc == 0
    import json

    records = json.loads((tmp_path / "bench_layer.json").read_text())["records"]
    assert [(r["tp"], r["B"], r["heads_local"]) for r in records] == [(1, 2, 2), (2, 2, 1)]
    for r in records:
        assert all(r[k] > 0 for k in ("layer_us", "proj_us", "conv_us", "rec_us", "out_us", "rec_share")), r
