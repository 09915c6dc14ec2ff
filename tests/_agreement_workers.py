"""Ranks that call the pool differently (tests/test_agreement.py), run on spawned gloo ranks by
``_dist_helpers.run_ranks`` (importable by the children).

:func:`mismatch_cases` runs each case on a fresh debug-mode pool over the whole world: rank ``odd`` calls the pool with
arguments the other ranks do not pass (a reversed slot order, a shorter batch, another ``num_accepted``, a
different call, a free list that diverged...). Each case reports, per rank, the error type and text (or None), whether
the pool's bytes (checkpoints, rings, cursors, conv windows, error record) stayed as they were, and whether the ranks
still meet at the next collective call.
"""

from __future__ import annotations

from typing import Any

import torch

from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.testing import random_decode_inputs, random_head_params

K = V = 16
W = 4
T = 2

CASES = ("same", "same-meaning", "slots-order", "batch", "force-flush", "dtype", "calls", "num-accepted",
         "commit-shape", "parents", "alloc", "free", "fork", "load-state", "layer-prefill", "placement-vs-call",
         "other-pool")


def _snapshot(pool: ReplaySSMStatePool) -> list[torch.Tensor]:
    return [t.clone() for t in (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache, pool.cursors,
                                pool.conv_state, pool.slot_errors)]


def mismatch_cases(rank: int, world: int, odd: int, debug: bool) -> dict[str, Any]:
    """``{case: (error type or None, error text or None, pool unchanged by the failed call, next collective met)}``,
    each case on a fresh pool; with ``debug=False`` only ``"same"`` and ``"slots-order"`` run (no exchange)."""
    results: dict[str, Any] = {}
    for case in (CASES if debug else ("same", "slots-order")):
        results[case] = _run_case(case, rank == odd, debug)
    return results


