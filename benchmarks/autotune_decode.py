#!/usr/bin/env python3
"""Helion's own autotuner on the decode kernel at one shape, then its best config in the cycle harness.

The autotuner times single launches of one step (ring cursor ``--cursor`` for every row: a non-flush
step with that many live ring entries; repeated launches are idempotent, they rewrite the same ring
entry), seeded with the library's pinned config and bounded by ``--budget-s``. The config it returns is
then timed the way every number in RESULTS.md is: full cursor cycles, flush step included,
graph-captured over disjoint slot sets (``tune_decode.time_cycle``), against the pinned config, with the
library's ``value_chunk`` for both. Needs a CUDA GPU.

    PYTHONPATH=/tmp/site:. python3 benchmarks/autotune_decode.py --hv 32 --batch 512 --state fp32 --budget-s 240
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import helion  # noqa: E402
from tune_decode import make_problem, op_launch, time_cycle  # noqa: E402

from tp_replayssm import configs, kernel, ops  # noqa: E402
from tp_replayssm._validation import DecodeDims  # noqa: E402


def pointer_indexing(config: helion.Config) -> helion.Config:
    """The search's config with every access through pointers: the kernel addresses its caches through
    overlapping row views (element strides 1, 1) that a TMA tensor descriptor cannot describe (the first
    run hit ``misaligned address`` on such a config, which ends the search)."""
    d = dict(config.config)
    if isinstance(d.get("indexing"), list):
        d["indexing"] = ["pointer"] * len(d["indexing"])
    elif "indexing" in d:
        d["indexing"] = "pointer"
    d.pop("host_tensor_descriptors", None)
    return helion.Config(**d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hv", type=int, default=32)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--state", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--ring", type=int, default=16)
    ap.add_argument("--cursor", type=int, default=8)
    ap.add_argument("--budget-s", type=int, default=240)
    ap.add_argument("--effort", choices=["quick", "full"], default="quick")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("autotune_decode.py needs a CUDA GPU")
    B, HV, L = args.batch, args.hv, args.ring
    sdt = torch.float32 if args.state == "fp32" else torch.bfloat16
    dims = DecodeDims(batch=B, num_q_heads=HV, num_v_heads=HV, key_dim=128, value_dim=128, ring_length=L,
                      num_slots=B)
    pinned, chunk, _, mma_chunks = configs.select_config(dims, sdt, torch.device("cuda"))
    prob = make_problem(B, HV, HV, L, sdt, 1)
    inp, p = prob["inputs"][0], prob["p"]
    zeros = torch.zeros(B, dtype=torch.int32, device="cuda")
    kargs = ops.kernel_args(dims, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, 128**-0.5, prob["st"], prob["d"],
                            prob["kc"], prob["g"], prob["out"], prob["slot_sets"][0], prob["cursors"][args.cursor],
                            zeros, True, None, chunk, False, configs.tiny_batch(dims), mma_chunks)
    kern = helion.kernel(kernel.replayssm_decode_kernel, static_shapes=True, index_dtype=torch.int64,
                         autotune_effort=args.effort, autotune_budget_seconds=args.budget_s,
                         autotune_seed_configs=[pinned], autotune_ignore_errors=True, autotune_progress_bar=False,
                         autotune_config_filter=pointer_indexing)
    t0 = time.monotonic()
    best = kern.autotune(kargs, force=True)
    search_s = time.monotonic() - t0
    print(f"autotune: {search_s:.0f} s, best {best}", flush=True)
    del prob, kargs
    torch.cuda.empty_cache()

    per_set = B * HV * 128 * 128 * sdt.itemsize
    prob = make_problem(B, HV, HV, L, sdt, max(1, min(16, (512 * 1024**2) // per_set)))
    rows = {}
    for name, choice in (("pinned", (pinned, chunk)), ("autotuned", (best, chunk)), ("pinned_again", (pinned, chunk))):
        rows[name] = time_cycle(prob, op_launch(choice), L)
        print(f"HV={HV} B={B} {args.state} {name}: {rows[name]:.2f} us/step (cycle, graph)", flush=True)
    result = dict(hv=HV, batch=B, state=args.state, ring=L, cursor=args.cursor, budget_s=args.budget_s,
                  effort=args.effort, search_s=search_s, best=repr(best), pinned=repr(pinned), value_chunk=chunk,
                  us_step=rows)
    with open(os.path.join(os.environ.get("OUT", "."), f"autotune_hv{HV}_b{B}_{args.state}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
