"""ReplaySSMStatePool (docs/contract.md, the pool) against the float64 plain recurrence.

On CPU the pool's decode runs the library's PyTorch path (its default for CPU tensors), so these tests are fast
and need no environment variable. The Helion kernel behind the pool runs in Triton's interpreter in one test per
ring layout (``test_pool_kernel_in_interpreter_matches_plain_kda``, the ``interpreter`` fixture), whose cost,
~0.1 s per (live row, value head) and a compile per shape, keeps it to the small geometry ``SMALL`` (H=1, HV=2,
K=V=16, S=4, L=3, B=4). With CUDA present the same tests run on ``cuda:0`` with the compiled kernel. A fresh process
with no environment variable set builds and decodes a CPU pool too.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _pool_helpers import (B, CURSOR_SENTINEL, DEV, KD, L, S, SENTINEL, SMALL, STEP_CASES, TOL_BF16, VD,
                           assert_bit_identical, i32, make_pool, params_for, pool_tensors, small_inputs,
                           snapshot_slots)
from tp_replayssm import reference
from tp_replayssm.testing import PlainKDA, random_decode_inputs, rel_err


# ---- the main scenario: many steps, several layers, churn, flushes, load_state, sentinels ---------

@STEP_CASES
def test_pool_matches_plain_kda_over_ring_cycles_with_churn(layout, lower_bound, A_log_shift, fused):
    """Two layers, >= 2 full ring cycles, padding rows, forced flushes, free + re-alloc mid-stream
    (of a never-used sentinel-filled slot and of a used one), load_state mid-ring on one layer, and
    read_state equal to the oracle at every cursor; unallocated slots stay bit-identical. In both ring
    layouts: ``ring_layout="predecayed"`` stores cumulative gates and pre-decayed keys per value head (GQA
    here: one q/k head, two value heads); with strong softplus gates (``A_log_shift``) its heads rebase.
    ``fused``: the step's last decode moves the cursors (``decode(..., advance=True)``), no ``advance`` call."""
    NL = 2
    pool = make_pool(num_layers=NL, ring_layout=layout)
    assert pool.k_cache.shape[2] == (2 if layout == "predecayed" else 1)
    gen = torch.Generator().manual_seed(1234)
    rng = random.Random(99)
    params = [params_for(SMALL.num_v_heads, gen) for _ in range(NL)]
    params = [dataclasses.replace(p, A_log=p.A_log + A_log_shift) for p in params]
    rebases = 0
    scales = [None, 0.3]  # layer 1 with an explicit scale
    oracles = [PlainKDA(S, 1, 2, KD, VD) for _ in range(NL)]

    live = pool.alloc(3).tolist()
    unalloc = sorted(set(range(S)) - set(live))
    idx = torch.tensor(unalloc, dtype=torch.long, device=DEV)
    for t in pool_tensors(pool).values():
        t[:, idx] = SENTINEL
    pool.cursors[idx] = CURSOR_SENTINEL
    frozen = snapshot_slots(pool, unalloc)
    cursor_model = {s: 0 for s in live}
    ever_live = set(live)
    reused = []  # re-allocated slots that had held a request before

    n_steps = 3 * L  # three full ring cycles
    for step in range(n_steps):
        if step in (3, 5):  # churn: a request finishes, a new one takes a slot
            gone = live.pop(rng.randrange(len(live)))
            pool.free([gone])
            was_used = set(pool.allocated_slots())
            new = pool.alloc(1).tolist()[0]
            assert new not in was_used
            if new in ever_live:
                reused.append(new)
            ever_live.add(new)
            unalloc = sorted((set(unalloc) | {gone}) - {new})
            frozen = snapshot_slots(pool, unalloc)  # the freed slot's stale content must stay untouched
            live.append(new)
            cursor_model.pop(gone)
            cursor_model[new] = 0
            for o in oracles:
                o.reset([new])
            assert int(pool.cursors[new]) == 0
            for layer in range(NL):  # a re-allocated slot starts from zero, whatever it held
                assert torch.count_nonzero(pool.read_state(layer, i32([new]))) == 0
                assert torch.count_nonzero(pool.checkpoint[layer, new]) == 0
        if step == 7:  # prefill-style load on layer 1 only, mid-ring: other layer and cursors untouched
            target = max(live, key=lambda s: cursor_model[s])
            assert cursor_model[target] > 0
            states = (torch.randn(1, 2, VD, KD, generator=gen) * 0.5).to(DEV)
            other_before = pool.read_state(0, i32([target]))
            cursors_before = pool.cursors.clone()
            pool.load_state(1, i32([target]), states)
            oracles[1].load([target], states)
            assert torch.equal(pool.read_state(1, i32([target])), states)
            assert torch.equal(pool.read_state(0, i32([target])), other_before)
            assert torch.equal(pool.cursors, cursors_before)

        rows = live + [-1] * (B - len(live))
        rng.shuffle(rows)
        slots = i32(rows)
        flush_rows = [1 if (step in (1, 4) and r == rows.index(max(live))) else 0 for r in range(B)]
        flush_rows[rows.index(-1)] = 1  # a padding row asking for a flush is ignored
        force = i32(flush_rows)
        for layer in range(NL):
            inp = small_inputs(gen)
            out = torch.full((B, 1, 2, VD), float("nan"), device=DEV)
            got = pool.decode(layer, inp.mixed_qkv, inp.a, inp.b, params[layer].A_log, params[layer].dt_bias, slots,
                              scale=scales[layer], force_flush=force, out=out, lower_bound=lower_bound,
                              advance=fused and layer == NL - 1)
            assert got is out
            want = oracles[layer].step(inp, params[layer], slots, scale=scales[layer], lower_bound=lower_bound)
            real = slots >= 0
            assert rel_err(out[real, 0], want[real.cpu()]) < TOL_BF16, (step, layer)
            assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padding rows exactly zero
            if layout == "predecayed":  # a rebase leaves G_c = 0 exactly where the head would have appended
                for r, s_ in enumerate(rows):
                    c = cursor_model.get(s_, -1)
                    if s_ >= 0 and not flush_rows[r] and c != L - 1:
                        rebases += int((pool.g_cache[layer, s_, :, c] == 0).all(-1).sum())
        if not fused:
            pool.advance(slots, force)
        for s, f in zip(rows, flush_rows):
            if s >= 0:
                cursor_model[s] = 0 if (f or cursor_model[s] == L - 1) else cursor_model[s] + 1
        assert {s: int(pool.cursors[s]) for s in live} == cursor_model, step
        live_t = i32(live)
        for layer in range(NL):
            assert rel_err(pool.read_state(layer, live_t), oracles[layer].state[live]) < TOL_BF16
        assert_bit_identical(frozen, snapshot_slots(pool, unalloc))
    assert reused  # the churn handed a used slot out again (and it started from zero)
    assert (rebases > 0) == (A_log_shift > 0), rebases  # never under lower_bound -5 at L = 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the tests above run the compiled kernel")
