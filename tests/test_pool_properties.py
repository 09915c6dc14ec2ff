"""Property tests (hypothesis) of the pool's host-side free list and its device-side cursor moves.

The alloc/free state machine runs random sequences against a model (a set of handed-out ids): no id is
handed out twice while held, ids stay in range, a failing call changes nothing, nothing leaks, and
every new slot starts from a zero state and cursor whatever it held before, in both ring layouts (their k rings
differ in shape). No kernel runs here.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tp_replayssm import KDAHeads, PoolExhaustedError, ReplaySSMStatePool

HEADS = KDAHeads(1, 2, 4, 4)
GARBAGE = -7.5


class AllocFreeMachine(RuleBasedStateMachine):
    ring_layout = "predecayed"  # the pool's default

    def __init__(self) -> None:
        super().__init__()
        self.num_slots = 6
        self.pool = ReplaySSMStatePool(HEADS, num_layers=2, num_slots=self.num_slots, ring_length=3, device="cpu",
                                       ring_layout=self.ring_layout)
        assert self.pool.ring_layout == self.ring_layout
        self.held: set[int] = set()

    def _tensors(self) -> list[torch.Tensor]:
        p = self.pool
        return [p.checkpoint, p.d_cache, p.k_cache, p.g_cache]

    def _dirty_free_slots(self) -> None:
        """What a finished request leaves behind: garbage state, ring and cursor in every free slot."""
        free = sorted(set(range(self.num_slots)) - self.held)
        if free:
            idx = torch.tensor(free)
            for t in self._tensors():
                t[:, idx] = GARBAGE
            self.pool.cursors[idx] = 2

    @rule(n=st.integers(0, 8))
    def alloc(self, n: int) -> None:
        self._dirty_free_slots()
        free_before = self.pool.num_free
        if n > self.num_slots - len(self.held):
            with pytest.raises(PoolExhaustedError):
                self.pool.alloc(n)
            assert self.pool.num_free == free_before
            return
        ids = self.pool.alloc(n)
        got = ids.tolist()
        assert ids.dtype == torch.int32 and len(got) == n
        assert len(set(got)) == n, "one id handed out twice in one call"
        assert not set(got) & self.held, "an id handed out while still held"
        assert all(0 <= i < self.num_slots for i in got)
        if got:
            idx = ids.long()
            for t in self._tensors():
                assert torch.count_nonzero(t[:, idx]) == 0
            assert torch.count_nonzero(self.pool.cursors[idx]) == 0
        self.held |= set(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), as_tensor=st.booleans())
    def free_some(self, data: st.DataObject, as_tensor: bool) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        self.pool.free(torch.tensor(chosen, dtype=torch.int32) if as_tensor else chosen)
        self.held -= set(chosen)

    @rule(data=st.data())
    def free_invalid(self, data: st.DataObject) -> None:
        """A call with at least one bad id (not held, out of range, or repeated) frees nothing."""
        good = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True, max_size=3)) if self.held else []
        not_held = sorted(set(range(self.num_slots)) - self.held)
        bad_choices = [st.integers(-3, -1), st.integers(self.num_slots, self.num_slots + 3)]
        if not_held:
            bad_choices.append(st.sampled_from(not_held))
        if good:
            bad_choices.append(st.sampled_from(good))  # a repeat within the call
        bad = data.draw(st.one_of(*bad_choices))
        ids = data.draw(st.permutations(good + [bad]))
        held_before = self.pool.allocated_slots()
        with pytest.raises(ValueError):
            self.pool.free(ids)
        assert self.pool.allocated_slots() == held_before

    @invariant()
    def matches_model(self) -> None:
        assert set(self.pool.allocated_slots()) == self.held
        assert self.pool.num_free + self.pool.num_allocated == self.num_slots
        assert self.pool.num_allocated == len(self.held)

    def teardown(self) -> None:
        """No leak: after freeing everything, every slot can be handed out again, each once."""
        if self.held:
            self.pool.free(sorted(self.held))
        assert sorted(self.pool.alloc(self.num_slots).tolist()) == list(range(self.num_slots))


class AllocFreeSglangMachine(AllocFreeMachine):
    ring_layout = "sglang"


AllocFreeMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
AllocFreeSglangMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestAllocFree = AllocFreeMachine.TestCase
TestAllocFreeSglang = AllocFreeSglangMachine.TestCase


@given(
    start=st.lists(st.integers(0, 3), min_size=5, max_size=5),
    rows=st.lists(st.tuples(st.integers(-2, 4), st.sampled_from([0, 0, 1, -4])), min_size=1, max_size=8),
    with_flags=st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_advance_property(start, rows, with_flags):
    """advance == host model: a slot listed once -> 0 if its row flushed or it sat at L-1, else +1; a slot listed
    twice is refused (unchanged, slot safety); padding rows and unlisted slots keep their cursors."""
    pool = ReplaySSMStatePool(HEADS, num_layers=1, num_slots=5, ring_length=4, device="cpu")
    pool.alloc(5)
    pool.cursors[:5] = torch.tensor(start, dtype=torch.int32)
    slots = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    flags = torch.tensor([f for _, f in rows], dtype=torch.int32)
    pool.advance(slots, flags if with_flags else None)
    expected = list(start)
    for s in {s for s, _ in rows if s >= 0}:
        if [r for r, _ in rows].count(s) > 1:
            continue
        flushed = start[s] == 3 or (with_flags and any(f != 0 for r, f in rows if r == s))
        expected[s] = 0 if flushed else start[s] + 1
    assert pool.cursors[:5].tolist() == expected
