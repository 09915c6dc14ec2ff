#!/usr/bin/env bash
# Run any command inside the project's virtual environment, creating it first if needed.
#   ./dev.sh torchrun --standalone --nproc-per-node 2 launch/serve.py
#   ./dev.sh python -m pytest -q
# Set-up (once, and again whenever pyproject.toml changes): .venv with the CPU build of
# torch 2.13.0 installed first (so nothing pulls a multi-GB CUDA build), then the project with its
# test and fla extras (helion 1.5.0, triton, pytest, hypothesis; flash-linear-attention 0.6.0, the layer tests'
# peer). Python 3.11 is all it needs. Beside it, in
# $venv/triton-h200 (exported as TP_REPLAYSSM_TRITON_H200, not on the path): triton 3.6.0, the device's
# compiler, so that register and spill counts of sm_90 code (tests/test_kernel_regs.py,
# benchmarks/kernel_regs.py, which put it on their path) are those of the H200's kernels.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${TP_REPLAYSSM_VENV:-$root/.venv}"
stamp="$venv/.tp_replayssm-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
need_mb=4096  # a full .venv is about 3.0 GB: torch 0.75, triton 1.0, triton-h200 0.65, the rest 0.6
check_disk() {
  local dir free_mb
  dir="$(dirname "$venv")"
  free_mb="$(df -Pm "$dir" | awk 'NR==2 {print $4}')"
  if [ "$free_mb" -lt "$need_mb" ]; then
    echo "dev.sh: setting up $venv needs about $need_mb MB free in $dir; df reports $free_mb MB" >&2
    exit 1
  fi
}
pip_install() { "$venv/bin/python" -m pip install -q --no-cache-dir "$@"; }
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "dev.sh: setting up $venv" >&2
  check_disk
  python3 -m venv "$venv"
  # the CPU build, named by its local label: plain PyPI has no +cpu wheel, so this can never pull a CUDA build (this
  # machine's pip finds the wheel on disk; elsewhere PyTorch's CPU index serves it)
  pip_install "torch==2.13.0+cpu" 2>/dev/null \
    || pip_install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
  pip_install -e "$root[test,fla]"
  echo "$want" > "$stamp"
fi
if [ ! -d "$venv/triton-h200/triton" ]; then
  pip_install --no-deps --target "$venv/triton-h200" triton==3.6.0
fi
export TP_REPLAYSSM_TRITON_H200="$venv/triton-h200"
export PATH="$venv/bin:$PATH"
cd "$root"
exec "$@"
