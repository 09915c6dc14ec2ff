"""Registers, shared memory and spills of the decode kernel for sm_90 (H100/H200), read on a CPU machine.

Generates the Triton code for a launch choice with Helion (``to_triton_code``), compiles it for
sm_90 with the ptxas that ships in the triton wheel, and reads the cubin's resource usage with the
bundled ``cuobjdump``. No GPU needed, so register budgets can be checked before spending device time.
Versions allocate registers differently (5 against 128 spill operations for one program between triton 3.6 and
3.9), so the command line uses the H200's triton 3.6.0 where ``dev.sh`` put it (``TP_REPLAYSSM_TRITON_H200``) and
prints the version it compiled with.

    ./dev.sh python benchmarks/kernel_regs.py --batch 128 --heads 8 --state fp32 --override value_tile=64
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_TRITON_DTYPE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int32": "i32"}


def jit_divisibility(arg_names: list[str], sig: dict[str, str]) -> dict[tuple[int], list]:
    """The ``tt.divisibility`` attributes Triton's JIT gives a launch on the GPU: 16-byte-aligned pointers and the
    strides (``*_s``, ``*_h``, ``*_v``, ``*_l``: multiples of 16 elements in the pool's tensors). A compile here
    without them loads element by element and counts registers the device's code does not use."""
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(arg_names)
            if sig[n].startswith("*") or n[-2:] in ("_s", "_h", "_v", "_l")}


def compile_sm90_source(fn: object, sig: dict[str, str], constexprs: dict, attrs: dict, warps: int, stages: int = 1,
                        maxnreg: int | None = None) -> object:
    """Triton's sm_90 compile of the jitted function ``fn`` with signature ``sig``, ``constexprs`` and the
    divisibility ``attrs`` a GPU launch would specialize (:func:`jit_divisibility`, or Triton's own specialization),
    ``warps`` warps, ``stages`` pipeline stages and ``maxnreg`` the launch's register cap (None: none)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def cubin_usage(compiled: object, with_sass: bool = False) -> tuple[dict[str, int], str | None]:
    """``({"regs", "stack", "shared", "local"}, sass)`` of a :func:`compile_sm90_source` result, read from its cubin
    with the ``cuobjdump`` in the triton wheel (``shared`` includes the dynamic shared memory; ``sass`` the
    disassembly when ``with_sass``, else None). Spills show up as ``stack`` bytes per thread."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(tool), "--dump-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout if with_sass else None
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", usage, re.S)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump output: {usage[:300]}")
    res = dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups())))
    res["shared"] = max(res["shared"], int(compiled.metadata.shared))  # dynamic (pipeline buffers) included
    return res, sass


def example_call(plan: object, state: str = "fp32", heads: int = 8, batch: int = 64) -> tuple:
    """``(call, dims)``: random activations and zero caches for ``plan`` (``H = HV = heads``, K = V = 128, bf16
    activations and rings, ``batch`` slots), the inputs code generation needs (nothing runs)."""
    import torch

    from tp_replayssm.testing import random_decode_inputs, random_head_params
    from tp_replayssm.validation import DecodeCall, DecodeDims

    sdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[state]
    B, H, K, V, L = batch, heads, 128, 128, plan.ring_length
    inp = random_decode_inputs(B, H, H, K, V)
    p = random_head_params(H, K)
    caches = (torch.zeros(B, H, V, K, dtype=sdt), torch.zeros(B, H, L, V, dtype=torch.bfloat16),
              torch.zeros(B, H, L, K, dtype=torch.bfloat16), torch.zeros(B, H, L, K))
    out = torch.empty(B, 1, H, V, dtype=inp.mixed_qkv.dtype)
    zeros = torch.zeros(B, dtype=torch.int32)
    cursors = torch.zeros(B + 1, dtype=torch.int32) if plan.cursor_table else zeros
    call = DecodeCall(inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, 0.1, *caches, out,
                      torch.arange(B, dtype=torch.int32), cursors, zeros, plan.use_l2norm,
                      -5.0 if plan.use_lower_bound else None)
    return call, DecodeDims(B, H, H, K, V, L, B)


def example_conv(call: object, dims: object, W: int = 4) -> object:
    """A ``FusedConv`` for ``example_call``'s call: bf16 windows of 2 layers over its ``B + 1`` slots, bf16 taps
    ``[D, W]`` and bias, zero counters (what a plan with ``fused_conv`` compiles against)."""
    import torch

    from tp_replayssm.kernels.args import FusedConv

    D = call.mixed_qkv.shape[1]
    return FusedConv(torch.zeros(2, dims.batch + 1, D, W - 1, dtype=torch.bfloat16), 1,
                     torch.zeros(D, W, dtype=torch.bfloat16), torch.zeros(D, dtype=torch.bfloat16),
                     torch.zeros((dims.batch + 1) * dims.num_q_heads, dtype=torch.int32))


