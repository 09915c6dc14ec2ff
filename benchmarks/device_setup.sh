# Source this on the device machine: installs the carried wheels (.devwheels/) into /tmp/site.
# usage: source benchmarks/device_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devwheels/*.whl \
  || { echo "wheel install failed"; return 1; }
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, triton, helion; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
