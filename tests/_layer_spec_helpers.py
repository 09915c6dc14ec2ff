"""Speculative decoding through ``TPKimiDeltaAttention``: scenarios, the runner and the gloo worker (importable by
spawned ranks as ``_layer_spec_helpers``).

A scenario is a packed prefill of ``n`` sequences, then :class:`Step` s: verify steps (``T`` draft tokens per row,
a chain or a tree, a padding row, each sequence keeping its own number of tokens) and plain decode steps. The
runner drives every rank's layers over its pool (verify of every layer, then one ``pool.commit``) and checks each
step against

- a *twin* pool with layers of the same weights that decodes the same tokens one at a time (``decode`` + the fused
  advance): every node's output from a fork of the row's slot into a scratch slot, decoding the node's path root
  first; after the commit, the twin decodes only the kept tokens, and every layer's ``read_state`` and conv window of
  the two pools must agree;
- :class:`_layer_helpers.PlainKDALayer`, the float64 layer, stepped along each node's path from a copy of the
  sequence's state.

It also tracks the cursor the contract gives (``base + num_accepted``, ``base = 0`` when the drafts do not fit) and
counts the rows that folded.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

import _layer_helpers as lh


@dataclasses.dataclass
class Step:
    """``kind`` "verify" (``x [B, T, hidden]``; ``parents`` per row or None for a chain; ``accepted`` per row;
    ``path`` per row, the kept nodes root first, None for a chain) or "decode" (``x [B, hidden]``). ``seqs``: the
    sequence of each row, None = a padding row."""

    kind: str
    seqs: list[int | None]
    x: torch.Tensor
    parents: list[list[int]] | None = None
    accepted: list[int] | None = None
    path: list[list[int]] | None = None


@dataclasses.dataclass
class Rank:
    """One rank's pools and layers: ``pool``/``layers`` verify, ``twin``/``twin_layers`` decode; ``slots[s]`` and
    ``twin_slots[s]`` the slots of sequence ``s``; ``scratch`` one twin slot per row for the forks."""

    pool: Any
    layers: list[Any]
    twin: Any
    twin_layers: list[Any]
    slots: list[int]
    twin_slots: list[int]
    scratch: list[int]


def node_paths(parents: list[int] | None, T: int) -> list[list[int]]:
    """Each node's path from the committed state, root first, itself last (a chain: ``0..t``)."""
    if parents is None:
        return [list(range(t + 1)) for t in range(T)]
    out = []
    for t in range(T):
        path, u = [], t
        while u >= 0:
            path.append(u)
            u = parents[u]
        out.append(path[::-1])
    return out


def kept_nodes(step: Step, b: int) -> list[int]:
    n = step.accepted[b]
    return list(range(n)) if step.path is None else step.path[b][:n]


