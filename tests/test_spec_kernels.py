"""The Helion kernels of speculative decoding against the PyTorch reference (tp_replayssm/reference_spec.py).

On CPU the kernels run in Triton's interpreter, ONE tiny case per kernel path (the ``interpreter`` fixture): the
verify kernel on a chain (pre-decayed layout, bad and padding rows), on a tree that folds over two value tiles (sglang
layout, bf16: the per-head reader counts), on heads that rebase (pre-decayed, unbounded gate), and the commit kernels
(chain, tree). Each runs the same calls on a twin pool through the PyTorch path and compares outputs and every pool
tensor. With CUDA (marker ``gpu``): the compiled kernels at K = V = 128 against the reference on CPU copies, and a
CUDA-graph replay of whole verify + commit steps against eager steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _spec_helpers import decode_step, make_model, random_drafts, read_states, rel, verify_all
import tp_replayssm.pool.spec as pool_spec
from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.kernels.backend import use_cpu_backend
from tp_replayssm.kernels.verify_plan import plan_verify
from tp_replayssm.testing import random_decode_inputs

# the interpreter cases run where triton was imported in interpreter mode (tests/conftest.py: machines without CUDA)
on_cpu_machine = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run on machines without CUDA")
TENSORS = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "spec_folded", "spec_counters", "slot_errors")


def _pool(heads: KDAHeads, device: str = "cpu", **kw: object) -> ReplaySSMStatePool:
    kw.setdefault("num_layers", 1)
    kw.setdefault("num_slots", 5)
    kw.setdefault("cache_dtype", torch.float32)
    return ReplaySSMStatePool(heads, device=device, **kw)


def _warm(pool: ReplaySSMStatePool, model: object, steps: list[list[int]], gen: torch.Generator,
          a_shift: float = 0.0) -> None:
    """Decode steps (torch path) with the given slots per step, so rows get different cursors."""
    lh = pool.local_heads
    with use_cpu_backend("torch"):
        for slots in steps:
            inputs = [random_decode_inputs(len(slots), lh.num_q_heads, lh.num_v_heads, lh.key_dim, lh.value_dim,
                                           dtype=torch.float32, device=pool.device, generator=gen)
                      for _ in range(pool.num_layers)]
            inputs = [type(x)(x.mixed_qkv, x.a + a_shift, x.b) for x in inputs]
            decode_step(pool, model, inputs, torch.tensor(slots, dtype=torch.int32, device=pool.device))


def _compare(kernel: ReplaySSMStatePool, torch_pool: ReplaySSMStatePool, tol: float) -> None:
    for name in TENSORS:
        a, b = getattr(kernel, name).float().cpu(), getattr(torch_pool, name).float().cpu()
        assert torch.allclose(a, b, rtol=tol, atol=tol), f"{name}: max diff {(a - b).abs().max().item()}"


def _verify_case(pool: ReplaySSMStatePool, model: object, slots: list[int], T: int, gen: torch.Generator,
                 parents: list[list[int]] | None, tol: float, a_shift: float = 0.0) -> None:
    twin = copy.deepcopy(pool)
    drafts = random_drafts(pool, len(slots), T, gen, a_shift=a_shift)
    t = torch.tensor(slots, dtype=torch.int32)
    par = None if parents is None else torch.tensor(parents, dtype=torch.int32)
    out = verify_all(pool, model, drafts, t, par)  # the kernel (the test's interpreter fixture)
    with use_cpu_backend("torch"):
        want = verify_all(twin, model, drafts, t, par)
    assert rel(out, want) < tol, rel(out, want)
    for r, s in enumerate(slots):
        if s < 0:
            assert (out[:, r] == 0).all()
    _compare(pool, twin, tol)


@on_cpu_machine
def test_verify_kernel_chain_with_bad_rows(interpreter: None) -> None:
    """Pre-decayed layout, a chain of 3 drafts; rows: one that folds (cursor 4, L = 6), one that does not (cursor 2),
    padding, a freed slot, a repeated slot."""
    pool = _pool(KDAHeads(1, 2, 16, 16), ring_length=6)
    gen = torch.Generator().manual_seed(1)
    model = make_model(pool, gen)
    pool.alloc(4)
    pool.free([3])
    _warm(pool, model, [[0, 1, 2], [0, -1, 2], [0, -1, -1], [0, -1, -1]], gen)
    assert pool.cursors[[0, 2]].tolist() == [4, 2]
    _verify_case(pool, model, [0, -1, 2, 3, 1, 1], 3, gen, None, 2e-5)
    assert pool.slot_errors[2] == 3  # the freed row and the two rows naming slot 1
    assert pool.spec_folded[0, [0, 2]].tolist() == [1, 0]


@on_cpu_machine
def test_verify_kernel_tree_fold_over_two_value_tiles(interpreter: None) -> None:
    """sglang layout, bf16 caches and state, GQA (H = 1, HV = 2), V = 32 (two 16-row tiles: the fold's per-head rows
    are written by the last program of each head). Rows: one folds (cursor 4, T = 3, L = 6), one does not."""
    pool = _pool(KDAHeads(1, 2, 16, 32), ring_length=6, ring_layout="sglang", cache_dtype=torch.bfloat16,
                 state_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    model = make_model(pool, gen)
    pool.alloc(2)
    _warm(pool, model, [[0, 1], [0, 1], [0, -1], [0, -1]], gen)
    assert pool.cursors[:2].tolist() == [4, 2]
    _verify_case(pool, model, [0, 1], 3, gen, [[-1, 0, 0], [-1, -1, 1]], 2e-2)  # (interpreter bf16 stores truncate)
    assert pool.spec_folded[0, :2].tolist() == [1, 0] and pool.spec_counters.abs().sum() == 0


@on_cpu_machine
def test_verify_kernel_rebase(interpreter: None) -> None:
    """Pre-decayed layout, an unbounded-in-a-ring gate (lower bound -18, L = 6): the committed gates plus the drafts
    pass -75, so heads rebase in verify (checkpoint, zeroed deltas, G_{c-1} = 0 by the head's last program)."""
    pool = _pool(KDAHeads(1, 2, 16, 32), ring_length=6)
    gen = torch.Generator().manual_seed(4)
    model = make_model(pool, gen, lower_bound=-18.0)
    pool.alloc(2)
    _warm(pool, model, [[0, 1], [0, 1], [0, -1]], gen, a_shift=4.0)
    before = pool.g_cache[0, 0, :, 2].clone()
    _verify_case(pool, model, [0, 1], 2, gen, None, 2e-5, a_shift=4.0)
    assert (before != 0).any() and (pool.g_cache[0, 0, :, 2] == 0).all(), "row 0 (cursor 3) did not rebase"


@on_cpu_machine
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_commit_kernels(tree: bool, interpreter: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit kernels (one-program verdicts and cursors; the tree compaction) against the torch ops, bitwise,
    with a conv window, a fold, a bad num_accepted and a padding row; then a commit of bad slots that the verify did
    not name, which the pool's host check refuses (patched out here: during a graph capture it does not run, and the
    kernel must refuse those rows itself)."""
    pool = _pool(KDAHeads(1, 2, 16, 16), num_layers=2, ring_length=5, conv_kernel_size=3)
    gen = torch.Generator().manual_seed(5)
    model = make_model(pool, gen, conv=True)
    pool.alloc(3)
    _warm(pool, model, [[0, 1, 2], [0, 1, -1], [0, -1, -1]], gen)
    slots = torch.tensor([0, 1, -1, 2], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 0]] * 4, dtype=torch.int32) if tree else None
    with use_cpu_backend("torch"):
        verify_all(pool, model, random_drafts(pool, 4, 3, gen), slots, parents)
    twin = copy.deepcopy(pool)
    n = torch.tensor([2, 1, 0, 4], dtype=torch.int32)
    path = torch.tensor([[0, 2, 1], [0, 1, 2], [0, 0, 0], [0, 1, 2]], dtype=torch.int32) if tree else None
    pool.commit(slots, n, path=path)
    with use_cpu_backend("torch"):
        twin.commit(slots, n, path=path)
    for name in (*TENSORS, "conv_state"):
        assert torch.equal(getattr(pool, name), getattr(twin, name)), name
    assert pool.slot_errors[1] == 1
    # a commit whose every row is bad (out of range, one slot named twice, num_accepted past T): nothing moves, and
    # the four rows join the record after the first call's row, in row order, as the torch ops record them
    drafts = random_drafts(pool, 4, 3, gen)
    for p in (pool, twin):
        with use_cpu_backend("torch"):
            verify_all(p, model, drafts, slots, parents)
    cursors = pool.cursors.clone()
    bad = torch.tensor([pool.num_slots + 3, 0, 0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"commit: `slots` must be the step's, as its first verify gave them"):
        pool.commit(bad, torch.zeros(4, dtype=torch.int32))
    monkeypatch.setattr(pool_spec, "_same_as_step", lambda *args: None)
    n = torch.tensor([1, 1, 1, 9], dtype=torch.int32)
    pool.commit(bad, n, path=path)
    with use_cpu_backend("torch"):
        twin.commit(bad, n, path=path)
    for name in (*TENSORS, "conv_state"):
        assert torch.equal(getattr(pool, name), getattr(twin, name)), name
    assert torch.equal(pool.cursors, cursors)
    assert pool.slot_errors[1:3].tolist() == [5, 5]
    assert pool.slot_errors[6:14].tolist() == [0, pool.num_slots + 3, 1, 0, 2, 0, 3, 1]


def test_plan_rules() -> None:
    """The CUDA-core form's plan (fp32 rings): chain / tree, the rebase mode by gate, value tiles that fill a wave,
    constexprs the kernel takes."""
    from tp_replayssm.kernels.verify_plan import VerifyProblem

    base = dict(batch=1, drafts=4, num_q_heads=8, num_v_heads=8, key_dim=128, value_dim=128, ring_length=16,
                state_dtype=torch.float32, cache_dtype=torch.float32, device_type="cuda", sm_count=132,
                ring_layout="predecayed", tree=False, use_l2norm=True, use_lower_bound=False, gate_bounded=False,
                activation_dtype=torch.bfloat16)
    small = plan_verify(VerifyProblem(**base))
    big = plan_verify(VerifyProblem(**{**base, "batch": 128, "num_v_heads": 32}))
    assert small.value_tile == 16 and big.value_tile == 128 and small.predecayed_ring == 2
    assert small.draft_block == 4 and small.tile_readers == 8 and big.tile_readers == 1
    bounded = plan_verify(VerifyProblem(**{**base, "use_lower_bound": True, "gate_bounded": True}))
    assert bounded.predecayed_ring == 1
    assert plan_verify(VerifyProblem(**{**base, "ring_layout": "sglang"})).predecayed_ring == 0
    import dataclasses

    with pytest.raises(ValueError, match="tile_readers"):
        dataclasses.replace(small, value_tile=32).check(VerifyProblem(**base))
    assert "value_tile=16" in str(small) and set(small.constexprs()) >= {"draft_block", "doubling_steps", "tree"}


# ---- GPU --------------------------------------------------------------------------------------------------------


def _to(pool: ReplaySSMStatePool, device: str) -> ReplaySSMStatePool:
    """A copy of ``pool`` on ``device`` (same configuration, tensors and slot table)."""
    new = ReplaySSMStatePool(pool.heads, num_layers=pool.num_layers, num_slots=pool.num_slots,
                             ring_length=pool.ring_length, state_dtype=pool.state_dtype, cache_dtype=pool.cache_dtype,
                             ring_layout=pool.ring_layout, device=device)
    for name in ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "slot_errors"):
        getattr(new, name).copy_(getattr(pool, name))
    new._slots = copy.deepcopy(pool._slots)
    return new


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["predecayed", "sglang"])
@pytest.mark.parametrize("heads,batch", [(KDAHeads(8, 8, 128, 128), 8), (KDAHeads(8, 16, 128, 128), 16)],
                         ids=["HV8-B8", "GQA-HV16-B16"])  # (the reference runs on CPU copies: HV32 B32 took over
# 200 s a case there with 16 test workers)
def test_gpu_verify_and_commit_match_reference(heads: KDAHeads, batch: int, layout: str, state: torch.dtype,
                                               tree: bool) -> None:
    """The compiled kernels at K = V = 128, L = 16, T = 4, over steps that cross every fold phase, against the
    reference on CPU copies of the pool: outputs, read_state after each commit."""
    S = batch + 2
    pool = ReplaySSMStatePool(heads, num_layers=2, num_slots=S, ring_length=16, state_dtype=state,
                              cache_dtype=torch.bfloat16, ring_layout=layout, device="cuda")
    gen = torch.Generator().manual_seed(11)
    model = make_model(pool, gen)
    cpu_model = type(model)([type(p)(p.A_log.cpu(), p.dt_bias.cpu()) for p in model.params])
    ids = pool.alloc(batch).tolist()
    slots = [s if r % 7 != 3 else -1 for r, s in enumerate(ids)]
    t = torch.tensor(slots, dtype=torch.int32, device="cuda")
    _warm(pool, model, [[s if r % 5 > i else -1 for r, s in enumerate(slots)] for i in range(4)], gen)
    T = 4
    parents = torch.tensor([[-1, 0, 0, 1]] * batch, dtype=torch.int32, device="cuda") if tree else None
    live = [r for r, s in enumerate(slots) if s >= 0]
    for step in range(6):
        ref = _to(pool, "cpu")
        drafts = random_drafts(pool, batch, T, gen, dtype=torch.bfloat16)
        out = verify_all(pool, model, drafts, t, parents)
        cpu_drafts = type(drafts)(drafts.mixed.cpu(), drafts.a.cpu(), drafts.b.cpu())
        want = verify_all(ref, cpu_model, cpu_drafts, t.cpu(), None if parents is None else parents.cpu())
        assert rel(out[:, live], want[:, live]) < 2e-2, f"step {step}"
        n = torch.randint(0, 3 if tree else T + 1, (batch,), generator=gen, dtype=torch.int32)
        path = torch.tensor([[0, 1, 3, 2]] * batch, dtype=torch.int32) if tree else None
        pool.commit(t, n.cuda(), path=None if path is None else path.cuda())
        ref.commit(t.cpu(), n, path=path)
        pool.check()
        assert torch.equal(pool.cursors.cpu(), ref.cursors)
        assert rel(read_states(pool, [slots[r] for r in live]), read_states(ref, [slots[r] for r in live])) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["predecayed", "sglang"])
def test_gpu_graph_replay_of_verify_and_commit(layout: str) -> None:
    """One CUDA graph holds a whole step (every layer's verify, then commit); replayed over steps with new inputs and
    acceptance copied into its buffers, it equals eager steps on a twin bitwise (the same kernels)."""
    heads = KDAHeads(4, 8, 128, 128)
    pool = ReplaySSMStatePool(heads, num_layers=2, num_slots=10, ring_length=8, ring_layout=layout, device="cuda")
    gen = torch.Generator().manual_seed(12)
    model = make_model(pool, gen)
    ids = pool.alloc(6).tolist()
    slots = torch.tensor([ids[0], -1, ids[1], ids[2], ids[3], ids[4]], dtype=torch.int32, device="cuda")
    _warm(pool, model, [[ids[0], -1, ids[1], ids[2], -1, -1], [ids[0], -1, -1, ids[2], ids[3], -1]], gen)
    twin = _to(pool, "cuda")
    B, T = 6, 3
    static = random_drafts(pool, B, T, gen, dtype=torch.bfloat16)
    n_static = torch.zeros(B, dtype=torch.int32, device="cuda")
    outs = {}

    def step(p: ReplaySSMStatePool, d: object, n: torch.Tensor) -> torch.Tensor:
        o = verify_all(p, model, d, slots)
        p.commit(slots, n)
        return o

    warm = _to(pool, "cuda")  # compile and record direct-launch plans outside the capture
    step(warm, static, n_static)
    from tp_replayssm.pool.spec import _spec_tensors

    # what the pool's first eager step would create (a capture may not copy from the host): its spec tensors and the
    # error-record codes of its calls
    _spec_tensors(pool)
    for layer in range(pool.num_layers):
        pool.guard("verify", layer)
    pool.guard("commit")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs["g"] = step(pool, static, n_static)
    # capture ran nothing: the pool is still the twin's
    for k in range(8):
        d = random_drafts(pool, B, T, gen, dtype=torch.bfloat16)
        n = torch.randint(0, T + 1, (B,), generator=gen, dtype=torch.int32).cuda()
        for name in ("mixed", "a", "b"):
            getattr(static, name).copy_(getattr(d, name))
        n_static.copy_(n)
        graph.replay()
        eager = step(twin, d, n)
        torch.cuda.synchronize()
        assert torch.equal(outs["g"], eager), f"step {k}"
        for name in ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "spec_folded"):
            assert torch.equal(getattr(pool, name), getattr(twin, name)), (k, name)
    pool.check()


# ---- sm_90 code, compiled on the CPU machine ------------------------------------------------------------------


@pytest.mark.timeout(500)
def test_kernels_compile_for_sm90_without_spills(tmp_path: object) -> None:
    """The verify kernels (tensor cores: a chain on a bf16 state with the fold in the chunk loop under the library's
    128-register cap, a chain on an fp32 state with the fold's pass, uncapped, and under the 168-register cap, a tree
    on an fp32 state; CUDA cores: a tree, sglang, fp32 state, the bounded gate) and the commit kernels compile for
    sm_90 with the H200's triton 3.6.0 (benchmarks/spec_regs.py, the strides specialized as the JIT does on the GPU).
    Uncapped they spill nothing, inside a loop or out; under a cap they take at most the cap and keep nothing (bf16
    checkpoint, 128 registers) / at most 88 B (fp32, 168) on the stack. A tensor-core verify whose head is one
    program (one value tile) writes a fold's ring rows without the count of the head's programs: no memory fence; with
    two value tiles the count's acq_rel fence is there. The CUDA-core verify programs stay at <= 168 registers (3
    resident per SM)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200", "")
    if not Path(h200, "triton").is_dir():
        pytest.skip("the H200's triton 3.6.0 is not set up (./dev.sh sets TP_REPLAYSSM_TRITON_H200)")
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "benchmarks"))
    import sass_loops

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    runs = [["--batch", "32", "--heads", "32", "--state", "bf16"],  # the fold in the chunk loop, capped at 128
            ["--batch", "4", "--heads", "32", "--state", "fp32"],  # 64-row value tiles, the fold's pass, uncapped
            ["--batch", "128", "--heads", "32", "--state", "fp32"],  # capped at 168
            ["--batch", "32", "--heads", "32", "--state", "fp32", "--tree"],
            ["--batch", "8", "--heads", "16", "--group", "2", "--state", "fp32", "--tree", "--layout", "sglang",
             "--lower-bound", "-5"],
            ["--commit"]]
    for n, extra in enumerate(runs):
        dump = Path(str(tmp_path)) / str(n)
        proc = subprocess.run([sys.executable, "benchmarks/spec_regs.py", *extra, "--dump", str(dump)], cwd=repo,
                              env=env, capture_output=True, text=True, timeout=360)  # (a busy 2-core machine)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "triton 3.6.0" in proc.stdout, proc.stdout
        stacks = re.findall(r"(\d+) B stack|'stack': (\d+)", proc.stdout)
        cap = re.search(r"maxnreg=(\d+)", proc.stdout)
        spill_bytes = 0 if cap is None else {128: 0, 168: 88}[int(cap.group(1))]
        assert stacks and all(int(a or b) <= spill_bytes for a, b in stacks), proc.stdout
        if cap is not None:
            assert int(re.search(r"(\d+) registers/thread", proc.stdout).group(1)) <= int(cap.group(1)), proc.stdout
        if "--commit" not in extra:
            ins = sass_loops.parse((dump / "kernel.sass").read_text())
            spans = sass_loops.loops(ins)
            # under fp32's cap of 168 the chunk loop stores and reloads some words (8 and 23 of its 605
            # instructions), bounded by the stack above
            in_loops = {None: ("STL", "LDL"), "128": ("STL", "LDL"), "168": ()}[cap and cap.group(1)]
            inside = [t for a, t in ins if sass_loops.opcode(t) in in_loops and
                      any(lo <= a <= hi for lo, hi in spans)]
            assert spans and not inside, (extra, inside[:4])
            readers = re.search(r"tensor_cores=True.*tile_readers=(\d+)", proc.stdout)
            if readers is not None:  # the count's fence (MEMBAR) only where a head has several programs
                fences = [t for _, t in ins if sass_loops.opcode(t) == "MEMBAR"]
                assert bool(fences) == (int(readers.group(1)) > 1), (extra, readers.group(0)[-40:], fences)
        if "tensor_cores=False" in proc.stdout:
            for regs in re.findall(r"(\d+) registers/thread", proc.stdout):
                assert int(regs) <= 168, proc.stdout


