"""Spawn harness for the distributed tests (gloo on CPU; NCCL on two GPUs), and the worker functions
the ranks run.

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

Worker functions live here (importable by the children as module ``_dist_helpers``).
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

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

START_METHOD = "forkserver"
PRELOAD = ["_dist_helpers", "tp_replayssm.tp.distributed", "tp_replayssm.pool.pool", "tp_replayssm.kernels.decode"]
PG_TIMEOUT_S = 30.0
CHECK_TIMEOUT_S = "20"

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the children (and the forkserver) import tp_replayssm from here
    sys.path.insert(0, str(REPO_ROOT))

K = V = 16  # small head dims


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


# ---- worker functions (run on every spawned rank) -------------------------------------------------

CPU = torch.device("cpu")
META = torch.device("meta")
FINGERPRINT_FAULTS = {  # fault -> (field, value on the bad rank)
    "ring-length": ("ring_length", 4),
    "num-slots": ("num_slots", 5),
    "num-layers": ("num_layers", 3),
    "state-dtype": ("state_dtype", "torch.bfloat16"),
    "cache-dtype": ("cache_dtype", "torch.float32"),
    "heads": ("num_v_heads", 8),
    "ring-layout": ("ring_layout", "sglang"),  # one rank's pool stores SGLang's layout, the others pre-decayed keys
}


def _fingerprint(world: int, rank: int, **over: Any) -> Any:
    from tp_replayssm.tp.placement import PoolFingerprint

    base = dict(num_q_heads=2, num_v_heads=4, key_dim=K, value_dim=V, tp_size=world, tp_rank=rank,
                num_layers=2, num_slots=4, ring_length=3, state_dtype="torch.float32", cache_dtype="torch.bfloat16",
                ring_layout="predecayed")
    base.update(over)
    return PoolFingerprint(**base)


class ExplodingTensor:
    """Stands in for a tensor whose device query throws (a broken local check)."""

    @property
    def device(self) -> torch.device:
        raise RuntimeError("device query failed (injected)")


POOL_NAMES = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors")


def _check_case(fault: str, rank: int, world: int, bad: int) -> tuple[dict[str, Any], Any]:
    """Arguments of ``collective_placement_check`` for one fault-matrix case, and a current-device hook."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    is_bad = rank == bad
    tensors: dict[str, Any] = {n: torch.zeros(2, 3) for n in POOL_NAMES}
    tensors["mixed_qkv"] = torch.zeros(2, 8)
    tensors["force_flush"] = None
    expected, fp, current = CPU, _fingerprint(world, rank), None
    if fault in ("same-cuda-device", "fake-cuda-ok"):
        index = 0 if (is_bad and fault == "same-cuda-device") else rank
        expected = torch.device("cuda", index)
        with FakeTensorMode():  # tensors that claim cuda:N on this CPU machine
            tensors = {n: torch.zeros(2, 3, device=expected) for n in POOL_NAMES}
        current = expected  # this rank's "current device" (e.g. forgot set_device(local_rank))
    elif is_bad and fault == "pool-device":
        expected = META
        tensors = {n: t.to(META) for n, t in tensors.items() if t is not None}
    elif is_bad and fault == "cache-device":
        tensors["k_cache"] = tensors["k_cache"].to(META)
    elif is_bad and fault == "activation-device":
        tensors["mixed_qkv"] = tensors["mixed_qkv"].to(META)
    elif is_bad and fault in FINGERPRINT_FAULTS:
        field, value = FINGERPRINT_FAULTS[fault]
        fp = _fingerprint(world, rank, **{field: value})
    elif is_bad and fault == "tp-rank":
        fp = _fingerprint(world, rank, tp_rank=(rank + 1) % world)
    elif is_bad and fault == "tp-size":
        fp = _fingerprint(world, rank, tp_size=world + 1)
    elif is_bad and fault == "local-check-throws":
        tensors["g_cache"] = ExplodingTensor()
    return dict(expected_device=expected, require_current_device=True, fingerprint=fp, tensors=tensors), current


