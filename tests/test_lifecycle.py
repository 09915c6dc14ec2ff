"""A request's life in the pool (docs/lifecycle.md): ``fork``, ``export_state`` / ``import_state`` and resharding.

Every test runs on ``cuda:0`` when there is one (the Helion kernels then decode), else on the CPU (the PyTorch
path). Forked slots are held to independent pools that decoded the same tokens, bit for bit; refused fork pairs to a
snapshot of every pool tensor (free slots NaN-poisoned) with only the good pairs applied, bit for bit; imports to
the uninterrupted pool up to the rounding of a materialized ring (fp32 checkpoint and fp32 rings: 1e-5).
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _dist_helpers as h
import _lifecycle_workers as lw
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError, StateShard
from tp_replayssm.kernels.guard import FREE_CURSOR
from tp_replayssm.testing import random_decode_inputs, random_head_params, rel_err

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
H, HV, K, V = 2, 4, 16, 16
NL, S, L, W = 2, 8, 4, 4
HEADS = KDAHeads(H, HV, K, V)
TENSORS = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "conv_state")
LAYOUTS = ["predecayed", "sglang"]
REPO = Path(__file__).resolve().parent.parent


# ---- helpers -------------------------------------------------------------------------------------------------------


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


# ---- fork ---------------------------------------------------------------------------------------------------------


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
    if not bad:
        pool.check()
        return
    with pytest.raises(SlotError) as info:
        pool.check()
    msg = str(info.value)
    assert msg.startswith("ReplaySSMStatePool.fork:") and f"{len(bad)} row(s)" in msg, msg
    for row, slot in bad.items():
        assert f"row {row} slot {slot}" in msg, msg
    pool.check()  # cleared


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


# ---- export -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_is_read_state_of_every_layer_with_metadata_and_changes_nothing(layout: str) -> None:
    pool = busy_pool(layout, Driver(), state=torch.bfloat16, steps=2)
    before = snapshot(pool)
    shard = pool.export_state(ids(3, 0, 3))  # (reading may name a slot twice)
    assert_same(pool, before, "export")
    assert shard.states.device.type == "cpu" and shard.states.dtype == torch.float32
    assert tuple(shard.states.shape) == (NL, 3, HV, V, K)
    assert tuple(shard.conv_states.shape) == (NL, 3, HEADS.qkv_width, W - 1)
    assert shard.conv_states.dtype == pool.conv_dtype
    for layer in range(NL):  # the same replay, all layers in one batch: bitwise on the CPU, fp32 sums on the GPU
        want = pool.read_state(layer, ids(3, 0, 3)).cpu()
        if DEV.type == "cpu":
            assert torch.equal(shard.states[layer], want)
        else:
            assert rel_err(shard.states[layer], want) < 1e-6
        assert torch.equal(shard.conv_states[layer], pool.read_conv_state(layer, ids(3, 0, 3)).cpu())
    assert (shard.heads, shard.tp_rank, shard.tp_size, shard.num_layers, shard.ring_length, shard.ring_layout) == \
        (HEADS, 0, 1, NL, L, layout)
    assert (shard.state_dtype, shard.cache_dtype, shard.conv_kernel_size, shard.conv_dtype) == \
        (torch.bfloat16, torch.bfloat16, W, torch.bfloat16)
    assert (shard.v_heads, shard.q_heads, shard.source_slots, shard.num_requests) == \
        (range(0, HV), range(0, H), (3, 0, 3), 3)
    assert (shard.conv_q_channels, shard.conv_k_channels, shard.conv_v_channels) == (K, K, V)
    assert shard.ready and shard.wait() is shard
    text = repr(shard)
    for name in ("heads=KDAHeads(", "tp_rank=0", "tp_size=1", "v_head_start=0", "v_head_end=4", "q_head_end=2",
                 "num_layers=2", "ring_length=4", f"ring_layout='{layout}'", "state_dtype=torch.bfloat16",
                 "cache_dtype=", "conv_kernel_size=4", "conv_dtype=", "conv_q_channels=16", "conv_v_channels=16",
                 "source_slots=(3, 0, 3)", "states=tensor shape [2, 3, 4, 16, 16] dtype torch.float32",
                 "conv_states=tensor shape [2, 3, 128, 3]"):
        assert name in text, (name, text)
    assert "tensor([" not in text  # no values
    no_conv = make_pool(layout, conv=False)
    s0 = no_conv.export_state(no_conv.alloc(1), device=None)
    assert s0.conv_states is None and s0.conv_dtype is None and s0.conv_kernel_size == 0
    assert s0.states.device == DEV and not s0.states.abs().any()


def test_export_and_import_check_slots_on_the_host_after_earlier_bad_calls() -> None:
    drv = Driver()
    pool = busy_pool("predecayed", drv)
    shard = pool.export_state(ids(0))
    drv.step(pool, [0, 6], seed=1)  # a bad row, recorded
    before = snapshot(pool)
    with pytest.raises(SlotError, match=r"decode\(layer=0\)"):  # the recorded call is reported first
        pool.export_state(ids(1))
    with pytest.raises(SlotError, match=r"export_state: slots out of range \[0, 8\) or not allocated: \[5\]"):
        pool.export_state([5])
    with pytest.raises(SlotError, match=r"import_state: slots out of range \[0, 8\) or not allocated: \[7\]"):
        pool.import_state([7], shard)
    with pytest.raises(SlotError, match=r"import_state: slots given more than once in one call: \[2\]"):
        pool.import_state(ids(2, 2), [shard, shard])
    assert_same(pool, before, "refused exports and imports")


# ---- round trips ---------------------------------------------------------------------------------------------------


def _carry(shard: StateShard, how: str, tmp_path: Path) -> StateShard:
    if how == "pickle":
        return pickle.loads(pickle.dumps(shard))
    if how == "torch.save":
        path = tmp_path / "shard.pt"
        torch.save(shard, path)
        return torch.load(path, weights_only=True)  # StateShard is a registered safe global
    if how == "cpu-and-back":
        return shard.to("cpu").to(DEV)
    return shard


ROUND_TRIPS = {  # how -> (carry, the target: "same pool" or a fresh pool's kwargs)
    "same-pool-other-slot": ("as-is", None),
    "pickle-fresh-pool": ("pickle", dict()),
    "torch.save-fresh-pool-other-layout": ("torch.save", dict(layout="other")),
    "cpu-and-back-bf16-state": ("cpu-and-back", dict(state=torch.bfloat16)),
}


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_keeps_decoding(layout: str, how: str, tmp_path: Path) -> None:
    """Export slot 2 (cursor 2, mid-ring), carry the shard, import it into a busy slot of this or a fresh pool (its
    ring is emptied, its cursor 0, no other slot changes); the import's state equals the source's; then both decode
    the same tokens for 5 steps (through a flush): the outputs match to 1e-5 with fp32 checkpoints and fp32 rings
    (the materialized ring is one fp32 rounding away), to 1e-2 with a bf16 checkpoint (the folded state is rounded
    to bf16 once more)."""
    drv = Driver()
    carry, target_kw = ROUND_TRIPS[how]
    src = busy_pool(layout, drv, steps=2, cache=torch.float32)
    shard = _carry(src.export_state(ids(2), device="cpu" if carry != "as-is" else None), carry, tmp_path)
    if target_kw is None:
        dst, slot = src, 4  # a request of its own until now: its ring holds entries, its cursor is 2
    else:  # slot 3 decoded one token of its own: ring entry 0 filled, cursor 1
        kw = dict(target_kw)
        other = {"predecayed": "sglang", "sglang": "predecayed"}[layout]
        dst = busy_pool(other if kw.pop("layout", None) == "other" else layout, drv, steps=1, cache=torch.float32,
                        **kw)
        slot = 3
    assert dst.cursors[slot] > 0 and dst.d_cache[:, slot].any()
    before = snapshot(dst)
    dst.import_state(ids(slot), [shard])
    changed = {n for n, t in before.items() if not torch.equal(bits(t), bits(getattr(dst, n)))}
    others = [i for i in range(S) if i != slot]
    for name in before:  # only the target slot changed
        sel = (others,) if name == "cursors" else (slice(None), others)
        assert torch.equal(bits(getattr(dst, name)[sel]), bits(before[name][sel])), name
    assert "checkpoint" in changed and dst.cursors[slot] == 0
    for ring in ("d_cache", "k_cache", "g_cache"):
        assert not getattr(dst, ring)[:, slot].any(), ring
    tol = 1e-2 if dst.state_dtype == torch.bfloat16 else 1e-5
    for layer in range(NL):
        assert rel_err(dst.read_state(layer, ids(slot)), src.read_state(layer, ids(2))) < tol
        assert torch.equal(dst.read_conv_state(layer, ids(slot)), src.read_conv_state(layer, ids(2)))
    for step in range(20, 25):
        if dst is src:
            out = drv.step(src, [2, slot], seed=step, repeat=True)
            a, b = [o[0] for o in out], [o[1] for o in out]
        else:
            a, b = [o[0] for o in drv.step(src, [2], seed=step)], [o[0] for o in drv.step(dst, [slot], seed=step)]
        for layer in range(NL):
            assert rel_err(b[layer], a[layer]) < tol, (step, layer, rel_err(b[layer], a[layer]))
    src.check()
    dst.check()


# ---- import refusals -----------------------------------------------------------------------------------------------


def _shard_from(layout: str = "predecayed", heads: KDAHeads = HEADS, tp: int = 1, rank: int = 0, n: int = 1,
                num_layers: int = NL, conv: int = W) -> StateShard:
    pool = ReplaySSMStatePool(heads, num_layers=num_layers, num_slots=4, ring_length=L, tp_rank=rank, tp_size=tp,
                              ring_layout=layout, conv_kernel_size=conv, device=DEV)
    return pool.export_state(pool.alloc(n))


REFUSALS = {  # case -> (shards, the slots imported into, text the error must hold: the shard's side, the pool's)
    "heads": (lambda: [_shard_from(heads=KDAHeads(2, 8, K, V))], [0],
              r"heads KDAHeads\(num_q_heads=2, num_v_heads=8.*\(shard: rank 0/1.* vs KDAHeads\(num_q_heads=2, "
              r"num_v_heads=4.*\(pool: rank 0/1"),
    "key-dim": (lambda: [_shard_from(heads=KDAHeads(H, HV, 32, V))], [0], r"key_dim=32.* vs KDAHeads.*key_dim=16"),
    "layers": (lambda: [_shard_from(num_layers=3)], [0], r"num_layers 3 \(shard: .*3 layers.*\) vs 2 \(pool: "),
    "requests": (lambda: [_shard_from(n=2)], [0], r"requests \(len\(slots\)\) 2 \(shard: .*2 request\(s\).*\) vs 1"),
    "conv-kernel": (lambda: [_shard_from(conv=3)], [0], r"conv_kernel_size 3 \(shard: .*\) vs 4 \(pool: "),
    "no-conv-shard": (lambda: [_shard_from(conv=0)], [0], r"conv_kernel_size 0 \(shard: .*\) vs 4 \(pool: "),
    "missing-value-heads": (lambda: [_shard_from(tp=2, rank=0)], [0],
                            r"do not cover this pool's value heads \[0, 4\) \(pool: rank 0/1.*\): missing \[2, 3\]; "
                            r"the shards hold \[0, 2\)"),
    "missing-qk-heads": (lambda: [_shard_from(tp=2, rank=0),
                                  dataclasses_replace_heads(_shard_from(tp=2, rank=1))], [0],
                         r"do not cover this pool's q/k heads \(conv channels\) \[0, 2\).*missing \[1\]; the shards "
                         r"hold \[0, 1\), \[0, 1\)"),
    "other-requests": (lambda: [_shard_from(tp=2, rank=0), other_slots(_shard_from(tp=2, rank=1))], [0],
                       r"shards\[1\] holds source slots \[3\] but shards\[0\] holds \[0\]: the shards of one import "
                       r"hold the same requests"),
    "two-source-pools": (lambda: [_shard_from(tp=2, rank=0), _shard_from(layout="sglang", tp=2, rank=1)], [0],
                         r"shards\[1\] comes from another pool than shards\[0\]: ring_layout sglang \(shards\[0\]: "
                         r"predecayed\); the shards of one import are one export's"),
    "not-a-shard": (lambda: ["state"], [0], r"`shards\[0\]` must be a StateShard; got str"),
    "a-dict": (lambda: {"rank0": _shard_from()}, [0], r"`shards` must be a StateShard or an iterable of StateShard "
                                                      r"\(a dict's: pass its values\(\)\); got dict"),
    "empty": (lambda: [], [0], r"`shards` is empty"),
    "corrupt-states": (lambda: [corrupt(_shard_from())], [0],
                       r"shards\[0\].states must be a float32 tensor \[layers, n, HV_s, V, K\] = \[2, 1, 4, 16, 16\]"),
}


def dataclasses_replace_heads(s: StateShard) -> StateShard:
    """A tp=2 rank-1 shard that (wrongly) claims q/k head 0: q/k head 1 is then held by no shard."""
    import dataclasses

    return dataclasses.replace(s, q_head_start=0, q_head_end=1)


def other_slots(s: StateShard) -> StateShard:
    """The shard as exported from slot 3: another request than its peer's slot 0 (the heads of two requests)."""
    import dataclasses

    return dataclasses.replace(s, source_slots=(3,))


