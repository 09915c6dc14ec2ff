"""The layer tests' oracle, scenarios and rank workers (importable by spawned ranks as ``_layer_helpers``).

- :class:`PlainKDALayer`: an independent float64 reimplementation of flash-linear-attention's ``KimiDeltaAttention``
  from its formulas (no library code): per sequence a conv window of the last ``W-1`` raw q/k/v projections and a
  state ``S [HV, V, K]``; token by token.
- :func:`random_weights`: a layer's global weights under FLA's names (no FLA needed).
- :class:`Call` and :func:`scenario`: a sequence of prefills (packed, chunked: a sequence's prompt in two pieces, the
  second after a decode) and decodes (with a padding row and a forced flush) over ``n`` sequences; the expected
  outputs come from the plain layer (:func:`plain_outputs`) or from FLA with its own cache (:func:`fla_outputs`).
- :func:`run_ours`: the scenario through ``TPKimiDeltaAttention`` on one pool per rank; :func:`tp_worker`: the same on
  a gloo rank (outputs all-reduced over the group), compared with the expected outputs there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

# ---- the plain float64 layer ----------------------------------------------------------------------------------


class PlainKDALayer:
    """KDA layer in float64 from global weights ``sd`` (FLA's names) and a ``KDALayerConfig``-like ``cfg``."""

    def __init__(self, sd: dict[str, torch.Tensor], cfg: Any) -> None:
        self.w = {k: v.detach().double().cpu() for k, v in sd.items()}
        self.c = cfg

    def new_state(self) -> dict[str, torch.Tensor]:
        c = self.c
        D = 2 * c.num_heads * c.head_k_dim + c.num_v_heads * c.head_v_dim
        return {"window": torch.zeros(D, max(c.conv_size - 1, 0), dtype=torch.float64),
                "S": torch.zeros(c.num_v_heads, c.head_v_dim, c.head_k_dim, dtype=torch.float64)}

    def step(self, x: torch.Tensor, st: dict[str, torch.Tensor]) -> torch.Tensor:
        """One token ``x [hidden]``; updates ``st`` in place; returns ``[hidden]``."""
        w, c = self.w, self.c
        H, HV, K, V, W = c.num_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, c.conv_size
        x = x.double()
        u = torch.cat([w["q_proj.weight"] @ x, w["k_proj.weight"] @ x, w["v_proj.weight"] @ x])  # raw [D]
        if W:
            conv_w = torch.cat([w[f"{n}_conv1d.weight"][:, 0, :] for n in "qkv"])  # [D, W], last tap = newest
            full = torch.cat([st["window"], u[:, None]], dim=1)  # [D, W] oldest first
            y = (full * conv_w).sum(-1)
            if c.conv_bias:
                y = y + torch.cat([w[f"{n}_conv1d.bias"] for n in "qkv"])
            st["window"] = full[:, 1:]
            y = F.silu(y)
        else:
            y = F.silu(u)
        q = y[: H * K].view(H, K)
        k = y[H * K: 2 * H * K].view(H, K)
        v = y[2 * H * K:].view(HV, V)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = (w["f_proj.1.weight"] @ (w["f_proj.0.weight"] @ x) + w["dt_bias"]).view(HV, K)
        A = torch.exp(w["A_log"])[:, None]
        if c.lower_bound is None:
            g = -A * torch.where(f > 20, f, torch.log1p(torch.exp(f)))
        else:
            g = c.lower_bound * torch.sigmoid(A * f)
        beta = torch.sigmoid(w["b_proj.weight"] @ x)
        S = st["S"]
        o = torch.empty(HV, V, dtype=torch.float64)
        for hv in range(HV):
            h = hv // (HV // H)
            S[hv] = S[hv] * torch.exp(g[hv])[None, :]
            S[hv] = S[hv] + beta[hv] * torch.outer(v[hv] - S[hv] @ k[h], k[h])
            o[hv] = S[hv] @ q[h]
        gate = w["g_proj.1.weight"] @ (w["g_proj.0.weight"] @ x)
        if c.gate_bias:
            gate = gate + w["g_proj.1.bias"]
        o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + c.norm_eps) * w["o_norm.weight"]
        o = o * torch.sigmoid(gate.view(HV, V))
        return w["o_proj.weight"] @ o.reshape(-1)


