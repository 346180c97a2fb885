"""What the launcher concludes from its monitor's events: a rank failed, or ranks were lost.

A rank that ends with a failure reports it (``exited``, code != 0). A rank whose connection
closes without an exit report, or that goes silent, is ``lost``; losses are gathered for
``gather_s`` (a host's ranks go together, a cut-off host's within one heartbeat), then named by
host: ``host n2 (ranks 2, 3)`` when every rank of the host was lost, else ``rank 3 on host
n2``. What follows a loss is the MPI launcher's teardown, not a cause: a failure reported after
it, losses on hosts that began more than ``WINDOW_S`` after the first, and losses on the
launcher's own host while a remote one was lost (the MPI launcher kills the wrappers there when
it notices the remote host gone; the launcher's host itself cannot be lost, we run on it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from hvdlite.launcher.monitor import Event, Monitor, RankState, group_by_host

__all__ = ["Verdict", "describe_lost"]

GATHER_S = 1.5
WINDOW_S = 0.5


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe_lost(lost: list[RankState], everyone: dict[int, RankState]) -> str:
    """``host n2 (ranks 2, 3)`` / ``rank 3 on host n2``, joined with ``and``."""
    by_host = group_by_host(lost)
    all_by_host = group_by_host(everyone)
    parts = []
    for host, ranks in by_host.items():
        if ranks == all_by_host.get(host):
            parts.append(f"host {host} ({_ranks_text(ranks)})")
        else:
            parts.append(f"{_ranks_text(ranks)} on host {host}")
    return " and ".join(parts)


class Verdict:
    """Reads ``monitor``'s events (:meth:`poll`), keeps the failure reports and decides when
    a loss ends the job (:meth:`loss`). Used by one thread (the launcher's)."""

    def __init__(self, monitor: Monitor, local_host: str, gather_s: float = GATHER_S) -> None:
        self.monitor = monitor
        self.local_host = local_host
        self.gather_s = gather_s
        self.failures: list[dict[str, Any]] = []  # shaped like the rank wrapper's report files
        self._lost: list[Event] = []
        self._first_failure_at: float | None = None
        self._first_lost_wall = 0.0
        self.concluded: str | None = None  # "" once the losses were found to be no host's

    def poll(self) -> None:
        for ev in self.monitor.events():
            if ev.kind == "exited" and ev.code:
                self.failures.append({"rank": ev.rank, "code": ev.code, "time": time.time(),
                                      "host": ev.host,
                                      "signalled": bool(ev.payload.get("signalled"))})
                if self._first_failure_at is None:
                    self._first_failure_at = ev.time
            elif ev.kind == "lost":
                if not self._lost:
                    self._first_lost_wall = time.time() - (time.monotonic() - ev.time)
                self._lost.append(ev)

    @property
    def lost_host(self) -> str | None:
        """The message naming the lost host(s) and ranks, once concluded; else None."""
        return self.concluded or None

    @property
    def pending(self) -> bool:
        """Ranks were lost and no conclusion was drawn yet."""
        return bool(self._lost) and self.concluded is None

    def loss(self, now: float, reports: Sequence[dict[str, Any]] = ()) -> str | None:
        """Once, when ranks were lost (and gathered): what to tell the user and the ranks.
        ``reports``: the rank wrappers' failure reports from the report directory (wall
        times), which a loss that came after them does not override."""
        if self.concluded is not None or not self._lost:
            return None
        first = self._lost[0].time
        if self._first_failure_at is not None and self._first_failure_at <= first:
            return None
        if any(r["time"] <= self._first_lost_wall for r in reports):
            return None  # a rank reported its failure first: the losses are the teardown
        if now - first < self.gather_s:
            return None
        causes = [e for e in self._lost if e.time - first <= WINDOW_S]
        causes = [e for e in causes if e.host != self.local_host]
        if not causes:
            # Only the launcher's own host: its wrappers were killed there (by the MPI
            # launcher after a failure, or by hand); that is no lost host.
            self.concluded = ""
            return None
        everyone = self.monitor.ranks()
        lost = [everyone[e.rank] for e in causes if e.rank in everyone]
        reasons = sorted({e.reason for e in causes})
        self.concluded = f"{describe_lost(lost, everyone)} lost: {'; '.join(reasons)}"
        return self.concluded