def corrupt(s: StateShard) -> StateShard:
    import dataclasses

    return dataclasses.replace(s, states=s.states[:, :, :2])


@pytest.mark.parametrize("case", list(REFUSALS))
def test_import_refusals_name_both_sides_and_leave_the_target_bit_identical(case: str) -> None:
    make_shards, slots, pattern = REFUSALS[case]
    pool = busy_pool("predecayed", Driver())
    shards = make_shards()
    before = snapshot(pool)
    with pytest.raises(ValueError, match=pattern) as info:
        pool.import_state(ids(*slots), shards)
    assert not isinstance(info.value, SlotError)
    assert_same(pool, before, case)
    pool.check()


def test_import_without_conv_state_needs_only_the_value_heads() -> None:
    """Pools without conv state: the two halves of a tp=2 pair, given in any order (an iterator), become the whole
    state in a tp=1 pool."""
    gen = torch.Generator().manual_seed(4)
    whole = [torch.randn(2, HV, V, K, generator=gen).to(DEV) for _ in range(NL)]
    parts = []
    for rank in (1, 0):
        half = ReplaySSMStatePool(HEADS, num_layers=NL, num_slots=4, ring_length=L, tp_rank=rank, tp_size=2,
                                  device=DEV)
        src = half.alloc(3)[1:]
        for layer in range(NL):
            half.load_state(layer, src, half.shard.slice_state(whole[layer]))
        parts.append(half.export_state(src))
    pool = make_pool(conv=False)
    pool.alloc(1)
    dst = pool.alloc(2)
    pool.import_state(dst, iter(parts))
    for layer in range(NL):
        assert torch.equal(pool.read_state(layer, dst), whole[layer])


