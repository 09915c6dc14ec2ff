"""Debug mode's agreement check: ranks of a group that call the pool with different step arguments all raise the same
RankMismatchError, naming the argument and which ranks passed what, before the call writes anything (gloo, 2 and 4
ranks; the ranks' work in tests/_agreement_workers.py)."""

from __future__ import annotations

import pytest
import torch

import _dist_helpers as h
from _agreement_workers import CASES, mismatch_cases
from tp_replayssm import KDAHeads, RankMismatchError, ReplaySSMStatePool
from tp_replayssm.pool.checks import _mismatch_text, _value_text

# what each case's text must name (besides the ranks)
EXPECT = {
    "slots-order": ["decode(layer=0)", "`slots`: [0, 1, 2] on rank", "[2, 1, 0] on rank"],
    "batch": ["decode(layer=0)", "`rows`: (3,) on rank", "(2,) on rank", "`slots`"],
    "force-flush": ["`force_flush`: [0, 0, 0] on rank", "[0, 1, 0] on rank"],
    "calls": ["the ranks are in different calls", "ReplaySSMStatePool.advance on rank",
              "ReplaySSMStatePool.decode(layer=1) on rank"],
    "num-accepted": ["ReplaySSMStatePool.commit", "`num_accepted`: [1, 2, 0] on rank", "[0, 2, 1] on rank"],
    "parents": ["verify(layer=0)", "`parents`: [[-1, 0], [-1, 0], [-1, 0]] on rank",
                "[[-1, 0], [-1, -1], [-1, 0]] on rank"],
    "alloc": ["ReplaySSMStatePool.alloc", "`ids`: [3] on rank", "[4] on rank"],
    "free": ["ReplaySSMStatePool.free", "`slots`: [1] on rank", "[2] on rank"],
    "fork": ["ReplaySSMStatePool.fork", "`dst`: [6] on rank", "[5] on rank"],
    "load-state": ["ReplaySSMStatePool.load_state", "`slots`: [0, 1] on rank", "[1, 2] on rank"],
    "layer-prefill": ["TPKimiDeltaAttention.prefill(layer=0)", "`cu_seqlens`: [0, 2, 5] on rank", "[0, 1, 5] on rank"],
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
        if case == "same":
            assert kinds == (None,) * world and not any(unchanged), (case, texts)  # it decoded
            continue
        assert all(unchanged), (case, unchanged)  # nothing written (the case's call raised before any write)
        assert kinds == ("RankMismatchError",) * world, (case, kinds, texts)
        assert all(t == texts[0] for t in texts), (case, texts)  # one text on every rank
        text = texts[0]
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
    got = [("ReplaySSMStatePool.commit", {"slots": "[0, 1]", "num_accepted": "[1, 1]", "path": "None"}),
           ("ReplaySSMStatePool.commit", {"slots": "[0, 1]", "num_accepted": "[1, 0]", "path": "None"}),
           ("ReplaySSMStatePool.commit", {"slots": "[0, 1]", "num_accepted": "[1, 1]", "path": "None"})]
    text = _mismatch_text(got)
    assert text.startswith("ReplaySSMStatePool.commit: the ranks passed different arguments: `num_accepted`: "
                           "[1, 1] on ranks 0, 2; [1, 0] on rank 1 (debug check;"), text
    assert "`slots`" not in text and "`path`" not in text
    long = [("c", {"slots": str(list(range(100)))}), ("c", {"slots": str(list(range(1, 101)))})]
    text = _mismatch_text(long)  # long values shortened to 120 characters each
    assert "29, 30,  ... on rank 0; [1, 2," in text and "31, ... on rank 1 (debug check" in text, text
    assert len(text) < 2 * 120 + 250, len(text)


@pytest.mark.parametrize("value,want", [
    (torch.tensor([3, 1], dtype=torch.int32), "[3, 1]"),
    (torch.tensor([3, 1]), "[3, 1] (torch.int64)"),
    (torch.zeros(2, 3), "torch.float32 (2, 3)"),  # activations: each rank's own values
    (torch.zeros(2, dtype=torch.int32, device="meta"), "torch.int32 (2,)"),
    (None, "None"),
    ((3, 2), "(3, 2)"),
])
def test_how_an_argument_is_compared(value: object, want: str) -> None:
    assert _value_text(value) == want


def test_rank_mismatch_error_is_a_value_error() -> None:
    assert issubclass(RankMismatchError, ValueError)
