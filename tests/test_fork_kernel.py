"""The fork kernel (tp_replayssm/kernels/fork.py) against the PyTorch path (lifecycle.fork_torch), bit for bit.

Twin pools hold the same random bits in every tensor (free slots and the conv scratch slot NaN- and
sentinel-filled); one forks with the kernel (Triton's interpreter on the CPU, the GPU under the ``gpu`` marker), the
other with the torch ops, and every pool tensor and the error record must agree bit for bit, over a sequence of
calls with good, padding and every kind of refused pair. Also: the plan's rules, the fallback for slot blocks that
are not whole words, and the kernel compiled for sm_90 with the H200's triton (registers, no spills).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError
from tp_replayssm.kernels import fork as fk
from tp_replayssm.kernels.guard import RECORDED_ROWS
from tp_replayssm.kernels.backend import use_cpu_backend
from tp_replayssm.kernels.guard import FREE_CURSOR
from tp_replayssm.pool import lifecycle

REPO = Path(__file__).resolve().parents[1]
TENSORS = ("checkpoint", "d_cache", "k_cache", "g_cache", "conv_state", "cursors", "slot_errors")
S, L, NL = 8, 4, 2


def make_pool(heads: KDAHeads, device: torch.device | str, *, layout: str = "predecayed", conv: int = 4,
              state: torch.dtype = torch.float32, num_layers: int = NL, num_slots: int = S, ring: int = L,
              seed: int = 0) -> ReplaySSMStatePool:
    """Slots 0-4 allocated with random bits everywhere and random cursors in [0, L-1], slot 5 allocated and freed,
    6.. never allocated; the free slots NaN-filled, the conv scratch slot filled with a sentinel."""
    pool = ReplaySSMStatePool(heads, num_layers=num_layers, num_slots=num_slots, ring_length=ring,
                              state_dtype=state, ring_layout=layout, conv_kernel_size=conv, device=device)
    pool.alloc(6)
    pool.free([5])
    gen = torch.Generator().manual_seed(seed)
    for name in ("checkpoint", "d_cache", "k_cache", "g_cache", "conv_state"):
        t = getattr(pool, name)
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
            t[:, 5:num_slots] = float("nan")
            if name == "conv_state":
                t[:, num_slots] = -12345.0  # the scratch window
    pool.cursors[:5] = torch.randint(0, ring, (5,), generator=gen, dtype=torch.int32).to(pool.device)
    assert pool.cursors[5:num_slots].eq(FREE_CURSOR).all()
    return pool


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN equals NaN)."""
    if not t.dtype.is_floating_point:
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def recorded(errors: torch.Tensor) -> tuple[list[int], list[tuple[int, int]]]:
    """An error record as (its counts, its recorded (row, slot) pairs sorted): the kernel's programs record in the
    order they run, which only the interpreter makes the row order."""
    e = errors.tolist()
    pairs = sorted((e[4 + 2 * i], e[5 + 2 * i]) for i in range(min(e[1], RECORDED_ROWS)))
    return e[:3], pairs


def assert_twins(pool: ReplaySSMStatePool, twin: ReplaySSMStatePool, what: str) -> None:
    for name in TENSORS:
        a, b = getattr(pool, name), getattr(twin, name)
        if a is None:
            assert b is None
            continue
        if name == "slot_errors":
            assert recorded(a) == recorded(b), f"{what}: the error records differ: {a.tolist()} / {b.tolist()}"
            continue
        assert torch.equal(bits(a), bits(b)), f"{what}: {name} differs between the kernel and the torch ops"


