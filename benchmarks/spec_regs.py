"""Registers, shared memory and spills of the speculative-decoding kernels for sm_90, read on a CPU machine.

Like ``benchmarks/kernel_regs.py`` for the decode kernel: Helion generates the Triton code of the verify kernel (a
plan of ``tp_replayssm.kernels.verify_plan``) or of the commit kernels, triton compiles it for sm_90 with the ptxas in
its wheel, and ``cuobjdump`` reads the cubin. No GPU needed, so a kernel that does not compile for the device (or
spills) shows up before device time is spent. Use the H200's triton 3.6.0 (``./dev.sh`` puts it at
``TP_REPLAYSSM_TRITON_H200``)::

    ./dev.sh python benchmarks/spec_regs.py --batch 32 --heads 32 --state bf16 [--tree] [--layout sglang]
    ./dev.sh python benchmarks/spec_regs.py --commit

``--dump DIR`` writes the generated Triton (``kernel.py``), its TTGIR (the layouts), PTX, SASS and cubin; ``nvdisasm -g -c
DIR/kernel.cubin`` (beside ``cuobjdump`` in the H200 triton's ``backends/nvidia/bin``) prints the SASS with the
``kernel.py`` line each instruction came from, whose comments name the Helion source line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_TRITON_DTYPE = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int32": "i32",
                 "torch.int64": "i64"}


def compile_sm90(kernel: object, args: tuple, warps: int, fn_name: str, dump: str | None = None,
                 maxnreg: int | None = None) -> dict[str, object]:
    """Compile the Helion ``kernel`` bound to ``args`` (its config's code) for sm_90 (``maxnreg``: ptxas's register
    cap, as the launch passes it); resource usage."""
    import torch
    from kernel_regs import compile_sm90_source, cubin_usage, jit_divisibility

    config = kernel.configs[0]
    code = kernel.bind(args).to_triton_code(config)
    with tempfile.TemporaryDirectory() as tmp:  # (the generated module lives here until the compile is done)
        src = Path(tmp) / "gen_kernel.py"
        src.write_text(code)
        spec = importlib.util.spec_from_file_location("tp_replayssm_generated_spec_kernel", src)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, fn_name)
        by_name = dict(zip(kernel.fn.__code__.co_varnames, args))
        sig, constexprs = {}, {}
        for i, name in enumerate(fn.arg_names):
            value = by_name.get(name)
            if isinstance(value, torch.Tensor):
                sig[name] = "*" + _TRITON_DTYPE[str(value.dtype)]
            elif name.startswith("_"):
                sig[name] = "constexpr"
                constexprs[(i,)] = int(re.search(rf"{name} = (\d+)", code).group(1))
            elif isinstance(value, float) or name in ("scale", "lower_bound"):
                sig[name] = "fp32"
            else:
                sig[name] = "i64"
        compiled = compile_sm90_source(fn, sig, constexprs, jit_divisibility(fn.arg_names, sig), warps,
                                       maxnreg=maxnreg)
    res, sass = cubin_usage(compiled, with_sass=bool(dump))
    if dump:  # the code, PTX and SASS (for benchmarks/sass_loops.py), and the cubin (``nvdisasm -g`` maps its SASS
        # to the lines of kernel.py)
        d = Path(dump)
        d.mkdir(parents=True, exist_ok=True)
        (d / "kernel.py").write_text(code)
        (d / "kernel.ttgir").write_text(compiled.asm["ttgir"])
        (d / "kernel.ptx").write_text(compiled.asm["ptx"])
        (d / "kernel.sass").write_text(sass)
        (d / "kernel.cubin").write_bytes(compiled.asm["cubin"])
    return res


def verify_example(batch: int, heads: int, state: str, layout: str, tree: bool, drafts: int, lower_bound: float | None,
                   group: int = 1, override: str = "", activations: str = "bf16", num_slots: int | None = None):
    """``(kernel, args, plan)`` of the verify kernel for a call of that shape (CPU tensors, or fake ones under
    ``FakeTensorMode``; nothing runs); ``activations`` the dtype of ``mixed_qkv``, ``a``, ``b`` and the outputs;
    ``num_slots`` the pool's slots (default: ``batch``)."""
    import torch

    from tp_replayssm.kernels.verify_args import verify_kernel_args
    from tp_replayssm.kernels.verify_plan import VerifyProblem, plan_verify
    from tp_replayssm.kernels.guard import ERROR_WORDS, SlotGuard
    from tp_replayssm.spec_validation import VerifyCall, VerifyDims

    B, HV, K, V, L, T = batch, heads, 128, 128, 16, drafts
    H = HV // group
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    sdt, adt = dtypes[state], dtypes[activations]
    KH = HV if layout == "predecayed" else H
    S = B if num_slots is None else num_slots
    call = VerifyCall(torch.zeros(B, T, 2 * H * K + HV * V, dtype=adt),
                      torch.zeros(B, T, HV * K, dtype=adt), torch.zeros(B, T, HV, dtype=adt),
                      torch.zeros(HV), torch.zeros(HV * K), 0.1, torch.zeros(S, HV, V, K, dtype=sdt),
                      torch.zeros(S, HV, L, V, dtype=torch.bfloat16), torch.zeros(S, KH, L, K, dtype=torch.bfloat16),
                      torch.zeros(S, HV, L, K), torch.zeros(B, T, HV, V, dtype=adt),
                      torch.arange(B, dtype=torch.int32), torch.zeros(S + 1, dtype=torch.int32),
                      torch.full((B, T), -1, dtype=torch.int32) if tree else None,
                      torch.zeros(S + 1, dtype=torch.int32), torch.zeros(S + 1, HV + H, dtype=torch.int32),
                      True, lower_bound)
    dims = VerifyDims(B, T, H, HV, K, V, L, S)
    bounded = lower_bound is not None and (L - 1) * abs(lower_bound) <= 75
    plan = plan_verify(VerifyProblem(B, T, H, HV, K, V, L, sdt, torch.bfloat16, "cuda", 132, layout, tree, True,
                                     lower_bound is not None, bounded, adt))
    if override:
        from plan_args import replace_verify, verify_override_arg

        plan = replace_verify(plan, verify_override_arg(override), V)  # VerifyPlan fields: ints, true/false
    guard = SlotGuard(torch.zeros(ERROR_WORDS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    args = verify_kernel_args(call, dims, plan, guard).values
    return plan.kernel, args, plan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--group", type=int, default=1, help="value heads per q/k head")
    ap.add_argument("--state", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--layout", choices=("predecayed", "sglang"), default="predecayed")
    ap.add_argument("--tree", action="store_true")
    ap.add_argument("--activations", choices=("bf16", "fp32"), default="bf16",
                    help="dtype of mixed_qkv, a, b and the outputs")
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--lower-bound", type=float, default=None)
    ap.add_argument("--commit", action="store_true", help="the commit kernels instead")
    ap.add_argument("--override", default="",
                    help="VerifyPlan fields, e.g. 'value_tile=32,num_warps=8' or 'batched_reductions=true'")
    ap.add_argument("--kernel", default=None, help="a .py file whose kernel of the plan's form (same name) replaces the library's")
    ap.add_argument("--dump", default=os.environ.get("KERNEL_REGS_DUMP"))
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("spec_regs compiles real GPU code: unset TRITON_INTERPRET")
    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200")
    if h200 and "triton" not in sys.modules:
        sys.path.insert(0, h200)
    sys.path.insert(0, str(REPO))
    import triton

    if args.commit:
        import torch

        from tp_replayssm.kernels.commit import compact_kernel, cursor_kernel_for

        B, T, NL, S = 64, args.drafts, 4, 64
        i32 = lambda *s: torch.zeros(*s, dtype=torch.int32)  # noqa: E731
        cargs = (i32(S + 1), i32(B), i32(B), i32(B * T), i32(B * T), i32(NL * (S + 1)), i32(2 * B), i32(20), i32(1),
                 16, NL, T, True, True)
        r = compile_sm90(cursor_kernel_for(64, 4), cargs, 4, "_helion_commit_cursor_kernel", args.dump)
        print(f"triton {triton.__version__}, commit cursor kernel (B {B}): {r}")
        rows = lambda n, x, dt: torch.zeros(n, x, dtype=dt)  # noqa: E731
        kargs = (rows(1000, 128, torch.bfloat16), rows(1000, 128, torch.bfloat16), rows(1000, 128, torch.float32),
                 i32(B), i32(B * T), i32(2 * B), NL, S, 8, 8, 1, 1, 1, 1, 1, 1, 1, 1, 1, T, 16)
        r = compile_sm90(compact_kernel(), kargs, 4, "_helion_commit_compact_kernel", args.dump)
        print(f"triton {triton.__version__}, commit compact kernel: {r}")
        return
    kernel, kargs, plan = verify_example(args.batch, args.heads, args.state, args.layout, args.tree, args.drafts,
                                         args.lower_bound, args.group, args.override, args.activations)
    if args.kernel:  # a candidate kernel with the same signature, compiled with the plan's config
        import helion

        spec = importlib.util.spec_from_file_location("candidate_verify_kernel", args.kernel)
        module = importlib.util.module_from_spec(spec)
        sys.modules["candidate_verify_kernel"] = module
        spec.loader.exec_module(module)
        kernel = helion.kernel(getattr(module, kernel.fn.__name__), config=kernel.configs[0], **module._SETTINGS)
    r = compile_sm90(kernel, kargs, plan.num_warps, "_helion_" + kernel.fn.__name__, args.dump, plan.maxnreg)
    print(f"triton {triton.__version__}, {plan}: {r['regs']} registers/thread, {r['shared']} B shared, "
          f"{r['stack']} B stack (spills), {r['local']} B local")


if __name__ == "__main__":
    main()
