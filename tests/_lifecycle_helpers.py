"""What the request-lifecycle test modules share (docs/lifecycle.md): the pool's shapes, a :class:`Driver` that
decodes model steps, busy pools whose free slots are NaN-poisoned, and bitwise snapshots and comparisons of pool
tensors and slots. Everything runs on ``cuda:0`` when there is one (the Helion kernels then decode), else on the CPU
(the PyTorch path).
"""

from __future__ import annotations

import torch

from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.testing import random_decode_inputs, random_head_params

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
H, HV, K, V = 2, 4, 16, 16
NL, S, L, W = 2, 8, 4, 4
HEADS = KDAHeads(H, HV, K, V)
TENSORS = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "conv_state")
LAYOUTS = ["predecayed", "sglang"]


class Driver:
    """Per-layer head params and conv weights; :meth:`step` decodes one model step of ``slots`` (every layer, the
    conv first when the pool has conv state, the fused advance on the last layer) with inputs drawn from ``seed``
    (the same inputs for any pool given the same seed and row count)."""

    def __init__(self, seed: int = 3) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [random_head_params(HV, K, device=DEV, generator=gen) for _ in range(NL)]
        self.conv_w = [(torch.randn(HEADS.qkv_width, W, generator=gen) * 0.5).to(DEV) for _ in range(NL)]

    def step(self, pool: ReplaySSMStatePool, slots: list[int], seed: int, *, repeat: bool = False
             ) -> list[torch.Tensor]:
        """``repeat``: every row gets the tokens a one-row step of this seed gets."""
        t = torch.tensor(slots, dtype=torch.int32, device=DEV)
        outs = []
        for layer in range(NL):
            gen = torch.Generator().manual_seed(seed * 101 + layer)
            x = random_decode_inputs(1 if repeat else len(slots), H, HV, K, V, dtype=torch.float32, device=DEV,
                                     generator=gen)
            if repeat:
                x = type(x)(*(u.expand(len(slots), -1).contiguous() for u in (x.mixed_qkv, x.a, x.b)))
            p = self.params[layer]
            conv_w = self.conv_w[layer] if pool.conv_state is not None else None
            outs.append(pool.decode(layer, x.mixed_qkv, x.a, x.b, p.A_log, p.dt_bias, t, conv_weight=conv_w,
                                    advance=layer == NL - 1))
        return outs


def make_pool(layout: str = "predecayed", *, conv: bool = True, state: torch.dtype = torch.float32,
              cache: torch.dtype = torch.bfloat16, **kw: object) -> ReplaySSMStatePool:
    return ReplaySSMStatePool(HEADS, num_layers=NL, num_slots=S, ring_length=L, state_dtype=state, cache_dtype=cache,
                              ring_layout=layout, conv_kernel_size=W if conv else 0, device=DEV, **kw)


def busy_pool(layout: str, drv: Driver, *, steps: int = 3, **kw: object) -> ReplaySSMStatePool:
    """Slots 0-4 allocated and decoded with different tokens for ``steps`` steps (cursor ``steps % L``), slot 5
    allocated and freed, 6-7 never allocated; every tensor of the free slots 5-7 NaN-poisoned (conv windows and
    rings included), so a copy from or to a free slot shows."""
    pool = make_pool(layout, **kw)
    pool.alloc(6)
    pool.free([5])
    for step in range(steps):
        drv.step(pool, [0, 1, 2, 3, 4], seed=step)
    free = torch.tensor([5, 6, 7], device=DEV)
    for name in TENSORS:
        t = getattr(pool, name)
        if t is not None and t.dtype.is_floating_point:
            t.index_fill_(0 if name == "cursors" else 1, free, float("nan"))
    pool.check()
    return pool


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (so NaN equals NaN in ``torch.equal``)."""
    if not t.dtype.is_floating_point:
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def snapshot(pool: ReplaySSMStatePool) -> dict[str, torch.Tensor]:
    return {n: getattr(pool, n).clone() for n in TENSORS if getattr(pool, n) is not None}


def assert_same(pool: ReplaySSMStatePool, snap: dict[str, torch.Tensor], what: str) -> None:
    for name, t in snap.items():
        assert torch.equal(bits(getattr(pool, name)), bits(t)), f"{what}: {name} changed"


def slot_bits(pool: ReplaySSMStatePool, slot: int) -> dict[str, torch.Tensor]:
    """Every byte of one slot: each layer's checkpoint, rings, conv window, and its cursor."""
    out = {n: bits(getattr(pool, n)[:, slot]) for n in TENSORS if n != "cursors" and getattr(pool, n) is not None}
    out["cursors"] = pool.cursors[slot]
    return out


def assert_slots_equal(pa: ReplaySSMStatePool, a: int, pb: ReplaySSMStatePool, b: int, what: str) -> None:
    sa, sb = slot_bits(pa, a), slot_bits(pb, b)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"{what}: {name} of slot {a} != slot {b}"


def ids(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int32, device=DEV)