def i32(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


# calls made in sequence (the record accumulates): good pairs, padding, every kind of refused pair
CALLS = (
    ([0, 3, -5], [1, -1, -2]),  # a good pair, two padding pairs (src < -1: the programs run the verdict, idle)
    ([S, 1, 2], [4, 3, 5]),  # src out of range; a good pair; dst freed
    ([0, 0, 2], [3, 4, 0]),  # a source that is another pair's destination: all three refused
    ([-1, 2, 1], [3, 2, 100000]),  # negative src; dst == src; dst far out of range
    ([4, 7, 3], [2, -7, 1]),  # good (4 -> 2); a padding pair whose src is never allocated; good (3 -> 1)
    ([0, 1], [1, 2]),  # dst is another pair's src: both refused
    ([6, 3], [0, 4]),  # src never allocated; good
    ([1, 1, 5], [0, 3, -1]),  # fan-out: one source into two destinations (both good); a padding pair
)


def run_calls(pool: ReplaySSMStatePool, twin: ReplaySSMStatePool, calls: tuple, device: torch.device | str,
              kernel: object, *, launches: bool = True) -> None:
    """Each call forks ``pool`` through ``kernel()``'s context (the kernel path; with ``launches``, the torch ops
    would fail there) and ``twin`` with the torch ops."""
    torch_ops = lifecycle.fork_torch
    for i, (src, dst) in enumerate(calls):
        s, d = i32(src, device), i32(dst, device)
        with kernel(), pytest.MonkeyPatch.context() as mp:
            if launches:
                mp.setattr(lifecycle, "fork_torch", _no_torch_ops)
            pool.fork(s, d)
        torch_ops(twin, s, d, twin.guard("fork"))
        assert_twins(pool, twin, f"call {i} {src} -> {dst}")
        for p in (pool, twin):
            stir(p, i)


def stir(pool: ReplaySSMStatePool, i: int) -> None:
    """Make the allocated slots 0-4 differ from each other again (a later copy between slots that an earlier call
    made equal then shows), the same way in twin pools; cursors stay in [0, L-1]."""
    for name in ("checkpoint", "d_cache", "k_cache", "g_cache", "conv_state"):
        t = getattr(pool, name)
        if t is not None:
            shift = torch.arange(1, 6, dtype=torch.float32, device=t.device) * (i + 1)
            t[:, :5] += shift.view(1, 5, *[1] * (t.dim() - 2)).to(t.dtype)
    pool.cursors[:5] = (pool.cursors[:5] + torch.arange(5, dtype=torch.int32, device=pool.device)) % pool.ring_length


def _no_torch_ops(*args: object) -> None:
    raise AssertionError("the fork ran the torch ops where the kernel should run")


def interpreted() -> object:
    return use_cpu_backend("interpreter")


# ---- Triton's interpreter ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,conv,state", [("predecayed", 4, torch.float32), ("sglang", 0, torch.bfloat16)])
def test_kernel_in_the_interpreter_matches_the_torch_ops_bit_for_bit(interpreter: None, layout: str, conv: int,
                                                                     state: torch.dtype) -> None:
    """HV = 8, K = V = 32 (an fp32 checkpoint spans two chunks; the conv window's 576 words are masked over two
    512-word blocks), then a call of 300 pairs (the slot scan takes two steps) with good, padding and bad pairs
    beyond the first step; the record's text names every refused pair of the first bad call."""
    heads = KDAHeads(2, 8, 32, 32)
    pool, twin = (make_pool(heads, "cpu", layout=layout, conv=conv, state=state, seed=1) for _ in range(2))
    words = fk.pool_words(pool)
    assert words is not None and (words.views[4] is None) == (conv == 0)
    if state == torch.float32:
        assert words.plan.chunks == 2, words.plan
    run_calls(pool, twin, CALLS, "cpu", interpreted)
    src, dst = [0] * 300, [-1] * 300
    src[3], dst[3] = 1, 0  # good
    src[280], dst[280] = 2, 3  # good, in the scan's second step
    src[299], dst[299] = 4, 0  # refused with pair 3: slot 0 named twice, once in each step
    run_calls(pool, twin, ((src, dst),), "cpu", interpreted)
    with pytest.raises(SlotError) as info:
        pool.check()
    msg = str(info.value)
    # the first bad call's rows and every later bad fork call's (one code for all fork calls): 13 rows, 8 recorded
    assert msg.startswith("ReplaySSMStatePool.fork: 13 row(s)"), msg
    assert "row 0 slot 8, row 2 slot 5, row 0 slot 0" in msg, msg
    twin.slot_errors.zero_()
    pool.check()


def test_pool_without_whole_word_slot_blocks_runs_the_torch_ops(interpreter: None) -> None:
    """A bf16 conv window of 9 channels x 1 step (18 bytes per slot block) is not a whole number of int32 words:
    the fork takes the torch ops (same results), and word_view says why for that tensor only."""
    heads = KDAHeads(1, 1, 3, 3)
    pool, twin = (make_pool(heads, "cpu", conv=2, seed=2) for _ in range(2))
    assert pool.conv_state.dtype == torch.bfloat16 and pool.conv_state[0, 0].numel() == 9
    assert fk.word_view(pool.conv_state) is None and fk.word_view(pool.checkpoint) is not None
    assert fk.pool_words(pool) is None
    run_calls(pool, twin, CALLS[:3], "cpu", interpreted, launches=False)


def test_word_views_and_plan_rules() -> None:
    """Word views: the words of a slot block, strides in words, a view of the same storage; a layer slice too. The
    plan: C = ceil(max words / MAX_BLOCK) chunks; each block the power of two that spans a tensor in <= C chunks."""
    t = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).view(2, 3, 4, 6).bfloat16()
    words, W, ls, ss = fk.word_view(t)
    assert (W, ls, ss) == (12, 36, 12) and words.dtype == torch.int32 and words.numel() == 72
    assert words.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert torch.equal(words[ls + 2 * ss:ls + 2 * ss + W].view(torch.bfloat16).view(4, 6), t[1, 2])
    sliced = t[:, 1:]  # not contiguous as a whole; its slot blocks are
    words, W, ls, ss = fk.word_view(sliced)
    assert (W, ls, ss) == (12, 36, 12) and torch.equal(words[:W].view(torch.bfloat16).view(4, 6), t[0, 1])
    assert fk.word_view(t[:, :, :, 1:]) is None  # a slot block that is not contiguous
    # the Kimi-Linear shapes: HV_l = 4 and 32, K = V = 128, L = 16, fp32 checkpoint, bf16 rings and conv (W = 4)
    p4 = fk.plan_fork((65536, 4096, 4096, 8192, 2304))
    assert (p4.chunks, p4.blocks, p4.num_warps) == (16, (4096, 256, 256, 512, 256), 8)
    p32 = fk.plan_fork((524288, 32768, 32768, 65536, 18432))
    assert (p32.chunks, p32.blocks, p32.num_warps) == (128, (4096, 256, 256, 512, 256), 8)
    tiny = fk.plan_fork((1024, 64, 64, 128, 0))
    assert (tiny.chunks, tiny.blocks, tiny.num_warps) == (1, (1024, 64, 64, 128, 32), 2)
    for words_t in ((65536, 4096, 4096, 8192, 2304), (32768, 4096, 4096, 8192, 2304), (3, 5, 7, 9, 11),
                    (100000, 1, 0, 4097, 12345)):
        plan = fk.plan_fork(words_t)
        for w, b in zip(words_t, plan.blocks):
            assert b & (b - 1) == 0 and fk.MIN_BLOCK <= b <= fk.MAX_BLOCK and -(-w // b) <= plan.chunks
    with pytest.raises(ValueError, match=r"`words` must be 5 counts"):
        fk.plan_fork((0, 0, 0, 0, 0))
    assert fk.fork_bytes((65536, 4096, 4096, 8192, 2304), 20, 1) == 13475848  # bench_lifecycle's 12.85 MB and cursor


# ---- sm_90 code, compiled on the CPU machine ----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_kernel_compiles_for_sm90_without_spills() -> None:
    """The fork kernel for the HV_l = 4 and 32 pools compiles for sm_90 with the H200's triton 3.6.0
    (benchmarks/fork_regs.py): no stack (spills), and the 16 KiB checkpoint chunk loads as 16-byte vectors."""
    h200 = os.environ.get("TP_REPLAYSSM_TRITON_H200", "")
    if not Path(h200, "triton").is_dir():
        pytest.skip("the H200's triton 3.6.0 is not set up (./dev.sh sets TP_REPLAYSSM_TRITON_H200)")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    proc = subprocess.run([sys.executable, "benchmarks/fork_regs.py", "--heads", "4,32"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("triton 3.6.0")]
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert re.search(r" 0 B stack", line) and int(re.search(r"(\d+) registers", line).group(1)) <= 128, line
        assert int(re.search(r"(\d+) LDG\.E\.128", line).group(1)) >= 4, line


# ---- on the GPU ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout,state,conv", [("predecayed", torch.float32, 4), ("sglang", torch.bfloat16, 4),
                                               ("predecayed", torch.bfloat16, 0)])
