"""The resharding scenario of tests/test_lifecycle_reshard.py, in one process (pools of every tp size side by side)
and on spawned gloo ranks (:func:`reshard_worker`, run by ``_dist_helpers.run_ranks``; importable by the children).

A global model (heads ``KDAHeads(H, HV, K, V)``, ``NL`` layers with a short conv of kernel ``W``) decodes two
requests (plus a padding row) through a chain of pool sets of tp sizes ``tps``: a phase decodes ``steps[p]`` model
steps on its pools, then every rank exports the requests' state, the shards move to the next phase's pools (in one
process: by hand; across processes: ``all_gather_object``, i.e. pickled), which import them into freshly allocated
slots and continue. Every output is compared with an uninterrupted single-rank pool decoding the same tokens, and
after each import the gathered ``read_state`` and conv windows with that pool's.
"""

from __future__ import annotations

from typing import Any

import torch

from tp_replayssm import KDAHeads, ReplaySSMStatePool, StateShard, concat_outputs
from tp_replayssm.testing import HeadParams, random_decode_inputs, random_head_params, rel_err
from tp_replayssm.tp.heads import HeadShard

K = V = 16
NL = 2
L = 4
W = 4
B = 3  # rows: request, padding, request


class Model:
    """The global model's per-layer constants (head params, conv weight ``[D, W]`` and bias ``[D]``) and, per
    step, its global inputs; the same draws in every process."""

    def __init__(self, heads: KDAHeads, seed: int = 5) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.gen = heads, gen
        self.params = [random_head_params(heads.num_v_heads, heads.key_dim, generator=gen) for _ in range(NL)]
        D = heads.qkv_width
        self.conv_w = [torch.randn(D, W, generator=gen) * 0.5 for _ in range(NL)]
        self.conv_b = [torch.randn(D, generator=gen) * 0.1 for _ in range(NL)]
        self.init = [torch.randn(2, heads.num_v_heads, V, K, generator=gen) * 0.2 for _ in range(NL)]

    def step_inputs(self) -> list[Any]:
        h = self.heads
        return [random_decode_inputs(B, h.num_q_heads, h.num_v_heads, K, V, dtype=torch.float32, generator=self.gen)
                for _ in range(NL)]


