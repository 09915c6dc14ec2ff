"""Helpers of the speculative-decoding tests (tests/test_spec.py, tests/test_spec_slots.py): pools, draft inputs,
sequential decode twins, the float64 tree oracle and the distributed worker.

The checks all compare a pool that ran ``verify`` + ``commit`` against:
- a *twin* (a deep copy of the pool before the verify) that decodes the same tokens one at a time with
  ``decode`` + ``advance`` (the contract's "sequential decode from the same state");
- :class:`tp_replayssm.testing.PlainKDA`, the float64 plain recurrence with no ring, stepped along each node's path.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.testing import DecodeInputs, HeadParams, PlainKDA, random_decode_inputs, random_head_params

K = V = 16


@dataclasses.dataclass
class Model:
    """Per-layer constants: gate parameters, optional conv weights (``[D, W]``) and the gate's lower bound."""

    params: list[HeadParams]
    conv: list[torch.Tensor] | None = None
    lower_bound: float | None = None

    def conv_kw(self, layer: int) -> dict[str, torch.Tensor]:
        return {} if self.conv is None else {"conv_weight": self.conv[layer]}


@dataclasses.dataclass
class Drafts:
    """Draft activations of every layer: ``mixed [NL, B, T, D]``, ``a [NL, B, T, HV*K]``, ``b [NL, B, T, HV]``."""

    mixed: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor

    def token(self, layer: int, nodes: list[int]) -> DecodeInputs:
        """Row ``b``'s draft ``nodes[b]`` of ``layer`` as one decode token per row."""
        rows = torch.arange(len(nodes))
        idx = torch.tensor(nodes)
        return DecodeInputs(self.mixed[layer, rows, idx], self.a[layer, rows, idx], self.b[layer, rows, idx])


def make_model(pool: ReplaySSMStatePool, gen: torch.Generator, *, conv: bool = False, a_log_shift: float = 0.0,
               lower_bound: float | None = None) -> Model:
    lh = pool.local_heads
    params = []
    for _ in range(pool.num_layers):
        p = random_head_params(lh.num_v_heads, lh.key_dim, generator=gen)
        params.append(HeadParams((p.A_log + a_log_shift).to(pool.device), p.dt_bias.to(pool.device)))
    weights = None
    if conv:
        weights = [(0.5 * torch.randn(pool.conv_channels, pool.conv_kernel_size, generator=gen)).to(pool.device)
                   for _ in range(pool.num_layers)]
    return Model(params, weights, lower_bound)


def random_drafts(pool: ReplaySSMStatePool, batch: int, drafts: int, gen: torch.Generator,
                  dtype: torch.dtype = torch.float32, a_shift: float = 0.0) -> Drafts:
    lh = pool.local_heads
    NL = pool.num_layers
    mixed = torch.randn(NL, batch, drafts, lh.qkv_width, generator=gen)
    a = torch.randn(NL, batch, drafts, lh.num_v_heads * lh.key_dim, generator=gen) + a_shift
    b = torch.randn(NL, batch, drafts, lh.num_v_heads, generator=gen)
    return Drafts(*(t.to(device=pool.device, dtype=dtype) for t in (mixed, a, b)))


def decode_step(pool: ReplaySSMStatePool, model: Model, inputs: list[DecodeInputs], slots: torch.Tensor,
                advance: bool = True) -> torch.Tensor:
    """One decode token per row in every layer (``inputs[layer]``), then the cursor advance; ``[NL, B, HV, V]``."""
    outs = []
    for layer, x in enumerate(inputs):
        p = model.params[layer]
        outs.append(pool.decode(layer, x.mixed_qkv, x.a, x.b, p.A_log, p.dt_bias, slots,
                                lower_bound=model.lower_bound, **model.conv_kw(layer))[:, 0])
    if advance:
        pool.advance(slots)
    return torch.stack(outs)


def verify_all(pool: ReplaySSMStatePool, model: Model, drafts: Drafts, slots: torch.Tensor,
               parents: torch.Tensor | None = None) -> torch.Tensor:
    """Every layer's verify; ``[NL, B, T, HV, V]``."""
    outs = []
    for layer in range(pool.num_layers):
        p = model.params[layer]
        outs.append(pool.verify(layer, drafts.mixed[layer], drafts.a[layer], drafts.b[layer], p.A_log, p.dt_bias,
                                slots, parents=parents, lower_bound=model.lower_bound, **model.conv_kw(layer)))
    return torch.stack(outs)


