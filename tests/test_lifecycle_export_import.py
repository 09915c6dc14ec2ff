"""``export_state`` / ``import_state`` of ``ReplaySSMStatePool`` (docs/lifecycle.md): the exported shard and its
metadata, slot checks on the host, round trips (pickled, saved, moved to the CPU and back; into the same pool or a
fresh one of another layout or state dtype) that keep decoding, refused imports that name both sides and change
nothing, and a non-blocking export to pinned memory (on the GPU). Imports are held to the uninterrupted pool up to
the rounding of a materialized ring (fp32 checkpoint and fp32 rings: 1e-5). Runs on ``cuda:0`` when there is one,
else on the CPU.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from _lifecycle_helpers import (DEV, H, HEADS, HV, K, L, LAYOUTS, NL, S, V, W, Driver, assert_same, bits, busy_pool,
                                ids, make_pool, snapshot)
from tp_replayssm import KDAHeads, ReplaySSMStatePool, SlotError, StateShard
from tp_replayssm.testing import rel_err


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


# ---- on the GPU ----------------------------------------------------------------------------------------------------


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
