"""Worker functions of the placement tests (tests/test_placement.py), run on spawned gloo ranks by
``_dist_helpers.run_ranks`` (importable by the children as module ``_placement_workers``): the fault matrix through
``collective_placement_check`` (world group and TP subgroups) and through the real pool, a slot error on one rank,
and a world pool built after a subgroup. Also the fingerprints and fault cases the unit tests share.
"""

from __future__ import annotations

import time
from typing import Any

import torch

K = V = 16  # small head dims

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
                 "ring-layout": {"ring_layout": "sglang"},
                 # arguments that build no pool on the bad rank: every rank raises (none waits out its timeout)
                 "bad-num-slots": {"num_slots": 0}, "bad-tp-size": {"tp_size": 3}, "bad-debug": {"debug": "false"}}
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
