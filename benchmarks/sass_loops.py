"""Instruction mix of a kernel's SASS, whole and per loop, read on a CPU machine.

Takes the ``kernel.sass`` that ``KERNEL_REGS_DUMP=DIR benchmarks/kernel_regs.py`` writes and prints, for the whole
kernel and for every loop (a backward branch), the instruction count and the barrier / shuffle / shared-memory /
global-memory / special-function / FMA counts. Used to compare kernel formulations before spending device time: each
``BAR.SYNC`` in the chunk loop stalls all warps of the program; each ``STS``/``LDS`` pair is a layout conversion
through shared memory. ``sass_hashes.py`` reads SASS with :func:`parse` too. Prints; writes nothing::

    KERNEL_REGS_DUMP=/tmp/dump ./dev.sh python benchmarks/kernel_regs.py --batch 512 --heads 32
    python3 benchmarks/sass_loops.py /tmp/dump/kernel.sass
"""

from __future__ import annotations

import re
import sys
from collections import Counter

_GROUPS = {"BAR": ("BAR",), "SHFL": ("SHFL",), "shared": ("LDS", "STS", "LDSM", "STSM"),
           "global": ("LDG", "STG", "LDGSTS"), "MUFU": ("MUFU",), "FFMA/FMUL/FADD": ("FFMA", "FMUL", "FADD")}


def parse(text: str) -> list[tuple[int, str]]:
    """``(address, instruction text)`` of every instruction line of a ``cuobjdump --dump-sass`` text."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(text: str) -> str:
    """The opcode of an instruction without its predicate and modifiers (``@!P0 LDG.E.128 ...`` -> ``LDG``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def mix(body: list[tuple[int, str]]) -> str:
    """One line: the instruction count and the count of each group of opcodes."""
    ops = Counter(opcode(t) for _, t in body)
    parts = [f"{name}={sum(ops[o] for o in members)}" for name, members in _GROUPS.items()]
    return f"{len(body):5d} instr  " + " ".join(parts)


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """``(start, end)`` addresses of every loop: a branch back to ``start`` at ``end``."""
    out = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\(.*?\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            out.append((int(m.group(1), 16), addr))
    return out


def main(argv: list[str] | None = None) -> None:
    path = (sys.argv[1:] if argv is None else argv)[0]
    with open(path) as f:
        ins = parse(f.read())
    print(f"kernel: {mix(ins)}")
    for start, end in loops(ins):
        print(f"loop {start:#06x}-{end:#06x}: {mix([x for x in ins if start <= x[0] <= end])}")


if __name__ == "__main__":
    main()