def _run_case(case: str, me: bool, debug: bool) -> tuple[Any, ...]:
    import torch.distributed as dist

    pool = ReplaySSMStatePool(KDAHeads(2, 4, K, V), num_layers=2, num_slots=8, ring_length=4, conv_kernel_size=W,
                              group=dist.group.WORLD, device="cpu", debug=debug)
    loc = pool.local_heads
    gen = torch.Generator().manual_seed(11)
    params = [random_head_params(loc.num_v_heads, K, generator=gen) for _ in range(2)]
    conv_w = torch.randn(pool.conv_channels, W, generator=gen) * 0.5
    slots = pool.alloc(3)

    def decode(ids: torch.Tensor, layer: int = 0, **kw: Any) -> None:
        x = random_decode_inputs(ids.shape[0], loc.num_q_heads, loc.num_v_heads, K, V, dtype=torch.float32,
                                 generator=torch.Generator().manual_seed(3))
        pool.decode(layer, x.mixed_qkv, x.a, x.b, params[layer].A_log, params[layer].dt_bias, ids,
                    conv_weight=conv_w, **kw)

    def verify(ids: torch.Tensor, parents: torch.Tensor | None = None) -> None:
        B = ids.shape[0]
        for layer in range(2):
            x = random_decode_inputs(B * T, loc.num_q_heads, loc.num_v_heads, K, V, dtype=torch.float32,
                                     generator=torch.Generator().manual_seed(4))
            pool.verify(layer, x.mixed_qkv.view(B, T, -1), x.a.view(B, T, -1), x.b.view(B, T, -1),
                        params[layer].A_log, params[layer].dt_bias, ids, parents=parents, conv_weight=conv_w)

    def prefill() -> None:  # the TP layer's prefill of 2 packed sequences, 5 tokens: one rank splits them 1 + 4
        from _layer_helpers import random_weights

        from tp_replayssm.layers import KDALayerConfig, TPKimiDeltaAttention

        config = KDALayerConfig(32, 2, 4, K, V, 16, conv_size=W)
        layer = TPKimiDeltaAttention.from_state_dict(random_weights(config, 2), config, pool=pool, layer_idx=0,
                                                     group=dist.group.WORLD)
        cu = torch.tensor([0, 1 if me else 2, 5], dtype=torch.int32)
        layer(torch.randn(5, 32, generator=torch.Generator().manual_seed(5)), slots[:2], cu)

    def same_meaning() -> None:  # padding spelled differently on one rank
        decode(torch.tensor([int(slots[0]), int(slots[1]), -2 if me else -1], dtype=torch.int32))

    def other_pool() -> None:  # one rank calls a second pool (built on every rank, after the first)
        other = ReplaySSMStatePool(KDAHeads(2, 4, K, V), num_layers=1, num_slots=8, ring_length=4,
                                   group=dist.group.WORLD, device="cpu", debug=True)
        ids = other.alloc(3)
        (other if me else pool).advance(ids)

    accepted = torch.tensor([1, 2, 0], dtype=torch.int32)
    calls = {
        "same-meaning": same_meaning,
        "commit-shape": lambda: pool.commit(slots[:2] if me else slots, accepted[:2] if me else accepted),
        "placement-vs-call": lambda: pool.verify_placement() if me else pool.advance(slots),
        "same": lambda: decode(slots),
        "slots-order": lambda: decode(slots.flip(0) if me else slots),
        "batch": lambda: decode(slots[:2] if me else slots),
        "force-flush": lambda: decode(slots, force_flush=torch.tensor([0, int(me), 0], dtype=torch.int32)),
        "dtype": lambda: decode(slots, force_flush=torch.zeros(3, dtype=torch.int64 if me else torch.int32)),
        "other-pool": other_pool,
        "calls": lambda: pool.advance(slots) if me else decode(slots, layer=1),
        "num-accepted": lambda: pool.commit(slots, accepted.flip(0) if me else accepted),
        "parents": lambda: verify(slots, torch.tensor([[-1, 0], [-1, -1 if me else 0], [-1, 0]], dtype=torch.int32)),
        "alloc": lambda: pool.alloc(1),
        "free": lambda: pool.free([int(slots[2]) if me else int(slots[1])]),
        "fork": lambda: pool.fork(slots[:1], torch.tensor([5 if me else 6], dtype=torch.int32)),
        "load-state": lambda: pool.load_state(1, slots[1:] if me else slots[:2], torch.zeros(2, loc.num_v_heads, V, K)),
        "layer-prefill": prefill,
    }
    if case in ("num-accepted", "commit-shape"):  # the step's verify (alike on every rank) opens the step
        verify(slots)
    if case == "alloc" and me:  # this rank's free list diverges (unchecked): slot 2 freed, slot 3 taken
        pool.debug = False
        pool.free([int(slots[2])])
        pool.alloc(1)
        pool.debug = True
    before = _snapshot(pool)
    allocated = pool.allocated_slots()
    try:
        calls[case]()
        err: tuple[Any, ...] = (None, None)
    except Exception as exc:  # noqa: BLE001
        err = (type(exc).__name__, str(exc))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool))) and pool.allocated_slots() == allocated
    if case in ("num-accepted", "commit-shape") and err[0] is not None:  # the step is open: close it alike
        pool.commit(slots, accepted)
    try:
        pool.verify_placement()  # a collective: every rank must still be at the same point
        met = True
    except Exception:  # noqa: BLE001
        met = False
    return (*err, unchanged, met)


def late_rank(rank: int, world: int, odd: int) -> tuple[str, str, bool]:
    """Rank ``odd`` reaches a debug-mode call after the check's timeout (3 s): (the error type on this rank, its
    text, whether the ranks then meet again at the next calls, which need a new check group)."""
    import os
    import time

    import torch.distributed as dist

    from tp_replayssm.tp import placement

    os.environ["TP_REPLAYSSM_PLACEMENT_TIMEOUT_S"] = "3"
    placement.reset_check_groups()  # (a check group made before has the harness's timeout)
    pool = ReplaySSMStatePool(KDAHeads(2, 4, K, V), num_layers=1, num_slots=4, ring_length=4,
                              group=dist.group.WORLD, device="cpu", debug=True)
    slots = pool.alloc(2)
    if rank == odd:
        time.sleep(6)
    try:
        pool.advance(slots)
        kind, text = "none", ""
    except Exception as exc:  # noqa: BLE001
        kind, text = type(exc).__name__, str(exc)
    dist.barrier()  # (the main group: the ranks line up again)
    try:
        pool.advance(slots)
        pool.verify_placement()
        met = True
    except Exception:  # noqa: BLE001
        met = False
    return kind, text, met


