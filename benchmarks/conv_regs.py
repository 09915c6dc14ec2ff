"""Registers, shared memory and spills of the conv kernel for sm_90 (H100/H200), read on a CPU machine.

Generates the Triton code of the conv kernel of the library's plan of each case (``tp_replayssm.kernels.conv``: the
plan's form, ``"once"`` or ``"taps"``) with Helion, compiles it for sm_90 with the ptxas of the triton wheel, with the
launch arguments specialized as on the GPU, and reads the cubin's resource usage with the bundled ``cuobjdump`` (as
``kernel_regs.py`` does for the decode kernel). Uses the H200's triton 3.6.0 where ``dev.sh`` put it
(``TP_REPLAYSSM_TRITON_H200``). Prints one line per case (registers, stack, shared memory, a hash of the SASS
instructions) and, with ``--json``, a JSON list.

    ./dev.sh python benchmarks/conv_regs.py
    ./dev.sh python benchmarks/conv_regs.py --case 128,1,12288,4 --form taps       # the other form
    KERNEL_REGS_DUMP=dir python benchmarks/conv_regs.py --case 512,1,12288,4   # keeps Triton code, TTGIR, PTX, SASS
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (batch, tokens, channels, W): HV 32 and HV 4 at K = V = 128, one and several tokens, no window
CASES = ((1, 1, 12288, 4), (8, 1, 12288, 4), (512, 1, 12288, 4), (32, 3, 1536, 2), (8, 1, 1536, 1))
_DTYPE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int32": "i32"}


def conv_resources(batch: int, tokens: int, channels: int, W: int, dtype: str = "bf16", bias: bool = True,
                   silu: bool = True, form: str | None = None, block_d: int | None = None,
                   num_warps: int | None = None) -> dict[str, object]:
    """``{"regs", "stack", "shared", "plan", "sass"?}`` of the conv kernel compiled for sm_90 with the library's plan
    (``form``: the library's plan of that form; ``block_d``, ``num_warps``: that field of the plan replaced).

    The launch arguments are those Helion's generated host code passes (it runs here with a launcher that records
    them), specialized as Triton's JIT specializes them on the GPU (``native_specialize_impl``: an integer 1 becomes a
    constant, integers and pointers divisible by 16 carry that hint), so the code is the one the device compiles."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("conv_regs compiles real GPU code: unset TRITON_INTERPRET")
    import dataclasses

    import helion
    import torch
    import triton
    from kernel_regs import compile_sm90_source, cubin_usage
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    sys.path.insert(0, str(REPO))
    from tp_replayssm.kernels import conv
    from tp_replayssm.kernels.args import rows_view
    from tp_replayssm.kernels.guard import ERROR_WORDS

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    # the library's plan of the call, or of the form asked for ("taps" runs any number of tokens, "once" one)
    plan = conv.plan_conv(batch, channels, W, 132, {None: tokens, "taps": None, "once": 1}[form])
    if block_d is not None:
        plan = dataclasses.replace(plan, block_d=block_d)
    if num_warps is not None:
        plan = dataclasses.replace(plan, num_warps=num_warps)
    plan.check(tokens, W)
    x = torch.zeros(batch, tokens, channels, dtype=dt)
    y = torch.zeros_like(x)
    S = batch + 2
    state = torch.zeros(2, S + 1, channels, max(W - 1, 0), dtype=dt)
    weight, b = torch.zeros(channels, W, dtype=dt), torch.zeros(channels, dtype=dt)
    slots, cursors = torch.zeros(batch, dtype=torch.int32), torch.zeros(S + 1, dtype=torch.int32)
    errors, code = torch.zeros(ERROR_WORDS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    win, (sl, ss, sd) = rows_view(state) if W > 1 else (weight[:1], (0, 0, 0))
    xs = (x.transpose(1, 2), y) if plan.form == "taps" else (x[:, 0], y[:, 0])
    if plan.form == "taps":
        args = (*xs, win, weight, b if bias else weight[0], slots, cursors, errors, code, sl, ss, sd, 4,
                W, plan.width_block, plan.named_block, bias, silu)
    else:
        args = (*xs, win, weight.view(-1), b if bias else weight[0], slots, cursors, errors, code, sl, ss, 4, sd, W,
                1, W, plan.width_block, plan.named_block, bias, silu, True)
    config = plan.config
    kernel_fn = conv._KERNELS[plan.form]
    source = helion.kernel(kernel_fn, config=config, **conv._SETTINGS).bind(args).to_triton_code(config)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "gen_conv_kernel.py"
        src.write_text(source)
        spec = importlib.util.spec_from_file_location("tp_replayssm_generated_conv", src)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # triton reads the jitted function's source from this file
        launched = {}

        def record(kernel: object, grid: tuple, *targs: object, **kw: object) -> None:
            launched.update(kernel=kernel, args=targs, options=kw)

        getattr(module, kernel_fn.__name__)(*args, _launcher=record)  # the host code: strides, sizes, grid
        fn = launched["kernel"]
        sig, constexprs, attrs = {}, {}, {}
        for i, (name, value) in enumerate(zip(fn.arg_names, launched["args"])):
            kind, hint = native_specialize_impl(BaseBackend, value, False, True, True)
            sig[name] = kind
            if kind == "constexpr":
                constexprs[(i,)] = value
            elif hint == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names[len(launched["args"]):], start=len(launched["args"])):
            sig[name] = "constexpr"  # the block sizes: module constants of the generated code
            constexprs[(i,)] = int(re.search(rf"{name} = tl.constexpr\((\d+)\)", source).group(1))
        compiled = compile_sm90_source(fn, sig, constexprs, attrs, launched["options"]["num_warps"],
                                       launched["options"]["num_stages"])
    res, sass = cubin_usage(compiled, with_sass=True)
    dump = os.environ.get("KERNEL_REGS_DUMP")
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        (Path(dump) / "conv_kernel.py").write_text(source)
        for ext in ("ttgir", "ptx"):
            (Path(dump) / f"conv_kernel.{ext}").write_text(compiled.asm[ext])
        (Path(dump) / "conv_kernel.sass").write_text(sass)
    return dict(regs=res["regs"], stack=res["stack"], shared=res["shared"], plan=str(plan), triton=triton.__version__,
                sass=sass)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", default=[], help="B,T,D,W (repeatable; default: the standard cases)")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16", help="inputs, windows and taps")
    ap.add_argument("--form", choices=("once", "taps"), default=None, help="the plan's form instead of the library's")
    ap.add_argument("--block-d", type=int, default=None, help="channels per program instead of the library's")
    ap.add_argument("--warps", type=int, default=None, help="warps per program instead of the library's")
    ap.add_argument("--json", action="store_true", help="print a JSON list instead of lines")
    args = ap.parse_args(argv)
    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200")
    if h200 and "triton" not in sys.modules:  # the device's compiler (dev.sh installs it beside the venv)
        sys.path.insert(0, h200)
    cases = [tuple(int(v) for v in c.split(",")) for c in args.case] or CASES
    rows = []
    for B, T, D, W in cases:
        res = conv_resources(B, T, D, W, args.dtype, form=args.form, block_d=args.block_d,
                             num_warps=args.warps)
        digest = hashlib.sha256("\n".join(_instructions(res.pop("sass"))).encode()).hexdigest()[:16]
        r = dict(batch=B, tokens=T, channels=D, W=W, sass_hash=digest, **res)
        rows.append(r)
        if not args.json:
            print(f"triton {r['triton']}: B={B} T={T} D={D} W={W} {args.dtype}: {r['regs']} registers/thread, "
                  f"{r['stack']} B stack (spills), {r['shared']} B shared, SASS {digest}; {r['plan']}")
    if args.json:
        print(json.dumps(rows))


def _instructions(sass: str) -> list[str]:
    """The instruction texts of a SASS dump, without addresses and encodings (as ``sass_hashes.py`` hashes them)."""
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)]


if __name__ == "__main__":
    main()