def scenario(hidden: int, seed: int) -> tuple[list[int], torch.Tensor, list[Step]]:
    """Three sequences: prompts of 5, 1 and 9 tokens; a decode of two of them (cursors 1, 0, 1); chain verifies of
    ``T = 3`` and tree verifies of ``T = 4`` (ring length 5: rows with cursor >= 2, resp. >= 1, fold), each with a
    padding row and the rows in another order, keeping 0..T tokens; decodes between and after."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, hidden, generator=g)

    prompts = [5, 1, 9]
    steps = [
        Step("decode", [0, None, 2], rnd(3)),
        Step("verify", [2, None, 0, 1], rnd(4, 3), accepted=[3, 0, 0, 2]),
        Step("verify", [0, 1, None, 2], rnd(4, 3), accepted=[1, 3, 0, 2]),
        Step("decode", [2, 1, 0], rnd(3)),
        Step("verify", [1, 2, 0, None], rnd(4, 3), accepted=[0, 1, 3, 0]),
        Step("verify", [0, None, 1, 2], rnd(4, 4),
             parents=[[-1, 0, 0, 1], [-1, 0, 0, 0], [-1, -1, 1, 2], [-1, 0, 1, 2]],
             accepted=[3, 0, 1, 4], path=[[0, 1, 3, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 2, 3]]),
        Step("verify", [2, 0, 1, None], rnd(4, 4),
             parents=[[-1, -1, 0, 2], [-1, 0, 1, 0], [-1, 0, 0, 2], [-1, 0, 0, 0]],
             accepted=[3, 3, 0, 0], path=[[0, 2, 3, 0], [0, 1, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]]),
        Step("decode", [0, 1, 2], rnd(3)),
        Step("verify", [None, 1, 0, 2], rnd(4, 3), accepted=[0, 2, 3, 1]),
        Step("decode", [1, None, 2, 0], rnd(4)),
    ]
    return prompts, rnd(sum(prompts)), steps


# ---- the runner ---------------------------------------------------------------------------------------------------


def _ids(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int32, device=device)


def _decode(layers: list[Any], x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One decode token per row in every layer (the last layer moves the cursors); ``[NL, B, hidden]`` float64."""
    return torch.stack([layer(x, slots, advance=i == len(layers) - 1).double().cpu() for i, layer in enumerate(layers)])


def _twin_nodes(rk: Rank, step: Step, dtype: torch.dtype) -> torch.Tensor:
    """Every node's output from sequential decode on the twin: per node, fork each row's slot into its scratch slot
    and decode the node's path there; ``[NL, B, T, hidden]`` float64 (padding rows zero)."""
    B, T = step.x.shape[:2]
    dev = rk.twin.device
    live = [b for b, s in enumerate(step.seqs) if s is not None]
    out = torch.zeros(len(rk.twin_layers), B, T, step.x.shape[-1], dtype=torch.float64)
    for t in range(T):
        paths = {b: node_paths(step.parents[b] if step.parents else None, T)[t] for b in live}
        rk.twin.fork(_ids([rk.twin_slots[step.seqs[b]] for b in live], dev), _ids(rk.scratch[:len(live)], dev))
        for j in range(max(len(p) for p in paths.values())):
            rows = [i for i, b in enumerate(live) if j < len(paths[b])]
            slots = _ids([rk.scratch[i] if i in rows else -1 for i in range(len(live))], dev)
            x = torch.stack([step.x[b, paths[b][min(j, len(paths[b]) - 1)]] for b in live]).to(dev, dtype)
            y = _decode(rk.twin_layers, x, slots)
            for i in rows:
                if j == len(paths[live[i]]) - 1:
                    out[:, live[i], t] = y[:, i]
    return out


def _twin_keep(rk: Rank, step: Step, dtype: torch.dtype) -> None:
    """The twin decodes each row's kept tokens (what the commit keeps), root first."""
    dev = rk.twin.device
    kept = [kept_nodes(step, b) if s is not None else [] for b, s in enumerate(step.seqs)]
    for j in range(max(len(k) for k in kept)):
        slots = _ids([rk.twin_slots[s] if s is not None and j < len(kept[b]) else -1
                      for b, s in enumerate(step.seqs)], dev)
        x = torch.stack([step.x[b, kept[b][j] if j < len(kept[b]) else 0] for b in range(len(kept))]).to(dev, dtype)
        _decode(rk.twin_layers, x, slots)


def _plain_nodes(plain: list[lh.PlainKDALayer], states: list[list[dict]], step: Step) -> torch.Tensor:
    """Every node's output of the float64 layers from copies of the states; ``[NL, B, T, hidden]``."""
    B, T = step.x.shape[:2]
    out = torch.zeros(len(plain), B, T, step.x.shape[-1], dtype=torch.float64)
    for li, layer in enumerate(plain):
        for b, s in enumerate(step.seqs):
            if s is None:
                continue
            for t, path in enumerate(node_paths(step.parents[b] if step.parents else None, T)):
                st = copy.deepcopy(states[li][s])
                for u in path:
                    y = layer.step(step.x[b, u], st)
                out[li, b, t] = y
    return out


