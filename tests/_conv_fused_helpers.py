"""Helpers of the fused-conv tests (tests/test_conv_fused.py, tests/test_conv_fused_plan.py): the decode problem of
a shape, CPU pools with sentinel windows, conv taps, the interpreter's plan, and the fused launch stepped beside the two
launches and the PyTorch path (optionally against a float64 conv1d feeding the PyTorch decode).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.kernels.backend import use_cpu_backend
from tp_replayssm.kernels.grid import H200_SMS
from tp_replayssm.kernels.plan import DecodeProblem, plan_decode
from tp_replayssm.testing import random_decode_inputs, random_head_params

K = V = 16
L, S = 4, 6
SENTINEL = 1234.5
STATE_TENSORS = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "conv_state")


def problem(batch: int, H: int, HV: int, *, state: torch.dtype = torch.bfloat16, device: str = "cuda",
            conv: int = 4, layout: str = "predecayed", advance: bool = False, key_dim: int = 128,
            value_dim: int = 128, lower_bound: float | None = None) -> DecodeProblem:
    bounded = lower_bound is not None and 15 * abs(lower_bound) <= 75  # (L = 16)
    return DecodeProblem(batch, H, HV, key_dim, value_dim, 16, state, torch.bfloat16, device, H200_SMS, layout, True,
                         advance, True, lower_bound is not None, bounded, conv)


def make_pool(H: int, HV: int, state: torch.dtype, layout: str = "predecayed", seed: int = 3) -> ReplaySSMStatePool:
    """Slots 0-3 allocated, 1 freed again (1, 4, 5 free), random states and windows in slots 0, 2, 3 of both layers;
    every other window (the scratch one included) holds SENTINEL."""
    pool = ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=2, num_slots=S, ring_length=L, device="cpu",
                              state_dtype=state, ring_layout=layout, conv_kernel_size=4, conv_dtype=torch.bfloat16)
    pool.conv_state.fill_(SENTINEL)
    pool.alloc(4)
    pool.free([1])
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([0, 2, 3], dtype=torch.int32)
    for layer in range(2):
        pool.load_state(layer, ids, torch.randn(3, HV, V, K, generator=gen) * 0.1,
                        conv_states=torch.randn(3, pool.conv_channels, 3, generator=gen))
    return pool


def conv_taps(D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(D, 4, generator=gen) * 0.5).bfloat16(), (torch.randn(D, generator=gen) * 0.2).bfloat16()


def plan_of(pool: ReplaySSMStatePool, batch: int, advance: bool):  # noqa: ANN201
    """The library's plan of a pool's decode with the conv on CPU tensors (the interpreter's plan)."""
    lh = pool.local_heads
    return plan_decode(DecodeProblem(batch, lh.num_q_heads, lh.num_v_heads, K, V, L, pool.checkpoint.dtype,
                                     pool.cache_dtype, "cpu", H200_SMS, pool.ring_layout, True, advance, True, False,
                                     False, 4), fuse_conv=True)


def fused_and_two_launch_steps(H: int, HV: int, state: torch.dtype, slots: list[int], *, steps: int = L + 1,
                               layout: str = "predecayed", plan_edit: dict | None = None,
                               fused_edit: dict | None = None, A_log_shift: float = 0.0, oracle: bool = False,
                               exact: bool = True) -> list[ReplaySSMStatePool]:
    """``steps`` model steps of 2 layers (the fused advance on the last) on three twin pools: the fused launch and the
    two launches in the interpreter, the PyTorch path; asserts at every layer that the first two agree bit for bit
    (``exact=False``: windows, cursors and the k and g rings bit for bit, the rest within 1e-2) and the third within
    bf16 steps, outputs NaN-poisoned first. ``plan_edit`` edits both launches' plans, ``fused_edit`` the fused
    one's alone. With ``oracle``, the live rows' outputs are also held to the PyTorch decode
    fed by a float64 conv1d of the windows' history. Returns the pools."""
    pools = [make_pool(H, HV, state, layout) for _ in range(3)]
    D = pools[0].conv_channels
    weight, bias = conv_taps(D, seed=5)
    params = random_head_params(HV, K, generator=torch.Generator().manual_seed(2))
    A_log = params.A_log + A_log_shift
    ids = torch.tensor(slots, dtype=torch.int32)
    B = len(slots)
    live = [r for r, s in enumerate(slots) if s in (0, 2, 3) and slots.count(s) == 1]
    history = {layer: pools[2].read_conv_state(layer, torch.tensor([slots[r] for r in live], dtype=torch.int32))
               .double() for layer in range(2)}  # [n, D, 3] per layer: the float64 conv's own window
    oracle_pool = make_pool(H, HV, state, layout)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        for layer in range(2):
            x = random_decode_inputs(B, H, HV, K, V, dtype=torch.bfloat16, generator=gen)
            advance = layer == 1
            plan = plan_of(pools[0], B, advance)
            assert plan.fused_conv, plan
            if plan_edit:
                plan = dataclasses.replace(plan, **plan_edit)
            two = plan.without_conv()
            if fused_edit:
                plan = dataclasses.replace(plan, **fused_edit)
            outs = []
            for pool, backend, p in ((pools[0], "interpreter", plan), (pools[1], "interpreter", two),
                                     (pools[2], "torch", None)):
                out = torch.full((B, 1, HV, V), float("nan"), dtype=torch.bfloat16)
                with use_cpu_backend(backend):
                    pool.decode(layer, x.mixed_qkv, x.a, x.b, A_log, params.dt_bias, ids, conv_weight=weight,
                                conv_bias=bias, advance=advance, out=out, plan=p)
                outs.append(out)
            where = f"step {step} layer {layer}"
            if exact:
                assert torch.equal(outs[0], outs[1]), where
            else:
                torch.testing.assert_close(outs[0].double(), outs[1].double(), rtol=1e-2, atol=1e-2)
                for name in ("checkpoint", "d_cache"):  # (the rebase's delta, rounded, feeds the later deltas)
                    torch.testing.assert_close(getattr(pools[0], name).double(), getattr(pools[1], name).double(),
                                               rtol=1e-2, atol=1e-2)
            for name in STATE_TENSORS if exact else STATE_TENSORS[2:]:
                assert torch.equal(getattr(pools[0], name), getattr(pools[1], name)), (where, name)
            torch.testing.assert_close(outs[0].double(), outs[2].double(), rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(pools[0].checkpoint.double(), pools[2].checkpoint.double(), rtol=3e-2,
                                       atol=3e-2)
            assert torch.equal(pools[0].conv_state, pools[2].conv_state), where
            assert torch.equal(pools[0].cursors, pools[2].cursors), where
            for r in range(B):
                if r not in live:
                    assert (outs[0][r] == 0).all(), (where, r)
            if oracle:  # the float64 conv of the history, rounded as the conv's launch hands it over, then decoded
                rows = torch.tensor(live)
                u = torch.cat([history[layer], x.mixed_qkv[rows].double()[:, :, None]], dim=2)  # [n, D, 4]
                y = F.conv1d(u, weight.double()[:, None, :], bias.double(), groups=D)[:, :, -1]
                y = y * torch.sigmoid(y)
                history[layer] = u[:, :, 1:]
                post = torch.zeros(B, D, dtype=torch.bfloat16)
                post[rows] = y.to(torch.bfloat16)
                with use_cpu_backend("torch"):
                    want = oracle_pool.decode(layer, post, x.a, x.b, A_log, params.dt_bias, ids, advance=advance)
                torch.testing.assert_close(outs[0][rows].double(), want[rows].double(), rtol=3e-2, atol=3e-2)
                assert torch.equal(pools[0].read_conv_state(layer, torch.tensor([slots[r] for r in live],
                                                                                dtype=torch.int32)),
                                   history[layer].to(torch.bfloat16)), where
    for p in pools[:2]:
        assert (p.conv_state[:, [4, 5, S]] == SENTINEL).all()  # never-allocated slots and the scratch window
        assert (p.conv_state[:, 1] == 0).all()  # the freed slot (zeroed by alloc)
        if hasattr(p, "conv_counters"):
            assert (p.conv_counters == 0).all()
    return pools
