# Source this on the device machine; run_device_checks.sh and run_device_bench.sh start with it. It makes $OUT
# (default benchmarks/out; exported as an absolute path), installs the carried wheels (.devwheels/: helion, FLA,
# pytest and the rest the device lacks) into /tmp/site, puts that folder and the repository on PYTHONPATH, sets the
# NCCL switches that keep NVLink multicast off, and prints one line (torch, triton, helion, GPU). Sourced again in the
# same process tree (one script running another) it skips the install. On failure it prints the install log and
# returns 1.
#   usage: source benchmarks/device_setup.sh || exit 1
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd); export OUT  # absolute: scripts that cd (into benchmarks/) still write under it
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${TP_REPLAYSSM_DEVICE_SETUP:-}" = "$PWD" ]; then
  return 0
fi
if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
     .devwheels/*.whl > "$OUT/setup.log" 2>&1 \
   && python3 -c "import torch, triton, helion, importlib.metadata as m; print('torch', torch.__version__, 'triton', \
triton.__version__, 'helion', m.version('helion'), torch.cuda.get_device_name())" >> "$OUT/setup.log" 2>&1; then
  tail -1 "$OUT/setup.log"; rm -f "$OUT/setup.log"
  export TP_REPLAYSSM_DEVICE_SETUP=$PWD
else
  echo "device_setup: wheel install or import failed"; cat "$OUT/setup.log"; return 1
fi
