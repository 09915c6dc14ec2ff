"""Config sweep for the decode kernel on a GPU (the data behind ``tp_replayssm/configs.py``).

For each shape and candidate config: one full cursor cycle (L steps, write_pos 0..L-1, the last
flushes) captured in a CUDA graph over disjoint slot sets (so the state streams from HBM, not L2),
replayed round-robin; prints us/step (median of replays / L) per config and the best one.

    python benchmarks/tune_decode.py --hv 32 8 --batch 1 8 32 128 512 --state fp32 bf16

``--kernel NAME=FILE`` (repeatable) also times candidate kernel functions (``replayssm_decode_kernel`` in
FILE, same signature; ``variant:NAME`` for one of ``benchmarks/experiments/variants.py``) with the same
configs, e.g. variants that leave one stage out to see what it costs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time

import torch

import helion
from launch_args import FORMAT, SWITCH_CHOICES, launch_spec_arg, switch


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(2 * 1024**3 // 4, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record()
        y.copy_(x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * x.numel() * 4 / statistics.median(times)


def make_problem(B: int, H: int, HV: int, L: int, state_dtype: torch.dtype, n_sets: int, K: int = 128, V: int = 128,
                 predecayed: bool = False, device: str = "cuda"):
    """Caches of ``n_sets`` disjoint slot sets, inputs per cursor phase; ``predecayed``: the pool's pre-decayed ring
    layout (cumulative gates, keys ``k * exp(-G)`` per value head)."""
    from tp_replayssm.testing import random_decode_inputs, random_head_params, random_ring_caches

    S = B * n_sets
    dev = torch.device(device)
    st, d, kc, g = random_ring_caches(S, H, HV, K, V, L, state_dtype=state_dtype, predecayed=predecayed, device=dev)
    p = random_head_params(HV, K, device=dev)
    inputs = [random_decode_inputs(B, H, HV, K, V, device=dev) for _ in range(L)]
    out = torch.empty(B, 1, HV, V, dtype=torch.bfloat16, device=dev)
    slot_sets = [torch.arange(i * B, (i + 1) * B, dtype=torch.int32, device=dev) for i in range(n_sets)]
    cursors = [torch.full((B,), c, dtype=torch.int32, device=dev) for c in range(L)]
    return dict(st=st, d=d, kc=kc, g=g, p=p, inputs=inputs, out=out, slot_sets=slot_sets, cursors=cursors)


def slot_sets(B: int, HV: int, L: int, state_dtype: torch.dtype, footprint_mib: float, K: int = 128,
              V: int = 128, max_sets: int = 256) -> int:
    """How many disjoint slot sets one timing cycles through: enough that the checkpoints and rings they
    hold exceed ``footprint_mib`` (at most ``max_sets``); ``footprint_mib`` 0 gives the old rule (at most
    16 sets of at most 512 MiB of checkpoints in all, which left B <= 8 resident in the L2)."""
    if footprint_mib <= 0:
        return max(1, min(16, (512 * 1024**2) // (B * HV * K * V * state_dtype.itemsize)))
    per_set = B * HV * (V * K * state_dtype.itemsize + L * V * 2 + L * K * 2 + L * K * 4)
    return max(1, min(max_sets, math.ceil(footprint_mib * 1024**2 / per_set)))


def graph_groups(n_sets: int, L: int, min_launches: int = 256) -> list[range]:
    """Slot-set indices per CUDA graph: consecutive sets, enough for ``min_launches`` op launches per
    graph. One graph per set (16 launches) added a gap between graph replays to every step: at B = 1
    on the H200, 6.2 us/step instead of 3.9 with 16 sets per graph (the first timing of a process
    escaped it, 4.4; benchmarks/RESULTS.md, ninth session)."""
    per = max(1, math.ceil(min_launches / L))
    return [range(i, min(i + per, n_sets)) for i in range(0, n_sets, per)]


def time_cycle(prob: dict, launch, L: int, reps: int = 20, min_launches: int = 256) -> float:
    """us per step, averaged over full cycles (every phase incl. the flush), graphs of whole cycles of
    several slot sets (:func:`graph_groups` with ``min_launches``)."""
    sets = prob["slot_sets"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for slots in sets:  # warm-up/compile outside capture
            for c in range(L):
                launch(prob, slots, c)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs = []
    for group in graph_groups(len(sets), L, min_launches):
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for i in group:
                for c in range(L):
                    launch(prob, sets[i], c)
        graphs.append(gr)
    for gr in graphs:
        gr.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        for gr in graphs:
            gr.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (len(sets) * L))
    return statistics.median(times)


def op_launch(choice, predecayed: bool = False, lower_bound: float | None = None):  # noqa: ANN001 - a LaunchChoice
    """The op's launch of one step under ``choice`` (None: the library's own); ``predecayed``: the pre-decayed
    ring layout's op."""
    from tp_replayssm import configs, ops

    op = ops.replayssm_decode_predecayed if predecayed else ops.replayssm_decode

    def launch(prob: dict, slots: torch.Tensor, c: int) -> None:
        inp = prob["inputs"][c]
        p = prob["p"]
        if choice is not None:
            configs.FORCED = choice
        try:
            op(inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, None, prob["st"], prob["d"],
               prob["kc"], prob["g"], prob["out"], slots, prob["cursors"][c], None, True, lower_bound)
        finally:
            configs.FORCED = None

    return launch


