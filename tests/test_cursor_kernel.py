"""The one-launch cursor advance (:mod:`tp_replayssm.kernels.cursor`) against the torch ops and a host model.

The kernel is called directly on ``DEV`` tensors: on a machine without CUDA that is the CPU and the
kernel runs in the Triton interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``; the kernel tests take the
``interpreter`` fixture; a CPU pool itself always takes the torch path); one program covers the whole batch, so
each case costs milliseconds. The
``gpu`` tests run ``pool.advance`` on CUDA, eagerly and inside a captured CUDA graph, against the torch
path on a CPU copy.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch

from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.kernels import cursor as cursor_kernel
from tp_replayssm.kernels.args import no_flush
from tp_replayssm.kernels.guard import ERROR_WORDS, FREE_CURSOR, RECORDED_ROWS, SlotGuard, call_code

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
SENTINEL = 1000  # cursor of slots no row lists: must come back unchanged


def random_case(rng: random.Random, B: int, L: int, num_slots: int,
                with_flags: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(cursors [S+1], slots [B], force_flush [B] or None)`` int32 on the CPU: listed slots (and the
    scratch entry) hold cursors in ``[0, L-1]`` (~1/8 of them free: ``FREE_CURSOR``), unlisted ones ``SENTINEL``;
    ~1/5 padding rows, ~1/10 slots out of range, repeated slots whenever ``B`` exceeds the slots."""
    slots = [rng.choice([-1, -5]) if rng.random() < 0.2 else
             num_slots + rng.randrange(3) if rng.random() < 0.1 else rng.randrange(num_slots) for _ in range(B)]
    listed = set(slots)
    cursors = [(FREE_CURSOR if rng.random() < 0.125 else rng.randrange(L)) if s in listed else SENTINEL
               for s in range(num_slots)] + [rng.randrange(L)]
    flags = [rng.choice([0, 0, 0, 1, 9]) for _ in range(B)]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return i32(cursors), i32(slots), (i32(flags) if with_flags else None)


def host_model(cursors: list[int], slots: list[int], flags: list[int] | None, L: int) -> tuple[list[int], set]:
    """The documented semantics, row by row on the host (values before this advance): a row whose slot is in
    range, named once and allocated moves its cursor; every other row changes nothing, and the rows with a slot
    ``>= 0`` among them are the bad rows ``{(row, slot)}``."""
    S = len(cursors) - 1
    out = list(cursors)
    named = collections.Counter(s for s in slots if 0 <= s < S)
    bad = set()
    for b, s in enumerate(slots):
        if 0 <= s < S and named[s] == 1 and 0 <= cursors[s] < L:
            flushed = cursors[s] >= L - 1 or (flags is not None and flags[b] != 0)
            out[s] = 0 if flushed else cursors[s] + 1
        elif s >= 0:
            bad.add((b, s))
    return out, bad


def _guard() -> SlotGuard:
    return SlotGuard(torch.zeros(ERROR_WORDS, dtype=torch.int32, device=DEV),
                     torch.tensor([call_code("advance")], dtype=torch.int32, device=DEV))


def _recorded(guard: SlotGuard) -> tuple[int, set]:
    """``(bad rows counted, the recorded (row, slot) pairs)`` of an error record."""
    rec = guard.errors.tolist()
    return rec[2], {(rec[4 + 2 * i], rec[5 + 2 * i]) for i in range(min(rec[1], RECORDED_ROWS))}