@pytest.mark.timeout(600)
def test_verify_plan_choices_cut_barriers_and_registers_in_sm90_code(tmp_path: object) -> None:
    """The tensor-core verify's plan choices at HV32 B32 bf16, T = 4, compiled for sm_90 on CPU (the H200's triton
    3.6.0, benchmarks/spec_regs.py --dump): the library's ``batched_reductions`` leaves at most a third of the CTA
    barriers of separate reductions before the chunk loop (its sums over K share their exchanges) and the chunk loop
    keeps its barrier count; both forms, and ``chunk_prefetch=False``, with the fold's pass and no register cap,
    compile without spills in at most 168 registers per thread (at least 3 programs per SM; the strides specialized as
    the JIT does on the GPU)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200", "")
    if not Path(h200, "triton").is_dir():
        pytest.skip("the H200's triton 3.6.0 is not set up (./dev.sh sets TP_REPLAYSSM_TRITON_H200)")
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "benchmarks"))
    import sass_loops

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    found = {}
    for name, override in (("separate", ["--override", "batched_reductions=false,fold_in_chunks=false,maxnreg=none"]),
                           ("library", ["--override", "chunk_prefetch=false,fold_in_chunks=false,maxnreg=none"])):
        dump = Path(str(tmp_path)) / name
        proc = subprocess.run([sys.executable, "benchmarks/spec_regs.py", "--batch", "32", "--heads", "32", "--state",
                               "bf16", *override, "--dump", str(dump)], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=360)
        assert proc.returncode == 0 and "triton 3.6.0" in proc.stdout, proc.stderr[-3000:]
        ins = sass_loops.parse((dump / "kernel.sass").read_text())
        start, end = sass_loops.loops(ins)[-1]  # the chunk loop: the last backward branch
        bars = [sum(1 for a, t in ins if lo <= a <= hi and sass_loops.opcode(t) == "BAR") for lo, hi in
                ((0, start - 1), (start, end))]
        regs, stack = (int(x) for x in re.search(r"(\d+) registers/thread, \d+ B shared, (\d+) B stack",
                                                  proc.stdout).groups())
        found[name] = (bars, regs, stack)
    (sep_pro, sep_loop), sep_regs, sep_stack = found["separate"]
    (pro, loop), regs, stack = found["library"]
    assert pro * 3 <= sep_pro and loop == sep_loop, found
    assert regs <= 168 and stack == 0 and sep_regs <= 168 and sep_stack == 0, found
