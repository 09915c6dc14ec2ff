"""The bad slot ids every method that takes slots is tested with (tests of slot safety share them).

They assume a pool of ``S`` slots whose slots 0-3 were allocated and slot 1 freed again, so slots 1, 4 and 5 are
free: ``bad_slot_cases(S)`` maps a case name to (the slots of one call, the rows that are bad).
"""

from __future__ import annotations

from typing import Any


def assert_reported(pool: Any, bad: dict[int, int], *parts: str) -> None:
    """The pool's next ``check()`` reports ``bad`` (row -> slot; nothing when empty) in a SlotError whose text holds
    ``parts`` and each ``row r slot s``, then the record is clear."""
    import pytest

    from tp_replayssm import SlotError

    if bad:
        with pytest.raises(SlotError) as info:
            pool.check()
        msg = str(info.value)
        for part in parts:
            assert part in msg, (part, msg)
        for row, slot in bad.items():
            assert f"row {row} slot {slot}" in msg, msg
    pool.check()  # clear


def bad_slot_cases(S: int) -> dict[str, tuple[list[int], list[int]]]:
    return {
        "out-of-range": ([0, S, 2], [1]),
        "far-out-of-range": ([100000, 2, -1], [0]),
        "never-allocated": ([4, 0, 3], [0]),
        "freed": ([0, 1, 2], [1]),
        "repeated": ([2, 0, 2, 3], [0, 2]),
        "negative-is-padding": ([-5, 0, 3], []),
    }