@pytest.mark.parametrize("B", [1, 3, 64, 300])
def test_kernel_matches_torch_ops_and_model(B: int, interpreter: None) -> None:
    rng = random.Random(B)
    hits = cursor_kernel.DIRECT_PLANS.hits
    for L in (1, 2, 5, 16):
        for num_slots in sorted({max(1, B // 3), B + 4}):  # many duplicates / unlisted slots
            for with_flags in (False, True):
                cursors, slots, flags = random_case(rng, B, L, num_slots, with_flags)
                ref, got = cursors.clone(), cursors.to(DEV, copy=True)
                flags_dev = None if flags is None else flags.to(DEV, copy=True)  # (a copy: on CPU .to is a no-op)
                ref_guard, guard = _guard(), _guard()
                ref_guard = SlotGuard(ref_guard.errors.cpu(), ref_guard.code.cpu())
                cursor_kernel.advance_torch(ref, slots, flags, L, ref_guard)
                cursor_kernel.advance_launch(got, slots.to(DEV), flags_dev, L, guard)
                got = got.cpu()
                case = (B, L, num_slots, with_flags)
                assert torch.equal(got, ref), case
                expected, bad = host_model(cursors.tolist(), slots.tolist(),
                                           None if flags is None else flags.tolist(), L)
                assert got.tolist() == expected, case
                n_bad, pairs = _recorded(guard)
                assert n_bad == len(bad) and pairs <= bad and len(pairs) == min(len(bad), RECORDED_ROWS), case
                assert _recorded(ref_guard)[0] == len(bad) and _recorded(ref_guard)[1] <= bad, case
                unlisted = set(range(num_slots)) - set(slots.tolist())
                assert all(got[s] == SENTINEL for s in unlisted), case
                assert got[num_slots] == cursors[num_slots], case  # the scratch entry is never moved
                # force_flush (given or the cached zeros for None) is read, never written
                read = no_flush(B, DEV) if flags is None else flags_dev
                assert torch.equal(read.cpu(), torch.zeros(B, dtype=torch.int32) if flags is None else flags), case
                assert flags_dev is None or flags_dev.data_ptr() != flags.data_ptr()  # not compared with itself
    if DEV.type == "cuda":  # cases of one metadata after the first launched the compiled kernel directly
        assert cursor_kernel.DIRECT_PLANS.hits > hits


def test_repeated_free_and_out_of_range_slots_are_refused(interpreter: None) -> None:
    cursors = torch.tensor([2, 2, 4, 0, FREE_CURSOR, 7], dtype=torch.int32, device=DEV)  # S = 5, L = 5, scratch 7
    slots = torch.tensor([0, 0, 1, 2, -1, 4, 9, 3], dtype=torch.int32, device=DEV)
    flags = torch.tensor([1, 0, 0, 0, 0, 0, 0, 3], dtype=torch.int32, device=DEV)
    guard = _guard()
    cursor_kernel.advance_launch(cursors, slots, flags, 5, guard)
    # slot 0 named twice: refused; slot 1 -> 3; slot 2 at L-1 -> 0; slot 3 forced -> 0; slot 4 free: refused; slot 9
    # out of range: refused; the scratch entry stays
    assert cursors.tolist() == [2, 3, 0, 0, FREE_CURSOR, 7]
    assert _recorded(guard) == (4, {(0, 0), (1, 0), (5, 4), (6, 9)})


def test_no_flush_flags_cached_and_zero() -> None:
    a = no_flush(7, torch.device("cpu"))
    assert a is no_flush(7, torch.device("cpu"))
    assert a.dtype == torch.int32 and a.shape == (7,) and not a.any()


def test_launch_choice() -> None:
    for B in (1, 31, 32, 33, 1000, 1024, 1025, 4096, 8193, cursor_kernel.MAX_ROWS):
        block, warps = cursor_kernel.launch_choice(B)
        assert block >= B and block & (block - 1) == 0 and block < 2 * max(B, 32)
        assert 4 <= warps <= 32 and block <= 32 * warps * 16
        assert warps == 4 if B <= 1024 else warps > 4


def test_generated_code_has_one_program_and_the_barriers() -> None:
    """Count, barrier, read, barrier, store on the cursor table: the order the refusal of repeated slots relies on
    (every row's count lands before any row reads, every read before any store)."""
    B = 300
    block, warps = cursor_kernel.launch_choice(B)
    kern = cursor_kernel.advance_kernel_for(block, warps)
    args = (torch.zeros(9, dtype=torch.int32), torch.zeros(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32),
            torch.zeros(ERROR_WORDS, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 4)
    code = kern.bind(args).to_triton_code(kern.configs[0])
    body = code[code.index("def _helion_cursor_advance_kernel"):code.index("\ndef cursor_advance_kernel")]
    marks = [line.strip().split("(")[0].split(" = ")[-1] for line in body.splitlines()
             if ("tl.debug_barrier" in line or "(cursors" in line) and not line.strip().startswith("#")]
    assert marks == ["tl.atomic_add", "tl.debug_barrier", "tl.load", "tl.debug_barrier", "tl.store"], marks
    assert f"_BLOCK_SIZE_0 = tl.constexpr({block})" in code and f"num_warps={warps}" in code


def test_cpu_pool_takes_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ReplaySSMStatePool(KDAHeads(1, 2, 4, 4), num_layers=1, num_slots=3, ring_length=3, device="cpu")
    pool.alloc(3)
    monkeypatch.setattr(cursor_kernel, "advance_launch", lambda *a: pytest.fail("kernel launched for a CPU pool"))
    pool.advance(torch.tensor([0, 2, -1], dtype=torch.int32))
    assert pool.cursors.tolist() == [1, 0, 1, 0]  # (padding rows leave the scratch entry alone)


# ---- GPU: the pool's kernel path, eager and in a CUDA graph ---------------------------------------

def _cuda_pool(num_slots: int, L: int) -> ReplaySSMStatePool:
    dev = torch.device("cuda", torch.cuda.current_device())
    return ReplaySSMStatePool(KDAHeads(1, 1, 16, 16), num_layers=1, num_slots=num_slots, ring_length=L, device=dev)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 3, 64, 300, 1500, 5000, cursor_kernel.MAX_ROWS, cursor_kernel.MAX_ROWS + 5])
def test_pool_advance_on_cuda_matches_torch_ops(B: int) -> None:
    rng = random.Random(B)
    hits = cursor_kernel.DIRECT_PLANS.hits
    for L in (1, 2, 5, 16):
        for num_slots in sorted({max(1, B // 3), B + 4}):
            pool = _cuda_pool(num_slots, L)
            for with_flags in (False, True):
                cursors, slots, flags = random_case(rng, B, L, num_slots, with_flags)
                ref = cursors.clone()
                cursor_kernel.advance_torch(ref, slots, flags, L)
                pool.cursors.copy_(cursors)
                pool.slot_errors.zero_()
                pool.advance(slots.to(pool.device), None if flags is None else flags.to(pool.device))
                assert torch.equal(pool.cursors.cpu(), ref), (B, L, num_slots, with_flags)


@pytest.mark.gpu
def test_pool_advance_in_cuda_graph_matches_torch_ops() -> None:
    """Capture one advance (static slots/flags), replay it over several ring cycles with fresh flags
    and cursors, and match the torch path on a CPU copy after every replay."""
    B, L, num_slots = 96, 5, 40
    pool = _cuda_pool(num_slots, L)
    rng = random.Random(0)
    _, slots_cpu, _ = random_case(rng, B, L, num_slots, True)
    slots = slots_cpu.to(pool.device)
    flags = torch.zeros(B, dtype=torch.int32, device=pool.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up before capture
        pool.advance(slots, flags)
        pool.advance(slots)
    torch.cuda.current_stream().wait_stream(side)
    graphs = {}
    for with_flags in (True, False):
        graphs[with_flags] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[with_flags]):
            pool.advance(slots, flags if with_flags else None)
    ref = pool.cursors.cpu()
    for step in range(3 * L):
        with_flags = step % 3 != 2
        flags_cpu = torch.tensor([1 if rng.random() < 0.1 else 0 for _ in range(B)], dtype=torch.int32)
        if step == L:  # reload arbitrary cursors mid-run: the graph reads them on the device
            ref = random_case(rng, B, L, num_slots, True)[0]
            pool.cursors.copy_(ref)
        flags.copy_(flags_cpu)
        graphs[with_flags].replay()
        cursor_kernel.advance_torch(ref, slots_cpu, flags_cpu if with_flags else None, L)
        assert torch.equal(pool.cursors.cpu(), ref), step


@pytest.mark.gpu
@pytest.mark.multigpu
def test_pool_advance_runs_on_the_pools_device() -> None:
    pool = ReplaySSMStatePool(KDAHeads(1, 1, 16, 16), num_layers=1, num_slots=6, ring_length=3, device="cuda:1")
    pool.alloc(6)
    torch.cuda.set_device(0)
    pool.advance(torch.tensor([0, 0, 5, -1], dtype=torch.int32, device="cuda:1"))
    assert pool.cursors.tolist() == [0, 0, 0, 0, 0, 1, 0]  # slot 0 named twice: refused
