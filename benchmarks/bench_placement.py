"""Cost of the collective placement check and of ``pool.decode`` in its default check mode.

Run under torchrun, on CPU (gloo) or GPUs (NCCL main group; the check itself always uses a CPU gloo group, see
``tp_replayssm/tp/placement.py``)::

    ./dev.sh torchrun --standalone --nproc-per-node 2 benchmarks/bench_placement.py
    torchrun --standalone --nproc-per-node 8 benchmarks/bench_placement.py --device cuda --shape kimi-linear

Measures on every rank (medians over ``--reps``, after a barrier each):

- ``check_us``: one ``collective_placement_check`` over the pool's tensors (success path);
- ``verify_us``: ``pool.verify_placement()``;
- ``host_first_us``: ``pool.decode`` host time on the first call of a layer (runs the collective check);
- ``host_later_us``: ``pool.decode`` host time on later calls (default mode: no collective, no sync); the decode
  itself (``run_decode``) is replaced by a no-op here, so both isolate the checks;
- ``decode_us`` (CUDA only): a real eager ``pool.decode`` incl. the kernel, synchronized.

Rank 0 prints one line per rank and writes ``bench_placement.json`` (a list of the ranks' records) into ``$OUT``
(else ``benchmarks/out/``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {"tiny": (2, 4, 16, 16, 2), "kimi-linear": (32, 32, 128, 128, 20)}  # H, HV, K, V, layers


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import importlib

    import torch.distributed as dist

    from tp_replayssm import KDAHeads, ReplaySSMStatePool
    from tp_replayssm.testing import random_decode_inputs, random_head_params
    from tp_replayssm.tp import distributed, placement

    pool_module = importlib.import_module("tp_replayssm.pool.step")  # the module whose run_decode the pool calls

    env = distributed.init_distributed(args.device)
    try:
        H, HV, K, V, NL = SHAPES[args.shape]
        heads = KDAHeads(H, HV, K, V)
        pool = ReplaySSMStatePool(heads, num_layers=NL, num_slots=max(8, args.batch), ring_length=16,
                                  group=dist.group.WORLD, device=env.device)
        tensors = {"checkpoint": pool.checkpoint, "d_cache": pool.d_cache, "k_cache": pool.k_cache,
                   "g_cache": pool.g_cache, "cursors": pool.cursors}
        res: dict[str, float | str | int] = dict(rank=env.rank, world=env.world_size, device=str(pool.device),
                                                 backend=env.backend, shape=args.shape)

        def timed(fn, reps: int) -> float:  # noqa: ANN001
            samples = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            return _median_us(samples)

        res["check_us"] = timed(lambda: placement.collective_placement_check(
            group=dist.group.WORLD, expected_device=pool.device, require_current_device=True,
            fingerprint=pool.fingerprint, tensors=tensors, context="bench"), args.reps)
        res["verify_us"] = timed(pool.verify_placement, args.reps)

        loc = pool.local_heads
        slots = pool.alloc(args.batch)
        p = random_head_params(loc.num_v_heads, K, device=pool.device)
        x = random_decode_inputs(args.batch, loc.num_q_heads, loc.num_v_heads, K, V, device=pool.device)

        def decode(layer: int) -> None:
            pool.decode(layer, x.mixed_qkv, x.a, x.b, p.A_log, p.dt_bias, slots)

        real_decode = pool_module.run_decode  # the pool's entry into the decode
        pool_module.run_decode = lambda *a, **k: None  # isolate the host-side checks
        try:
            first = [timed(lambda layer=layer: decode(layer), 1) for layer in range(NL)]
            res["host_first_us"] = statistics.median(first)
            later = []
            for i in range(args.reps):
                t0 = time.perf_counter()
                decode(i % NL)
                later.append(time.perf_counter() - t0)
            res["host_later_us"] = _median_us(later)
        finally:
            pool_module.run_decode = real_decode
        if pool.device.type == "cuda":
            decode(0)  # compile
            torch.cuda.synchronize()
            samples = []
            for i in range(50):
                t0 = time.perf_counter()
                decode(i % NL)
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - t0)
            res["decode_us"] = _median_us(samples)

        gathered: list[dict] = [None] * env.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, res)
        if env.rank == 0:
            for r in gathered:
                print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
            out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "out"))
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "bench_placement.json").write_text(json.dumps(gathered, indent=1))
    finally:
        distributed.teardown_distributed()


if __name__ == "__main__":
    main()