def run(cfg: Any, weights: list[dict[str, torch.Tensor]], ranks: list[Rank], prompts: list[int], x0: torch.Tensor,
        steps: list[Step], *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The scenario on every rank (outputs summed over ``ranks``: one entry per rank in this process with no group,
    or this rank alone with the layers' all-reduce). Returns the largest relative error of each comparison, whether
    padding rows were exactly zero, whether every cursor was the contract's and how many rows folded."""
    NL, L = len(weights), ranks[0].pool.ring_length
    plain = [lh.PlainKDALayer(w, cfg) for w in weights]
    states = [[p.new_state() for _ in prompts] for p in plain]
    errs: dict[str, float] = {}
    padding_zero, cursors_ok, folds = True, True, 0
    cursor = [0] * len(prompts)

    def note(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        errs[name] = max(errs.get(name, 0.0), lh.rel(got, want))

    cu = [0]
    for n in prompts:
        cu.append(cu[-1] + n)
    got = 0
    for rk in ranks:  # the prefill: both pools, the last layer setting the cursors to 0
        for pool, layers, ids in ((rk.pool, rk.layers, rk.slots), (rk.twin, rk.twin_layers, rk.twin_slots)):
            cu_t = torch.tensor(cu, dtype=torch.int32, device=pool.device)
            ys = [layer(x0.to(pool.device, dtype), _ids(ids, pool.device), cu_t, advance=i == NL - 1).double().cpu()
                  for i, layer in enumerate(layers)]
            if pool is rk.pool:
                got = got + torch.stack(ys)
    want = torch.stack([torch.cat([torch.stack([p.step(t, states[li][s]) for t in x0[cu[s]:cu[s + 1]]])
                                   for s in range(len(prompts))]) for li, p in enumerate(plain)])
    note("prefill vs plain", got, want)

    for step in steps:
        live = [(b, s) for b, s in enumerate(step.seqs) if s is not None]
        if step.kind == "decode":
            got = twin_got = 0
            for rk in ranks:
                dev = rk.pool.device
                x = step.x.to(dev, dtype)
                got = got + _decode(rk.layers, x, _ids([-1 if s is None else rk.slots[s] for s in step.seqs], dev))
                twin_got = twin_got + _decode(rk.twin_layers, x, _ids([-1 if s is None else rk.twin_slots[s]
                                                                       for s in step.seqs], dev))
            want = torch.zeros_like(got)
            for li, p in enumerate(plain):
                for b, s in live:
                    want[li, b] = p.step(step.x[b], states[li][s])
            note("decode vs plain", got, want)
            note("decode vs twin", got, twin_got)
            for _, s in live:
                cursor[s] = 0 if cursor[s] == L - 1 else cursor[s] + 1
        else:
            B, T = step.x.shape[:2]
            got = seq = 0
            for rk in ranks:
                dev = rk.pool.device
                slots = _ids([-1 if s is None else rk.slots[s] for s in step.seqs], dev)
                parents = None if step.parents is None else _ids(step.parents, dev)
                x = step.x.to(dev, dtype)
                ys = [layer(x, slots, verify=True, parents=parents) for layer in rk.layers]
                assert all(tuple(y.shape) == (B, T, x.shape[-1]) and y.dtype == dtype for y in ys)
                got = got + torch.stack([y.double().cpu() for y in ys])
                seq = seq + _twin_nodes(rk, step, dtype)
                path = None if step.path is None else _ids(step.path, dev)
                rk.pool.commit(slots, _ids([step.accepted[b] if s is not None else 0
                                            for b, s in enumerate(step.seqs)], dev), path=path)
                _twin_keep(rk, step, dtype)
            note("verify vs twin", got, seq)
            note("verify vs plain", got, _plain_nodes(plain, states, step))
            padding_zero &= all(bool((got[:, b] == 0).all()) for b, s in enumerate(step.seqs) if s is None)
            for li, p in enumerate(plain):
                for b, s in live:
                    for u in kept_nodes(step, b):
                        p.step(step.x[b, u], states[li][s])
            for b, s in live:
                base = cursor[s] if cursor[s] + T <= L - 1 else 0
                folds += base != cursor[s] and cursor[s] > 0
                cursor[s] = base + step.accepted[b]
        for rk in ranks:  # after every step: states and windows of both pools, against each other and float64
            ids, tids = _ids(rk.slots, rk.pool.device), _ids(rk.twin_slots, rk.twin.device)
            sh = rk.pool.shard
            cursors_ok &= rk.pool.cursors[ids.long()].tolist() == cursor
            for li in range(NL):
                mine = rk.pool.read_state(li, ids)
                note("state vs twin", mine, rk.twin.read_state(li, tids))
                want = torch.stack([st["S"] for st in states[li]])[:, sh.v_head_start:sh.v_head_end]
                note("state vs plain", mine, want)
                if cfg.conv_size:
                    win = rk.pool.read_conv_state(li, ids)
                    note("conv vs twin", win, rk.twin.read_conv_state(li, tids))
                    glob = torch.stack([st["window"] for st in states[li]])
                    note("conv vs plain", win, sh.slice_mixed_qkv(glob.transpose(1, 2)).transpose(1, 2))
    for rk in ranks:
        rk.pool.check()
        rk.twin.check()
    return {"errs": errs, "padding_zero": padding_zero, "cursors_ok": cursors_ok, "folds": folds}


def build_rank(cfg: Any, weights: list[dict[str, torch.Tensor]], n: int, *, rank: int = 0, tp: int = 1,
               group: Any = None, ring_length: int = 5, ring_layout: str = "predecayed",
               dtype: torch.dtype = torch.float32, device: Any = "cpu") -> Rank:
    """A pool and a twin (``n`` sequences at slots 1.. of the pool, other ids on the twin, ``n + 1`` scratch slots),
    and each layer on both. ``group``: the layers all-reduce over it (None: partial sums)."""
    from tp_replayssm import ReplaySSMStatePool
    from tp_replayssm.layers import TPKimiDeltaAttention

    pools = []
    for slots_count in (n + 2, 2 * n + 3):
        pools.append(ReplaySSMStatePool(cfg.heads, num_layers=len(weights), num_slots=slots_count,
                                        ring_length=ring_length, cache_dtype=torch.float32,
                                        conv_kernel_size=cfg.conv_size, ring_layout=ring_layout, group=group,
                                        tp_rank=None if group is not None else rank,
                                        tp_size=None if group is not None else tp, device=device))
    pool, twin = pools
    layers = [[TPKimiDeltaAttention.from_state_dict(w, cfg, pool=p, layer_idx=i, group=group, dtype=dtype,
                                                    prefill_backend="torch")
               for i, w in enumerate(weights)] for p in pools]
    burn = pool.alloc(1)  # the sequences get slots 1.., not 0..
    slots = pool.alloc(n).tolist()
    pool.free(burn)
    scratch = twin.alloc(n + 1).tolist()  # scratch first: the twin's sequences get other ids than the pool's
    return Rank(pool, layers[0], twin, layers[1], slots, twin.alloc(n).tolist(), scratch)


def gloo_worker(rank: int, world: int, cfg: Any, weights: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """On a gloo rank: the scenario through layers that all-reduce over the world group."""
    import torch.distributed as dist

    prompts, x0, steps = scenario(cfg.hidden_size, 5)
    rk = build_rank(cfg, weights, len(prompts), group=dist.group.WORLD)
    out = run(cfg, weights, [rk], prompts, x0, steps)
    out["v_heads"] = list(rk.pool.shard.v_heads)
    return out
