"""Spawn harness for the distributed tests (gloo on CPU; NCCL on two GPUs).

:func:`run_ranks` starts ``world_size`` processes with ``torch.multiprocessing``, each of which
initializes gloo (NCCL with ``device="cuda"``) through :func:`tp_replayssm.tp.distributed.init_distributed`
(torchrun-style env vars, a ``file://`` store in the test's tmp dir, 30 s group timeout), runs
``fn(rank, world_size, *args)`` and
pickles its return value or its exception. The parent waits with a hard deadline, kills every
process still alive when it passes (so no test hangs and nothing is left behind) and returns the
per-rank results; a rank that exits non-zero (e.g. an abort in teardown) fails the test too.
On CPU the ranks' pools run the library's PyTorch path (its default for CPU tensors): no environment variable.

Start method (CPU): ``forkserver`` with ``torch``, this module and the pool (which imports helion) preloaded.
The server process starts once per pytest session from a clean interpreter (no threads, no CUDA), imports the
heavy modules once (helion alone takes several seconds on this 2-core machine), and forks each rank from that
clean state; a plain ``spawn`` paid those imports in every rank of every test. It exits with pytest.

The worker functions the ranks run live in topic modules that the children import by name (``_distributed_workers``,
``_placement_workers``, ``_conv_workers``, ...).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

START_METHOD = "forkserver"
PRELOAD = ["_dist_helpers", "tp_replayssm.tp.distributed", "tp_replayssm.pool.pool", "tp_replayssm.kernels.decode"]
PG_TIMEOUT_S = 30.0
CHECK_TIMEOUT_S = "20"

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the children (and the forkserver) import tp_replayssm from here
    sys.path.insert(0, str(REPO_ROOT))


class RankFailed(AssertionError):
    pass


def _entry(rank: int, fn: Callable[..., Any], world_size: int, store: str, out_dir: str, args: tuple,
           one_per_node: bool, device: str) -> None:
    local_rank, local_world = (0, 1) if one_per_node else (rank, world_size)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world),
        TP_REPLAYSSM_PLACEMENT_TIMEOUT_S=CHECK_TIMEOUT_S,
    )
    from tp_replayssm.tp import distributed

    result: dict[str, Any]
    ok = False
    try:
        distributed.init_distributed(device, timeout_s=PG_TIMEOUT_S, init_method=f"file://{store}")
        result = {"ok": True, "value": fn(rank, world_size, *args)}
        ok = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "type": type(exc).__name__, "msg": str(exc), "tb": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    distributed.teardown_distributed(clean=ok)


_stop_registered = False


def _prepare_forkserver() -> None:
    """Preload list for the server (no effect once it runs); stop and reap it when pytest exits."""
    global _stop_registered
    import atexit
    import multiprocessing
    import multiprocessing.forkserver as fs

    multiprocessing.set_forkserver_preload(PRELOAD)
    if not _stop_registered:
        atexit.register(getattr(fs._forkserver, "_stop", lambda: None))
        _stop_registered = True


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any,
              timeout_s: float = 100.0, one_per_node: bool = False, device: str = "cpu") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the per-rank values.

    ``device="cpu"``: gloo ranks forked from the preloaded forkserver. ``device="cuda"``: NCCL ranks,
    rank ``r`` on ``cuda:r`` (``init_distributed`` sets it from ``LOCAL_RANK``), started with ``spawn``
    (a fork would inherit the parent's CUDA driver state).
    ``one_per_node``: every rank gets ``LOCAL_RANK=0`` (as with one process per node), so a code path
    that took LOCAL_RANK for the global rank would collide.

    Raises :class:`RankFailed` when a rank raised (with its traceback) or the deadline passed.
    """
    start_method = START_METHOD if device == "cpu" else "spawn"
    if start_method == "forkserver":
        _prepare_forkserver()
    run_dir = tmp_path / f"run_{fn.__name__}_{time.monotonic_ns()}"
    run_dir.mkdir()
    store = str(run_dir / "store")
    ctx = mp.start_processes(_entry, args=(fn, world_size, store, str(run_dir), args, one_per_node, device),
                             nprocs=world_size, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout_s
    exit_error = None
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise RankFailed(f"{fn.__name__}: ranks still running after {timeout_s:.0f} s (hang)")
    except ProcessException as exc:  # a rank died or exited non-zero
        exit_error = f"{type(exc).__name__}: {exc}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    results = []
    for rank in range(world_size):
        path = run_dir / f"rank{rank}.pkl"
        if not path.exists():
            raise RankFailed(f"{fn.__name__}: rank {rank} wrote no result")
        with open(path, "rb") as f:
            results.append(pickle.load(f))
    failed = [(r, res) for r, res in enumerate(results) if not res["ok"]]
    if failed:
        raise RankFailed("\n".join(f"rank {r}: {res['type']}: {res['msg']}\n{res['tb']}" for r, res in failed))
    if exit_error is not None:
        raise RankFailed(f"{fn.__name__}: a rank did not exit cleanly: {exit_error}")
    return [res["value"] for res in results]