@pytest.mark.parametrize("layout, fused", [("sglang", False), ("predecayed", True)],
                         ids=["sglang-advance", "predecayed-fused-advance"])
def test_pool_kernel_in_interpreter_matches_plain_kda(interpreter, monkeypatch, layout, fused):  # noqa: ARG001
    """The pool's steps through the Helion kernel (Triton's interpreter on CPU), one case per ring layout: three
    live rows and a padding row, a forced flush, a full ring cycle and its wrap; outputs, cursors and ``read_state``
    against the float64 oracle after every step. The cursors move by ``pool.advance`` (sglang) or inside the decode
    (``advance=True``, pre-decayed)."""

    def torch_path(*args, **kwargs):
        raise AssertionError("the interpreter backend must launch the kernel, not the PyTorch path")

    monkeypatch.setattr(reference, "decode_rows", torch_path)
    pool = make_pool(num_layers=1, ring_layout=layout)
    gen = torch.Generator().manual_seed(21)
    p = params_for(2, gen)
    oracle = PlainKDA(S, 1, 2, KD, VD)
    live = pool.alloc(3).tolist()
    rows = [live[0], -1, live[1], live[2]]
    slots = i32(rows)
    cursor_model = {s: 0 for s in live}
    for step in range(L + 1):
        flags = [1 if (step == 1 and r == 2) else 0 for r in range(B)]
        force = i32(flags)
        inp = small_inputs(gen)
        out = pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots, force_flush=force,
                          advance=fused)
        want = oracle.step(inp, p, slots)
        assert rel_err(out[:, 0], want) < TOL_BF16, step
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padding row
        if not fused:
            pool.advance(slots, force)
        for s_, f in zip(rows, flags):
            if s_ >= 0:
                cursor_model[s_] = 0 if (f or cursor_model[s_] == L - 1) else cursor_model[s_] + 1
        assert {s_: int(pool.cursors[s_]) for s_ in live} == cursor_model, step
        assert rel_err(pool.read_state(0, i32(live)), oracle.state[live]) < TOL_BF16, step


