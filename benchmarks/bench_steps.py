"""The tensors and step closures ``bench_decode.py`` times, and its correctness checks.

- :class:`Buffers`: a pool-like set of random caches for one shape, split into disjoint slot sets, in one ring layout,
  with rotated input sets (and q/k/v split for FLA).
- Step closures, one full cursor cycle per slot set: :func:`pool_steps` (ours as the pool runs it:
  :func:`tp_replayssm.kernels.launch.run_decode` on the slot-indexed cursor table, then the pool's cursor advance
  :func:`tp_replayssm.kernels.cursor.advance`, or the advance fused into the decode), :func:`replay_steps` (any op
  with SGLang's signature on row-indexed cursors), :func:`fla_steps` (FLA's packed in-place decode).
- Checks of one step: :func:`check_replay` (an op against the reference on copies of the pool) and
  :func:`check_fla` (FLA's ``out`` against the reference at an empty ring).

CPU-runnable: ``tests/test_byte_model.py`` runs the pool's steps against the row-cursor steps on CPU tensors.
"""

from __future__ import annotations

import argparse
import functools
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench_shapes import Shape
from tp_replayssm.reference import predecay_rings

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------
# buffers


class Buffers:
    """A pool-like set of random tensors for one shape, split into ``n_sets`` disjoint slot sets, its rings in
    ``ring_layout`` (default ``args.ring_layout``): enough sets that one graph replay touches ``args.footprint_mb``
    (0: 4x ``l2_bytes``), at most ``args.max_graph_steps`` steps per replay."""

    def __init__(self, shape: Shape, args: argparse.Namespace, device: torch.device, l2_bytes: int,
                 need_fla: bool, ring_layout: str | None = None):
        H, HV, K, V, L, B = shape.H, shape.HV, shape.K, shape.V, shape.L, shape.B
        self.shape = shape
        sdt, cdt, adt = DTYPES[shape.state], DTYPES[args.cache_dtype], DTYPES[args.act_dtype]
        self.sdt, self.cdt, self.adt = sdt, cdt, adt
        sb, cb, ab = sdt.itemsize, cdt.itemsize, adt.itemsize
        gen = torch.Generator(device=device)
        gen.manual_seed(args.seed * 1000003 + zlib.crc32(shape.label.encode()))
        self.gen = gen

        # the pre-decayed ring layout (the pool's default): cumulative gates, keys k*exp(-G) per value head
        self.ring_layout = ring_layout or args.ring_layout
        self.predecayed = self.ring_layout == "predecayed"
        KH = HV if self.predecayed else H
        per_set = B * (HV * V * K * sb + HV * L * V * cb + KH * L * K * cb + HV * L * K * 4)
        target = args.footprint_mb * 2**20 if args.footprint_mb > 0 else 4 * l2_bytes
        max_sets = max(1, args.max_graph_steps // L)
        self.n_sets = int(max(1, min(math.ceil(target / per_set), max_sets)))
        self.S = self.n_sets * B
        self.n_steps = self.n_sets * L
        width = 2 * H * K + HV * V
        per_input = B * (width * ab + HV * K * ab + HV * ab + HV * V * ab)  # mixed, a, b, out
        if need_fla:
            per_input += B * (width * ab + HV * V * ab)  # q/k/v copies, FLA's out
        self.n_in = int(max(1, min(self.n_steps, args.max_input_mb * 2**20 // per_input)))
        self.footprint = per_set * self.n_sets + per_input * self.n_in

        S = self.S
        perm = torch.randperm(S, device=device, generator=gen).to(torch.int32)
        self.slots = [perm[i * B:(i + 1) * B].contiguous() for i in range(self.n_sets)]
        self.state = torch.randn(S, HV, V, K, device=device, dtype=sdt, generator=gen).mul_(0.05)
        self.d = torch.randn(S, HV, L, V, device=device, dtype=cdt, generator=gen).mul_(0.5)
        k = torch.randn(S, KH, L, K, device=device, dtype=torch.float32, generator=gen)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        self.g = torch.rand(S, HV, L, K, device=device, dtype=torch.float32, generator=gen).mul_(-0.2).sub_(0.01)
        if self.predecayed:
            k, self.g = predecay_rings(k, self.g)
        self.k = k.to(cdt)
        del k
        self.A_log = torch.empty(HV, device=device).uniform_(-1.0, 0.5, generator=gen) + args.A_log_shift
        self.dt_bias = torch.empty(HV * K, device=device).uniform_(-4.0, 0.0, generator=gen)

        base = (torch.arange(B, device=device, dtype=torch.int32) % L) if args.phase == "stagger" \
            else torch.zeros(B, device=device, dtype=torch.int32)
        self.base = base
        self.cursors = [base.clone() for _ in range(self.n_sets)]  # row-indexed cursor per slot set
        self.wp_const = [((base + t) % L).to(torch.int32).contiguous() for t in range(L)]
        # the pool's cursor table [S + 1] (entry S: padding rows' scratch), read by ours' pool steps
        self.cursor_table = torch.zeros(S + 1, device=device, dtype=torch.int32)
        for slots in self.slots:
            self.cursor_table[slots.long()] = base

        self.mixed, self.a, self.b, self.out = [], [], [], []
        self.q4, self.k4, self.v4, self.out_fla = [], [], [], []
        for _ in range(self.n_in):
            mixed = torch.randn(B, width, device=device, dtype=adt, generator=gen)
            self.mixed.append(mixed)
            self.a.append(torch.randn(B, HV * K, device=device, dtype=adt, generator=gen))
            self.b.append(torch.randn(B, HV, device=device, dtype=adt, generator=gen))
            self.out.append(torch.zeros(B, 1, HV, V, device=device, dtype=adt))
            if need_fla:
                q4, k4, v4 = split_qkv(mixed, H, HV, K, V)
                self.q4.append(q4)
                self.k4.append(k4)
                self.v4.append(v4)
                self.out_fla.append(torch.zeros(B, 1, HV, V, device=device, dtype=adt))

    def input_index(self, set_idx: int, t: int) -> int:
        return (set_idx * self.shape.L + t) % self.n_in


def split_qkv(mixed: torch.Tensor, H: int, HV: int, K: int, V: int):
    """``mixed_qkv [B, 2HK+HV*V]`` -> contiguous ``q, k [B, 1, H, K]``, ``v [B, 1, HV, V]`` (FLA's layout)."""
    B = mixed.shape[0]
    q = mixed[:, : H * K].contiguous().view(B, 1, H, K)
    k = mixed[:, H * K: 2 * H * K].contiguous().view(B, 1, H, K)
    v = mixed[:, 2 * H * K:].contiguous().view(B, 1, HV, V)
    return q, k, v


# ----------------------------------------------------------------------------------------------
# step closures


StepList = list[tuple[Callable[[], None], Callable[[], None] | None]]


def ours_op(ring_layout: str, plan: Any = None) -> Callable[..., Any]:
    """Our op with SGLang's signature (``tp_replayssm.ops.replayssm_decode``) on ``ring_layout`` rings, launched
    with ``plan`` (a ``DecodePlan`` for row cursors; None: the library's)."""
    from tp_replayssm.kernels.launch import run_decode
    from tp_replayssm.validation import DecodeCall

    def op(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        call = DecodeCall(*args, **kwargs)
        run_decode(call, ring_layout=ring_layout, plan=plan)
        return call.out, call.initial_state

    return op


def pool_steps(buf: Buffers, shape: Shape, *, l2norm: bool, fused: bool = False, plan: Any = None,
               sets: Sequence[int] | None = None) -> StepList:
    """Ours as the pool runs it, one full cursor cycle per slot set: the decode reads the slot-indexed cursor table
    ``buf.cursor_table`` (``run_decode(..., cursor_table=True)``, as ``ReplaySSMStatePool.decode``), then the
    pool's cursor advance moves it (``cursor.advance``, as ``ReplaySSMStatePool.advance``); with ``fused`` the
    decode moves the cursors itself (``advance=True``, the pool's ``decode(..., advance=True)``). ``plan``: a
    ``DecodePlan`` for that call (None: the library's)."""
    from tp_replayssm.kernels import cursor
    from tp_replayssm.kernels.launch import run_decode
    from tp_replayssm.validation import DecodeCall

    steps: StepList = []
    for si in (range(buf.n_sets) if sets is None else sets):
        for t in range(shape.L):
            j = buf.input_index(si, t)
            call = DecodeCall(buf.mixed[j], buf.a[j], buf.b[j], buf.A_log, buf.dt_bias, None, buf.state, buf.d,
                              buf.k, buf.g, buf.out[j], buf.slots[si], buf.cursor_table, None, l2norm, shape.lb)

            def step(call: DecodeCall = call) -> None:
                run_decode(call, ring_layout=buf.ring_layout, cursor_table=True, advance=fused, plan=plan)

            def adv(si: int = si) -> None:
                cursor.advance(buf.cursor_table, buf.slots[si], None, shape.L)
            steps.append((step, None if fused else adv))
    return steps


def replay_steps(op: Callable[..., Any], buf: Buffers, shape: Shape, *, l2norm: bool,
                 advance: Callable[[torch.Tensor], None] | None, sets: Sequence[int] | None = None) -> StepList:
    """``op`` (SGLang's signature) over one full cursor cycle per slot set, on row-indexed cursors. With ``advance``
    the cursors advance in place after every step; without it each step reads a constant ``write_pos`` tensor
    holding the same phase (the op alone)."""
    steps: StepList = []
    for si in (range(buf.n_sets) if sets is None else sets):
        for t in range(shape.L):
            j = buf.input_index(si, t)
            wp = buf.cursors[si] if advance is not None else buf.wp_const[t]

            def step(j: int = j, si: int = si, wp: torch.Tensor = wp) -> None:
                op(buf.mixed[j], buf.a[j], buf.b[j], buf.A_log, buf.dt_bias, None, buf.state, buf.d, buf.k,
                   buf.g, buf.out[j], buf.slots[si], wp, None, use_qk_l2norm_in_kernel=l2norm,
                   lower_bound=shape.lb)

            steps.append((step, None if advance is None else functools.partial(advance, buf.cursors[si])))
    return steps


def fla_steps(fla: Callable[..., Any], buf: Buffers, shape: Shape, *, l2norm: bool,
              sets: Sequence[int] | None = None) -> StepList:
    """FLA's packed in-place decode, one step per (slot set, cursor phase) of the same inputs as ours: q/k/v split
    beforehand, gate, beta sigmoid and l2norm inside FLA's kernel, the state read and written by slot."""
    B, HV, K = shape.B, shape.HV, shape.K
    steps: StepList = []
    for si in (range(buf.n_sets) if sets is None else sets):
        for t in range(shape.L):
            j = buf.input_index(si, t)

            def step(j=j, si=si) -> None:
                fla(q=buf.q4[j], k=buf.k4[j], v=buf.v4[j], g=buf.a[j].view(B, 1, HV, K),
                    beta=buf.b[j].view(B, 1, HV), A_log=buf.A_log, dt_bias=buf.dt_bias,
                    initial_state=buf.state, scale=None, output_final_state=False, inplace_final_state=True,
                    state_v_first=True, ssm_state_indices=buf.slots[si], use_qk_l2norm_in_kernel=l2norm,
                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=shape.lb,
                    out=buf.out_fla[j])
            steps.append((step, None))
    return steps


def run_steps(steps: StepList) -> Callable[[], None]:
    def fn() -> None:
        for op, adv in steps:
            op()
            if adv is not None:
                adv()
    return fn


# ----------------------------------------------------------------------------------------------
# correctness


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    if a.numel() == 0:
        return 0.0
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def _fresh_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    B, H, HV, K, V = shape.B, shape.H, shape.HV, shape.K, shape.V
    mixed = torch.randn(B, 2 * H * K + HV * V, device=device, dtype=dtype, generator=gen)
    a = torch.randn(B, HV * K, device=device, dtype=dtype, generator=gen)
    b = torch.randn(B, HV, device=device, dtype=dtype, generator=gen)
    return mixed, a, b


def check_replay(op: Callable[..., Any], ref: Callable[..., Any], buf: Buffers, shape: Shape,
                 l2norm: bool) -> dict[str, Any]:
    """One step of ``op`` against ``ref`` (the reference in the buffers' layout) on copies of the pool: random
    cursors with at least one flush row and, for ``B >= 4``, a padding row; the output poisoned with NaN first.
    Returns the relative errors of ``out``, of the flushed checkpoints and of the appended ring entries, whether
    padding rows are zero and non-flushed checkpoints untouched (except heads the reference rebased), and the
    number of rebased heads."""
    B, L, dev = shape.B, shape.L, buf.state.device
    gen = buf.gen
    slots = buf.slots[0].clone()
    if B >= 4:
        slots[0] = -1  # a padding row
    passes = []
    wp = torch.randint(0, L, (B,), device=dev, dtype=torch.int32, generator=gen)
    wp[-1] = L - 1  # at least one flush row
    passes.append(wp)
    if L > 1 and (B < 3 or bool((wp[slots >= 0] == L - 1).all())):
        passes.append(torch.randint(0, L - 1, (B,), device=dev, dtype=torch.int32, generator=gen))  # appends
    res = {"err_out": 0.0, "err_state": 0.0, "err_ring": 0.0, "pad_ok": True, "untouched_ok": True,
           "rebased": 0, "append_heads": 0}
    for wp in passes:
        mixed, a, b = _fresh_inputs(shape, buf.adt, dev, gen)
        mine = [t.clone() for t in (buf.state, buf.d, buf.k, buf.g)]
        theirs = [t.clone() for t in (buf.state, buf.d, buf.k, buf.g)]
        out_m = torch.full((B, 1, shape.HV, shape.V), float("nan"), device=dev, dtype=buf.adt)
        out_r = torch.full_like(out_m, float("nan"))
        op(mixed, a, b, buf.A_log, buf.dt_bias, None, *mine, out_m, slots, wp, None,
           use_qk_l2norm_in_kernel=l2norm, lower_bound=shape.lb)
        ref(mixed, a, b, buf.A_log, buf.dt_bias, None, *theirs, out_r, slots, wp, None,
            use_qk_l2norm_in_kernel=l2norm, lower_bound=shape.lb)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        valid = slots >= 0
        res["err_out"] = max(res["err_out"], _rel_err(out_m[valid], out_r[valid]))
        if (~valid).any():
            pad = out_m[~valid]
            res["pad_ok"] = res["pad_ok"] and bool(torch.isfinite(pad).all() and (pad == 0).all())
        flush = valid & (wp == L - 1)
        keep = valid & (wp != L - 1)
        s_f = slots[flush].long()
        s_n, c_n = slots[keep].long(), wp[keep].long()
        if s_f.numel():
            res["err_state"] = max(res["err_state"], _rel_err(mine[0][s_f], theirs[0][s_f]))
        if s_n.numel():
            e_ring = max(_rel_err(mine[1][s_n, :, c_n], theirs[1][s_n, :, c_n]),
                         _rel_err(mine[2][s_n, :, c_n], theirs[2][s_n, :, c_n]),
                         _rel_err(mine[3][s_n, :, c_n], theirs[3][s_n, :, c_n]))
            res["err_ring"] = max(res["err_ring"], e_ring)
            # an appending row leaves its checkpoint alone, except in heads that rebase (the pre-decayed layout,
            # cumulative gate past -75): those the reference rewrote must match it, all others stay bit-identical
            before = buf.state[s_n]
            ref_kept = (theirs[0][s_n] == before).flatten(2).all(-1)  # [n, HV]
            mine_kept = (mine[0][s_n] == before).flatten(2).all(-1)
            res["untouched_ok"] = res["untouched_ok"] and bool((mine_kept | ~ref_kept).all())
            if not bool(ref_kept.all()):
                res["err_state"] = max(res["err_state"], _rel_err(mine[0][s_n][~ref_kept], theirs[0][s_n][~ref_kept]))
            res["rebased"] += int((~ref_kept).sum())
            res["append_heads"] += ref_kept.numel()
        del mine, theirs
    return res


def check_fla(fla: Callable[..., Any], ref: Callable[..., Any], buf: Buffers, shape: Shape,
              l2norm: bool) -> float:
    """FLA's ``out`` after one step vs the reference at cursor 0 (empty ring): same function?"""
    B, H, HV, K, V, dev = shape.B, shape.H, shape.HV, shape.K, shape.V, buf.state.device
    mixed, a, b = _fresh_inputs(shape, buf.adt, dev, buf.gen)
    q4, k4, v4 = split_qkv(mixed, H, HV, K, V)
    slots = buf.slots[0]
    st = buf.state.clone()
    out_f = torch.full((B, 1, HV, V), float("nan"), device=dev, dtype=buf.adt)
    fla(q=q4, k=k4, v=v4, g=a.view(B, 1, HV, K), beta=b.view(B, 1, HV), A_log=buf.A_log, dt_bias=buf.dt_bias,
        initial_state=st, scale=None, output_final_state=False, inplace_final_state=True, state_v_first=True,
        ssm_state_indices=slots, use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=shape.lb, out=out_f)
    del st
    theirs = [t.clone() for t in (buf.state, buf.d, buf.k, buf.g)]
    out_r = torch.full_like(out_f, float("nan"))
    ref(mixed, a, b, buf.A_log, buf.dt_bias, None, *theirs, out_r, slots,
        torch.zeros(B, device=dev, dtype=torch.int32), None, use_qk_l2norm_in_kernel=l2norm, lower_bound=shape.lb)
    torch.cuda.synchronize()
    err = _rel_err(out_f, out_r)
    del theirs
    return err