def random_weights(cfg: Any, seed: int) -> dict[str, torch.Tensor]:
    """Global fp32 weights under FLA's names with the shapes ``cfg`` implies; gates with per-step decays between
    about 0.3 and 0.999 (as real checkpoints), a non-trivial norm weight and biases."""
    g = torch.Generator().manual_seed(seed)
    H, HV, K, V, R, W, hid = (cfg.num_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.gate_rank,
                              cfg.conv_size, cfg.hidden_size)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    sd = {"q_proj.weight": rnd(H * K, hid, scale=hid ** -0.5), "k_proj.weight": rnd(H * K, hid, scale=hid ** -0.5),
          "v_proj.weight": rnd(HV * V, hid, scale=hid ** -0.5)}
    if W:
        for n, C in (("q", H * K), ("k", H * K), ("v", HV * V)):
            sd[f"{n}_conv1d.weight"] = rnd(C, 1, W, scale=0.5)
            if cfg.conv_bias:
                sd[f"{n}_conv1d.bias"] = rnd(C, scale=0.3)
    sd.update({"f_proj.0.weight": rnd(R, hid, scale=hid ** -0.5), "f_proj.1.weight": rnd(HV * K, R, scale=R ** -0.5),
               "b_proj.weight": rnd(HV, hid, scale=hid ** -0.5), "g_proj.0.weight": rnd(R, hid, scale=hid ** -0.5),
               "g_proj.1.weight": rnd(HV * V, R, scale=R ** -0.5),
               "A_log": torch.empty(HV).uniform_(-1.0, 0.5, generator=g),
               "dt_bias": torch.empty(HV * K).uniform_(-4.0, 0.0, generator=g),
               "o_norm.weight": 1.0 + rnd(V, scale=0.2), "o_proj.weight": rnd(hid, HV * V, scale=(HV * V) ** -0.5)})
    if cfg.gate_bias:
        sd["g_proj.1.bias"] = rnd(HV * V, scale=0.3)
    return sd


# ---- scenarios --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Call:
    """One call of the layer: ``kind`` "prefill" (``seqs`` the packed sequences, ``lens`` their token counts, ``x
    [sum(lens), hidden]``) or "decode" (``seqs`` one sequence per row, None = padding row; ``x [B, hidden]``;
    ``force_flush`` per row or None)."""

    kind: str
    seqs: list[int | None]
    x: torch.Tensor
    lens: list[int] | None = None
    force_flush: list[int] | None = None


def scenario(hidden: int, seed: int, *, first: list[int], second: list[int], order2: list[list[int]],
             decodes_between: int = 1, decodes_after: int = 2) -> list[Call]:
    """``n = len(first)`` sequences: a packed prefill of ``first[i]`` tokens each; ``decodes_between`` decode steps
    (with a padding row); the second pieces ``second[i]`` in the packed calls ``order2`` (lists of sequences, e.g.
    ``[[2, 0], [1]]``); ``decodes_after`` decode steps (rows in reverse order, the last step force-flushing row 0).
    Every sequence is in every call, so FLA's batched cache can follow it."""
    g = torch.Generator().manual_seed(seed)
    n = len(first)
    calls = [Call("prefill", list(range(n)), torch.randn(sum(first), hidden, generator=g), lens=list(first))]
    for _ in range(decodes_between):
        rows: list[int | None] = [*range(n)]
        rows.insert(1, None)
        calls.append(Call("decode", rows, torch.randn(len(rows), hidden, generator=g)))
    for piece in order2:
        lens = [second[s] for s in piece]
        calls.append(Call("prefill", list(piece), torch.randn(sum(lens), hidden, generator=g), lens=lens))
    for j in range(decodes_after):
        rows = list(reversed(range(n)))
        flush = [1 if (j == decodes_after - 1 and r == 0) else 0 for r in range(n)]
        calls.append(Call("decode", rows, torch.randn(n, hidden, generator=g), force_flush=flush))
    return calls


def _pieces(call: Call) -> list[tuple[int, torch.Tensor]]:
    """A prefill call's ``(sequence, tokens)`` pieces."""
    out, at = [], 0
    for s, n in zip(call.seqs, call.lens):
        out.append((s, call.x[at:at + n]))
        at += n
    return out


def plain_outputs(layer: PlainKDALayer, calls: list[Call], n: int) -> tuple[list[torch.Tensor], list[dict]]:
    """Expected outputs (float64, padding rows zero) of every call and the final per-sequence states."""
    states = [layer.new_state() for _ in range(n)]
    outs = []
    for call in calls:
        if call.kind == "prefill":
            outs.append(torch.cat([torch.stack([layer.step(t, states[s]) for t in toks]) for s, toks in _pieces(call)]))
        else:
            outs.append(torch.stack([layer.step(x, states[s]) if s is not None else torch.zeros_like(x).double()
                                     for s, x in zip(call.seqs, call.x)]))
    return outs, states