@pytest.mark.parametrize("layout", ["sglang", "predecayed"])
def test_ring_length_one_flushes_every_step(layout):
    """L = 1: every step folds into the (fp32) checkpoint; tight match with the oracle."""
    pool = make_pool(num_layers=1, ring_length=1, cache_dtype=torch.float32, ring_layout=layout)
    gen = torch.Generator().manual_seed(5)
    p = params_for(2, gen)
    oracle = PlainKDA(S, 1, 2, KD, VD)
    live = pool.alloc(2).tolist()
    slots = i32([live[0], -1, live[1], -1])
    for _ in range(3):
        inp = random_decode_inputs(B, 1, 2, KD, VD, dtype=torch.float32, generator=gen)
        out = pool.decode(0, inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, slots)
        assert out.shape == (B, 1, 2, VD) and out.dtype == torch.float32 and out.device == DEV
        want = oracle.step(inp, p, slots)
        assert rel_err(out[:, 0], want) < 1e-5
        pool.advance(slots)
        assert pool.cursors[live].tolist() == [0] * len(live)  # (the free slots hold FREE_CURSOR)
        assert rel_err(pool.checkpoint[0, live], oracle.state[live]) < 1e-5


# ---- a pool on CPU with no environment variable ----------------------------------------------------

_NO_ENV_SCRIPT = """
import os
assert "TRITON_INTERPRET" not in os.environ and "TP_REPLAYSSM_CPU_BACKEND" not in os.environ
import torch
from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.testing import PlainKDA, random_decode_inputs, random_head_params, rel_err

H, HV, K, V, S, L, B = 1, 2, 16, 16, 4, 3, 4
for layout in ("predecayed", "sglang"):
    gen = torch.Generator().manual_seed(5)
    pool = ReplaySSMStatePool(KDAHeads(H, HV, K, V), num_layers=1, num_slots=S, ring_length=L, device="cpu",
                              ring_layout=layout)
    ids = pool.alloc(3)
    p = random_head_params(HV, K, generator=gen)
    oracle = PlainKDA(S, H, HV, K, V)
    slots = torch.tensor([int(ids[0]), -1, int(ids[1]), int(ids[2])], dtype=torch.int32)
    err_out = err_state = 0.0
    for step in range(L + 1):
        x = random_decode_inputs(B, H, HV, K, V, dtype=torch.float32, generator=gen)
        out = pool.decode(0, x.mixed_qkv, x.a, x.b, p.A_log, p.dt_bias, slots)
        err_out = max(err_out, rel_err(out[:, 0], oracle.step(x, p, slots)))
        pool.advance(slots)
        err_state = max(err_state, rel_err(pool.read_state(0, ids), oracle.state[ids.long()]))
    print(f"{layout}: cursors {pool.cursors[ids.long()].tolist()} out {err_out:.3e} state {err_state:.3e}")
"""


@pytest.mark.timeout(120)
def test_cpu_pool_works_without_environment_variables():
    """A fresh process with neither ``TRITON_INTERPRET`` nor ``TP_REPLAYSSM_CPU_BACKEND`` builds a CPU pool, allocs,
    decodes a few steps, advances and reads the state, equal to the float64 oracle (both ring layouts)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TP_REPLAYSSM_CPU_BACKEND")}
    repo = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", _NO_ENV_SCRIPT], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=110)
    assert run.returncode == 0, run.stderr[-4000:]
    found = re.findall(r"^(\w+): cursors \[(.*)\] out (\S+) state (\S+)$", run.stdout, flags=re.M)
    assert [f[0] for f in found] == ["predecayed", "sglang"], run.stdout
    for _, cursors, err_out, err_state in found:
        assert cursors == "1, 1, 1"  # L + 1 steps: a full ring cycle (the flush at L-1 wraps to 0), one more
        assert float(err_out) < TOL_BF16 and float(err_state) < TOL_BF16, run.stdout
