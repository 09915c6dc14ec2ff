"""What the launchers' command lines share: the help format, a parser whose usage errors one rank prints, the exit.

Under ``torchrun`` every rank parses the same command line, so a bad option would print the same usage block and
error once per rank; :class:`RankParser` prints it on rank 0 (or without ``RANK``: a plain run, ``--help``) and
exits 2 on every rank. :func:`exit_rank` ends a rank with its status; after a failure it skips the interpreter's
teardown.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

__all__ = ["HelpFormatter", "RankParser", "exit_rank"]


def exit_rank(status: int) -> NoReturn:
    """Exit with ``status``. A failed rank (status != 0) leaves its gloo group to the process's end (its peers may be
    gone: no barrier), and the interpreter's teardown of gloo's threads can then abort the process ("terminate
    called without an active exception", status -6) after its RESULT line: so it flushes its output and ends with
    ``os._exit``, skipping that teardown."""
    if status:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The description as written (its command lines keep their layout), and every option's default."""


class RankParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose :meth:`error` prints on rank 0 only; every rank exits 2."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            super().error(message)
        sys.exit(2)