# ---- resharding ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("H_", "HV_", "tps", "state", "cache", "tol"),
    [
        (2, 8, (1, 2, 4, 1), torch.float32, torch.float32, 1e-5),  # q/k heads replicated at tp=4
        (4, 4, (2, 4, 1, 2), torch.float32, torch.bfloat16, 1e-2),  # bf16 rings: rounded where they were written
        (2, 8, (4, 1, 2), torch.bfloat16, torch.bfloat16, 1e-2),  # bf16 checkpoint: the fold is rounded once more
    ],
    ids=["fp32-1-2-4-1", "bf16ring-2-4-1-2", "bf16-4-1-2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reshard_in_one_process(layout: str, H_: int, HV_: int, tps: tuple[int, ...], state: torch.dtype,
                                cache: torch.dtype, tol: float) -> None:
    """Pools of every tp size side by side (no process group): decode, export every rank, import into the next
    tp size, continue; outputs, states and conv windows against the uninterrupted single-rank pool."""
    errs = lw.reshard_chain(H_, HV_, tps, (3, 2, 3, 2)[:len(tps)], layout, state, cache, pickle_shards=True,
                            device=DEV)
    assert errs["out"] < tol and errs["state"] < tol, errs
    assert errs["conv"] == 0.0, errs  # the conv windows travel exactly