def placement_matrix(rank: int, world: int, bad: int, faults: list[str], group_ranks: list[int] | None = None
                     ) -> dict[str, tuple[str | None, float]]:
    """Run each fault case through ``collective_placement_check``; per case: (error text or None, seconds).

    ``group_ranks``: run the checks on that subgroup (only its members may call this).
    """
    import torch.distributed as dist

    from tp_replayssm.tp import devices, placement

    group = dist.group.WORLD
    if group_ranks is not None:
        group = dist.new_group(group_ranks, use_local_synchronization=True)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    out: dict[str, tuple[str | None, float]] = {}
    real_hook = devices.current_cuda_device
    for fault in faults:
        kwargs, current = _check_case(fault, rank, world, bad)
        if current is not None:
            devices.current_cuda_device = lambda c=current: c
        t0 = time.perf_counter()
        try:
            if current is not None:  # the check must work inside FakeTensorMode too (real CPU exchange)
                from torch._subclasses.fake_tensor import FakeTensorMode

                with FakeTensorMode():
                    placement.collective_placement_check(group=group, context=f"test {fault}", **kwargs)
            else:
                placement.collective_placement_check(group=group, context=f"test {fault}", **kwargs)
            msg = None
        except placement.PlacementError as exc:
            msg = str(exc)
        finally:
            devices.current_cuda_device = real_hook
        out[fault] = (msg, time.perf_counter() - t0)
    return out


def placement_matrix_world_and_subgroups(rank: int, world: int, bad: int, faults: list[str], sub_bad: int,
                                         sub_faults: list[str]) -> tuple[dict, dict]:
    """:func:`placement_matrix` on the world group, then on two TP groups (first and second half of the
    ranks, both checking at the same time, each with its own bad group-rank ``sub_bad``)."""
    on_world = placement_matrix(rank, world, bad, faults)
    half = world // 2
    mine = list(range(half)) if rank < half else list(range(half, world))
    return on_world, placement_matrix(rank, world, sub_bad, sub_faults, mine)


def _snapshot(pool: Any) -> dict[str, torch.Tensor]:
    return {n: getattr(pool, n).detach().clone() for n in POOL_NAMES}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def pool_faults(rank: int, world: int, bad: int, faults: list[str]) -> dict[str, tuple[str | None, float, bool]]:
    """The fault matrix through the real pool: construction, ``verify_placement()`` and the first decode.

    Per case: (error text or None, seconds, every pool tensor of the healthy pool unchanged).
    """
    import torch.distributed as dist

    from tp_replayssm import KDAHeads, PlacementError, ReplaySSMStatePool
    from tp_replayssm.testing import random_decode_inputs, random_head_params
    from tp_replayssm.tp import devices

    group = dist.group.WORLD
    heads = KDAHeads(2, 4, K, V)
    base = dict(num_layers=2, num_slots=4, ring_length=3, group=group)
    pool = ReplaySSMStatePool(heads, **base)
    slots = pool.alloc(2)
    gen = torch.Generator().manual_seed(7)
    for layer in range(2):
        pool.load_state(layer, slots, torch.randn(2, pool.local_heads.num_v_heads, V, K, generator=gen))
    pool.advance(slots)  # non-trivial cursors
    loc = pool.local_heads
    params = random_head_params(loc.num_v_heads, K, generator=gen)
    x = random_decode_inputs(2, loc.num_q_heads, loc.num_v_heads, K, V, dtype=torch.float32, generator=gen)
    construct = {"pool-device": {"device": "meta"}, "ring-length": {"ring_length": 4}, "num-slots": {"num_slots": 5},
                 "num-layers": {"num_layers": 3}, "state-dtype": {"state_dtype": torch.bfloat16},
                 "cache-dtype": {"cache_dtype": torch.float32}, "tp-rank": {"tp_rank": (rank + 1) % world},
                 "ring-layout": {"ring_layout": "sglang"}}
    out: dict[str, tuple[str | None, float, bool]] = {}
    real_hook = devices.current_cuda_device
    for fault in faults:
        before = _snapshot(pool)
        is_bad = rank == bad
        saved = pool.d_cache
        t0 = time.perf_counter()
        try:
            if fault in construct:
                ReplaySSMStatePool(heads, **{**base, **(construct[fault] if is_bad else {})})
            elif fault == "activation-device":
                mixed = x.mixed_qkv.to(META) if is_bad else x.mixed_qkv
                pool.decode(0, mixed, x.a, x.b, params.A_log, params.dt_bias, slots)
            elif fault == "cache-device-first-decode":  # a replaced cache met by a layer's first decode
                if is_bad:
                    pool.d_cache = pool.d_cache.to(META)
                pool.decode(1, x.mixed_qkv, x.a, x.b, params.A_log, params.dt_bias, slots)
            else:
                if is_bad and fault == "cache-device":
                    pool.d_cache = pool.d_cache.to(META)
                if is_bad and fault == "cache-replaced":  # same device: the kernels' views keep the old tensor
                    pool.d_cache = pool.d_cache.clone()
                if is_bad and fault == "local-check-throws":
                    def boom() -> torch.device:
                        raise RuntimeError("cudaGetDevice failed (injected)")
                    devices.current_cuda_device = boom
                pool.verify_placement()
            msg = None
        except PlacementError as exc:
            msg = str(exc)
        finally:
            dt = time.perf_counter() - t0
            pool.d_cache = saved
            devices.current_cuda_device = real_hook
        out[fault] = (msg, dt, _same(before, _snapshot(pool)))
    return out


