"""The one-launch cursor advance (:mod:`tp_replayssm.kernels.cursor`) against the torch ops and a host model.

The kernel is called directly on ``DEV`` tensors: on a machine without CUDA that is the CPU and the
kernel runs in the Triton interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``; the kernel tests take the
``interpreter`` fixture; a CPU pool itself always takes the torch path); one program covers the whole batch, so
each case costs milliseconds. The
``gpu`` tests run ``pool.advance`` on CUDA, eagerly and inside a captured CUDA graph, against the torch
path on a CPU copy.
"""

from __future__ import annotations

import random

import pytest
import torch

from tp_replayssm import KDAHeads, ReplaySSMStatePool
from tp_replayssm.kernels import cursor as cursor_kernel
from tp_replayssm.kernels.launch import no_flush

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
SENTINEL = 1000  # cursor of slots no row lists: must come back unchanged


def random_case(rng: random.Random, B: int, L: int, num_slots: int,
                with_flags: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(cursors [S+1], slots [B], force_flush [B] or None)`` int32 on the CPU: listed slots (and the
    scratch entry) hold cursors in ``[0, L-1]``, unlisted ones ``SENTINEL``; ~1/5 padding rows, duplicates
    whenever ``B`` exceeds the slots, flags mixed within a duplicated slot's rows."""
    slots = [rng.choice([-1, -5]) if rng.random() < 0.2 else rng.randrange(num_slots) for _ in range(B)]
    listed = set(slots)
    cursors = [rng.randrange(L) if s in listed else SENTINEL for s in range(num_slots)] + [rng.randrange(L)]
    flags = [rng.choice([0, 0, 0, 1, 9]) for _ in range(B)]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return i32(cursors), i32(slots), (i32(flags) if with_flags else None)


def host_model(cursors: list[int], slots: list[int], flags: list[int] | None, L: int) -> list[int]:
    """The documented semantics, row by row on the host (values before this advance)."""
    S = len(cursors) - 1
    out = list(cursors)
    groups: dict[int, bool] = {}
    for b, s in enumerate(slots):
        idx = s if s >= 0 else S
        flushed = cursors[idx] >= L - 1 or (flags is not None and flags[b] != 0)
        groups[idx] = groups.get(idx, False) or flushed
    for idx, flushed in groups.items():
        out[idx] = 0 if flushed else cursors[idx] + 1
    return out


@pytest.mark.parametrize("B", [1, 3, 64, 300])
def test_kernel_matches_torch_ops_and_model(B: int, interpreter: None) -> None:
    rng = random.Random(B)
    hits = cursor_kernel.DIRECT_PLANS.hits
    for L in (1, 2, 5, 16):
        for num_slots in sorted({max(1, B // 3), B + 4}):  # many duplicates / unlisted slots
            for with_flags in (False, True):
                cursors, slots, flags = random_case(rng, B, L, num_slots, with_flags)
                ref, got = cursors.clone(), cursors.to(DEV, copy=True)
                flags_dev = None if flags is None else flags.to(DEV)
                cursor_kernel.advance_torch(ref, slots, flags, L)
                cursor_kernel.advance_launch(got, slots.to(DEV), flags_dev, L)
                got = got.cpu()
                case = (B, L, num_slots, with_flags)
                assert torch.equal(got, ref), case
                expected = host_model(cursors.tolist(), slots.tolist(), None if flags is None else flags.tolist(), L)
                assert got.tolist() == expected, case
                unlisted = set(range(num_slots)) - set(slots.tolist())
                assert all(got[s] == SENTINEL for s in unlisted), case
                if not (slots < 0).any():
                    assert got[num_slots] == cursors[num_slots], case  # scratch untouched without padding
                # force_flush (given or the cached zeros for None) is read, never written
                read = no_flush(B, DEV) if flags is None else flags_dev
                assert torch.equal(read.cpu(), torch.zeros(B, dtype=torch.int32) if flags is None else flags), case
    if DEV.type == "cuda":  # cases of one metadata after the first launched the compiled kernel directly
        assert cursor_kernel.DIRECT_PLANS.hits > hits


def test_duplicates_resolve_to_zero_if_any_row_flushed(interpreter: None) -> None:
    cursors = torch.tensor([2, 2, 4, 0, 7], dtype=torch.int32, device=DEV)  # S = 4, L = 5, scratch = 7
    slots = torch.tensor([0, 0, 1, 1, 2, -1, -2, 0], dtype=torch.int32, device=DEV)
    flags = torch.tensor([0, 0, 0, 0, 0, 0, 0, 3], dtype=torch.int32, device=DEV)
    cursor_kernel.advance_launch(cursors, slots, flags, 5)
    # slot 0: one forced row -> 0; slot 1: none -> 3; slot 2: at L-1 -> 0; slot 3 unlisted; scratch 7 >= L-1 -> 0
    assert cursors.tolist() == [0, 3, 0, 0, 0]


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
    """Gather, barrier, store, barrier, store: the order the duplicate handling relies on."""
    B = 300
    block, warps = cursor_kernel.launch_choice(B)
    kern = cursor_kernel.advance_kernel_for(block, warps)
    args = (torch.zeros(9, dtype=torch.int32), torch.zeros(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32), 4)
    code = kern.bind(args).to_triton_code(kern.configs[0])
    body = code[code.index("def _helion_cursor_advance_kernel"):code.index("def cursor_advance_kernel")]
    marks = [line.strip().split("(")[0] for line in body.splitlines()
             if line.strip().startswith(("tl.debug_barrier", "tl.store")) or "tl.load(cursors" in line]
    assert [m.split(" = ")[-1] for m in marks] == ["tl.load", "tl.debug_barrier", "tl.store", "tl.debug_barrier",
                                                   "tl.store"]
    assert f"_BLOCK_SIZE_0 = tl.constexpr({block})" in code and f"num_warps={warps}" in code


def test_cpu_pool_takes_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ReplaySSMStatePool(KDAHeads(1, 2, 4, 4), num_layers=1, num_slots=3, ring_length=3, device="cpu")
    pool.alloc(3)
    monkeypatch.setattr(cursor_kernel, "advance_launch", lambda *a: pytest.fail("kernel launched for a CPU pool"))
    pool.advance(torch.tensor([0, 2, -1], dtype=torch.int32))
    assert pool.cursors.tolist() == [1, 0, 1, 1]


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
    assert pool.cursors.tolist() == [1, 0, 0, 0, 0, 1, 1]
