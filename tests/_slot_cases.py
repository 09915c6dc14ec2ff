"""The bad slot ids every method that takes slots is tested with (tests of slot safety share them).

They assume a pool of ``S`` slots whose slots 0-3 were allocated and slot 1 freed again, so slots 1, 4 and 5 are
free: ``bad_slot_cases(S)`` maps a case name to (the slots of one call, the rows that are bad).
"""

from __future__ import annotations


def bad_slot_cases(S: int) -> dict[str, tuple[list[int], list[int]]]:
    return {
        "out-of-range": ([0, S, 2], [1]),
        "far-out-of-range": ([100000, 2, -1], [0]),
        "never-allocated": ([4, 0, 3], [0]),
        "freed": ([0, 1, 2], [1]),
        "repeated": ([2, 0, 2, 3], [0, 2]),
        "negative-is-padding": ([-5, 0, 3], []),
    }
