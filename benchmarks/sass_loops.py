"""Instruction mix of a kernel's SASS, whole and per loop, read on a CPU machine.

Takes the ``kernel.sass`` that ``KERNEL_REGS_DUMP=dir benchmarks/kernel_regs.py`` writes and prints,
for the straight-line code and for every loop (a backward branch), the instruction count and the
barrier / shuffle / shared-memory / global-memory / special-function counts. Used to compare kernel
formulations before spending device time: each ``BAR.SYNC`` in the chunk loop stalls all warps of the
program; each ``STS``/``LDS`` pair is a layout conversion through shared memory.

    python benchmarks/sass_loops.py /tmp/dump/kernel.sass
"""

from __future__ import annotations

import re
import sys
from collections import Counter

_GROUPS = {"BAR": ("BAR",), "SHFL": ("SHFL",), "shared": ("LDS", "STS", "LDSM", "STSM"),
           "global": ("LDG", "STG", "LDGSTS"), "MUFU": ("MUFU",), "FFMA/FMUL/FADD": ("FFMA", "FMUL", "FADD")}


def parse(text: str) -> list[tuple[int, str]]:
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def mix(body: list[tuple[int, str]]) -> str:
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


def main() -> None:
    ins = parse(open(sys.argv[1]).read())
    print(f"kernel: {mix(ins)}")
    for start, end in loops(ins):
        print(f"loop {start:#06x}-{end:#06x}: {mix([x for x in ins if start <= x[0] <= end])}")


if __name__ == "__main__":
    main()