def kernel_resources(plan: object, state: str = "fp32", heads: int = 8, kernel_fn: object = None,
                     with_sass: bool = False, with_ptx: bool = False) -> dict[str, object]:
    """``{"regs", "stack", "shared", "local"}`` of the decode kernel compiled for sm_90 with ``plan`` (a
    ``tp_replayssm.kernels.plan.DecodePlan``; ``state`` the checkpoint dtype, "fp32" or "bf16"; ``kernel_fn`` a
    candidate kernel function with the same signature, default the library's). Register spills show up as ``stack``
    bytes per thread (ptxas's stack frame). ``with_sass`` adds the disassembly as ``"sass"``, ``with_ptx`` the PTX
    as ``"ptx"``."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("kernel_regs compiles real GPU code: unset TRITON_INTERPRET")
    import helion
    import torch

    sys.path.insert(0, str(REPO))
    from tp_replayssm.kernels import decode
    from tp_replayssm.kernels.args import decode_kernel_args
    from tp_replayssm.kernels.guard import spare_guard

    # 64 rows, or fewer where the pool's count of the rows naming a slot covers only that many in one load (a plan
    # made for B <= 16 has no loop for more rows: compiling it for 64 would add one)
    call, dims = example_call(plan, state, heads, batch=min(64, plan.named_block) if plan.cursor_table else 64)
    conv = example_conv(call, dims) if plan.fused_conv else None  # (a plan that fuses the pool's conv)
    args = decode_kernel_args(call, dims, plan, 0.1, call.force_flush, spare_guard(torch.device("cpu")), conv).values
    config, maxnreg = plan.config, plan.maxnreg
    warps = config.config["num_warps"]
    kernel_fn = kernel_fn or decode.replayssm_decode_kernel
    settings = getattr(sys.modules.get(kernel_fn.__module__), "_SETTINGS", decode._SETTINGS)  # a variant's own
    code = helion.kernel(kernel_fn, config=config, **settings).bind(args).to_triton_code(config)
    params = list(inspect.signature(kernel_fn).parameters)
    pointers = {name: "*" + _TRITON_DTYPE[str(arg.dtype)] for name, arg in zip(params, args)
                if isinstance(arg, torch.Tensor)}
    with tempfile.TemporaryDirectory() as tmp:  # (the generated module lives here until the compile is done)
        src = Path(tmp) / "gen_kernel.py"
        src.write_text(code)
        spec = importlib.util.spec_from_file_location("tp_replayssm_generated_kernel", src)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # triton reads the jitted functions' source from this file
        fn = module._helion_replayssm_decode_kernel
        sig, constexprs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in pointers:
                sig[name] = pointers[name]
            elif name.startswith("_"):
                sig[name] = "constexpr"
                constexprs[(i,)] = int(re.search(rf"{name} = (\d+)", code).group(1))
            else:
                sig[name] = "fp32" if name == "scale" else "i64"
        compiled = compile_sm90_source(fn, sig, constexprs, jit_divisibility(fn.arg_names, sig), warps,
                                       maxnreg=maxnreg)
        if os.environ.get("KERNEL_REGS_DUMP"):  # debugging aid: keep the generated code, PTX and SASS
            dump = Path(os.environ["KERNEL_REGS_DUMP"])
            dump.mkdir(parents=True, exist_ok=True)
            (dump / "kernel.py").write_text(code)
            for ext in ("ttgir", "ptx"):
                (dump / f"kernel.{ext}").write_text(compiled.asm[ext])
    res, sass = cubin_usage(compiled, with_sass=bool(os.environ.get("KERNEL_REGS_DUMP")) or with_sass)
    if os.environ.get("KERNEL_REGS_DUMP"):
        (Path(os.environ["KERNEL_REGS_DUMP"]) / "kernel.sass").write_text(sass)
    if with_sass:
        res["sass"] = sass
    if with_ptx:
        res["ptx"] = compiled.asm["ptx"]
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128, help="rows of the call whose launch plan is compiled")
    ap.add_argument("--heads", type=int, default=8, help="value heads (= q/k heads) of that call")
    ap.add_argument("--state", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--layout", choices=("predecayed", "sglang"), default="predecayed")
    ap.add_argument("--lower-bound", action="store_true", help="a bounded gate (lower_bound = -5)")
    ap.add_argument("--advance", action="store_true", help="the fused cursor advance")
    ap.add_argument("--conv", type=int, default=0, help="pre-conv q/k/v with the pool's conv of this W, fused into "
                                                          "the launch (plan_decode(..., fuse_conv=True))")
    ap.add_argument("--override", default="", help="plan fields to replace, e.g. 'value_tile=64,vector_tiles=0'")
    ap.add_argument("--kernel", default=None, help="a .py file whose replayssm_decode_kernel replaces the library's")
    args = ap.parse_args(argv)
    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200")
    if h200 and "triton" not in sys.modules:  # the device's compiler (dev.sh installs it beside the venv)
        sys.path.insert(0, h200)
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from plan_args import build_plan

    plan = build_plan(batch=args.batch, heads=args.heads, state=args.state, layout=args.layout,
                      lower_bound=-5.0 if args.lower_bound else None, advance=args.advance, override=args.override,
                      conv_kernel_size=args.conv, cursor_table=True if args.conv else None,
                      fuse_conv=bool(args.conv))
    kernel_fn = None
    if args.kernel:
        import importlib.util

        spec = importlib.util.spec_from_file_location("candidate_kernel", args.kernel)
        module = importlib.util.module_from_spec(spec)
        sys.modules["candidate_kernel"] = module  # Helion looks the kernel's module up by name
        spec.loader.exec_module(module)
        kernel_fn = module.replayssm_decode_kernel
    r = kernel_resources(plan, args.state, kernel_fn=kernel_fn)
    import triton

    print(f"triton {triton.__version__}, {plan}: {r['regs']} registers/thread, {r['shared']} B shared, "
          f"{r['stack']} B stack (spills), {r['local']} B local")

if __name__ == "__main__":
    main()
