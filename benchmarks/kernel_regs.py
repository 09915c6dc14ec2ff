"""Registers, shared memory and spills of the decode kernel for sm_90 (H100/H200), read on a CPU machine.

Generates the Triton code for a launch choice with Helion (``to_triton_code``), compiles it for
sm_90 with the ptxas that ships in the triton wheel, and reads the cubin's resource usage with the
bundled ``cuobjdump``. No GPU needed, so register budgets can be checked before spending device time.
Versions allocate registers differently (sixteenth session: 5 against 128 spill operations for one program),
so the command line uses the H200's triton 3.6.0 where ``dev.sh`` put it (``TP_REPLAYSSM_TRITON_H200``) and
prints the version it compiled with.

    ./dev.sh python benchmarks/kernel_regs.py --vt 128 --vc 16 --warps 4 --state fp32
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


def kernel_resources(config: object, vc: int, state: str = "fp32", heads: int = 8,
                     lower_bound: bool = False, kernel_fn: object = None,
                     tiny: bool = False, maxnreg: int | None = None, with_sass: bool = False,
                     mma_chunks: bool = False, predecayed: bool = False,
                     advance_cursors: int = 0, count_after_loads: bool = False,
                     with_ptx: bool = False) -> dict[str, object]:
    """``{"regs", "stack", "shared", "local"}`` of the kernel compiled for sm_90 with this launch choice
    (``config`` a ``helion.Config`` such as ``tp_replayssm.configs.launch_config(...)``; ``kernel_fn`` a
    candidate kernel function with the same signature, default the library's; ``tiny`` the kernel's
    tiny-batch path, as ``tp_replayssm.configs.tiny_batch`` picks it; ``maxnreg`` the launch choice's
    register cap; ``mma_chunks`` its tensor-core chunk path; ``predecayed`` the pre-decayed ring layout's path;
    ``advance_cursors`` the fused cursor advance's count of readers per row, 0 for none; ``count_after_loads`` where
    it counts, ``tp_replayssm.configs.count_after_loads``). Register spills show up
    as ``stack`` bytes per thread (ptxas's stack frame; the H200's Triton reports the same kernels' ``n_spills`` > 0
    exactly when it is nonzero). ``with_sass`` adds the disassembly as ``"sass"`` (to see where spill loads and
    stores sit), ``with_ptx`` the PTX as ``"ptx"``."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("kernel_regs compiles real GPU code: unset TRITON_INTERPRET")
    import helion
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(REPO))
    from tp_replayssm import configs, kernel
    from tp_replayssm.testing import example_kernel_args

    sdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[state]
    args = example_kernel_args(heads=heads, state_dtype=sdt, value_chunk=vc, lower_bound=-5.0 if lower_bound else None,
                               tiny=tiny, mma_chunks=mma_chunks, predecayed=predecayed,
                               rebase_pass=configs.rebase_pass(configs.LaunchChoice(config, vc, maxnreg, mma_chunks)),
                               vector_tiles=configs.vector_tiles(configs.LaunchChoice(config, vc, maxnreg, mma_chunks), sdt, 128),
                               cursors_by_slot=advance_cursors > 0,
                               advance_cursors=advance_cursors, count_after_loads=count_after_loads)
    warps = config.config["num_warps"]
    kernel_fn = kernel_fn or kernel.replayssm_decode_kernel
    settings = getattr(sys.modules.get(kernel_fn.__module__), "_SETTINGS", kernel._SETTINGS)  # a variant's own
    code = helion.kernel(kernel_fn, config=config, **settings).bind(args).to_triton_code(config)
    params = list(inspect.signature(kernel_fn).parameters)
    pointers = {name: "*" + _TRITON_DTYPE[str(arg.dtype)] for name, arg in zip(params, args)
                if isinstance(arg, torch.Tensor)}
    with tempfile.TemporaryDirectory() as tmp:
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
        # the JIT specializes 16-divisible pointers and strides the same way on the GPU
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or n[-2:] in ("_s", "_h", "_v", "_l")}
        compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=1,
                                               **({"maxnreg": maxnreg} if maxnreg else {})))
        if os.environ.get("KERNEL_REGS_DUMP"):  # debugging aid: keep the generated code, PTX and SASS
            dump = Path(os.environ["KERNEL_REGS_DUMP"])
            dump.mkdir(parents=True, exist_ok=True)
            (dump / "kernel.py").write_text(code)
            for ext in ("ttgir", "ptx"):
                (dump / f"kernel.{ext}").write_text(compiled.asm[ext])
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        sass = None
        if os.environ.get("KERNEL_REGS_DUMP") or with_sass:
            sass = subprocess.run([str(tool), "--dump-sass", str(cubin)], capture_output=True, text=True).stdout
        if os.environ.get("KERNEL_REGS_DUMP"):
            (Path(os.environ["KERNEL_REGS_DUMP"]) / "kernel.sass").write_text(sass)
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", usage, re.S)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump output: {usage[:300]}")
    res = dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups())))
    res["shared"] = max(res["shared"], int(compiled.metadata.shared))  # dynamic (pipeline buffers) included
    if with_sass:
        res["sass"] = sass
    if with_ptx:
        res["ptx"] = compiled.asm["ptx"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vt", type=int, default=128)
    ap.add_argument("--vc", type=int, default=16)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--state", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--mma-chunks", action="store_true", help="the tensor-core chunk path (bf16 state), with "
                    "--stages pipeline stages on its loop")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--kernel", default=None, help="a .py file whose replayssm_decode_kernel replaces the library's, "
                    "or variant:NAME (benchmarks/experiments/variants.py)")
    ap.add_argument("--predecayed", action="store_true", help="the pre-decayed ring layout's path (no rebase check)")
    ap.add_argument("--advance", type=int, default=0, metavar="N",
                    help="the fused cursor advance with N programs per row (0: none)")
    ap.add_argument("--count-after-loads", action="store_true",
                    help="with --advance: the count after the loads (configs.count_after_loads), not the atomic read")
    ap.add_argument("--vector-tiles", choices=("auto", "0", "1", "2"), default="auto",
                    help="the kernel's vector_tiles: the library's rule (auto) or forced (configs.FORCED_VECTOR_TILES)")
    ap.add_argument("--loops", type=int, default=3, help="device loops of the --kernel candidate (range_num_stages "
                    "entries, all 0)")
    args = ap.parse_args()
    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200")
    if h200 and "triton" not in sys.modules:  # the device's compiler (dev.sh installs it beside the venv)
        sys.path.insert(0, h200)
    sys.path.insert(0, str(REPO))
    import torch

    from tp_replayssm import configs
    config = configs.launch_config(args.vt, args.warps, chunk_stages=args.stages if args.mma_chunks else 0)
    if args.loops != 3:
        import helion
        config = helion.Config(**{**config.config, "range_num_stages": [0] * args.loops})
    configs.FORCED_VECTOR_TILES = None if args.vector_tiles == "auto" else int(args.vector_tiles)
    kernel_fn = None
    if args.kernel:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from experiments.variants import load_kernel

        kernel_fn = load_kernel(args.kernel)
    tiles = configs.vector_tiles(configs.LaunchChoice(config, args.vc, args.maxnreg, args.mma_chunks),
                                 {"fp32": torch.float32, "bf16": torch.bfloat16}[args.state], 128)
    r = kernel_resources(config, args.vc, args.state, kernel_fn=kernel_fn, maxnreg=args.maxnreg,
                         mma_chunks=args.mma_chunks, predecayed=args.predecayed, advance_cursors=args.advance,
                         count_after_loads=args.count_after_loads)
    import triton
    print(f"triton {triton.__version__}, vt={args.vt} vc={args.vc} warps={args.warps} maxnreg={args.maxnreg} "
          f"state={args.state} mma_chunks={args.mma_chunks} predecayed={args.predecayed} advance={args.advance} "
          f"count_after_loads={args.count_after_loads} vector_tiles={tiles}: "
          f"{r['regs']} registers/thread, {r['shared']} B shared, {r['stack']} B stack (spills), {r['local']} B local")


if __name__ == "__main__":
    main()