@pytest.mark.timeout(300)
def test_reshard_across_processes_1_2_4_1(tmp_path: Path) -> None:
    """Four gloo ranks: tp=1 on rank 0, tp=2 on ranks 0-1 (a group), tp=4 on all, tp=1 again, with H=2 q/k heads
    (replicated at tp=4) and HV=8, conv state W=4, fp32 checkpoints and rings; the shards travel pickled through
    ``all_gather_object``. Both ring layouts in one spawn."""
    res = h.run_ranks(lw.reshard_worker, 4, tmp_path, 2, 8, (1, 2, 4, 1), (3, 2, 3, 2), tuple(LAYOUTS),
                      timeout_s=280)
    for layout in LAYOUTS:
        r0 = res[0][layout]
        assert r0["out"] < 1e-5 and r0["state"] < 1e-5 and r0["conv"] == 0.0, (layout, r0)
        assert r0["shards_seen"] == 1 + 2 + 4 + 1
        assert [r[layout]["ran"] for r in res] == [[1, 2, 4, 1], [2, 4], [4], [4]]


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


@pytest.mark.gpu
def test_export_non_blocking_to_pinned_memory_and_import_back() -> None:
    drv = Driver()
    pool = busy_pool("predecayed", drv, cache=torch.float32)
    want = pool.export_state(ids(0, 1, 2))
    shard = pool.export_state(ids(0, 1, 2), non_blocking=True)
    assert shard.copy_done is not None and shard.states.is_pinned() and shard.conv_states.is_pinned()
    shard.wait()
    assert shard.ready and torch.equal(shard.states, want.states) and torch.equal(shard.conv_states, want.conv_states)
    again = pickle.loads(pickle.dumps(pool.export_state(ids(0), non_blocking=True)))  # pickling waits
    assert again.copy_done is None and torch.equal(again.states, want.states[:, :1])
    dst = pool.alloc(1)
    pool.import_state(dst, pool.export_state(ids(1), non_blocking=True))  # import waits for the copy
    for layer in range(NL):
        assert rel_err(pool.read_state(layer, dst), want.states[layer, 1].to(DEV)[None]) < 1e-6
    pool.check()


# ---- the benchmark runs --------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_lifecycle_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    """benchmarks/bench_lifecycle.py's CPU smoke mode (tiny shapes, eager timings): its checks pass and it writes
    one record per configuration."""
    import json

    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_lifecycle.py"), "--smoke", "--out",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    data = json.loads((tmp_path / "bench_lifecycle.json").read_text())
    kinds = {r["kind"] for r in data["records"]}
    assert {"fork", "export", "import", "copy"} <= kinds, kinds
    assert all(r["check"] == "ok" for r in data["records"] if "check" in r), data["records"]
    assert re.search(r"^== bench_lifecycle", run.stdout, flags=re.M), run.stdout[-2000:]
