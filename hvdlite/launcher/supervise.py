"""One MPI world watched to its end, and the one line that says how it ended.

:func:`supervise` waits for the MPI launcher and ends the world early on a rank failure, a
lost host (the ranks' monitor, :mod:`hvdlite.launcher.monitor`, through a
:class:`~hvdlite.launcher.verdict.Verdict`), a signal to ``hvdliterun`` or the timeout;
:func:`conclude` names what happened (the rank that failed first, the host that was lost)
and returns ``hvdliterun``'s exit status. Importing this module has no side effects.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from types import FrameType

from hvdlite.launcher import rankwrap
from hvdlite.launcher.common import (
    KILL_GRACE_S,
    POLL_S,
    describe_status,
    end_group,
    exit_code,
    first_failure,
    kill_group,
    ranks_text,
    read_reports,
    say,
)
from hvdlite.launcher.verdict import Verdict

__all__ = ["EXIT_HOST_LOST", "EXIT_TIMEOUT", "Outcome", "StartCheck", "conclude", "supervise"]

EXIT_TIMEOUT = 124
EXIT_HOST_LOST = 1
# After the surviving ranks were told to end: their wrappers escalate to SIGTERM, then SIGKILL.
LOST_GRACE_S = rankwrap.ABORT_GRACE_S + rankwrap.TERM_GRACE_S + 1.0
# After the MPI launcher failed, this long for the monitor to report a loss it caused.
SETTLE_S = 0.5
# After a rank failed, the MPI launcher gets this long to end the job itself.
FAILURE_GRACE_S = 3.0


@dataclass
class Outcome:
    """How :func:`supervise` saw the world end."""

    returncode: int
    timed_out: bool
    interrupted: int | None
    not_started: str | None = None  # the ranks that did not start in time, named


@dataclass
class StartCheck:
    """Every rank's wrapper must reach the monitor within ``timeout_s`` (horovodrun's
    ``--start-timeout``). ``hosts``: the host of each rank, in rank order."""

    hosts: list[str]
    timeout_s: float

    def missing(self, verdict: Verdict) -> str | None:
        """The ranks that have not started, by host (None when all did)."""
        joined = verdict.monitor.ranks()
        absent = [r for r in range(len(self.hosts)) if r not in joined]
        if not absent:
            return None
        by_host: dict[str, list[int]] = {}
        for rank in absent:
            by_host.setdefault(self.hosts[rank], []).append(rank)
        return " and ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} on "
                            f"host {h}" for h, r in by_host.items())


def supervise(proc: subprocess.Popen[bytes], report_dir: str, timeout: float | None,
              verdict: Verdict, start_check: StartCheck | None = None) -> Outcome:
    """Wait for the world ``proc`` (the MPI launcher, leading its process group) runs; end
    it early on a rank failure, a lost host, a signal to us, ``timeout`` seconds, or ranks
    that did not start within ``start_check``'s time. A lost host: the other ranks are told
    to end (they write their timelines)."""
    start = time.monotonic()
    started = start_check is None
    end_by: float | None = None  # when to stop waiting for the MPI launcher to end the job
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal end_by
        interrupted.append(signum)
        kill_group(proc.pid, signum)
        end_by = time.monotonic() + (KILL_GRACE_S if len(interrupted) == 1 else 0.0)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = proc.wait(timeout=POLL_S)
                if code != 0:
                    _settle(verdict, report_dir)
                kill_group(proc.pid, signal.SIGKILL)  # stragglers whose launcher is gone
                return Outcome(code, False, interrupted[0] if interrupted else None)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                end_group(proc)
                return Outcome(proc.returncode, True, None)
            if not started and start_check is not None:
                missing = start_check.missing(verdict)
                started = missing is None
                if missing is not None and now - start > start_check.timeout_s:
                    end_group(proc)
                    return Outcome(proc.returncode, False, None,
                                   f"{missing} did not start within --start-timeout "
                                   f"{start_check.timeout_s:g} s")
            if _lost(verdict, now, report_dir):
                end_by = now + LOST_GRACE_S
            if verdict.lost_host and not verdict.monitor.running() and end_by:
                # Every rank that can still be reached has ended; the MPI launcher may wait
                # long for the lost host's proxy (a cut link): do not wait for it.
                end_by = min(end_by, now + FAILURE_GRACE_S / 3)
            if end_by is None and (verdict.failures or read_reports(report_dir, causes=True)):
                end_by = now + FAILURE_GRACE_S
            if end_by is not None and now > end_by:
                end_group(proc)
                return Outcome(proc.returncode, False, interrupted[0] if interrupted else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _lost(verdict: Verdict, now: float, report_dir: str) -> bool:
    """Read the monitor; when ranks were lost, tell the others to end (True, once)."""
    verdict.poll()
    lost = verdict.loss(now, read_reports(report_dir, causes=True)) if verdict.pending else None
    if lost is not None:
        verdict.monitor.abort(f"{lost}; hvdliterun ends the job", ranks=verdict.monitor.running())
    return lost is not None


def _settle(verdict: Verdict, report_dir: str) -> None:
    """The MPI launcher failed: it may have noticed a lost host as soon as the monitor did.
    Give the monitor's losses their gathering time, so the message names the host."""
    start = time.monotonic()
    while True:
        now = time.monotonic()
        if _lost(verdict, now, report_dir) or now - start > verdict.gather_s + SETTLE_S:
            return
        if not verdict.pending and now - start > SETTLE_S:
            return
        time.sleep(POLL_S)


def conclude(outcome: Outcome, report_dir: str, np: int, timeout: float | None,
             verdict: Verdict) -> int:
    """Say how the world ended (one line, unless it succeeded); ``hvdliterun``'s exit status."""
    if outcome.timed_out:
        say(f"job of {ranks_text(np)} exceeded --timeout {timeout:g} s; all ranks were killed")
        return EXIT_TIMEOUT
    if outcome.not_started:
        say(f"{outcome.not_started}; the job of {ranks_text(np)} was ended")
        return EXIT_TIMEOUT
    if verdict.lost_host:
        say(f"{verdict.lost_host}; the job of {ranks_text(np)} was ended (the other ranks were "
            "told to end and write their timelines)")
        return EXIT_HOST_LOST
    first = first_failure(read_reports(report_dir) + verdict.failures)
    if first is not None:
        say(f"rank {first['rank']} (host {first['host']}) failed first with "
            f"{describe_status(first['code'])}; the job of {ranks_text(np)} was ended")
        return exit_code(first["code"]) or 1
    if outcome.interrupted is not None:
        say(f"interrupted by {signal.Signals(outcome.interrupted).name}; job ended")
        return 128 + outcome.interrupted
    if outcome.returncode != 0 and verdict.orphaned:
        say(f"{verdict.orphaned}: its rank wrapper was killed while the rank ran; the job of "
            f"{ranks_text(np)} was ended")
        return exit_code(outcome.returncode)
    if outcome.returncode != 0:
        say(f"the MPI launcher ended the job with {describe_status(outcome.returncode)} and "
            f"no rank reported a failure (see the messages above)")
        return exit_code(outcome.returncode)
    return 0
