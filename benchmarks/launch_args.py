"""Command-line forms shared by the benchmark scripts (``bench_decode.py --config``, ``tune_decode.py --cands``,
their ``--tiny-batch`` / ``--rebase-pass`` switches), parsed at argument time so a typo fails before any GPU work.

A launch choice is ``VT:VC:WARPS[:MAXNREG[:PER_SM]][:mma[N]]``: the value tile and value chunk (rows of V, powers
of two, VC <= VT), warps per program, then optionally a register cap per thread (0: none, else 24-255), a
persistent grid of PER_SM programs per SM (0: not persistent), and the word ``mma`` for the tensor-core chunk path
(the kernel takes it for a bf16 checkpoint and bf16 rings) with ``N`` software-pipeline stages (2-9; ``mma`` alone:
``configs.MMA_CHUNK_STAGES``, the pinned number). E.g. ``32:32:4``, ``32:8:1:168``, ``64:16:1:mma``,
``64:16:1:mma5``, ``128:16:1:0:2``. Pure Python until
:meth:`LaunchSpec.launch_choice` imports the library.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

FORMAT = "VT:VC:WARPS[:MAXNREG[:PER_SM]][:mma[N]]"
# --tiny-batch / --rebase-pass: the library's own choice (None), or forced on / off (configs.FORCED_TINY_BATCH, ...)
_SWITCH_VALUES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
SWITCH_CHOICES = tuple(_SWITCH_VALUES)


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """One launch choice from a command line (see the module docstring); ``maxnreg`` / ``per_sm`` None: none;
    ``stages`` the tensor-core chunk loop's pipeline stages (None: the pinned number; only with ``mma``)."""

    vt: int
    vc: int
    warps: int
    maxnreg: int | None = None
    per_sm: int | None = None
    mma: bool = False
    stages: int | None = None

    def launch_choice(self) -> Any:  # tp_replayssm.configs.LaunchChoice
        from tp_replayssm import configs

        stages = (self.stages or configs.MMA_CHUNK_STAGES) if self.mma else 0
        config = configs.launch_config(self.vt, self.warps, self.per_sm, chunk_stages=stages)
        return configs.LaunchChoice(config, self.vc, self.maxnreg, self.mma)


def launch_spec_arg(text: str) -> LaunchSpec:
    """``argparse`` type of a launch choice: ``VT:VC:WARPS[:MAXNREG[:PER_SM]][:mma[N]]``."""
    fields = text.split(":")
    mma = fields[-1].startswith("mma")
    numbers = fields[:-1] if mma else fields
    stages = None
    if mma and fields[-1] != "mma":
        if not (fields[-1][3:].isdigit() and 2 <= int(fields[-1][3:]) <= 9):
            raise argparse.ArgumentTypeError(f"expected mma or mmaN with N 2-9 pipeline stages, got {fields[-1]!r} "
                                             f"in {text!r}")
        stages = int(fields[-1][3:])
    try:
        if not 3 <= len(numbers) <= 5:
            raise ValueError
        vt, vc, warps, maxnreg, per_sm = (int(x) for x in numbers + ["0"] * (5 - len(numbers)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {FORMAT} (three to five integers, then optionally mma or "
                                         f"mmaN), got {text!r}") from None
    if any(x < 1 or x & (x - 1) for x in (vt, vc, warps)) or vc > vt:
        raise argparse.ArgumentTypeError(f"expected VT, VC and WARPS powers of two with VC <= VT, got {text!r}")
    if maxnreg and not 24 <= maxnreg <= 255:
        raise argparse.ArgumentTypeError(f"expected MAXNREG 0 (no cap) or 24-255, got {maxnreg} in {text!r}")
    if per_sm < 0:
        raise argparse.ArgumentTypeError(f"expected PER_SM 0 (not persistent) or more, got {per_sm} in {text!r}")
    return LaunchSpec(vt, vc, warps, maxnreg or None, per_sm or None, mma, stages)


def switch(text: str) -> bool | None:
    """``auto`` / ``on`` / ``off`` as None / True / False (the library's choice, or forced)."""
    return _SWITCH_VALUES[text]