def local_args(shard: HeadShard, model: Model, layer: int, x: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's slices of one layer's global inputs (the conv weight sliced like ``mixed_qkv``'s columns)."""
    p: HeadParams = model.params[layer]
    local = dict(mixed_qkv=shard.slice_mixed_qkv(x.mixed_qkv), a=shard.slice_a(x.a), b=shard.slice_b(x.b),
                 A_log=shard.slice_A_log(p.A_log), dt_bias=shard.slice_dt_bias(p.dt_bias),
                 conv_weight=shard.slice_mixed_qkv(model.conv_w[layer].T).T,
                 conv_bias=shard.slice_mixed_qkv(model.conv_b[layer]))
    return {name: t.to(device).contiguous() for name, t in local.items()}


def decode_step(pool: ReplaySSMStatePool, model: Model, xs: list[Any], slots: torch.Tensor) -> list[torch.Tensor]:
    """One model step (every layer, the fused advance on the last) on one pool; the local outputs per layer."""
    outs = []
    for layer, x in enumerate(xs):
        a = local_args(pool.shard, model, layer, x, pool.device)
        outs.append(pool.decode(layer, a["mixed_qkv"], a["a"], a["b"], a["A_log"], a["dt_bias"], slots,
                                conv_weight=a["conv_weight"], conv_bias=a["conv_bias"], advance=layer == NL - 1))
    return outs


def make_pool(heads: KDAHeads, tp: int, rank: int, layout: str, state_dtype: torch.dtype,
              cache_dtype: torch.dtype, group: object | None = None, device: torch.device | str = "cpu"
              ) -> ReplaySSMStatePool:
    return ReplaySSMStatePool(heads, num_layers=NL, num_slots=6, ring_length=L, state_dtype=state_dtype,
                              cache_dtype=cache_dtype, tp_rank=None if group is not None else rank,
                              tp_size=None if group is not None else tp, group=group, ring_layout=layout,
                              conv_kernel_size=W, device=device)


def target_slots(pool: ReplaySSMStatePool, phase: int) -> torch.Tensor:
    """Two fresh slots, different ids in every phase (``phase`` slots are taken and kept first)."""
    if phase:
        pool.alloc(phase % 3)
    return pool.alloc(2)


def row_slots(ids: torch.Tensor) -> torch.Tensor:
    return torch.tensor([int(ids[0]), -1, int(ids[1])], dtype=torch.int32, device=ids.device)


def reference_pool(heads: KDAHeads, model: Model, layout: str, state_dtype: torch.dtype,
                   cache_dtype: torch.dtype, device: torch.device | str = "cpu"
                   ) -> tuple[ReplaySSMStatePool, torch.Tensor]:
    """The uninterrupted single-rank pool with the two requests prefilled."""
    ref = make_pool(heads, 1, 0, layout, state_dtype, cache_dtype, device=device)
    ids = ref.alloc(2)
    for layer in range(NL):
        ref.load_state(layer, ids, model.init[layer].to(ref.device))
    return ref, ids


def reshard_chain(H: int, HV: int, tps: tuple[int, ...], steps: tuple[int, ...], layout: str,
                  state_dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype = torch.float32,
                  pickle_shards: bool = False, device: torch.device | str = "cpu") -> dict[str, float]:
    """The scenario in one process. Returns the worst relative errors of the outputs (``out``), and of the states
    and conv windows right after each import (``state``, ``conv``) against the uninterrupted pool."""
    import pickle

    heads = KDAHeads(H, HV, K, V)
    model = Model(heads)
    ref, ref_ids = reference_pool(heads, model, layout, state_dtype, cache_dtype, device)
    errs = dict(out=0.0, state=0.0, conv=0.0)
    shards: list[StateShard] | None = None
    for phase, (tp, n_steps) in enumerate(zip(tps, steps)):
        pools = [make_pool(heads, tp, r, layout, state_dtype, cache_dtype, device=device) for r in range(tp)]
        ids = [target_slots(p, phase) for p in pools]
        for p, i in zip(pools, ids):
            if shards is None:  # the prefill
                for layer in range(NL):
                    p.load_state(layer, i, p.shard.slice_state(model.init[layer]).to(p.device))
            else:
                p.import_state(i, shards)
        if shards is not None:
            for layer in range(NL):
                got = torch.cat([p.read_state(layer, i) for p, i in zip(pools, ids)], dim=1)
                errs["state"] = max(errs["state"], rel_err(got, ref.read_state(layer, ref_ids)))
                got_c = gather_conv([p.read_conv_state(layer, i) for p, i in zip(pools, ids)],
                                    [p.shard for p in pools])
                errs["conv"] = max(errs["conv"], rel_err(got_c, ref.read_conv_state(layer, ref_ids)))
        for _ in range(n_steps):
            xs = model.step_inputs()
            want = decode_step(ref, model, xs, row_slots(ref_ids))
            local = [decode_step(p, model, xs, row_slots(i)) for p, i in zip(pools, ids)]
            for layer in range(NL):
                got = concat_outputs([o[layer] for o in local])
                errs["out"] = max(errs["out"], rel_err(got, want[layer]))
                assert (got[1] == 0).all()
        for p in pools:
            p.check()
        shards = [p.export_state(i) for p, i in zip(pools, ids)]
        if pickle_shards:
            shards = [pickle.loads(pickle.dumps(s)) for s in shards]
    return errs


def gather_conv(parts: list[torch.Tensor], shards: list[HeadShard]) -> torch.Tensor:
    """Global conv windows ``[n, D, W-1]`` from per-rank ``[n, D_l, W-1]`` (q blocks, k blocks, v blocks; a
    replicated q/k head is taken from its first holder)."""
    heads = shards[0].heads
    H, HV = heads.num_q_heads, heads.num_v_heads
    q: dict[int, torch.Tensor] = {}
    k: dict[int, torch.Tensor] = {}
    v: dict[int, torch.Tensor] = {}
    for part, sh in zip(parts, shards):
        Hl = sh.num_q_heads_local
        for j, h in enumerate(sh.q_heads):
            q.setdefault(h, part[:, j * K:(j + 1) * K])
            k.setdefault(h, part[:, Hl * K + j * K:Hl * K + (j + 1) * K])
        for j, h in enumerate(sh.v_heads):
            v[h] = part[:, 2 * Hl * K + j * V:2 * Hl * K + (j + 1) * V]
    return torch.cat([q[h] for h in range(H)] + [k[h] for h in range(H)] + [v[h] for h in range(HV)], dim=1)


def reshard_worker(rank: int, world: int, H: int, HV: int, tps: tuple[int, ...], steps: tuple[int, ...],
                   layouts: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """The scenario across processes (``world = max(tps)`` gloo ranks): a phase of tp size ``t`` runs on ranks
    ``0..t-1`` (a group of those ranks; no group for ``t = 1``); shards travel pickled through
    ``all_gather_object`` over the world group. Rank 0 compares the gathered outputs, states and conv windows with
    its own uninterrupted pool; returns per layout the worst relative errors (rank 0) and the tp sizes it ran."""
    import torch.distributed as dist

    heads = KDAHeads(H, HV, K, V)
    # A pool over the world group first: its placement check creates the check group over every rank while every
    # rank has made the same process groups. (torch names a group made with use_local_synchronization, as the
    # check group is, by its ranks AND the number of groups this process knows; a rank outside a subgroup knows
    # one group fewer than its members, so a later world check group would get different names on different ranks
    # and its rendezvous would hang.)
    make_pool(heads, world, rank, layouts[0], torch.float32, torch.float32, dist.group.WORLD)
    groups = {t: (dist.group.WORLD if t == world else dist.new_group(list(range(t)))) for t in sorted(set(tps))
              if t > 1}
    results: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        model = Model(heads)
        ref, ref_ids = reference_pool(heads, model, layout, torch.float32, torch.float32) if rank == 0 else (None,
                                                                                                            None)
        errs: dict[str, Any] = dict(out=0.0, state=0.0, conv=0.0, ran=[], shards_seen=0)
        shards: list[StateShard] | None = None
        for phase, (tp, n_steps) in enumerate(zip(tps, steps)):
            mine = rank < tp
            pool = ids = None
            if mine:
                pool = make_pool(heads, tp, rank, layout, torch.float32, torch.float32, groups.get(tp))
                ids = target_slots(pool, phase)
                errs["ran"].append(tp)
                if shards is None:
                    for layer in range(NL):
                        pool.load_state(layer, ids, pool.shard.slice_state(model.init[layer]))
                else:
                    pool.import_state(ids, shards)
            if shards is not None:
                for layer in range(NL):
                    st = _gather(world, (pool.read_state(layer, ids), pool.read_conv_state(layer, ids), pool.shard)
                                 if mine else None)
                    if rank == 0:
                        got = torch.cat([s for s, _, _ in st], dim=1)
                        errs["state"] = max(errs["state"], rel_err(got, ref.read_state(layer, ref_ids)))
                        got_c = gather_conv([c for _, c, _ in st], [sh for _, _, sh in st])
                        errs["conv"] = max(errs["conv"], rel_err(got_c, ref.read_conv_state(layer, ref_ids)))
            for _ in range(n_steps):
                xs = model.step_inputs()  # every rank draws, so the streams stay in step
                local = decode_step(pool, model, xs, row_slots(ids)) if mine else None
                outs = _gather(world, local)
                if rank == 0:
                    want = decode_step(ref, model, xs, row_slots(ref_ids))
                    for layer in range(NL):
                        got = concat_outputs([o[layer] for o in outs])
                        errs["out"] = max(errs["out"], rel_err(got, want[layer]))
            if mine:
                pool.check()
            shards = _gather(world, pool.export_state(ids) if mine else None)
            errs["shards_seen"] += len(shards)
        results[layout] = errs
    return results


def _gather(world: int, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (pickled through gloo), without the ranks that gave None, in rank order."""
    import torch.distributed as dist

    got: list[Any] = [None] * world
    dist.all_gather_object(got, obj)
    return [g for g in got if g is not None]
