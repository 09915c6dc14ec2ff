"""``ReplaySSMStatePool.fork`` (docs/lifecycle.md): forked slots against independent pools that decoded the same
tokens, bit for bit; refused pairs against a snapshot of every pool tensor (free slots NaN-poisoned) with only the
good pairs applied, bit for bit; the debug mode's and the arguments' errors; no read back to the host, and a fork
captured in a CUDA graph (on the GPU). Runs on ``cuda:0`` when there is one, else on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from _lifecycle_helpers import (DEV, H, HV, K, L, LAYOUTS, NL, S, TENSORS, V, Driver, assert_same, assert_slots_equal,
                                bits, busy_pool, ids, snapshot)
from _slot_cases import assert_reported
from tp_replayssm import SlotError
from tp_replayssm.testing import random_decode_inputs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fork_then_divergent_decoding_equals_independent_pools(layout: str) -> None:
    """Slot 0 (mid-ring) is forked onto slot 1 (which had its own history); then rows 0, 1, 2 decode different
    tokens for 5 steps (through a flush). Slot 0 and the bystander slot 2 equal a pool without the fork decoding
    rows 0 and 2; slot 1 equals a pool whose slot 0 decoded row 1's tokens: outputs and every byte of the slots."""
    drv = Driver()
    pool, plain, other = (busy_pool(layout, drv) for _ in range(3))
    pool.fork(ids(0, 3), ids(1, -1))  # (a padding pair too)
    pool.check()
    assert_slots_equal(pool, 1, plain, 0, "right after the fork")
    for step in range(10, 15):
        got = drv.step(pool, [0, 1, 2], seed=step)
        want_02 = drv.step(plain, [0, -1, 2], seed=step)
        want_1 = drv.step(other, [-1, 0, -1], seed=step)
        for layer in range(NL):
            assert torch.equal(got[layer][[0, 2]], want_02[layer][[0, 2]]), (step, layer)
            assert torch.equal(got[layer][1], want_1[layer][1]), (step, layer)
    assert not torch.equal(pool.checkpoint[:, 0], pool.checkpoint[:, 1])  # they did diverge
    assert_slots_equal(pool, 0, plain, 0, "the source")
    assert_slots_equal(pool, 2, plain, 2, "a bystander")
    assert_slots_equal(pool, 1, other, 0, "the fork")
    pool.check()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fork_copies_every_layer_conv_window_and_cursor_and_nothing_else(layout: str) -> None:
    drv = Driver()
    pool = busy_pool(layout, drv, steps=2)
    drv.step(pool, [3], seed=50)  # slot 3's cursor is 3, the others' 2
    before = snapshot(pool)
    pool.fork(ids(3, 1), ids(0, 4))
    pool.check()
    assert pool.cursors[[0, 4]].tolist() == [3, 2]
    for name, old in before.items():
        new = getattr(pool, name)
        want = old.clone()
        if name == "cursors":
            want[[0, 4]] = old[[3, 1]]
        else:
            want[:, [0, 4]] = old[:, [3, 1]]
        assert torch.equal(bits(new), bits(want)), name
    for layer in range(NL):  # the true state and conv windows follow
        assert torch.equal(pool.read_state(layer, ids(0)), pool.read_state(layer, ids(3)))
        assert torch.equal(pool.read_conv_state(layer, ids(0)), pool.read_conv_state(layer, ids(3)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fork_mid_ring_then_the_next_decode_flushes_both_identically(layout: str) -> None:
    """A fork at cursor 3 of L = 4: the next decode of both (the same tokens) flushes both into equal checkpoints,
    both cursors go to 0, and both equal the unforked source's flush."""
    drv = Driver()
    pool, plain = busy_pool(layout, drv), busy_pool(layout, drv)
    assert pool.cursors[0] == L - 1
    pool.fork(ids(0), ids(2))
    gen = torch.Generator().manual_seed(9)
    t = ids(0, 2)
    for layer in range(NL):
        x = random_decode_inputs(1, H, HV, K, V, dtype=torch.float32, device=DEV, generator=gen)
        two = [u.expand(2, -1).contiguous() for u in (x.mixed_qkv, x.a, x.b)]
        p = drv.params[layer]
        out = pool.decode(layer, *two, p.A_log, p.dt_bias, t, conv_weight=drv.conv_w[layer], advance=layer == 1)
        ref = plain.decode(layer, *two, p.A_log, p.dt_bias, ids(0, -1), conv_weight=drv.conv_w[layer],
                           advance=layer == 1)
        assert torch.equal(out[0], out[1]) and torch.equal(out[0], ref[0])
    assert pool.cursors[[0, 2]].tolist() == [0, 0]
    assert_slots_equal(pool, 0, pool, 2, "both flushed")
    assert_slots_equal(pool, 0, plain, 0, "as without the fork")
    pool.check()


BAD_PAIRS = {  # case -> (src, dst, {bad row: the slot the record names})
    "src-out-of-range": ([S, 1], [2, 3], {0: S}),
    "dst-far-out-of-range": ([0, 1], [100000, 3], {0: 100000}),
    "src-freed": ([5, 1], [2, 3], {0: 5}),
    "dst-never-allocated": ([0, 1], [6, 3], {0: 6}),
    "dst-equals-src": ([2, 0], [2, 1], {0: 2}),
    "dst-repeated": ([0, 1], [3, 3], {0: 3, 1: 3}),
    "fan-out": ([0, 0, 1], [2, 3, 4], {}),  # one source into two destinations: every pair copies
    "src-is-a-dst": ([0, 0], [1, 0], {0: 0, 1: 0}),
    "dst-is-another-pairs-src": ([0, 1], [1, 2], {0: 1, 1: 1}),
    "negative-src": ([-1, 1], [2, 3], {0: -1}),
    "every-pair-bad": ([5, 7, 2], [1, 0, 2], {0: 5, 1: 7, 2: 2}),
    "padding-pairs-only-pad": ([7, -1, 0], [-1, -4, 1], {}),  # a padding pair's src names no slot
}


@pytest.mark.parametrize("case", list(BAD_PAIRS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_fork_pairs_are_refused_recorded_and_change_nothing(layout: str, case: str) -> None:
    src, dst, bad = BAD_PAIRS[case]
    pool = busy_pool(layout, Driver())
    before = snapshot(pool)
    pool.fork(ids(*src), ids(*dst))
    good = [(s, d) for r, (s, d) in enumerate(zip(src, dst)) if d >= 0 and r not in bad]
    for name, old in before.items():  # exactly the good pairs happened
        want = old.clone()
        for s, d in good:
            if name == "cursors":
                want[d] = old[s]
            else:
                want[:, d] = old[:, s]
        assert torch.equal(bits(getattr(pool, name)), bits(want)), f"{name}: a refused pair wrote"
    assert_reported(pool, bad, "ReplaySSMStatePool.fork:", f"{len(bad)} row(s)")


def test_fork_debug_mode_raises_at_the_call_and_writes_nothing() -> None:
    pool = busy_pool("predecayed", Driver(), debug=True)
    before = snapshot(pool)
    for src, dst, match in (([0], [5], r"fork \(pairs \[\(0, 5\)\]\) \(debug check\): slots out of range .*\[5\]"),
                            ([0, 1], [1, 2], "named as a source and as a destination: \\[1\\]"),
                            ([3], [3], "as a source and as a destination: \\[3\\]"),
                            ([0, 1], [2, 2], "given more than once in one call: \\[2\\]"),
                            ([-1], [2], r"not allocated: \[-1\]")):
        with pytest.raises(SlotError, match=match):
            pool.fork(ids(*src), ids(*dst))
    assert_same(pool, before, "debug refusals")
    pool.fork(ids(0, 6), ids(1, -1))  # a padding pair's src is not checked
    pool.fork(ids(0, 0), ids(2, 3))  # one source into two destinations
    pool.check()


def test_fork_argument_errors_name_the_argument() -> None:
    pool = busy_pool("predecayed", Driver())
    before = snapshot(pool)
    with pytest.raises(ValueError, match=r"`src` must be a 1-D torch.int32 tensor on .*got tensor shape \[1\] "
                                         r"dtype torch.int64"):
        pool.fork(torch.tensor([0], device=DEV), ids(1))
    with pytest.raises(ValueError, match="`dst` must be a 1-D torch.int32"):
        pool.fork(ids(0), [1])
    with pytest.raises(ValueError, match=r"the same length; got tensor shape \[2\].* and tensor shape \[1\]"):
        pool.fork(ids(0, 1), ids(2))
    pool.fork(ids(), ids())  # nothing to do
    assert_same(pool, before, "argument errors")
    pool.check()


def test_fork_reads_nothing_back_to_the_host() -> None:
    """Every aten op a fork runs (good, bad and padding pairs), seen through a dispatch mode: none reads a value back
    to the host (``.item()``, a 0-d tensor index, ``nonzero``, boolean masks), so a CUDA graph can capture it. The
    op count (each op is about one launch on the GPU) stays small: one gather and one scatter per pool tensor, and
    the verdict and the record."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    pool = busy_pool("predecayed", Driver())
    src, dst = ids(0, 6, 1, 2), ids(3, 1, -1, 2)
    with Ops() as ops:
        pool.fork(src, dst)
    syncing = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.item", "aten.is_nonzero",
               "aten.unique_consecutive", "aten._unique2"}
    assert not syncing & set(ops.names), sorted(syncing & set(ops.names))
    assert len(ops.names) < 130, len(ops.names)  # (121 ops: the verdict counts sources and destinations apart)
    with pytest.raises(SlotError, match="row 1 slot 6, row 3 slot 2"):
        pool.check()


# ---- on the GPU ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fork_in_a_cuda_graph(layout: str) -> None:
    """A fork captured in a CUDA graph with good pairs, replayed with other pairs (one of them bad) in its buffers:
    the good pairs copy, the bad one changes nothing and is reported at the next check(); no host sync in capture
    (capture would fail)."""
    drv = Driver()
    pool, twin = busy_pool(layout, drv), busy_pool(layout, drv)
    src, dst = ids(0, 1), ids(2, 3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pool.fork(src, dst)  # warm-up (the same copy the twin makes below)
        twin.fork(ids(0, 1), ids(2, 3))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.fork(src, dst)
    src.copy_(ids(4, 6))
    dst.copy_(ids(1, 0))  # 4 -> 1 is good; 6 is never allocated
    graph.replay()
    twin.fork(ids(4), ids(1))
    torch.cuda.synchronize()
    for name in TENSORS:
        assert torch.equal(bits(getattr(pool, name)), bits(getattr(twin, name))), name
    with pytest.raises(SlotError, match=r"fork: 1 row\(s\).*row 1 slot 6"):
        pool.check()
    twin.check()