def use_kernel(fn=None) -> None:  # noqa: ANN001 - a Helion kernel function
    """Make the op launch the kernel function ``fn`` (None: the library's own kernel), e.g. one loaded
    by ``experiments.variants.load_kernel``; the compiled-kernel caches are dropped on a change."""
    from tp_replayssm import kernel

    if not hasattr(kernel, "_LIBRARY_KERNEL"):
        kernel._LIBRARY_KERNEL = kernel.replayssm_decode_kernel
    fn = kernel._LIBRARY_KERNEL if fn is None else fn
    if kernel.replayssm_decode_kernel is not fn:
        kernel.replayssm_decode_kernel = fn
        kernel._compiled.cache_clear()
        kernel._BY_CONFIG.clear()


_REPORTED: set = set()


def register_report() -> None:
    """Registers / spills / shared memory of every compiled ReplaySSM Triton kernel."""
    import sys

    import triton

    for mod in list(sys.modules.values()):
        for name, obj in list(vars(mod).items()) if hasattr(mod, "__dict__") else []:
            if not (isinstance(obj, triton.runtime.jit.JITFunction) and name.startswith("_helion_replayssm")):
                continue
            for cache in getattr(obj, "device_caches", {}).values():
                for key, k in cache[0].items():
                    tag = (name, id(k))
                    if tag in _REPORTED:
                        continue
                    _REPORTED.add(tag)
                    md = k.metadata
                    print(f"{name}: regs={k.n_regs} spills={k.n_spills} warps={md.num_warps} "
                          f"shared={md.shared} consts={str(key)[-80:]}", flush=True)


def pinned_with(B: int, HV: int, L: int, state_dtype: torch.dtype, changes: dict,
                predecayed: bool = False):  # -> configs.LaunchChoice
    """The library's pinned launch choice for this shape with some config keys replaced (the keys
    ``maxnreg`` (0: no cap), ``value_chunk`` and ``mma_chunks`` set the choice's fields of those names, not
    Helion config keys)."""
    from tp_replayssm import configs
    from tp_replayssm._validation import DecodeDims

    dims = DecodeDims(batch=B, num_q_heads=HV, num_v_heads=HV, key_dim=128, value_dim=128, ring_length=L,
                      num_slots=B)
    choice = configs.select_config(dims, state_dtype, torch.device("cuda"), predecayed=predecayed)
    changes = dict(changes)
    maxnreg = changes.pop("maxnreg", choice.maxnreg) or None
    value_chunk = changes.pop("value_chunk", choice.value_chunk)
    mma_chunks = bool(changes.pop("mma_chunks", choice.mma_chunks))
    return configs.LaunchChoice(helion.Config(**{**choice.config.config, **changes}), value_chunk, maxnreg, mma_chunks)