def test_kernel_on_gpu_matches_the_torch_ops_bit_for_bit(layout: str, state: torch.dtype, conv: int) -> None:
    """The Kimi-Linear shape of one TP8 rank (HV_l = 4, K = V = 128, L = 16, 3 layers, 16 slots) on the GPU: the
    kernel (several chunks per slot-layer) against the torch ops on a twin pool on the same device, bit for bit,
    every call of CALLS and a call of 300 pairs; then eager repeats go through the direct launch."""
    dev = torch.device("cuda", 0)
    heads = KDAHeads(4, 4, 128, 128)
    pool, twin = (make_pool(heads, dev, layout=layout, conv=conv, state=state, num_layers=3, num_slots=16,
                            ring=16, seed=3) for _ in range(2))
    assert fk.pool_words(pool).plan.chunks == (16 if state == torch.float32 else 8)
    run_calls(pool, twin, CALLS, dev, _no_context)
    src, dst = [0] * 300, [-1] * 300
    src[3], dst[3], src[280], dst[280], src[299], dst[299] = 1, 0, 2, 3, 4, 0
    run_calls(pool, twin, ((src, dst),), dev, _no_context)
    hits = fk.DIRECT_PLANS.hits
    run_calls(pool, twin, CALLS[:1] * 3, dev, _no_context)
    assert fk.DIRECT_PLANS.hits >= hits + 2
    torch.cuda.synchronize()
    with pytest.raises(SlotError):
        pool.check()
    with pytest.raises(SlotError):
        twin.check()


