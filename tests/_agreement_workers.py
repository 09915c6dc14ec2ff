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

CASES = ("same", "slots-order", "batch", "force-flush", "calls", "num-accepted", "parents", "alloc", "free", "fork",
         "load-state", "layer-prefill")


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

    accepted = torch.tensor([1, 2, 0], dtype=torch.int32)
    calls = {
        "same": lambda: decode(slots),
        "slots-order": lambda: decode(slots.flip(0) if me else slots),
        "batch": lambda: decode(slots[:2] if me else slots),
        "force-flush": lambda: decode(slots, force_flush=torch.tensor([0, int(me), 0], dtype=torch.int32)),
        "calls": lambda: pool.advance(slots) if me else decode(slots, layer=1),
        "num-accepted": lambda: pool.commit(slots, accepted.flip(0) if me else accepted),
        "parents": lambda: verify(slots, torch.tensor([[-1, 0], [-1, -1 if me else 0], [-1, 0]], dtype=torch.int32)),
        "alloc": lambda: pool.alloc(1),
        "free": lambda: pool.free([int(slots[2]) if me else int(slots[1])]),
        "fork": lambda: pool.fork(slots[:1], torch.tensor([5 if me else 6], dtype=torch.int32)),
        "load-state": lambda: pool.load_state(1, slots[1:] if me else slots[:2], torch.zeros(2, loc.num_v_heads, V, K)),
        "layer-prefill": prefill,
    }
    if case == "num-accepted":  # the step's verify (alike on every rank) opens the step the commit closes
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
    if case == "num-accepted" and err[0] is not None:  # the step is still open: close it alike on every rank
        pool.commit(slots, accepted)
    try:
        pool.verify_placement()  # a collective: every rank must still be at the same point
        met = True
    except Exception:  # noqa: BLE001
        met = False
    return (*err, unchanged, met)
