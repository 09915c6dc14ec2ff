"""Placement checks (docs/contract.md, placement): verdict formatting, local rules, and the collective fault matrix.

The fault matrix runs on spawned CPU/gloo ranks (see ``_dist_helpers`` and ``_placement_workers``): one rank is
misplaced or disagrees, and every rank must raise the *identical* ``PlacementError`` naming that rank (and only
that rank), within seconds, with no rank hanging and no pool tensor changed.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import _dist_helpers as h
import _placement_workers as pw
from tp_replayssm import PlacementError
from tp_replayssm.tp import devices
from tp_replayssm.tp import placement as P

FAST_S = 10.0  # "within seconds": generous for a loaded 2-core CI machine


# ---- unit level -------------------------------------------------------------------------------


def _report(rank: int, problems: tuple[str, ...] = (), *, device: str = "cpu", key: str = "", **fp_over) -> P.RankReport:
    fp = dataclasses.asdict(pw._fingerprint(4, rank, **fp_over))
    return P.RankReport(rank, rank, "hostA", device, key, fp, problems, "unit")


def test_placement_error_is_value_error() -> None:
    assert issubclass(PlacementError, ValueError)
    import tp_replayssm

    assert tp_replayssm.PlacementError is PlacementError


def test_fingerprint_digest_ignores_tp_rank_only() -> None:
    a, b = pw._fingerprint(2, 0), pw._fingerprint(2, 1)
    assert a.digest() == b.digest()
    for field, value in pw.FINGERPRINT_FAULTS.values():
        assert pw._fingerprint(2, 0, **{field: value}).digest() != a.digest(), field
    assert pw._fingerprint(2, 0, tp_size=3).digest() != a.digest()


def test_format_none_when_all_ok() -> None:
    assert P.format_placement_error([_report(r) for r in range(4)], 4) is None


def test_format_names_offending_rank_tensor_and_devices() -> None:
    reports = [_report(r) for r in range(4)]
    reports[2] = _report(2, ("`d_cache` on meta, expected cpu",))
    msg = P.format_placement_error(reports, 4)
    assert msg is not None
    assert msg.splitlines()[0].endswith("offending rank(s): 2")
    assert "rank 2 (host hostA, pool device cpu)" in msg and "`d_cache` on meta, expected cpu" in msg
    assert "during unit (4 ranks)" in msg
    # a pure function of the gathered reports: order of arrival does not matter
    assert P.format_placement_error(list(reversed(reports)), 4) == msg


def test_format_fingerprint_majority_and_fields() -> None:
    reports = [_report(r) for r in range(4)]
    reports[1] = _report(1, ring_length=9, cache_dtype="torch.float32")
    msg = P.format_placement_error(reports, 4)
    assert msg is not None and msg.splitlines()[0].endswith("offending rank(s): 1")
    assert "ring_length=9 (rank 0: 3)" in msg and "cache_dtype='torch.float32' (rank 0: 'torch.bfloat16')" in msg
    assert "disagrees with ranks 0, 2, 3 on the pool" in msg
    # the majority wins even when rank 0 is the odd one out
    reports = [_report(r) for r in range(4)]
    reports[0] = _report(0, num_slots=99)
    msg = P.format_placement_error(reports, 4)
    assert msg is not None and msg.splitlines()[0].endswith("offending rank(s): 0")
    assert "num_slots=99 (rank 1: 4)" in msg


def test_format_shared_cuda_device_names_both_ranks() -> None:
    reports = [_report(r, device=f"cuda:{r}", key=f"hostA/cuda:{r}") for r in range(4)]
    reports[3] = _report(3, device="cuda:1", key="hostA/cuda:1")
    msg = P.format_placement_error(reports, 4)
    assert msg is not None and msg.splitlines()[0].endswith("offending rank(s): 1, 3")
    assert "ranks 1, 3 all hold their pool on host hostA device cuda:1" in msg
    # same index on different physical devices (per-rank CUDA_VISIBLE_DEVICES) is fine
    ok = [_report(r, device="cuda:0", key=f"uuid:{r}") for r in range(4)]
    assert P.format_placement_error(ok, 4) is None


def test_local_check_exception_becomes_a_problem() -> None:
    report = P._local_report(
        expected_device=torch.device("cpu"), require_current_device=False, fingerprint=pw._fingerprint(1, 0),
        tensors={"x": torch.zeros(1), "bad": pw.ExplodingTensor()}, context="unit", group_rank=0, global_rank=0,
        group_size=1, group_backend="gloo")
    assert report.problems == ("local placement check raised RuntimeError: device query failed (injected)",)


def test_no_group_is_local_and_raises_placement_error() -> None:
    fp = pw._fingerprint(2, 1)  # a pool without a group may hold any shard
    good = {"checkpoint": torch.zeros(2), "force_flush": None}
    P.collective_placement_check(group=None, expected_device=torch.device("cpu"), require_current_device=False,
                                 fingerprint=fp, tensors=good, context="unit")
    bad = {**good, "k_cache": torch.zeros(2, device="meta"), "g_cache": torch.zeros(2, device="meta")}
    with pytest.raises(PlacementError) as info:
        P.collective_placement_check(group=None, expected_device=torch.device("cpu"), require_current_device=False,
                                     fingerprint=fp, tensors=bad, context="unit")
    msg = str(info.value)
    assert "`k_cache`, `g_cache` on meta, expected cpu" in msg and "no group" in msg
    with pytest.raises(PlacementError, match="tp_rank 2 not in"):
        P.collective_placement_check(group=None, expected_device=torch.device("cpu"), require_current_device=False,
                                     fingerprint=pw._fingerprint(2, 2), tensors=good, context="unit")


def test_current_device_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    fp = pw._fingerprint(1, 0)
    kw = dict(require_current_device=True, fingerprint=fp, tensors={}, group_rank=0, group_size=1)
    assert P.local_problems(expected_device=torch.device("cpu"), group_backend="gloo", **kw) == []
    assert "not this rank's current device cpu" in P.local_problems(expected_device=torch.device("meta"), **kw)[0]
    if not torch.cuda.is_available():
        assert "no CUDA device" in P.local_problems(expected_device=torch.device("cuda", 0), **kw)[0]
    monkeypatch.setattr(devices, "current_cuda_device", lambda: torch.device("cuda", 1))
    assert P.local_problems(expected_device=torch.device("cuda", 1), **kw) == []
    assert "cuda:0 is not this rank's current device cuda:1" in P.local_problems(
        expected_device=torch.device("cuda", 0), **kw)[0]
    # a CPU pool in an NCCL group on a GPU host is misplaced; in a gloo group it is fine
    assert P.local_problems(expected_device=torch.device("cpu"), group_backend="nccl", **kw)
    assert P.local_problems(expected_device=torch.device("cpu"), group_backend="gloo", **kw) == []


# ---- collective fault matrix (spawned gloo ranks) ---------------------------------------------

# fault -> substrings the common message must contain (besides the offending rank)
EXPECT = {
    "pool-device": ["pool device meta is not this rank's current device cpu"],
    "cache-device": ["`k_cache` on meta, expected cpu"],
    "activation-device": ["`mixed_qkv` on meta, expected cpu"],
    "same-cuda-device": ["all hold their pool on host", "device cuda:0"],
    "ring-length": ["ring_length=4 (rank 0: 3)"],
    "num-slots": ["num_slots=5 (rank 0: 4)"],
    "num-layers": ["num_layers=3 (rank 0: 2)"],
    "state-dtype": ["state_dtype='torch.bfloat16' (rank 0: 'torch.float32')"],
    "cache-dtype": ["cache_dtype='torch.float32' (rank 0: 'torch.bfloat16')"],
    "heads": ["num_v_heads=8 (rank 0: 4)"],
    "ring-layout": ["ring_layout='sglang' (rank 0: 'predecayed')"],
    "tp-rank": ["shard index tp_rank="],
    "tp-size": ["tp_size="],
    "local-check-throws": ["local placement check raised RuntimeError: device query failed (injected)"],
}
OK_CASES = ["none", "fake-cuda-ok"]


def _assert_case(results: list[dict], fault: str, bad: int, world: int, offenders: list[int]) -> None:
    msgs = [r[fault][0] for r in results]
    times = [r[fault][1] for r in results]
    assert all(t < FAST_S for t in times), (fault, times)
    if fault in OK_CASES:
        assert msgs == [None] * world, (fault, msgs)
        return
    assert all(m is not None for m in msgs), (fault, msgs)  # every rank raised
    assert len(set(msgs)) == 1, f"{fault}: ranks raised different texts:\n" + "\n---\n".join(msgs)
    msg = msgs[0]
    header = msg.splitlines()[0]
    assert header.endswith("offending rank(s): " + ", ".join(map(str, offenders))), (fault, msg)
    assert f"test {fault}" in header and f"({world} ranks)" in header
    named = {int(m) for m in re.findall(r"^  rank (\d+)[ ,]", msg, flags=re.M)}
    assert named == set(offenders), (fault, named, msg)
    assert bad in named
    for sub in EXPECT[fault]:
        assert sub in msg, (fault, sub, msg)


SUB_FAULTS = ["none", "ring-length", "activation-device"]


@pytest.fixture(scope="module")
def matrix4(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict, dict]]:
    """One 4-rank run: the whole matrix on the world group (bad rank 2), then ``SUB_FAULTS`` in two TP
    groups [0, 1] and [2, 3] at once (bad group-rank 1, i.e. global ranks 1 and 3)."""
    return h.run_ranks(pw.placement_matrix_world_and_subgroups, 4, tmp_path_factory.mktemp("m4"), 2,
                       OK_CASES + list(EXPECT), 1, SUB_FAULTS)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", OK_CASES + list(EXPECT))
def test_fault_matrix_4_ranks(matrix4: list[tuple[dict, dict]], fault: str) -> None:
    offenders = [0, 2] if fault == "same-cuda-device" else [2]
    _assert_case([world for world, _ in matrix4], fault, 2, 4, offenders)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", SUB_FAULTS)
def test_fault_matrix_tp_subgroups(matrix4: list[tuple[dict, dict]], fault: str) -> None:
    """Each TP group checks over its own lazily created gloo group; a fault in group-rank 1 names rank 1
    (global rank 1 resp. 3) in its own group only, and the texts differ between the groups."""
    group_a, group_b = [sub for _, sub in matrix4[:2]], [sub for _, sub in matrix4[2:]]
    _assert_case(group_a, fault, 1, 2, [] if fault == "none" else [1])
    _assert_case(group_b, fault, 1, 2, [] if fault == "none" else [1])
    if fault != "none":
        assert "rank 1 (host" in group_a[0][fault][0]
        assert "rank 1, global rank 3 (host" in group_b[0][fault][0]


@pytest.mark.timeout(150)
def test_fault_matrix_2_ranks(tmp_path) -> None:  # noqa: ANN001
    """With two ranks a disagreement is a tie: the lowest rank is the reference, rank 1 is named."""
    faults = ["none", "ring-length", "cache-dtype", "activation-device", "local-check-throws", "same-cuda-device"]
    results = h.run_ranks(pw.placement_matrix, 2, tmp_path, 1, faults)
    for fault in faults:
        _assert_case(results, fault, 1, 2, [0, 1] if fault == "same-cuda-device" else [1])


# ---- the same through the real pool -----------------------------------------------------------

POOL_EXPECT = {
    "pool-device": ["pool device meta is not this rank's current device cpu"],
    "ring-length": ["ring_length=4 (rank 0: 3)"],
    "num-slots": ["num_slots=5 (rank 0: 4)"],
    "num-layers": ["num_layers=3 (rank 0: 2)"],
    "state-dtype": ["state_dtype='torch.bfloat16' (rank 0: 'torch.float32')"],
    "cache-dtype": ["cache_dtype='torch.float32' (rank 0: 'torch.bfloat16')"],
    "ring-layout": ["ring_layout='sglang' (rank 0: 'predecayed')"],
    "tp-rank": ["shard index tp_rank=0 != rank in group 1"],
    "bad-num-slots": ["the arguments build no pool", "rank 1: ReplaySSMStatePool: `num_slots` must be a positive int; "
                      "got 0"],
    "bad-tp-size": ["the arguments build no pool", "rank 1: ReplaySSMStatePool: "],
    "bad-debug": ["the arguments build no pool", "`debug` must be a bool or None", "got 'false'"],
    "cache-device": ["`d_cache` on meta, expected cpu", "verify_placement",
                     "pool.d_cache replaced after construction"],
    "cache-replaced": ["pool.d_cache replaced after construction", "build a new pool", "verify_placement"],
    "cache-device-first-decode": ["`pool.d_cache` on meta, expected cpu", "pool.d_cache replaced after construction",
                                  "decode(layer=1)"],
    "activation-device": ["`mixed_qkv` on meta, expected cpu", "decode(layer=0)"],
    "local-check-throws": ["local placement check raised RuntimeError: cudaGetDevice failed (injected)"],
}


@pytest.mark.timeout(150)
def test_pool_fault_matrix(tmp_path) -> None:  # noqa: ANN001
    faults = ["verify-ok"] + list(POOL_EXPECT)
    results = h.run_ranks(pw.pool_faults, 2, tmp_path, 1, faults)
    for fault in faults:
        msgs = [r[fault][0] for r in results]
        assert all(r[fault][1] < FAST_S for r in results), (fault, [r[fault][1] for r in results])
        assert all(r[fault][2] for r in results), f"{fault}: a pool tensor changed"
        if fault == "verify-ok":
            assert msgs == [None, None]
            continue
        assert msgs[0] is not None and msgs[0] == msgs[1], (fault, msgs)
        assert msgs[0].splitlines()[0].endswith("offending rank(s): 1"), (fault, msgs[0])
        for sub in POOL_EXPECT[fault]:
            assert sub in msgs[0], (fault, sub, msgs[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_a_slot_error_on_one_rank_is_raised_on_every_rank(tmp_path, world: int) -> None:  # noqa: ANN001
    """``verify_placement()`` exchanges the ranks' ``check()`` results: the SlotError of the one rank that named a
    bad slot is raised on every rank with the same text (naming that rank and its record), and the ranks stay
    together (a later collective call meets on all of them)."""
    results = h.run_ranks(pw.slot_error_on_one_rank, world, tmp_path, 1)
    owns, msgs, laters = zip(*results)
    assert owns == tuple("recorded" if r == 1 else "ok" for r in range(world)), owns
    assert msgs[0] is not None and all(m == msgs[0] for m in msgs), msgs
    assert f"slot errors on 1 of {world} ranks; rank 1: " in msgs[0] and "slot 99" in msgs[0], msgs[0]
    assert laters == (None,) * world, laters  # the record was cleared by the check; all ranks met again


@pytest.mark.timeout(120)
def test_world_pool_after_a_subgroup_was_created(tmp_path) -> None:  # noqa: ANN001
    """A rank outside an earlier subgroup knows one process group fewer; the check group over the whole world must
    still be one group on every rank (its name must not depend on that count)."""
    assert h.run_ranks(pw.world_pool_after_a_subgroup, 4, tmp_path) == ["ok"] * 4