def tp_equivalence(rank: int, world: int, H: int, HV: int, L: int, steps: int, cache: str, dim: int = K,
                   layouts: tuple[str, ...] = ("sglang", "predecayed")) -> dict[str, dict[str, Any]]:
    """:func:`tp_equivalence_one` for each ring layout of the pool (the same draws): layout -> its results."""
    return {layout: tp_equivalence_one(rank, world, H, HV, L, steps, cache, dim, layout) for layout in layouts}


def tp_equivalence_one(rank: int, world: int, H: int, HV: int, L: int, steps: int, cache: str, dim: int,
                       ring_layout: str) -> dict[str, Any]:
    """Decode ``steps`` steps of 2 layers on a TP pool of ``ring_layout``; gather every rank's ``out`` and compare
    it with the single-rank PyTorch reference on the global heads (the sglang layout: same ring semantics, and in
    that layout the same rounding) and with the float64 plain recurrence. Rows: [request, padding, request]; one
    forced flush at step 1. ``K = V = dim``. The pool lives on the rank's device (its CUDA device under NCCL);
    inputs are drawn on the CPU (the same draws on every rank) and moved there; the references run on the CPU.

    Returns max relative errors, whether the padding row was exactly zero, and whether the pool's
    cursors matched the expected ones (every rank computes the same global reference).
    """
    import torch.distributed as dist

    from tp_replayssm import KDAHeads, ReplaySSMStatePool, concat_outputs, reference
    from tp_replayssm.testing import PlainKDA, random_decode_inputs, random_head_params, rel_err

    NL, S, B = 2, 4, 3
    K = V = dim  # noqa: N806 - the module's names for the head dims
    cache_dtype = getattr(torch, cache)
    heads = KDAHeads(H, HV, K, V)
    pool = ReplaySSMStatePool(heads, num_layers=NL, num_slots=S, ring_length=L, cache_dtype=cache_dtype,
                              group=dist.group.WORLD, ring_layout=ring_layout)
    shard = pool.shard
    dev = pool.device
    gen = torch.Generator().manual_seed(1234)  # the same draws on every rank
    params = [random_head_params(HV, K, generator=gen) for _ in range(NL)]
    init = [torch.randn(2, HV, V, K, generator=gen) * 0.3 for _ in range(NL)]
    ids = pool.alloc(2)
    for layer in range(NL):
        pool.load_state(layer, ids, shard.slice_state(init[layer]).contiguous().to(dev))
    slots = torch.tensor([int(ids[0]), -1, int(ids[1])], dtype=torch.int32)
    slots_dev = slots.to(dev)
    # single-rank reference: the global pool's tensors, driven by the reference op
    ref = [dict(S0=torch.zeros(S, HV, V, K), d=torch.zeros(S, HV, L, V, dtype=cache_dtype),
                k=torch.zeros(S, H, L, K, dtype=cache_dtype), g=torch.zeros(S, HV, L, K)) for _ in range(NL)]
    oracle = [PlainKDA(S, H, HV, K, V) for _ in range(NL)]
    for layer in range(NL):
        ref[layer]["S0"][ids.long().cpu()] = init[layer]
        oracle[layer].load(ids.tolist(), init[layer])
    cursor = {int(s): 0 for s in ids}
    err_ref = err_oracle = 0.0
    padding_zero = cursors_ok = True
    for step in range(steps):
        force = torch.tensor([0, 0, 1 if step == 1 else 0], dtype=torch.int32)
        write_pos = torch.tensor([cursor.get(int(s), 0) for s in slots], dtype=torch.int32)
        for layer in range(NL):
            x = random_decode_inputs(B, H, HV, K, V, dtype=torch.float32, generator=gen)
            p = params[layer]
            local = pool.decode(layer, *(t.to(dev) for t in (shard.slice_mixed_qkv(x.mixed_qkv), shard.slice_a(x.a),
                                shard.slice_b(x.b), shard.slice_A_log(p.A_log), shard.slice_dt_bias(p.dt_bias))),
                                slots_dev, force_flush=force.to(dev))
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local.contiguous())
            gathered = concat_outputs(parts).cpu()  # [B, 1, HV, V]
            want = torch.full((B, 1, HV, V), float("nan"))
            r = ref[layer]
            reference.replayssm_decode(x.mixed_qkv, x.a, x.b, p.A_log, p.dt_bias, None, r["S0"], r["d"], r["k"],
                                       r["g"], want, slots, write_pos, force, use_qk_l2norm_in_kernel=True)
            exact = oracle[layer].step(x, p, slots)
            live = [0, 2]
            err_ref = max(err_ref, rel_err(gathered[live], want[live]))
            err_oracle = max(err_oracle, rel_err(gathered[live, 0], exact[live]))
            padding_zero &= bool((gathered[1] == 0).all())
        pool.advance(slots_dev, force.to(dev))
        for row in (0, 2):
            s = int(slots[row])
            cursor[s] = 0 if (cursor[s] == L - 1 or force[row]) else cursor[s] + 1
        cursors_ok &= pool.cursors[ids.long()].cpu().tolist() == [cursor[int(s)] for s in ids]
    # the final states: every rank's read_state, gathered, against the oracle
    for layer in range(NL):
        st = pool.read_state(layer, ids)
        parts = [torch.empty_like(st) for _ in range(world)]
        dist.all_gather(parts, st.contiguous())
        err_oracle = max(err_oracle, rel_err(torch.cat(parts, 1).cpu(), oracle[layer].state[ids.long().cpu()]))
    return dict(err_ref=err_ref, err_oracle=err_oracle, padding_zero=padding_zero, cursors_ok=cursors_ok,
                q_heads=list(shard.q_heads), v_heads=list(shard.v_heads), k_cache=list(pool.k_cache.shape))


