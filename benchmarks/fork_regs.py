"""Registers, spills and memory instructions of the fork kernel for sm_90 (H100/H200), read on a CPU machine.

For pools of the Kimi-Linear shape per rank (``--heads``: local value heads = local q/k heads; K = V = 128, L = 16,
bf16 rings, conv W = 4, 20 layers by default), Helion generates the Triton code of
``tp_replayssm.kernels.fork.fork_kernel`` for the library's plan; the launch arguments are the ones Helion's host
code passes, specialized as Triton's runtime specializes them (an integer 1 becomes a constant, multiples of 16 and
16-byte aligned pointers are marked divisible), so the compiled code is what the device runs. triton compiles it for
sm_90 with the ptxas of its wheel and ``cuobjdump`` reads the cubin: registers, stack (spills), shared memory, and
the count of 16-byte global loads and stores in the SASS. Uses the H200's triton 3.6.0 where ``dev.sh`` put it
(``TP_REPLAYSSM_TRITON_H200``). Prints one line per pool shape.

    ./dev.sh python benchmarks/fork_regs.py --heads 4,32
    ./dev.sh python benchmarks/fork_regs.py --heads 4 --state bf16 --dump /tmp/fork_sass   # Triton code, PTX, SASS
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_BYTES = {"fp32": 4, "bf16": 2}


def pool_geometry(HV: int, K: int, V: int, L: int, W: int, S: int, state: str, cache: str, conv: str,
                  layout: str) -> tuple[tuple[int, int, int], ...]:
    """``(words per slot block, layer stride, slot stride)`` in int32 words of each fork tensor of a pool with
    ``HV`` local value heads = q/k heads (what ``kernels.fork.word_view`` gives for its contiguous tensors)."""
    H = HV
    KH = HV if layout == "predecayed" else H
    D = 2 * H * K + HV * V
    blocks = ((HV * V * K * _BYTES[state], S), (HV * L * V * _BYTES[cache], S), (KH * L * K * _BYTES[cache], S),
              (HV * L * K * 4, S), (D * (W - 1) * _BYTES[conv], S + 1))
    out = []
    for nbytes, slots in blocks:
        if nbytes % 4:
            raise ValueError(f"fork_regs: a slot block of {nbytes} bytes is not whole words (the torch ops run)")
        words = nbytes // 4
        out.append((words, slots * words, words) if words else (0, 0, 0))
    return tuple(out)


def fork_resources(HV: int, *, K: int = 128, V: int = 128, L: int = 16, W: int = 4, layers: int = 20,
                   slots: int = 64, pairs: int = 8, state: str = "fp32", cache: str = "bf16", conv: str = "bf16",
                   layout: str = "predecayed", dump: str | None = None) -> dict[str, object]:
    """``{"regs", "stack", "shared", "ldg128", "stg128", "plan"}`` of the fork kernel compiled for sm_90."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("fork_regs compiles real GPU code: unset TRITON_INTERPRET")
    import torch
    import triton
    from kernel_regs import compile_sm90_source, cubin_usage
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    sys.path.insert(0, str(REPO))
    from tp_replayssm.kernels import fork as fk
    from tp_replayssm.kernels.guard import ERROR_WORDS

    geometry = pool_geometry(HV, K, V, L, W, slots, state, cache, conv, layout)
    plan = fk.plan_fork(tuple(g[0] for g in geometry))
    i32 = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731 - tiny tensors: the sizes are runtime values
    has_conv = geometry[4][0] > 0
    values = dict(src=i32(pairs), dst=i32(pairs), cursors=i32(slots + 1), ckpt_w=i32(64), d_w=i32(64), k_w=i32(64),
                  g_w=i32(64), conv_w=i32(64) if has_conv else i32(1), slot_errors=i32(ERROR_WORDS),
                  call_code=i32(1), num_slots=slots, ring_length=L, num_layers=layers, chunks=plan.chunks,
                  has_conv=has_conv, named_block=max(16, 1 << (pairs - 1).bit_length()))
    for prefix, (w, ls, ss), block in zip(("ckpt", "d", "k", "g", "conv"), geometry, plan.blocks):
        values.update({f"{prefix}_words": w, f"{prefix}_ls": ls, f"{prefix}_ss": ss, f"{prefix}_block": block})
    args = tuple(values[p] for p in fk._PARAMS)
    kernel = fk.fork_kernel_for(plan.config)
    config = plan.config
    bound = kernel.bind(args)
    code = bound.to_triton_code(config)
    calls = []
    bound.compile_config(config)(*args, _launcher=lambda fn, grid, *a, **kw: calls.append((fn, a, kw)))
    (jit_fn, launch_args, launch_kw), = calls
    sig, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(jit_fn.arg_names, launch_args)):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + {torch.int32: "i32", torch.float32: "fp32", torch.bfloat16: "bf16"}[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # the pool's allocations are 16-byte aligned
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        sig[name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = value
        elif key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = compile_sm90_source(jit_fn, sig, constexprs, attrs, launch_kw["num_warps"],
                                   launch_kw.get("num_stages", 1))
    res, sass = cubin_usage(compiled, with_sass=True)
    if dump:
        d = Path(dump)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"fork_hv{HV}_{state}.py").write_text(code)
        (d / f"fork_hv{HV}_{state}.ptx").write_text(compiled.asm["ptx"])
        (d / f"fork_hv{HV}_{state}.sass").write_text(sass)
    return dict(regs=res["regs"], stack=res["stack"], shared=res["shared"],
                ldg128=len(re.findall(r"\bLDG\.E\.128\b", sass)), stg128=len(re.findall(r"\bSTG\.E\.128\b", sass)),
                instructions=len(re.findall(r"/\*[0-9a-f]{4}\*/", sass)), plan=str(plan), triton=triton.__version__,
                bytes_per_pair=fk.fork_bytes([g[0] for g in geometry], layers, 1),
                programs_per_pair=plan.chunks * layers)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="4,32", help="local value heads (= q/k heads), comma list")
    ap.add_argument("--state", choices=tuple(_BYTES), default="fp32")
    ap.add_argument("--cache", choices=tuple(_BYTES), default="bf16", help="ring dtype (the conv's too)")
    ap.add_argument("--layout", choices=("predecayed", "sglang"), default="predecayed")
    ap.add_argument("--conv", type=int, default=4, help="conv kernel size W (1: no conv window)")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--dump", default=os.environ.get("KERNEL_REGS_DUMP"))
    args = ap.parse_args(argv)
    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200")
    if h200 and "triton" not in sys.modules:  # the device's compiler (dev.sh installs it beside the venv)
        sys.path.insert(0, h200)
    for HV in (int(x) for x in args.heads.split(",")):
        r = fork_resources(HV, W=args.conv, layers=args.layers, pairs=args.pairs, state=args.state,
                           cache=args.cache, conv=args.cache, layout=args.layout, dump=args.dump)
        mb = r["bytes_per_pair"] / 2**20
        print(f"triton {r['triton']}: HV={HV} {args.state} state, {args.cache} rings, {args.layout}, W={args.conv}: "
              f"{r['regs']} registers/thread, {r['stack']} B stack (spills), {r['shared']} B shared, "
              f"{r['ldg128']} LDG.E.128, {r['stg128']} STG.E.128, {r['instructions']} instructions; {r['plan']}; "
              f"{r['programs_per_pair']} programs and {mb:.2f} MiB per pair")


if __name__ == "__main__":
    main()