def fla_outputs(fla_layer: Any, calls: list[Call], n: int) -> list[torch.Tensor]:
    """Expected outputs from FLA's layer with its own cache: consecutive prefill calls merge into one packed call of
    every sequence in order (each sequence once), a decode call is one batched step of every sequence (padding rows
    dropped; their expected output is zero). Inputs go to the layer's device and dtype; outputs are float64 on CPU."""
    import _fla_cpu

    p = next(fla_layer.parameters())
    cache = _fla_cpu.new_cache()
    outs: list[torch.Tensor | None] = [None] * len(calls)
    i = 0
    while i < len(calls):
        if calls[i].kind == "prefill":
            j = i
            pieces: dict[int, tuple[int, int, torch.Tensor]] = {}
            while j < len(calls) and calls[j].kind == "prefill":
                at = 0
                for s, toks in _pieces(calls[j]):
                    assert s not in pieces, "a merged FLA prefill takes each sequence once"
                    pieces[s] = (j, at, toks)
                    at += toks.shape[0]
                j += 1
            assert sorted(pieces) == list(range(n)), "a merged FLA prefill covers every sequence"
            x = torch.cat([pieces[s][2] for s in range(n)])
            cu = [0]
            for s in range(n):
                cu.append(cu[-1] + pieces[s][2].shape[0])
            y = _fla_cpu.run(fla_layer, x[None].to(p.device, p.dtype), cache, cu)[0].double().cpu()
            for k in range(i, j):
                outs[k] = torch.zeros(calls[k].x.shape[0], y.shape[-1], dtype=torch.float64)
            for s in range(n):
                k, at, toks = pieces[s]
                outs[k][at:at + toks.shape[0]] = y[cu[s]:cu[s + 1]]
            i = j
        else:
            call = calls[i]
            rows = {s: r for r, s in enumerate(call.seqs) if s is not None}
            assert sorted(rows) == list(range(n)), "an FLA decode step takes every sequence"
            x = torch.stack([call.x[rows[s]] for s in range(n)])[:, None].to(p.device, p.dtype)
            y = _fla_cpu.run(fla_layer, x, cache)[:, 0].double().cpu()
            out = torch.zeros(call.x.shape[0], y.shape[-1], dtype=torch.float64)
            for s, r in rows.items():
                out[r] = y[s]
            outs[i] = out
            i += 1
    return outs  # type: ignore[return-value]


# ---- our layer through a scenario -------------------------------------------------------------------------------


def run_ours(ranks: list[tuple[Any, list[Any]]], calls: list[Call], slot_of: list[int], *, fused: bool,
             dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """The calls through every layer of each rank's ``(pool, layers)`` (each layer gets the call's inputs);
    ``slot_of[s]`` the slot of sequence ``s``. ``fused``: the last layer moves the cursors (``advance=True``);
    else ``pool.advance`` / ``end_prefill`` after the layers. Returns per layer the outputs of every call, summed
    over ``ranks`` (one pool per rank in this process, group None) in float64."""
    from tp_replayssm.layers import end_prefill

    nl = len(ranks[0][1])
    outs: list[list[torch.Tensor]] = [[] for _ in range(nl)]
    for call in calls:
        dev = ranks[0][0].device
        slots = torch.tensor([-1 if s is None else slot_of[s] for s in call.seqs], dtype=torch.int32, device=dev)
        ff = None if call.force_flush is None else torch.tensor(call.force_flush, dtype=torch.int32, device=dev)
        x = call.x.to(dev, dtype)
        per_layer = [torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64) for _ in range(nl)]
        for pool, layers in ranks:
            for li, layer in enumerate(layers):
                last = fused and li == nl - 1
                if call.kind == "prefill":
                    cu = torch.tensor([0, *torch.tensor(call.lens).cumsum(0).tolist()], dtype=torch.int32)
                    y = layer(x, slots, cu, advance=last)
                else:
                    y = layer(x, slots, advance=last, force_flush=ff)
                per_layer[li] += y.double().cpu()
            if not fused:
                if call.kind == "prefill":
                    end_prefill(pool, slots)
                else:
                    pool.advance(slots, ff)
        for li in range(nl):
            outs[li].append(per_layer[li])
    return outs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs error over max abs value (float64)."""
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.isfinite(a).all():
        return math.inf
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def tp_worker(rank: int, world: int, config: Any, weights: dict[str, torch.Tensor], calls: list[Call], n: int,
              expected: list[torch.Tensor], fused: bool) -> dict[str, Any]:
    """On a gloo rank: a pool and the layer (``from_state_dict``, FLA's names, all-reduce over the world group), the
    calls, each output compared with ``expected``. Returns the errors, whether padding rows were exactly zero, the
    cursors after the run and the rank's heads."""
    import torch.distributed as dist

    from tp_replayssm import ReplaySSMStatePool
    from tp_replayssm.layers import TPKimiDeltaAttention

    group = dist.group.WORLD
    pool = ReplaySSMStatePool(config.heads, num_layers=1, num_slots=n + 2, ring_length=2,
                              cache_dtype=torch.float32, conv_kernel_size=config.conv_size or 0, group=group)
    layer = TPKimiDeltaAttention.from_state_dict(weights, config, pool=pool, layer_idx=0, group=group)
    burn = pool.alloc(1)  # the sequences get slots 1.., not 0..
    slot_of = pool.alloc(n).tolist()
    pool.free(burn)
    outs = run_ours([(pool, [layer])], calls, slot_of, fused=fused)[0]
    errs = [rel(o, e) for o, e in zip(outs, expected)]
    pad = all(bool((o[r] == 0).all()) for o, c in zip(outs, calls) for r, s in enumerate(c.seqs) if s is None)
    pool.check()
    return {"errs": errs, "padding_zero": pad, "cursors": pool.cursors[torch.tensor(slot_of)].tolist(),
            "v_heads": list(pool.shard.v_heads), "q_heads": list(pool.shard.q_heads)}
