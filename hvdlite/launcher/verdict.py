"""What the launcher concludes from its monitor's events: a rank failed, or ranks were lost.

A rank that ends with a failure reports it (``exited``, code != 0). A rank whose connection
closes without an exit report, or that goes silent, is ``lost``; losses are gathered for
``gather_s`` (a host's ranks go together, a cut-off host's within a heartbeat or so), then named by
host: ``host n2 (ranks 2, 3)`` when every rank of the host was lost, else ``rank 3 on host
n2``; a host whose connections closed is ``lost``, one that went silent ``stopped answering``
(and for how long). What follows a loss is the MPI launcher's teardown, not a cause: a failure
reported after it, losses on hosts that began more than ``WINDOW_S`` after the first, losses
on the launcher's own host while a remote one was lost (the launcher's host itself cannot be
lost, we run on it), and losses on any host that showed it still answers (``Event.alive``: a
rank's guard reported its wrapper killed while the rank ran, which is what the MPI launcher
does on every surviving host when it ends the job, whether it runs on a rank's host or on a
head node of its own).
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
        self.concluded: str | None = None  # "" once the losses were found to be no host's
        self.lost_ranks: list[int] = []  # the ranks named lost, once concluded

    def poll(self) -> None:
        """Read the monitor's events since the last call."""
        for ev in self.monitor.events():
            if ev.kind == "exited" and ev.code:
                self.failures.append({"rank": ev.rank, "code": ev.code, "time": time.time(),
                                      "host": ev.host,
                                      "signalled": bool(ev.payload.get("signalled"))})
                if self._first_failure_at is None:
                    self._first_failure_at = ev.time
            elif ev.kind == "lost":
                self._lost.append(ev)

    @property
    def lost_host(self) -> str | None:
        """The message naming the lost host(s) and ranks, once concluded; else None."""
        return self.concluded or None

    @property
    def orphaned(self) -> str | None:
        """``rank 2 (host n2)`` whose wrapper was killed first while the rank ran (its host
        alive), or None: what ended a job where nothing else did (a wrapper killed by hand or
        by the OOM killer)."""
        first = next((e for e in self._lost if e.alive), None)
        return None if first is None else f"rank {first.rank} (host {first.host})"

    @property
    def pending(self) -> bool:
        """Ranks were lost and no conclusion was drawn yet."""
        return bool(self._lost) and self.concluded is None

    def loss(self, now: float, reports: Sequence[dict[str, Any]] = ()) -> str | None:
        """Once, when ranks were lost (and gathered): what to tell the user and the ranks.
        ``reports``: the rank wrappers' failure reports from the report directory (wall
        times, those that may name a cause), which a loss that came after them does not
        override."""
        if self.concluded is not None or not self._lost:
            return None
        if now - self._lost[0].time < self.gather_s:
            return None
        alive = {e.host for e in self._lost if e.alive}
        down = [e for e in self._lost if not e.alive]
        if not down:
            # Every loss so far was a wrapper killed on a host that answers: no conclusion yet
            # (a host may still be found silent, the MPI launcher having noticed it first).
            return None
        first = down[0].time
        if self._first_failure_at is not None and self._first_failure_at <= first:
            return None
        first_wall = time.time() - (time.monotonic() - first)
        if any(r["time"] <= first_wall for r in reports):
            return None  # a rank reported its failure first: the losses are the teardown
        if now - first < self.gather_s:
            return None
        # A cut-off host's ranks go silent together, but each is found silent a timeout after
        # its own last heartbeat, up to a beat apart (more on a loaded launcher host): a
        # silent loss on a host already silent in the window is part of the same cause.
        cut = {e.host for e in down if e.time - first <= WINDOW_S and e.silent_s}
        causes = [e for e in down if (e.time - first <= WINDOW_S or (e.silent_s and e.host in cut))
                  and e.host != self.local_host and e.host not in alive]
        if not causes:
            # Only hosts that still answer: their wrappers were killed (by the MPI launcher
            # after a failure, or by hand); that is no lost host.
            self.concluded = ""
            return None
        everyone = self.monitor.ranks()
        parts = []
        closed = [e for e in causes if not e.silent_s]
        if closed:
            reasons = "; ".join(sorted({e.reason for e in closed}))
            parts.append(f"{self._who(closed, everyone)} lost: {reasons}")
        silent = [e for e in causes if e.silent_s]
        if silent:
            longest = max(silent, key=lambda e: e.silent_s)
            parts.append(f"{self._who(silent, everyone)} stopped answering: {longest.reason}")
        self.lost_ranks = sorted({e.rank for e in causes})
        self.concluded = "; ".join(parts)
        return self.concluded

    @staticmethod
    def _who(events: list[Event], everyone: dict[int, RankState]) -> str:
        return describe_lost([everyone[e.rank] for e in events if e.rank in everyone], everyone)
