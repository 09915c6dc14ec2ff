"""Worker functions of the tensor-parallel tests (tests/test_distributed.py, tests/test_multigpu.py), run on spawned
ranks by ``_dist_helpers.run_ranks`` (importable by the children as module ``_distributed_workers``): a TP pool's
gathered decode against the single-rank reference and the float64 recurrence, and what ``init_distributed`` gives.
"""

from __future__ import annotations

from typing import Any

import torch

K = V = 16  # small head dims


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
