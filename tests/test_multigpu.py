"""Two CUDA GPUs over NCCL (run on the device's two-GPU machine): the launcher end to end, its
placement faults on real devices, and tensor-parallel equivalence of pools on ``cuda:0`` / ``cuda:1``.

Each test starts its own ranks (torchrun, or spawned processes) with hard deadlines, so a hang fails
the test and leaves no process behind. On machines with fewer than two GPUs they are skipped.
"""

from __future__ import annotations

import re

import pytest

import _dist_helpers as h
import _distributed_workers as dw
from test_launcher import _torchrun, placement_error_lines, result_lines

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.mark.timeout(300)
def test_launcher_two_gpus_nccl() -> None:
    """The README's CUDA job on two ranks: each rank on its own GPU, NCCL, every sampled row matches
    the float64 oracle, and the summary reports both ranks."""
    run = _torchrun("--device", "cuda", "--shape", "kimi-linear", "--layers", "4", "--steps", "12", "--batch", "8",
                    "--ring-length", "4", timeout=280.0)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "RESULT: OK" in out, out[-4000:]
    assert re.search(r"backend nccl", out), out[-4000:]
    per_rank = re.findall(r"rank (\d) (cuda:\d): pool .* placement checks (\d+) .* sampled rows (\d+) max rel err "
                          r"([0-9.e+-]+), mismatches (\d+)", out)
    assert sorted((r[0], r[1]) for r in per_rank) == [("0", "cuda:0"), ("1", "cuda:1")], out[-4000:]
    for _, _, checks, rows, err, bad in per_rank:
        assert int(checks) >= 3 and int(rows) > 0 and int(bad) == 0 and float(err) < 2e-2


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("fault", "offenders", "expect"),
    [
        ("cache-device", "1", "`d_cache` on cuda:0, expected cuda:1"),
        ("activation-device", "1", "`mixed_qkv` on cuda:0, expected cuda:1"),
        ("same-device", "0, 1", "ranks 0, 1 all hold their pool on host"),
        ("ring-length", "1", "ring_length=5 (rank 0: 4)"),
    ],
)
def test_launcher_placement_faults_two_gpus(tmp_path, fault: str, offenders: str, expect: str) -> None:  # noqa: ANN001
    """A real misplacement across two GPUs: every rank raises the same PlacementError, naming the
    offending rank(s), the tensor, the expected and the actual device, and prints it as its one RESULT: FAIL line;
    nothing hangs."""
    run = _torchrun("--device", "cuda", "--inject-fault", fault, timeout=180.0, log_dir=tmp_path / "logs")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    lines = placement_error_lines(out)
    assert all(line is not None for line in lines), out[-6000:]
    assert lines[0] == lines[1], out[-6000:]  # the same text on every rank
    assert lines[0].endswith(f"offending rank(s): {offenders}"), lines[0]
    assert expect in out, out[-4000:]
    assert "RESULT: OK" not in out
    assert all(len(found) == 1 for found in result_lines(out)), out[-4000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("H", "HV", "L", "cache", "dim", "tol_ref", "tol_oracle"),
    [
        (4, 4, 2, "bfloat16", 128, 1e-2, 2e-2),  # q/k heads split; the model's head dims
        (1, 2, 3, "float32", 16, 1e-5, 1e-4),  # H < tp: the q/k head replicated on both ranks; tiny dims
    ],
    ids=["tp2-H4-HV4-K128", "tp2-H1-HV2-K16"],
)
def test_tp_equivalence_nccl(tmp_path, H, HV, L, cache, dim, tol_ref, tol_oracle) -> None:  # noqa: ANN001
    """Pools on cuda:0 and cuda:1 (both ring layouts), outputs all-gathered over NCCL, equal the single-rank
    reference on the global heads and the float64 recurrence."""
    by_layout = h.run_ranks(dw.tp_equivalence, 2, tmp_path, H, HV, L, 4, cache, dim, timeout_s=220, device="cuda")
    for layout in ("sglang", "predecayed"):
        results = [r[layout] for r in by_layout]
        r0 = results[0]
        for r in results:
            assert r["err_ref"] == r0["err_ref"] and r["err_oracle"] == r0["err_oracle"]
            assert r["padding_zero"] and r["cursors_ok"]
        assert r0["err_ref"] < tol_ref and r0["err_oracle"] < tol_oracle, (layout, r0)
        assert [r["v_heads"] for r in results] == [list(range(t * HV // 2, (t + 1) * HV // 2)) for t in range(2)]
