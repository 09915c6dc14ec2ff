"""Registers, shared memory and spills of the conv kernel for sm_90 (H100/H200), read on a CPU machine.

Generates the Triton code of ``tp_replayssm.kernels.conv.conv_update_kernel`` for the library's plan of each case
with Helion, compiles it for sm_90 with the ptxas of the triton wheel and reads the cubin's resource usage with the
bundled ``cuobjdump`` (as ``kernel_regs.py`` does for the decode kernel). Uses the H200's triton 3.6.0 where
``dev.sh`` put it (``TP_REPLAYSSM_TRITON_H200``). Prints one line per case and, with ``--json``, a JSON list.

    ./dev.sh python benchmarks/conv_regs.py
    KERNEL_REGS_DUMP=dir python benchmarks/conv_regs.py --case 512,1,12288,4   # keeps the Triton code, PTX, SASS
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (batch, tokens, channels, W): HV 32 and HV 4 at K = V = 128, one and several tokens, no window
CASES = ((1, 1, 12288, 4), (8, 1, 12288, 4), (512, 1, 12288, 4), (32, 3, 1536, 2), (8, 1, 1536, 1))
_DTYPE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int32": "i32"}


def conv_resources(batch: int, tokens: int, channels: int, W: int, dtype: str = "bf16", bias: bool = True,
                   silu: bool = True) -> dict[str, object]:
    """``{"regs", "stack", "shared", "plan"}`` of the conv kernel compiled for sm_90 with the library's plan."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("conv_regs compiles real GPU code: unset TRITON_INTERPRET")
    import helion
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(REPO))
    from tp_replayssm.kernels import conv
    from tp_replayssm.kernels.args import rows_view
    from tp_replayssm.kernels.guard import ERROR_WORDS

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    plan = conv.plan_conv(batch, channels, W, 132)
    x = torch.zeros(batch, tokens, channels, dtype=dt)
    y = torch.zeros_like(x)
    S = batch + 2
    state = torch.zeros(2, S + 1, channels, max(W - 1, 0), dtype=dt)
    weight, b = torch.zeros(channels, W), torch.zeros(channels)
    slots, cursors = torch.zeros(batch, dtype=torch.int32), torch.zeros(S + 1, dtype=torch.int32)
    errors, code = torch.zeros(ERROR_WORDS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    win, (sl, ss, sd) = rows_view(state) if W > 1 else (weight[:1], (0, 0, 0))
    args = (x.transpose(1, 2), y, win, weight, b if bias else weight[0], slots, cursors, errors, code, sl, ss, sd, 4,
            W, plan.width_block, plan.named_block, bias, silu)
    config = plan.config
    source = helion.kernel(conv.conv_update_kernel, config=config, **conv._SETTINGS).bind(args).to_triton_code(config)
    tensors = dict(xt3=x, y3=y, win_rows=win, weight=weight, bias=b, slots=slots, cursors=cursors,
                   slot_errors=errors, call_code=code)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "gen_conv_kernel.py"
        src.write_text(source)
        spec = importlib.util.spec_from_file_location("tp_replayssm_generated_conv", src)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # triton reads the jitted function's source from this file
        fn = module._helion_conv_update_kernel
        sig, constexprs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in tensors:
                sig[name] = "*" + _DTYPE[str(tensors[name].dtype)]
            elif name.startswith("_"):
                sig[name] = "constexpr"
                constexprs[(i,)] = int(re.search(rf"{name} = (\d+)", source).group(1))
            else:
                sig[name] = "i64"
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
        compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=plan.num_warps, num_stages=1))
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        dump = os.environ.get("KERNEL_REGS_DUMP")
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            (Path(dump) / "conv_kernel.py").write_text(source)
            (Path(dump) / "conv_kernel.ptx").write_text(compiled.asm["ptx"])
            sass = subprocess.run([str(tool), "--dump-sass", str(cubin)], capture_output=True, text=True).stdout
            (Path(dump) / "conv_kernel.sass").write_text(sass)
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", usage, re.S)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump output: {usage[:300]}")
    regs, stack, shared = map(int, m.groups())
    return dict(regs=regs, stack=stack, shared=max(shared, int(compiled.metadata.shared)), plan=str(plan),
                triton=triton.__version__)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", default=[], help="B,T,D,W (repeatable; default: the standard cases)")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16", help="inputs and windows")
    ap.add_argument("--json", action="store_true", help="print a JSON list instead of lines")
    args = ap.parse_args(argv)
    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200")
    if h200 and "triton" not in sys.modules:  # the device's compiler (dev.sh installs it beside the venv)
        sys.path.insert(0, h200)
    cases = [tuple(int(v) for v in c.split(",")) for c in args.case] or CASES
    rows = []
    for B, T, D, W in cases:
        r = dict(batch=B, tokens=T, channels=D, W=W, **conv_resources(B, T, D, W, args.dtype))
        rows.append(r)
        if not args.json:
            print(f"triton {r['triton']}: B={B} T={T} D={D} W={W} {args.dtype}: {r['regs']} registers/thread, "
                  f"{r['stack']} B stack (spills), {r['shared']} B shared; {r['plan']}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
