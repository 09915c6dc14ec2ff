"""A multi-step decode scenario: one op (kernel or reference) against the reference and the float64
plain recurrence, with NaN-poisoned outputs, NaN-filled unread ring entries, 1e30 sentinels in every
unused slot and random per-row forced flushes. Used by the CPU (interpreter) and GPU op tests; also
:func:`planned_op`, the op with an edited launch plan, and :func:`record_kernel_args`, which records what
reached the kernel."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import pytest
import torch

from tp_replayssm import reference
from tp_replayssm.kernels import launch
from tp_replayssm.kernels.decode import replayssm_decode_kernel
from tp_replayssm.kernels.direct import LaunchArgs
from tp_replayssm.kernels.plan import DecodePlan
from tp_replayssm.testing import PlainKDA, random_decode_inputs, random_head_params, rel_err
from tp_replayssm.validation import DecodeCall, validate_decode

SENTINEL = 1e30
OUT_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# out and final state against the float64 plain recurrence at the Kimi GPU shapes (kimi_scenario)
PLAIN64_TOL = 3e-2


@dataclasses.dataclass(frozen=True)
class Scenario:
    B: int = 4
    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 32
    L: int = 4
    S: int = 8
    act_dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype = torch.bfloat16
    l2norm: bool = True
    lower_bound: float | None = None
    steps: int = 9
    layer_view: bool = False  # caches are layer 1 of a [2, S, ...] allocation
    a_3d: bool = False  # a as [B, HV, K] and dt_bias as [HV, K]
    pad_rows: int = 1
    flush_prob: float = 0.2
    seed: int = 0
    device: str = "cpu"
    # the pre-decayed ring layout (ring_layout="predecayed"), else SGLang's
    predecayed: bool = False
    # added to every head's A_log: gates exp(shift) times stronger (pre-decayed rebases need G below -80)
    A_log_shift: float = 0.0

    @property
    def ring_layout(self) -> str:
        return "predecayed" if self.predecayed else "sglang"


def kimi_scenario(H: int, HV: int, B: int, state_dtype: torch.dtype, device: str = "cuda") -> Scenario:
    """The GPU scenario at a Kimi-Linear shape (tests/test_op_gpu.py; benchmarks/experiments/
    check_candidate.py runs the same one on a candidate kernel): K = V = 128, L = 16, a full cycle plus
    one step, a padding row from B = 2 up, lower_bound -5 at B = 8, 5% forced flushes."""
    return Scenario(B=B, H=H, HV=HV, K=128, V=128, L=16, S=B + 3, pad_rows=1 if B > 1 else 0, steps=17,
                    state_dtype=state_dtype, lower_bound=-5.0 if B == 8 else None, flush_prob=0.05,
                    seed=B * 1000 + HV, device=device)


@dataclasses.dataclass
class Worst:
    out_vs_reference: float = 0.0
    out_vs_plain64: float = 0.0
    state_vs_plain64: float = 0.0
    flushes: int = 0
    appends: int = 0
    rebases: int = 0  # (row, value head) pairs of the pre-decayed layout that rebased instead of appending


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, sc: Scenario) -> torch.Tensor:
    if sc.layer_view:
        return torch.empty((2, *shape), dtype=dtype, device=sc.device)[1]
    return torch.empty(shape, dtype=dtype, device=sc.device)


def run_scenario(sc: Scenario, op: Callable[..., object]) -> Worst:
    """Run ``sc.steps`` decode steps with ``op`` (the op's signature, called with ``ring_layout=``); assert every
    invariant; return the worst errors."""
    gen = torch.Generator().manual_seed(sc.seed)
    dev = torch.device(sc.device)
    params = random_head_params(sc.HV, sc.K, device=dev, generator=gen)
    if sc.A_log_shift:
        params = dataclasses.replace(params, A_log=params.A_log + sc.A_log_shift)
    n_active = sc.B - sc.pad_rows
    if not 1 <= n_active <= sc.S:  # a scenario without an active row would check nothing
        raise ValueError(f"Scenario: B - pad_rows = {sc.B} - {sc.pad_rows} active rows, expected 1..S = 1..{sc.S}")
    perm = torch.randperm(sc.S, generator=gen)
    active, unused = perm[:n_active], perm[n_active:]
    slots = torch.full((sc.B,), -1, dtype=torch.int32)
    rows = torch.randperm(sc.B, generator=gen)[:n_active]
    slots[rows] = active.int()
    slots = slots.to(dev)

    state = _alloc((sc.S, sc.HV, sc.V, sc.K), sc.state_dtype, sc)
    d_cache = _alloc((sc.S, sc.HV, sc.L, sc.V), sc.cache_dtype, sc)
    k_cache = _alloc((sc.S, sc.HV if sc.predecayed else sc.H, sc.L, sc.K), sc.cache_dtype, sc)
    g_cache = _alloc((sc.S, sc.HV, sc.L, sc.K), torch.float32, sc)
    caches = (state, d_cache, k_cache, g_cache)
    for t in caches:
        t.fill_(SENTINEL)
        t[active.to(dev)] = float("nan")  # ring entries j >= cursor must never be read
    init = (0.1 * torch.randn(n_active, sc.HV, sc.V, sc.K, generator=gen)).to(dev)
    state[active.to(dev)] = init.to(sc.state_dtype)
    oracle = PlainKDA(sc.S, sc.H, sc.HV, sc.K, sc.V, device=dev)
    oracle.load(active, state[active.to(dev)].double())
    sentinels = [t[unused.to(dev)].clone() for t in caches]
    cursor = torch.zeros(sc.B, dtype=torch.int32, device=dev)
    pad = slots < 0
    worst = Worst()

    for _ in range(sc.steps):
        inp = random_decode_inputs(sc.B, sc.H, sc.HV, sc.K, sc.V, dtype=sc.act_dtype, device=dev, generator=gen)
        if not sc.l2norm:  # keep raw q/k at unit scale so the recurrence stays bounded
            qk = 2 * sc.H * sc.K
            mq = inp.mixed_qkv.clone()
            mq[:, :qk] = (mq[:, :qk].float() / sc.K**0.5).to(sc.act_dtype)
            inp = dataclasses.replace(inp, mixed_qkv=mq)
        a = inp.a.unflatten(1, (sc.HV, sc.K)) if sc.a_3d else inp.a
        dt_bias = params.dt_bias.unflatten(0, (sc.HV, sc.K)) if sc.a_3d else params.dt_bias
        force = (torch.rand(sc.B, generator=gen) < sc.flush_prob).int().to(dev)
        out = torch.full((sc.B, 1, sc.HV, sc.V), float("nan"), dtype=sc.act_dtype, device=dev)
        ref_out = out.clone()
        ref_caches = [t.clone() for t in caches]
        args = (inp.mixed_qkv, a, inp.b, params.A_log, dt_bias, None)
        tail = (slots, cursor, force, sc.l2norm, sc.lower_bound)
        result = op(*args, *caches, out, *tail, ring_layout=sc.ring_layout)
        reference.replayssm_decode(*args, *ref_caches, ref_out, *tail, ring_layout=sc.ring_layout)
        expected = oracle.step(inp, params, slots.cpu(), use_qk_l2norm=sc.l2norm, lower_bound=sc.lower_bound)

        assert result[0] is out and result[1] is state, "op must return (out, initial_state) in place"
        assert torch.isfinite(out).all(), "out has unwritten (NaN) or non-finite entries"
        assert (out[pad] == 0).all(), "padding rows must be exactly zero"
        worst.out_vs_reference = max(worst.out_vs_reference, rel_err(out, ref_out))
        worst.out_vs_plain64 = max(worst.out_vs_plain64, rel_err(out[:, 0], expected))
        for name, got, want in zip(("initial_state", "d_cache", "k_cache", "g_cache"), caches, ref_caches):
            # one rounding step of the stored dtype apart at most
            tol = 2e-5 if got.dtype == torch.float32 else (2**-10 if got.dtype == torch.float16 else 2**-7)
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-5, equal_nan=True,
                                       msg=lambda m, n=name: f"{n} differs from the reference: {m}")
        for t, before in zip(caches, sentinels):
            assert torch.equal(t[unused.to(dev)], before), "an unused slot was written"

        flush = (cursor == sc.L - 1) | (force != 0)
        if sc.predecayed:  # a rebase leaves G_c = 0 exactly (gates are never 0)
            live = ~flush & ~pad
            at_c = ref_caches[3][slots[live].long(), :, cursor[live].long()]  # [n, HV, K]
            worst.rebases += int((at_c == 0).all(-1).sum())
        worst.flushes += int((flush & ~pad).sum())
        worst.appends += int((~flush & ~pad).sum())
        cursor = torch.where(flush, 0, cursor + 1).int()

    # the state the pool would read back (checkpoint + ring) equals the float64 recurrence
    act = slots[~pad].long()
    if sc.predecayed:
        replayed = reference.replay_predecayed_ring(state[act], d_cache[act], k_cache[act], g_cache[act], cursor[~pad])
    else:
        replayed = reference.replay_ring(
            state[act], d_cache[act], k_cache[act].repeat_interleave(sc.HV // sc.H, dim=1), g_cache[act],
            cursor[~pad])
    worst.state_vs_plain64 = rel_err(replayed, oracle.state[act])
    return worst


def planned_op(edit: Callable[[DecodePlan], DecodePlan] | None = None,
               **changes: object) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The op (``ops.replayssm_decode``'s signature) launching the library's plan for each call edited by ``edit``
    and then ``dataclasses.replace(plan, **changes)``, through ``run_decode(..., plan=)``: how a test puts the kernel
    on a path the library would not choose for its shape (``DecodePlan.check`` still vets the edited plan)."""

    def op(*args: object, ring_layout: str = "sglang") -> tuple[torch.Tensor, torch.Tensor]:
        call = DecodeCall(*args)
        dims = validate_decode(call, ring_layout=ring_layout)
        plan = launch.plan_for(call, dims, ring_layout=ring_layout, cursor_table=False, advance=False)
        if edit is not None:
            plan = edit(plan)
        launch.run_decode(call, ring_layout=ring_layout, plan=dataclasses.replace(plan, **changes))
        return call.out, call.initial_state

    return op


def record_kernel_args(monkeypatch: pytest.MonkeyPatch, *names: str) -> list[tuple]:
    """A list that gets, for every launch, the kernel arguments ``names`` (parameter names of
    :func:`replayssm_decode_kernel`) as ``decode_kernel_args`` built them."""
    params = list(inspect.signature(replayssm_decode_kernel).parameters)
    at, built_by, seen = [params.index(n) for n in names], launch.decode_kernel_args, []

    def recording(*args: object, **kwargs: object) -> LaunchArgs:
        built = built_by(*args, **kwargs)
        seen.append(tuple(built.values[i] for i in at))
        return built

    monkeypatch.setattr(launch, "decode_kernel_args", recording)
    return seen
