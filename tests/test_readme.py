"""The README's quick start runs as written, on a CPU, in a fresh interpreter with no environment variable set."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has no python block"
    script = tmp_path / "quick_start.py"
    script.write_text(blocks[0])
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TP_REPLAYSSM_CPU_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the block's last line says what it prints
    expected = blocks[0].strip().splitlines()[-1].split("#", 1)[1].strip()
    assert proc.stdout.strip().splitlines()[-1] == expected, proc.stdout
