"""What the launchers' command lines share: the help format, and a parser whose usage errors one rank prints.

Under ``torchrun`` every rank parses the same command line, so a bad option would print the same usage block and
error once per rank; :class:`RankParser` prints it on rank 0 (or without ``RANK``: a plain run, ``--help``) and
exits 2 on every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

__all__ = ["HelpFormatter", "RankParser"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The description as written (its command lines keep their layout), and every option's default."""


class RankParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose :meth:`error` prints on rank 0 only; every rank exits 2."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            super().error(message)
        sys.exit(2)