@pytest.mark.gpu
def test_kernel_on_gpu_in_a_cuda_graph_with_large_offsets() -> None:
    """A captured fork replayed with new ids (good, padding, refused) in its buffers equals the torch ops; a pool
    whose checkpoint passes 2**31 words (int64 offsets) copies its last slot correctly."""
    dev = torch.device("cuda", 0)
    heads = KDAHeads(4, 4, 128, 128)
    pool, twin = (make_pool(heads, dev, num_layers=2, num_slots=16, ring=16, seed=4) for _ in range(2))
    src, dst = i32([0, 1], dev), i32([2, 3], dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pool.fork(src, dst)
        lifecycle.fork_torch(twin, src, dst, twin.guard("fork"))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.fork(src, dst)
    for s, d in (([4, 3], [0, -1]), ([2, 6], [1, 0]), ([3, 3], [4, 0])):
        src.copy_(i32(s, dev))
        dst.copy_(i32(d, dev))
        graph.replay()
        lifecycle.fork_torch(twin, i32(s, dev), i32(d, dev), twin.guard("fork"))
        torch.cuda.synchronize()
        assert_twins(pool, twin, f"replay {s} -> {d}")
    del pool, twin
    # an fp32 checkpoint of 2 layers x 16386 slots x 65536 words: slot 16385 of layer 1 starts past 2**31 words
    big = ReplaySSMStatePool(heads, num_layers=2, num_slots=16386, ring_length=16, conv_kernel_size=0, device=dev)
    assert (big.checkpoint[1, 16385].data_ptr() - big.checkpoint.data_ptr()) // 4 > 2**31
    big.alloc(16386)
    big.checkpoint[:, 0].normal_()
    big.g_cache[:, 0].normal_()
    big.fork(i32([0], dev), i32([16385], dev))
    torch.cuda.synchronize()
    assert torch.equal(bits(big.checkpoint[:, 16385]), bits(big.checkpoint[:, 0]))
    assert torch.equal(bits(big.g_cache[:, 16385]), bits(big.g_cache[:, 0]))
    big.check()


class _no_context:
    """The kernel path as it is (on CUDA tensors the kernel runs anyway)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
