"""Debug mode's agreement check: ranks of a group that call the pool with different step arguments all raise the same
RankMismatchError, naming the argument and which ranks passed what, before the call writes anything (gloo, 2 and 4
ranks; the ranks' work in tests/_agreement_workers.py)."""

from __future__ import annotations

import pytest
import torch

import _dist_helpers as h
from _agreement_workers import CASES, bad_env_on_one_rank, calls_compared, debug_on_one_rank, late_rank, mismatch_cases
from tp_replayssm import KDAHeads, RankMismatchError, ReplaySSMStatePool
from tp_replayssm.pool.agreement import DEBUG_ENV, _value_text, debug_from_env, mismatch_text, shape_of, slot_ids

# what each case's text must name (besides the ranks)
EXPECT = {
    "slots-order": ["decode(layer=0)", "`slots`: torch.int32 [0, 1, 2] on rank", "torch.int32 [2, 1, 0] on rank"],
    "batch": ["decode(layer=0)", "`mixed_qkv`: torch.float32 (3, ", "torch.float32 (2, ",
              "`slots`"],
    "force-flush": ["`force_flush`: torch.int32 [0, 0, 0] on rank", "torch.int32 [0, 1, 0] on rank"],
    "dtype": ["`force_flush`: torch.int32 [0, 0, 0] on rank", "torch.int64 [0, 0, 0] on rank"],
    "other-pool": ["ReplaySSMStatePool.advance", "`pool`: #"],
    "calls": ["the ranks of the group are in different collective checks", "ReplaySSMStatePool.advance (debug check)",
              "ReplaySSMStatePool.decode(layer=1) (debug check)"],
    "num-accepted": ["ReplaySSMStatePool.commit", "`num_accepted`: torch.int32 [1, 2, 0] on rank",
                     "torch.int32 [0, 2, 1] on rank"],
    "parents": ["verify(layer=0)", "`parents`: torch.int32 [[-1, 0], [-1, 0], [-1, 0]] on rank",
                "torch.int32 [[-1, 0], [-1, -1], [-1, 0]] on rank"],
    "alloc": ["ReplaySSMStatePool.alloc", "`ids`: [3] on rank", "[4] on rank"],
    "free": ["ReplaySSMStatePool.free", "`slots`: [1] on rank", "[2] on rank"],
    "fork": ["ReplaySSMStatePool.fork", "`dst`: torch.int32 [6] on rank", "torch.int32 [5] on rank"],
    "load-state": ["ReplaySSMStatePool.load_state", "`slots`: torch.int32 [0, 1] on rank", "torch.int32 [1, 2] on rank"],
    "layer-prefill": ["TPKimiDeltaAttention(layer=0)", "`cu_seqlens`: torch.int32 [0, 2, 5] on rank",
                      "torch.int32 [0, 1, 5] on rank"],
    "commit-shape": ["ReplaySSMStatePool.commit", "`slots`: torch.int32 [0, 1, 2] on rank",
                     "torch.int32 [0, 1] on rank", "`num_accepted`: torch.int32 [1, 2, 0] on rank",
                     "torch.int32 [1, 2] on rank"],
    "placement-vs-call": ["the ranks of the group are in different collective checks",
                          "placement check during ReplaySSMStatePool.verify_placement()",
                          "ReplaySSMStatePool.advance (debug check)"],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,odd", [(2, 1), (4, 2)])
def test_ranks_that_disagree_all_raise_the_same_error(tmp_path, world: int, odd: int) -> None:  # noqa: ANN001
    results = h.run_ranks(mismatch_cases, world, tmp_path, odd, True, timeout_s=200)
    others = ", ".join(str(r) for r in range(world) if r != odd)
    for case in CASES:
        got = [r[case] for r in results]
        kinds, texts, unchanged, met = zip(*got)
        assert all(met), (case, met)  # the ranks stayed together: the next collective met on every rank
        if case in ("same", "same-meaning"):  # (same-meaning: padding -1 on one rank, -2 on the others)
            assert kinds == (None,) * world and not any(unchanged), (case, texts)  # it decoded
            continue
        assert all(unchanged), (case, unchanged)  # nothing written (the case's call raised before any write)
        assert kinds == ("RankMismatchError",) * world, (case, kinds, texts)
        assert all(t == texts[0] for t in texts), (case, texts)  # one text on every rank
        text = texts[0]
        if case == "placement-vs-call":
            assert f"rank {odd}: placement check" in text, text
        elif case == "calls":
            assert f"rank {odd}: ReplaySSMStatePool.advance" in text, text
        else:
            assert f"on rank {odd}" in text and f"on rank{'s' if world > 2 else ''} {others}" in text, (case, text)
        for part in EXPECT[case]:
            assert part in text, (case, part, text)


@pytest.mark.timeout(120)
def test_without_debug_mode_nothing_is_exchanged(tmp_path) -> None:  # noqa: ANN001
    """Debug mode off (the default): the ranks exchange nothing, so a reversed slot order goes undetected (the
    documented limit) and costs no collective."""
    results = h.run_ranks(mismatch_cases, 2, tmp_path, 1, False)
    for r in results:
        assert r["same"] == (None, None, False, True), r  # (the decode wrote: "unchanged" is False)
        assert r["slots-order"] == (None, None, False, True), r


def test_a_pool_without_a_group_checks_nothing_across_ranks() -> None:
    pool = ReplaySSMStatePool(KDAHeads(2, 4, 16, 16), num_layers=1, num_slots=4, ring_length=4, device="cpu",
                              debug=True)
    assert pool.alloc(2).tolist() == [0, 1]  # no process group: no exchange, no error
    pool.free([1])


def test_the_text_names_each_differing_argument_by_value_and_ranks() -> None:
    got = [("ReplaySSMStatePool.commit", {"slots": "[0, 1]", "num_accepted": "[1, 1]", "path": "None"}, 0),
           ("ReplaySSMStatePool.commit", {"slots": "[0, 1]", "num_accepted": "[1, 0]", "path": "None"}, 1),
           ("ReplaySSMStatePool.commit", {"slots": "[0, 1]", "num_accepted": "[1, 1]", "path": "None"}, 2)]
    text = mismatch_text(got)
    assert text.startswith("ReplaySSMStatePool.commit: the ranks passed different arguments: `num_accepted`: "
                           "[1, 1] on ranks 0, 2; [1, 0] on rank 1 (debug check;"), text
    assert "`slots`" not in text and "`path`" not in text
    ids = list(range(1500))
    late, early = ids[:1200] + [9999] + ids[1201:], ids[:700] + [8888] + ids[701:]  # deep in long lists
    text = mismatch_text([("c", {"slots": str(v)}, r) for r, v in enumerate((ids, late, early, ids))])
    assert "on ranks 0, 3;" in text and "1199, 9999, 1201" in text and "(differs from element 1200) on rank 1;" in text
    assert "699, 8888, 701" in text and "(differs from element 700) on rank 2 (" in text, text
    assert len(text) < 3 * 190 + 250, len(text)
    sub = mismatch_text([("c", {"n": "1"}, 2), ("c", {"n": "2"}, 3)])  # a subgroup: its ranks and their global ranks
    assert "on rank 0; 2 on rank 1 (debug check; ranks of the pool's group, whose global ranks are 2, 3;" in sub, sub


@pytest.mark.parametrize("value,want", [
    (torch.tensor([3, 1], dtype=torch.int32), "torch.int32 [3, 1]"),
    (torch.tensor([3, 1]), "torch.int64 [3, 1]"),  # integer tensors by dtype and value
    (torch.zeros(2, 3), "torch.float32 (2, 3)"),  # activations: each rank's own values
    (torch.zeros(2, dtype=torch.int32, device="meta"), "torch.int32 (2,)"),
    (None, "None"),
    ((3, 2), "(3, 2)"),
])
def test_how_an_argument_is_compared(value: object, want: str) -> None:
    assert _value_text(value) == want


def test_rank_mismatch_error_is_a_value_error() -> None:
    assert issubclass(RankMismatchError, ValueError)


def test_arguments_are_compared_as_passed_but_padding() -> None:
    """As passed (a rank's own checks must not refuse on one rank what they accept on another): the container and
    the integer dtype count; the one leniency is padding, any negative slot id being -1."""
    i32 = torch.int32
    assert slot_ids(torch.tensor([3, -2, 1], dtype=i32)) == slot_ids(torch.tensor([3, -1, 1], dtype=i32))
    assert slot_ids(torch.tensor([3, 1], dtype=i32)) == "torch.int32 [3, 1]"
    assert slot_ids(torch.tensor([3, 1])) != slot_ids(torch.tensor([3, 1], dtype=i32))
    assert slot_ids([3, 1]) == "list [3, 1]" != slot_ids((3, 1))
    assert slot_ids("x") == "x"  # anything else is left for the call's own checks
    assert shape_of(torch.zeros(2, 3)) == "torch.float32 (2, 3)" != shape_of(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert _value_text(None) != _value_text(torch.zeros(3, dtype=i32))  # None against zeros: different


@pytest.mark.parametrize("value,want", [("1", True), ("true", True), ("Yes", True), ("on", True), ("0", False),
                                        ("false", False), ("no", False), ("OFF", False), ("", False), (None, False)])
def test_debug_env_values(monkeypatch: pytest.MonkeyPatch, value: str | None, want: bool) -> None:
    if value is None:
        monkeypatch.delenv(DEBUG_ENV, raising=False)
    else:
        monkeypatch.setenv(DEBUG_ENV, value)
    assert debug_from_env("here") is want


def test_a_debug_env_value_not_understood_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_ENV, "enabled")
    with pytest.raises(ValueError, match=r"ReplaySSMStatePool: TP_REPLAYSSM_DEBUG must be one of 1, true.*'enabled'"):
        ReplaySSMStatePool(KDAHeads(2, 4, 16, 16), num_layers=1, num_slots=4, ring_length=4, device="cpu")


@pytest.mark.timeout(120)
def test_a_rank_late_past_the_timeout_fails_every_rank_then_they_go_on(tmp_path) -> None:  # noqa: ANN001
    """A rank that reaches a debug-mode call after the check's timeout: every rank raises PlacementError, which
    states the timeout; the check group is made again, so the ranks' next calls meet."""
    results = h.run_ranks(late_rank, 2, tmp_path, 1)
    for kind, text, met in results:
        assert kind == "PlacementError" and "the check's timeout is 3 s" in text, (kind, text)
        assert met, results


@pytest.mark.timeout(120)
def test_debug_mode_on_some_ranks_only_is_refused_at_construction(tmp_path) -> None:  # noqa: ANN001
    results = h.run_ranks(debug_on_one_rank, 2, tmp_path, 1)
    assert results[0] == results[1] and results[0].startswith("PlacementError"), results
    assert "debug=True (rank 0: False)" in results[0], results[0]


@pytest.mark.timeout(120)
def test_a_debug_env_value_not_understood_on_one_rank_fails_every_rank(tmp_path) -> None:  # noqa: ANN001
    results = h.run_ranks(bad_env_on_one_rank, 2, tmp_path, 1)
    assert results[0] == results[1] and results[0].startswith("PlacementError"), results
    assert "TP_REPLAYSSM_DEBUG must be one of" in results[0] and "'2'" in results[0], results[0]


@pytest.mark.timeout(120)
def test_every_call_that_takes_slots_compares_first(tmp_path) -> None:  # noqa: ANN001
    """Each pool call that takes slots, and the TP layer's, runs the comparison in debug mode (a call added without
    it fails here); the ranks agree, so nothing is raised."""
    seen = h.run_ranks(calls_compared, 2, tmp_path)
    assert seen[0] == seen[1], seen
    want = ["alloc", "conv_update(layer=0)", "decode(layer=0)", "advance", "verify(layer=0)", "commit",
            "read_state", "load_state", "read_conv_state", "fork", "export_state", "free", "import_state"]
    calls = {c.removeprefix("ReplaySSMStatePool.") for c in seen[0]}
    assert set(want) <= calls, sorted(set(want) - calls)
    assert "TPKimiDeltaAttention(layer=0)" in calls and "end_prefill" in calls, calls
