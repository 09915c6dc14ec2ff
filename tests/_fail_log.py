"""A pytest plugin that writes each failure to a file as it happens (tests/conftest.py loads it).

pytest prints tracebacks only in its final summary, so a run cut by a time limit (a device stage under ``timeout``)
loses them. With ``TP_REPLAYSSM_FAIL_LOG=PATH`` set, every failed report (setup, call or teardown; a pytest-timeout
"Timeout" too) is appended to ``PATH`` the moment pytest receives it: the node id, the phase, the duration, the
traceback (``report.longreprtext``) and the tail of each captured section (log, stdout, stderr). Unset, the plugin does
nothing.

Under pytest-xdist the controller receives every worker's reports through this same hook, and it alone writes (a
worker's own call would write each failure twice); a worker that crashes is reported by the controller too. Each
record is one ``write`` of an append-mode file, flushed at once, so a run killed afterwards keeps it.
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["ENV", "format_report", "pytest_runtest_logreport"]

ENV = "TP_REPLAYSSM_FAIL_LOG"
SECTION_TAIL = 4000  # characters kept of each captured section (the end: the lines before the failure)


def _is_xdist_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def format_report(report: Any) -> str:
    """One failure record: a header line, the traceback, then the tail of each captured section."""
    duration = getattr(report, "duration", 0.0) or 0.0
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)  # xdist: "gw3"
    where = f" on {worker}" if worker else ""
    lines = [f"===== FAILED {report.nodeid} ({report.when}, {duration:.1f} s){where} at {time.strftime('%H:%M:%S')}",
             report.longreprtext.rstrip()]
    for title, content in getattr(report, "sections", []):
        if content.strip():
            tail = content[-SECTION_TAIL:]
            cut = " (tail)" if len(content) > SECTION_TAIL else ""
            lines += [f"----- {title}{cut}", tail.rstrip()]
    return "\n".join(lines) + "\n\n"


def pytest_runtest_logreport(report: Any) -> None:
    """Append ``report`` to the file named by ``TP_REPLAYSSM_FAIL_LOG`` if it failed (module docstring)."""
    path = os.environ.get(ENV)
    if not path or not report.failed or _is_xdist_worker():
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(format_report(report))
        f.flush()
