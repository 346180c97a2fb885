"""Helpers of the launcher plane, written once: messages, process groups, failure reports.

Importing this module has no side effects.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hvdlite._rankside.protocol import LIVE_PREFIX, UNREACHABLE_KEY, describe_status
from hvdlite.launcher import rankwrap

__all__ = ["KILL_GRACE_S", "POLL_S", "await_ranks", "describe_status", "end_group",
           "exit_code", "first_failure", "kill_group", "ranks_text", "read_reports", "say"]

POLL_S = 0.05
# After SIGTERM to a job's process group, this long before SIGKILL.
KILL_GRACE_S = 2.0
# Beyond the rank guard's grace, how long to wait for a rank program left by the launcher.
LIVE_SLACK_S = 3.0


def say(message: str, what: str = "") -> None:
    """One line ``hvdliterun: [what: ]message`` on stderr."""
    prefix = f"hvdliterun: {what}: " if what else "hvdliterun: "
    print(prefix + message, file=sys.stderr, flush=True)


def kill_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; nothing if it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def end_group(proc: subprocess.Popen[bytes], grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM ``proc``'s process group (it leads one), SIGKILL what is left ``grace_s``
    later, and reap ``proc``."""
    kill_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    kill_group(proc.pid, signal.SIGKILL)
    proc.wait()


def read_reports(directory: str, causes: bool = False) -> list[dict[str, Any]]:
    """The rank wrappers' failure reports (``rank-<N>.json``) in ``directory``. ``causes``:
    only those that may name a cause, leaving out the ranks a wrapper ended because the
    launcher stopped answering (a cut-off host, whose report reached a shared directory: the
    monitor names that host, a moment later)."""
    reports = []
    for path in Path(directory).glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            reports.append(json.loads(path.read_text(encoding="utf-8")))
    if causes:
        return [r for r in reports if not r.get(UNREACHABLE_KEY)]
    return reports


def first_failure(reports: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The failure that started it: ranks that were signalled by the teardown come last."""
    if not reports:
        return None
    return min(reports, key=lambda r: (bool(r.get(UNREACHABLE_KEY)), bool(r.get("signalled")),
                                       r["time"], r["rank"] or 0))


def await_ranks(report_dir: str, busy: Callable[[], object] | None = None) -> None:
    """Wait (bounded) until every rank program the world left behind has ended.

    When a rank fails, the MPI launcher SIGKILLs the other ranks' wrappers; their programs run
    in process groups of their own and get SIGTERM instead, so they can write their timelines.
    Each wrapper's ``live-<rank>`` marker stays until its program ended (its guard SIGKILLs it
    ``GUARD_GRACE_S`` after the wrapper died), so a world's files are complete (and no rank of
    an old world still writes a commit) when this returns. ``busy``: also wait while it says
    true (the monitor's open connections: a rank on another host, where no marker reaches
    this host, holds its connection until its program has ended).
    """
    deadline = time.monotonic() + rankwrap.GUARD_GRACE_S + LIVE_SLACK_S
    while any(Path(report_dir).glob(f"{LIVE_PREFIX}*")) or (busy is not None and busy()):
        if time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


def ranks_text(n: int) -> str:
    """``1 rank`` / ``4 ranks``."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def exit_code(code: int) -> int:
    """A ``Popen.returncode`` as a shell exit status (``-9`` -> 137)."""
    return 128 - code if code < 0 else code
