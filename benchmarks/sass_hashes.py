"""Hash the sm_90 SASS of every kind of program the library launches, to show a kernel edit changed no code.

A source edit that should not change the compiled kernel (a refactor, a comment, a helper) is proven so by
compiling the committed kernel and the edited one here (no GPU; the H200's triton 3.6.0) and comparing their SASS
instruction text per launch choice: equal text means the GPU timings and GPU test results carry over. The choices
are the launch plans ``tp_replayssm.kernels.plan.plan_decode`` makes over K = V = 128, L = 16, B 1-512, HV 4-32,
both checkpoint dtypes, both ring layouts, with and without a lower bound and the fused cursor advance, and with the
pool's conv (W = 4) where the library fuses it, one per distinct set of compiled switches (launch config, value
chunk, register cap, tensor-core chunks, tiny batch, gate, vector tiles, pre-decayed mode, fused advance, q/k
before the verdict, the fused conv's mode and count): 227 programs (163 without the conv), 3-25 s each on the
2-core CPU machine (about 25 min in all). A result file of an older script lacks some of them (the conv's programs,
the pre-decayed bf16 program without ``early_qk`` at 2048 pairs), which a compare against it reports as missing.

    git worktree add /tmp/base HEAD      # the committed kernel, beside the edited working tree
    TP_REPLAYSSM_VENV=$PWD/.venv /tmp/base/dev.sh python benchmarks/sass_hashes.py --out /tmp/base.json
    ./dev.sh python benchmarks/sass_hashes.py --out /tmp/new.json --compare /tmp/base.json

Each copy of this script compiles the ``tp_replayssm`` of its own checkout (it puts that checkout first on the path),
so both sides share one environment. With ``--compare`` it exits 1 when any program's SASS differs or is missing from
either file; ``-k TEXT`` keeps the programs whose names contain TEXT, ``--list`` prints the names.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32, 128, 512)
HEADS = (4, 8, 12, 16, 32)


def launch_kinds() -> dict[str, dict]:
    """One shape per distinct compiled program: ``name -> {"plan", "state"}``, the first shape met in the sweep
    order standing for its kind."""
    import torch

    from plan_args import build_plan

    kinds: dict[tuple, tuple[str, dict]] = {}
    # cursors: "row" (the op's per-row cursors), "fused" (the pool's table with the fused advance), "table" (the
    # pool's table, the other layers of a step); conv 4: a pre-conv call (W = 4) on the pool's table, kept where the
    # library fuses the conv (from FUSE_CONV_FROM pairs)
    for conv, pd, state, lb, cursors, batch, hv in itertools.product((0, 4), (False, True),
                                                                     (torch.float32, torch.bfloat16), (False, True),
                                                                     ("row", "fused", "table"), BATCHES, HEADS):
        if conv and cursors == "row":
            continue
        sname = "fp32" if state == torch.float32 else "bf16"
        fused = cursors == "fused"
        plan = build_plan(batch=batch, heads=hv, state=sname, layout="predecayed" if pd else "sglang",
                          lower_bound=-5.0 if lb else None, advance=fused, cursor_table=cursors != "row",
                          conv_kernel_size=conv)
        # the plan's switches that decide the compiled code (vector tiles, the pre-decayed mode and the late count
        # follow from them; the slot scan's block, named_block, is a loop bound: the first batch of a kind stands for
        # the others); with the conv its mode and its count's form too
        kind = (str(plan.config), plan.value_chunk, plan.maxnreg, plan.tensor_core_chunks, sname, plan.tiny_batch, lb,
                pd, cursors, plan.early_qk, plan.fused_conv, plan.relaxed_conv_count)
        if (conv and not plan.fused_conv) or kind in kinds:
            continue
        name = (f"B{batch} HV{hv} {sname} {'predecayed' if pd else 'spec'} mode={plan.predecayed_ring}"
                f"{' lb' if lb else ''}{f' fused={plan.advance_readers}' if fused else ''}"
                f"{' table' if cursors == 'table' else ''}{f' conv={plan.fused_conv}' if conv else ''}")
        # (the conv's programs compiled at their own head count; the others at kernel_resources' default, as their
        # recorded hashes were)
        kinds[kind] = (name, dict(plan=plan, state=sname, **({"heads": hv} if conv else {})))
    named = dict(kinds.values())
    if len(named) != len(kinds):  # two kinds under one name: one of them would go unchecked
        raise RuntimeError(f"sass_hashes: {len(kinds)} kinds of program under {len(named)} names")
    return named


def sass_digest(sass: str) -> tuple[str, int]:
    """``(sha256 prefix, instruction count)`` of a ``cuobjdump --dump-sass`` text: instructions only, without their
    addresses and encodings, so two compiles of the same code hash alike."""
    from sass_loops import parse

    instructions = [t for _, t in parse(sass)]
    return hashlib.sha256("\n".join(instructions).encode()).hexdigest()[:16], len(instructions)


def compare(new: dict[str, dict], base: dict[str, dict]) -> list[str]:
    """The programs whose SASS differs between two result files (or that only one of them has)."""
    return [f"{name}: {base.get(name, {}).get('hash', 'missing')} -> {new.get(name, {}).get('hash', 'missing')}"
            for name in sorted(set(new) | set(base)) if new.get(name, {}).get("hash") != base.get(name, {}).get("hash")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None,
                    help="JSON file for name -> {hash, instructions, regs, stack} (needed unless --list)")
    ap.add_argument("--compare", default=None, help="a result file of the other kernel: exit 1 on any difference")
    ap.add_argument("-k", default=None, help="only the programs whose name contains this text")
    ap.add_argument("--list", action="store_true", help="print the programs' names and compile nothing")
    args = ap.parse_args(argv)
    if args.out is None and not args.list:
        ap.error("--out is needed to compile (only --list runs without it)")
    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200")
    if h200:  # the H200's compiler first (dev.sh installs it beside the environment), as kernel_regs.main does
        sys.path.insert(0, h200)
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from kernel_regs import kernel_resources

    kinds = {n: kw for n, kw in launch_kinds().items() if args.k is None or args.k in n}
    if args.list:
        for name in kinds:
            print(name)
        return 0
    import triton

    results: dict[str, dict] = {}
    for i, (name, kw) in enumerate(kinds.items()):
        start = time.time()
        kw = dict(kw)
        res = kernel_resources(kw["plan"], kw["state"], kw.get("heads", 8), with_sass=True)
        digest, count = sass_digest(res.pop("sass"))
        results[name] = dict(hash=digest, instructions=count, regs=res["regs"], stack=res["stack"])
        print(f"[{i + 1}/{len(kinds)}] {name}: {digest} ({count} instructions, {res['regs']} regs, "
              f"{res['stack']} B stack; {time.time() - start:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps(dict(triton=triton.__version__, programs=results), indent=1))
    if args.compare is None:
        return 0
    base = json.loads(Path(args.compare).read_text())["programs"]
    if args.k is not None:
        base = {n: r for n, r in base.items() if args.k in n}
    diffs = compare(results, base)
    total = len(set(results) | set(base))
    print(f"{total - len(diffs)} of {total} programs compile to the same SASS")
    for line in diffs:
        print("DIFFERS " + line)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