def dist_env(rank: int, world: int) -> dict[str, Any]:
    """What ``init_distributed`` gave, that a second call is a no-op, and that ``distributed_session``
    tears the group down."""
    import torch.distributed as dist

    from tp_replayssm.tp import distributed

    env = distributed.init_distributed("cpu")
    again = distributed.init_distributed("cpu")
    t = torch.tensor([float(env.rank)])
    dist.all_reduce(t)
    info = dict(rank=env.rank, world=env.world_size, local_rank=env.local_rank, dist_rank=dist.get_rank(),
                backend=env.backend, device=str(env.device), same=again is env, sum=float(t))
    with distributed.distributed_session("cpu") as inner:
        info["inner_same"] = inner is env
    info["initialized_after"] = dist.is_initialized()
    return info


def slot_error_on_one_rank(rank: int, world: int, bad: int) -> tuple[str, str | None, str | None]:
    """Every rank decodes layer 0, rank ``bad`` with an out-of-range slot; then every rank calls
    ``verify_placement()``: (``check()``'s own text on this rank, verify_placement's SlotError text or None, the text
    of the next collective call's error or None: the ranks must all stop at verify_placement)."""
    import torch.distributed as dist

    from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError
    from tp_replayssm.testing import random_decode_inputs, random_head_params

    pool = ReplaySSMStatePool(KDAHeads(2, 4, 16, 16), num_layers=1, num_slots=4, ring_length=4,
                              group=dist.group.WORLD, device="cpu")
    slots = pool.alloc(2)
    loc = pool.local_heads
    gen = torch.Generator().manual_seed(3)
    params = random_head_params(loc.num_v_heads, 16, generator=gen)
    x = random_decode_inputs(2, loc.num_q_heads, loc.num_v_heads, 16, 16, dtype=torch.float32, generator=gen)
    ids = torch.tensor([int(slots[0]), 99 if rank == bad else int(slots[1])], dtype=torch.int32)
    pool.decode(0, x.mixed_qkv, x.a, x.b, params.A_log, params.dt_bias, ids)
    own = "ok" if pool.slot_errors[0].item() == 0 else "recorded"
    try:
        pool.verify_placement()
        msg = None
    except SlotError as exc:
        msg = str(exc)
    try:  # every rank must have stopped above: a collective after it still meets on every rank
        pool.verify_placement()
        later = None
    except Exception as exc:  # noqa: BLE001
        later = f"{type(exc).__name__}: {exc}"
    return own, msg, later


def world_pool_after_a_subgroup(rank: int, world: int) -> str:
    """Every rank creates a subgroup of the first two ranks (torch's usual way: all ranks call ``new_group``),
    then builds a pool over the whole world: the placement check's own group must still meet on every rank (a
    rank outside the subgroup knows one process group fewer)."""
    import torch.distributed as dist

    from tp_replayssm import KDAHeads, ReplaySSMStatePool

    dist.new_group([0, 1])
    pool = ReplaySSMStatePool(KDAHeads(2, 4, 16, 16), num_layers=1, num_slots=2, ring_length=4,
                              group=dist.group.WORLD, device="cpu")
    pool.verify_placement()
    return "ok"