def node_paths(parents: list[list[int]]) -> list[list[list[int]]]:
    """Per row and node, the node's path from the root (itself last)."""
    out = []
    for row in parents:
        paths = []
        for t in range(len(row)):
            path, u = [], t
            while u >= 0:
                path.append(u)
                u = row[u]
            paths.append(path[::-1])
        out.append(paths)
    return out


def decode_paths(twin: ReplaySSMStatePool, model: Model, drafts: Drafts, slots: list[int],
                 paths: list[list[int]]) -> torch.Tensor | None:
    """Decode each row's path of draft nodes on ``twin`` (rows whose path ended, and padding rows, sit out);
    returns the outputs of the last step each row took, ``[NL, B, HV, V]`` (None when no row took any)."""
    B = len(slots)
    last = None
    for i in range(max((len(p) for p in paths), default=0)):
        step_slots = [s if s >= 0 and len(paths[r]) > i else -1 for r, s in enumerate(slots)]
        nodes = [paths[r][i] if len(paths[r]) > i else 0 for r in range(B)]
        out = decode_step(twin, model, [drafts.token(layer, nodes) for layer in range(twin.num_layers)],
                          torch.tensor(step_slots, dtype=torch.int32, device=twin.device))
        for r in range(B):
            if step_slots[r] >= 0:
                if last is None:
                    last = torch.zeros_like(out)
                last[:, r] = out[:, r]
    return last


def sequential_outputs(pool: ReplaySSMStatePool, model: Model, drafts: Drafts, slots: list[int],
                       parents: list[list[int]]) -> torch.Tensor:
    """What decode gives for every draft node after its ancestors, from copies of ``pool``; ``[NL, B, T, HV, V]``."""
    T = len(parents[0])
    outs = []
    paths = node_paths(parents)
    for t in range(T):
        twin = copy.deepcopy(pool)
        outs.append(decode_paths(twin, model, drafts, slots, [paths[r][t] for r in range(len(slots))]))
    return torch.stack(outs, dim=2)


class Oracle:
    """Float64 plain recurrences of every layer (:class:`PlainKDA`), stepped along draft paths."""

    def __init__(self, pool: ReplaySSMStatePool) -> None:
        lh = pool.local_heads
        self.layers = [PlainKDA(pool.num_slots, lh.num_q_heads, lh.num_v_heads, lh.key_dim, lh.value_dim)
                       for _ in range(pool.num_layers)]

    def step(self, model: Model, inputs: list[DecodeInputs], slots: list[int]) -> torch.Tensor:
        return torch.stack([o.step(x, model.params[layer], slots, lower_bound=model.lower_bound)
                            for layer, (o, x) in enumerate(zip(self.layers, inputs))])

    def follow(self, model: Model, drafts: Drafts, slots: list[int], paths: list[list[int]]) -> torch.Tensor:
        """Step each row along its path in place; the last output of each row ``[NL, B, HV, V]`` (0 if none)."""
        B = len(slots)
        last = torch.zeros(len(self.layers), B, self.layers[0].HV, self.layers[0].V, dtype=torch.float64)
        for i in range(max((len(p) for p in paths), default=0)):
            step_slots = [s if s >= 0 and len(paths[r]) > i else -1 for r, s in enumerate(slots)]
            nodes = [paths[r][i] if len(paths[r]) > i else 0 for r in range(B)]
            out = self.step(model, [drafts.token(layer, nodes) for layer in range(len(self.layers))], step_slots)
            for r in range(B):
                if step_slots[r] >= 0:
                    last[:, r] = out[:, r]
        return last

    def tree_outputs(self, model: Model, drafts: Drafts, slots: list[int], parents: list[list[int]]) -> torch.Tensor:
        """Every node's output after its ancestors, the states left as they were; ``[NL, B, T, HV, V]`` float64."""
        saved = [o.state.clone() for o in self.layers]
        paths = node_paths(parents)
        outs = []
        for t in range(len(parents[0])):
            outs.append(self.follow(model, drafts, slots, [paths[r][t] for r in range(len(slots))]))
            for o, st in zip(self.layers, saved):
                o.state.copy_(st)
        return torch.stack(outs, dim=2)

    def states(self, slots: list[int]) -> torch.Tensor:
        return torch.stack([o.state[torch.tensor(slots)] for o in self.layers])