def debug_on_one_rank(rank: int, world: int, odd: int) -> str:
    """A pool built in debug mode on rank ``odd`` alone: the construction's placement check refuses it (the text)."""
    import torch.distributed as dist

    try:
        ReplaySSMStatePool(KDAHeads(2, 4, K, V), num_layers=1, num_slots=4, ring_length=4, group=dist.group.WORLD,
                           device="cpu", debug=rank == odd)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "built"


def calls_compared(rank: int, world: int) -> list[str]:
    """Every pool call that takes slots, and the TP layer's, once each with the same arguments on every rank in
    debug mode; the calls whose comparison ran (the contexts of the exchanges, in order)."""
    import torch.distributed as dist

    from _layer_helpers import random_weights

    from tp_replayssm.layers import KDALayerConfig, TPKimiDeltaAttention, end_prefill
    from tp_replayssm.tp import placement

    seen: list[str] = []
    exchange = placement.gather_if_different

    def recording(group: Any, digest: int, payload: Any, context: str, local: str) -> Any:
        seen.append(context.removesuffix(" (debug check)"))
        return exchange(group, digest, payload, context, local)

    placement.gather_if_different = recording
    try:
        pool = ReplaySSMStatePool(KDAHeads(2, 4, K, V), num_layers=1, num_slots=8, ring_length=4, conv_kernel_size=W,
                                  group=dist.group.WORLD, device="cpu", debug=True)
        loc = pool.local_heads
        params = random_head_params(loc.num_v_heads, K, generator=torch.Generator().manual_seed(1))
        conv_w = torch.randn(pool.conv_channels, W, generator=torch.Generator().manual_seed(2))
        slots = pool.alloc(2)
        x = random_decode_inputs(2, loc.num_q_heads, loc.num_v_heads, K, V, dtype=torch.float32,
                                 generator=torch.Generator().manual_seed(3))
        pool.conv_update(0, x.mixed_qkv, conv_w, slots)
        pool.decode(0, x.mixed_qkv, x.a, x.b, params.A_log, params.dt_bias, slots, conv_weight=conv_w)
        pool.advance(slots)
        x2 = random_decode_inputs(2 * T, loc.num_q_heads, loc.num_v_heads, K, V, dtype=torch.float32,
                                  generator=torch.Generator().manual_seed(4))
        pool.verify(0, x2.mixed_qkv.view(2, T, -1), x2.a.view(2, T, -1), x2.b.view(2, T, -1), params.A_log,
                    params.dt_bias, slots, conv_weight=conv_w)
        pool.commit(slots, torch.ones(2, dtype=torch.int32))
        pool.load_state(0, slots, pool.read_state(0, slots))
        pool.read_conv_state(0, slots)
        pool.fork(slots[:1], pool.alloc(1))
        shard = pool.export_state(slots)
        pool.free(slots.tolist())
        pool.import_state(pool.alloc(2), shard)
        config = KDALayerConfig(32, 2, 4, K, V, 16, conv_size=W)
        layer = TPKimiDeltaAttention.from_state_dict(random_weights(config, 2), config, pool=pool, layer_idx=0,
                                                     group=dist.group.WORLD)
        ids = pool.allocated_slots()[:2]
        layer(torch.randn(2, 32, generator=torch.Generator().manual_seed(5)), torch.tensor(ids, dtype=torch.int32))
        end_prefill(pool, torch.tensor(ids, dtype=torch.int32))
    finally:
        placement.gather_if_different = exchange
    return seen


def bad_env_on_one_rank(rank: int, world: int, odd: int) -> str:
    """``TP_REPLAYSSM_DEBUG=2`` (not understood) on rank ``odd`` alone: its pool's construction reports it in the
    exchange of the ranks' argument checks every rank takes part in (the text)."""
    import os

    import torch.distributed as dist

    if rank == odd:
        os.environ["TP_REPLAYSSM_DEBUG"] = "2"
    try:
        ReplaySSMStatePool(KDAHeads(2, 4, K, V), num_layers=1, num_slots=4, ring_length=4, group=dist.group.WORLD,
                           device="cpu")
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        os.environ.pop("TP_REPLAYSSM_DEBUG", None)
    return "built"