DEFAULT_CANDIDATES = ("128:16:1", "64:16:1", "32:16:1", "128:16:4")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hv", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--state", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--ring", type=int, default=16)
    ap.add_argument("--cands", nargs="+", type=launch_spec_arg, metavar=FORMAT,
                    default=[launch_spec_arg(c) for c in DEFAULT_CANDIDATES],
                    help="candidate launch choices (benchmarks/launch_args.py): value tile, value chunk, warps, "
                         "register cap per thread (0 = none), persistent grid with PER_SM programs per SM (0 = not "
                         "persistent), 'mma[N]' for the tensor-core chunk path (N pipeline stages); default "
                         + " ".join(DEFAULT_CANDIDATES))
    ap.add_argument("--default-only", action="store_true")
    ap.add_argument("--tiny-batch", choices=SWITCH_CHOICES, default="auto",
                    help="the kernel's tiny-batch path (whole-ring loads, reverse scan): the library's choice, "
                         "or forced on / off")
    ap.add_argument("--rebase-pass", choices=SWITCH_CHOICES, default="auto",
                    help="the pre-decayed rebase check's form where it is compiled in (unbounded gates): the "
                    "library's choice (a pass of its own under a register cap, ops.predecayed_mode 3), or forced "
                    "on (3) / off (2: through the flush branch)")
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME=FILE",
                    help="also time this candidate kernel file or variant:NAME (repeatable); the library "
                         "kernel is 'lib'")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this long")
    ap.add_argument("--ring-layout", choices=["spec", "predecayed"], default="spec",
                    help="the rings' layout: SPEC section 1's, or the pool's pre-decayed one")
    ap.add_argument("--lower-bound", type=float, default=None, help="the gate's lower_bound (default: none)")
    ap.add_argument("--tag", default="tune", help="name of the results file, $OUT/<tag>.json (default tune): "
                                                  "runs that share $OUT, at once or in turn, each keep their own")
    ap.add_argument("--footprint-mib", type=float, default=240.0,
                    help="cycle through enough disjoint slot sets to touch this much cache memory (checkpoints and "
                         "rings; default 4x the H200's 60 MiB L2, so small batches stream from DRAM as in an engine "
                         "with many layers; 0 = the sessions 1-7 rule: at most 16 sets, L2-resident below B = 8)")
    ap.add_argument("--override", action="append", default=[], metavar="NAME=JSON",
                    help="also time the library's pinned choice for the shape with these Helion config keys "
                         "replaced, e.g. 'ev={\"load_eviction_policies\": [...]}' (repeatable; '{}' re-times it; "
                         "the keys maxnreg, value_chunk and mma_chunks set those fields of the launch choice)")
    ap.add_argument("--override-kernels", nargs="+", default=None, metavar="NAME",
                    help="the kernels (names from --kernel, 'lib') that run the --override choices; default all")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    predecayed = args.ring_layout == "predecayed"
    if not torch.cuda.is_available():
        raise SystemExit("tune_decode.py needs a CUDA GPU")
    from experiments.variants import load_kernel

    from tp_replayssm import configs
    configs.FORCED_TINY_BATCH = switch(args.tiny_batch)
    configs.FORCED_REBASE_PASS = switch(args.rebase_pass)
    kernels = [("lib", None)] + [(name, load_kernel(spec)) for name, spec in (k.split("=", 1) for k in args.kernel)]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    t0 = time.monotonic()
    for HV, B, sname in itertools.product(args.hv, args.batch, args.state):
        if time.monotonic() - t0 > args.budget_s:
            print(f"HV={HV} B={B} {sname}: skipped (--budget-s)", flush=True)
            continue
        sdt = torch.float32 if sname == "fp32" else torch.bfloat16
        n_sets = slot_sets(B, HV, args.ring, sdt, args.footprint_mib)
        prob = make_problem(B, HV, HV, args.ring, sdt, n_sets, predecayed=predecayed)
        cands = [None] if args.default_only else [None] + [c.launch_choice() for c in args.cands]
        overrides = [(name, pinned_with(B, HV, args.ring, sdt, json.loads(text), predecayed))
                     for name, text in (o.split("=", 1) for o in args.override)]
        for (kname, kfn), cfg in itertools.product(kernels, cands + [o[1] for o in overrides]):
            if args.override_kernels is not None and kname not in args.override_kernels and not any(cfg is c for c in cands):
                continue
            use_kernel(kfn)
            name = "default" if cfg is None else next((o[0] for o in overrides if o[1] is cfg), None) or \
                "vt{}-vc{}-w{}-m{}-p{}{}".format(
                cfg[0]["block_sizes"][0], cfg[1], cfg[0]["num_warps"],
                cfg.maxnreg or 0, cfg[0].config.get("num_sm_multiplier") or 0,
                f"-mma{cfg[0].config['range_num_stages'][1]}" if cfg.mma_chunks else "")
            if kname != "lib":
                name = f"{kname}:{name}"
            try:
                us = time_cycle(prob, op_launch(cfg, predecayed, args.lower_bound), args.ring)
            except Exception as exc:  # noqa: BLE001 - record and go on
                print(f"HV={HV} B={B} {sname} {name}: FAILED {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
                continue
            rows.append(dict(HV=HV, B=B, state=sname, config=name, us=us))
            print(f"HV={HV:3d} B={B:4d} {sname} {name:12s} {us:9.2f} us/step", flush=True)
        use_kernel(None)
        del prob
        torch.cuda.empty_cache()
        register_report()
        with open(os.path.join(os.environ.get("OUT", "."), f"{args.tag}.json"), "w") as f:  # after every shape
            json.dump(dict(copy_bw=bw, rows=rows), f, indent=1)
    print("\nbest per shape:")
    for key, grp in itertools.groupby(rows, key=lambda r: (r["HV"], r["B"], r["state"])):
        grp = list(grp)
        best = min(grp, key=lambda r: r["us"])
        dflt = next((r["us"] for r in grp if r["config"] == "default"), float("nan"))
        print(f"HV={key[0]:3d} B={key[1]:4d} {key[2]}: best {best['config']:12s} {best['us']:8.2f} us  default {dflt:8.2f} us")


if __name__ == "__main__":
    main()