def read_states(pool: ReplaySSMStatePool, slots: list[int]) -> torch.Tensor:
    ids = torch.tensor(slots, dtype=torch.int32, device=pool.device)
    return torch.stack([pool.read_state(layer, ids) for layer in range(pool.num_layers)]).cpu()


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def build(heads: KDAHeads, *, layout: str = "predecayed", state: torch.dtype = torch.float32,
          cache: torch.dtype = torch.float32, L: int = 5, S: int = 6, NL: int = 2, **kw: object) -> ReplaySSMStatePool:
    return ReplaySSMStatePool(heads, num_layers=NL, num_slots=S, ring_length=L, ring_layout=layout, state_dtype=state,
                              cache_dtype=cache, device="cpu", **kw)


def staggered(pool: ReplaySSMStatePool, model: object, oracle: Oracle | None, slots: list[int],
              gen: torch.Generator, a_shift: float = 0.0) -> None:
    """Decode 0, 1, 2, ... tokens per row (row r sits out after r steps) so the rows' cursors differ."""
    lh = pool.local_heads
    for i in range(len(slots)):
        step = [s if r > i else -1 for r, s in enumerate(slots)]
        inputs = [random_decode_inputs(len(slots), lh.num_q_heads, lh.num_v_heads, K, V, dtype=torch.float32,
                                       generator=gen) for _ in range(pool.num_layers)]
        inputs = [type(x)(x.mixed_qkv, x.a + a_shift, x.b) for x in inputs]
        decode_step(pool, model, inputs, torch.tensor(step, dtype=torch.int32))
        if oracle is not None:
            oracle.step(model, inputs, step)


# ---- the distributed worker (gloo, spawned by tests/_dist_helpers.run_ranks) -------------------------------------


def tp_spec_equivalence(rank: int, world: int, steps: int) -> dict[str, float]:
    """Verify + commit on a tp pool (this rank's heads of H=2, HV=4) against a single-rank pool on the global heads,
    the same draws on every rank: gathered outputs and gathered read_state after every commit. Chain steps and one
    tree step; T cycles over 1..L-1 so that some rows fold."""
    import torch.distributed as dist

    from tp_replayssm.tp.heads import concat_outputs

    heads = KDAHeads(2, 4, K, V)
    L, S, NL, B = 4, 4, 2, 3
    kw = dict(num_layers=NL, num_slots=S, ring_length=L, cache_dtype=torch.float32)
    pool = ReplaySSMStatePool(heads, group=dist.group.WORLD, **kw)
    full = ReplaySSMStatePool(heads, **kw)
    shard = pool.shard
    gen = torch.Generator().manual_seed(77)
    model_full = make_model(full, gen)
    model = Model([HeadParams(shard.slice_A_log(p.A_log), shard.slice_dt_bias(p.dt_bias)) for p in model_full.params])
    ids_p, ids_f = pool.alloc(2), full.alloc(2)
    slots = torch.tensor([int(ids_p[0]), -1, int(ids_p[1])], dtype=torch.int32)
    assert torch.equal(ids_p, ids_f)
    err_out = err_state = 0.0
    for step in range(steps):
        T = 1 + step % (L - 1)
        d = random_drafts(full, B, T, gen)
        parents = torch.tensor([[-1] + [0] * (T - 1)] * B, dtype=torch.int32) if step == steps - 1 else None
        local = Drafts(torch.stack([shard.slice_mixed_qkv(d.mixed[layer].reshape(B * T, -1)).reshape(B, T, -1)
                                    for layer in range(NL)]),
                       torch.stack([shard.slice_a(d.a[layer].reshape(B * T, -1)).reshape(B, T, -1)
                                    for layer in range(NL)]),
                       torch.stack([shard.slice_b(d.b[layer].reshape(B * T, -1)).reshape(B, T, -1)
                                    for layer in range(NL)]))
        mine = verify_all(pool, model, local, slots, parents)
        want = verify_all(full, model_full, d, slots, parents)
        for layer in range(NL):
            parts = [torch.empty_like(mine[layer]) for _ in range(world)]
            dist.all_gather(parts, mine[layer].contiguous())
            got = concat_outputs([p.reshape(B * T, 1, *p.shape[2:]) for p in parts]).reshape(want[layer].shape)
            err_out = max(err_out, rel(got, want[layer]))
        n = torch.randint(0, T + 1, (B,), generator=gen, dtype=torch.int32)
        pool.commit(slots, n)
        full.commit(slots, n)
        for layer in range(NL):
            st = pool.read_state(layer, ids_p)
            parts = [torch.empty_like(st) for _ in range(world)]
            dist.all_gather(parts, st.contiguous())
            err_state = max(err_state, rel(torch.cat(parts, 1), full.read_state(layer, ids_f)))
    same_cursors = bool(torch.equal(pool.cursors, full.cursors))
    return {"err_out": err_out, "err_state": err_state, "same_cursors": float(same_cursors)}
