"""Register budget of the pinned GPU launch choices, checked on CPU by compiling for sm_90.

The decode kernel is latency-bound (benchmarks/RESULTS.md): every register per thread costs resident
programs per SM. Version 1 of the single-pass kernel put a matrix product in the flush path and paid
~95 registers per thread on every program, flushing or not. This test compiles the kernel for sm_90
(ptxas from the triton wheel, no GPU) at each pinned choice and fails on spills or, for programs of
several warps, on more than 168 registers per thread (fewer than 3 resident CTAs of 4 warps). The
one-warp choices (128+ row-head pairs) run at 223-255 registers by design: their 16-row chunks sit just
under the limit (32 rows spill), so the lower-bound gate path is checked too. Since the tenth session
their flush loop (tensor-core ring product) spills a few registers (16 B of stack); the every-step path,
which ptxas lays out first (up to the first ``EXIT``), must have no spill load or store. Since the
eleventh session a bf16 checkpoint on large grids (here 4096 pairs) runs the tensor-core chunks under a
168-register cap (12 programs per SM), and the flush path spills more. Compiled with the H200's triton 3.6
(``kernel_regs.py`` with that wheel on ``PYTHONPATH``) its every-step path has no spill load and its chunk
loop no spill at all (160 B of stack, 9 spill stores ahead of the loop); this machine's triton 3.9
allocates differently (224 B, 2 spill operations in the loop), so for the capped choice the test bounds
only the stack and the register count. The pre-decayed ring layout's path is held to the same rules (its
rebase writes sit before the flush loop: written after it, their addresses spilled 120 B in the one-warp
program); with the rebase check compiled in, the capped grid runs uncapped (the check spilled under the cap).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, torch
from tp_replayssm._validation import DecodeDims
from tp_replayssm.configs import select_config, tiny_batch
from benchmarks.kernel_regs import kernel_resources
out = []
from benchmarks.sass_loops import parse
for batch, hv, state, lb, pd in ((512, 32, torch.float32, False, False), (512, 32, torch.bfloat16, False, False),
                                 (512, 32, torch.float32, True, False), (128, 8, torch.bfloat16, False, False),
                                 (8, 32, torch.float32, False, False), (8, 8, torch.float32, False, False),
                                 (1, 8, torch.float32, False, False), (512, 32, torch.float32, False, True),
                                 (512, 32, torch.bfloat16, False, True), (8, 16, torch.bfloat16, False, True),
                                 (8, 16, torch.float32, True, True)):
    dims = DecodeDims(batch, hv, hv, 128, 128, 16, batch)
    config, chunk, maxnreg, mma = select_config(dims, state, torch.device("cuda", 0), rebase_check=pd and not lb)
    r = kernel_resources(config, chunk, "fp32" if state == torch.float32 else "bf16", lower_bound=lb,
                         tiny=tiny_batch(dims), maxnreg=maxnreg, with_sass=True, mma_chunks=mma, predecayed=pd)
    ins = parse(r.pop("sass"))
    first_exit = next(a for a, t in ins if t.split()[-1] == "EXIT")
    path = [(a, t) for a, t in ins if a < first_exit]
    r["spill_loads_before_exit"] = sum("LDL" in t for _, t in path)
    r["spill_stores_before_exit"] = sum("STL" in t for _, t in path)
    r["spill_ops"] = sum(("STL" in t or "LDL" in t) for _, t in ins)
    out.append(dict(batch=batch, hv=hv, state=str(state), lower_bound=lb, predecayed=pd, vt=config.config["block_sizes"][0],
                    vc=chunk, warps=config.config["num_warps"], maxnreg=maxnreg, mma=mma, **r))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_pinned_choices_fit_the_register_budget_on_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=280)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-3000:]
    results = json.loads(line[len("RESULT "):])
    assert len(results) == 11
    assert [r["warps"] for r in results] == [1, 1, 1, 1, 1, 4, 4, 1, 1, 1, 1]  # one warp from 128 row-head pairs up
    assert [r["mma"] for r in results] == [False, True, False, True, False, False, False, False, True, False, False]
    for r in results:
        capped = r["maxnreg"] is not None
        assert r["local"] == 0 and r["stack"] <= (256 if capped else 16 if r["warps"] == 1 else 0), f"spills: {r}"
        if not capped:
            assert r["spill_loads_before_exit"] == r["spill_stores_before_exit"] == 0, \
                f"spills on the every-step path: {r}"
        assert (r["stack"] == 0) == (r["spill_ops"] == 0), r  # the SASS count sees what ptxas reports
        assert 0 < r["regs"] <= (r["maxnreg"] or (255 if r["warps"] == 1 else 168)), f"over the register budget: {r}"
    # the rebase check's kernel (pre-decayed, softplus gate) runs the capped grid uncapped (select_config)
    assert results[1]["maxnreg"] == 168 and results[3]["maxnreg"] is None and results[8]["maxnreg"] is None
