"""The elastic driver's hosts: discovery, blacklisting with a cool-down, worker identities.

Horovod's rules (``horovod/runner/elastic/discovery.py``, ``registration.py``): hosts come
from the discovery script (or ``-H``) and keep the order they first appeared in (ranks fill
them in that order, so the hosts that hold the state keep the low ranks); a host where a worker
failed is blacklisted, for good or, with ``--blacklist-cooldown-range MIN MAX``, for a
cool-down of ``MIN * 2**n + U(0, MIN)`` seconds clamped to ``[MIN, MAX]`` (``n``: how often it
was blacklisted), after which it returns as an added host. A worker is one slot ``(host,
local_rank)``: it keeps the ``HOROVOD_*`` identity of the world it was started in for as long
as it stays in the job, as a Horovod worker process keeps its environment across resets.
Importing this module has no side effects.
"""

from __future__ import annotations

import os
import random
import select
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hvdlite._rankside.protocol import worker_rows, worker_table, workers_plan
from hvdlite.launcher.common import say
from hvdlite.launcher.hosts import check_host

__all__ = ["ADDED", "MAX_DISCOVERY_BYTES", "REMOVED", "Hosts", "Workers", "describe",
           "parse_hosts", "run_discovery", "size"]

DISCOVERY_TIMEOUT_S = 30.0
# About 200,000 hosts' lines: more is a script gone wrong, not read into memory.
MAX_DISCOVERY_BYTES = 4 << 20
COOLDOWN_MIN_S = 1  # Horovod's bounds on --blacklist-cooldown-range
COOLDOWN_MAX_S = 3600
ADDED = 1  # Horovod's HostUpdateResult bits
REMOVED = 2


def parse_hosts(text: str, default_slots: int | None, what: str) -> list[tuple[str, int]]:
    """``"a:2,b"`` or lines ``a:2`` -> ``[("a", 2), ("b", default_slots)]``; ValueError for
    a bad slot count, a name that is not a host (:func:`~hvdlite.launcher.hosts.check_host`)
    or a host listed twice. Linear in the text."""
    hosts: dict[str, int] = {}
    for item in text.replace(",", "\n").splitlines():
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        name, sep, count = item.partition(":")
        name = check_host(name.strip(), what)
        if sep:
            if not count.strip().isdigit() or int(count) < 1:
                raise ValueError(f"{what}: bad slot count in {item!r}: expected host:N, N >= 1")
            slots = int(count)
        elif default_slots is not None:
            slots = default_slots
        else:
            raise ValueError(f"{what}: {item!r} has no ':slots' and --slots is not given")
        if name in hosts:
            raise ValueError(f"{what}: host {name!r} is listed twice")
        hosts[name] = slots
    return list(hosts.items())


def run_discovery(script: str) -> str:
    """What ``script`` printed (no shell, stdin and stderr closed), at most
    ``MAX_DISCOVERY_BYTES`` within ``DISCOVERY_TIMEOUT_S``; ValueError past the bound,
    ``subprocess.SubprocessError`` for a timeout or a non-zero exit, OSError when it cannot
    run."""
    proc = subprocess.Popen([script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    chunks: list[bytes] = []
    total = 0
    deadline = time.monotonic() + DISCOVERY_TIMEOUT_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired([script], DISCOVERY_TIMEOUT_S)
            if not select.select([proc.stdout], [], [], left)[0]:
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                break
            total += len(data)
            if total > MAX_DISCOVERY_BYTES:
                raise ValueError(f"it printed more than {MAX_DISCOVERY_BYTES} bytes")
            chunks.append(data)
        code = proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if code != 0:
        raise subprocess.CalledProcessError(code, [script])
    return b"".join(chunks).decode()


def size(assignment: Sequence[tuple[str, int]]) -> int:
    """How many ranks ``assignment`` holds."""
    return sum(n for _, n in assignment)


def describe(assignment: Sequence[tuple[str, int]]) -> str:
    """``a:2,b:2`` (``(none)`` when empty)."""
    return ",".join(f"{h}:{n}" for h, n in assignment) or "(none)"


@dataclass
class _Blacklist:
    """One host's blacklisting: since when, until when (None: for good), how often."""

    until: float | None = None
    count: int = 0
    why: str = ""


@dataclass
class Hosts:
    """The hosts the job may use, in the order they first appeared, less blacklisted ones.

    ``discovery``: the script (None: ``static``, the ``-H`` hosts); ``cooldown``: Horovod's
    ``--blacklist-cooldown-range`` (None: a blacklisted host never returns)."""

    discovery: str | None
    static: tuple[tuple[str, int], ...]
    slots: int | None
    max_np: int | None
    interval_s: float
    cooldown: tuple[int, int] | None = None
    known: dict[str, int] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    blacklisted: dict[str, _Blacklist] = field(default_factory=dict)
    # Blacklist counts of hosts back from a cool-down (their next one is longer).
    returned: dict[str, int] = field(default_factory=dict)
    next_poll: float = 0.0

    def discover(self, first: bool = False) -> int:
        """Refresh from the discovery script (a failure ends the job only the first time) and
        return the change since the last call: ``ADDED`` | ``REMOVED`` bits (a host back from
        its cool-down counts as added)."""
        before = dict(self.known)
        if self.discovery is None:
            self.known = dict(self.static)
        else:
            try:
                out = run_discovery(self.discovery)
                self.known = dict(parse_hosts(out, self.slots, "host discovery script"))
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                if first:
                    raise RuntimeError(f"--host-discovery-script {self.discovery!r} "
                                       f"failed: {exc}") from exc
                say(f"host discovery failed ({exc}); keeping the last hosts", "elastic")
        self.order = [h for h in self.order if h in self.known] + \
            [h for h in self.known if h not in self.order]
        self.next_poll = time.monotonic() + self.interval_s
        change = 0
        for host, n in self.known.items():
            if n > before.get(host, 0):
                change |= ADDED
            elif n < before[host]:
                change |= REMOVED
        if any(h not in self.known for h in before):
            change |= REMOVED
        now = time.monotonic()
        for host, entry in list(self.blacklisted.items()):
            if entry.until is not None and now >= entry.until:
                del self.blacklisted[host]
                self.returned[host] = entry.count
                if host in self.known:
                    say(f"host {host} is back from its blacklist cool-down", "elastic")
                    change |= ADDED
        return change

    def poll(self) -> int | None:
        """Discover again if it is time: the change (0: none), or None if it did not run."""
        if time.monotonic() < self.next_poll:
            return None
        if self.discovery is None and not self.cooling():
            return None
        return self.discover()

    def cooling(self) -> bool:
        """A blacklisted host may still come back (its cool-down runs)."""
        return any(e.until is not None for e in self.blacklisted.values())

    def blacklist(self, host: str, why: str) -> None:
        """Leave ``host`` out (Horovod's blacklist): for good, or for its next cool-down."""
        if host in self.blacklisted:
            return
        count = self.returned.pop(host, 0) + 1
        until = None
        if self.cooldown is not None:
            low, high = self.cooldown
            delay = max(low, min(high, low * (1 << count) + random.uniform(0, 1) * low))
            until = time.monotonic() + delay
        self.blacklisted[host] = _Blacklist(until, count, why)

    def can_return(self) -> bool:
        """More slots may still come: a discovery script, or a host cooling down."""
        return self.discovery is not None or self.cooling()

    def assignment(self) -> list[tuple[str, int]]:
        """The slots a world started now would use: in host order, at most --max-np."""
        out: list[tuple[str, int]] = []
        total = 0
        for host in self.order:
            if host in self.blacklisted:
                continue
            free = self.known[host]
            if self.max_np is not None:
                free = min(free, self.max_np - total)
            if free > 0:
                out.append((host, free))
                total += free
        return out


class Workers:
    """The job's workers, one per slot ``(host, local_rank)``: each keeps the identity
    (``[host, rank, size, local_rank, local_size, cross_rank, cross_size]``) of the world it
    was started in until it leaves the job (its host failed, was removed or lost the slot).
    A worker's identity is a row of its first world's table: the plan (:meth:`plan`) names
    those worlds and runs of their rows, so its size grows with the hosts, not the ranks."""

    def __init__(self) -> None:
        self.origin: dict[tuple[str, int], tuple[int, int]] = {}  # slot -> (world, row)
        self.worlds: dict[int, tuple[tuple[tuple[str, int], ...], int]] = {}
        self._next_world = 0

    def plan(self, assignment: Sequence[tuple[str, int]]) -> str:
        """The ``WORKERS_ENV`` text (:func:`~hvdlite._rankside.protocol.workers_plan`) of a
        world on ``assignment``: kept identities for slots whose worker goes on, the new
        world's rows for new workers."""
        world = self._next_world
        self._next_world += 1
        rows = worker_table(assignment, size(assignment))
        keep = {(str(r[0]), int(str(r[3]))) for r in rows}
        self.origin = {slot: o for slot, o in self.origin.items() if slot in keep}
        origins = [self.origin.setdefault((str(r[0]), int(str(r[3]))), (world, i))
                   for i, r in enumerate(rows)]
        self.worlds[world] = (tuple(assignment), size(assignment))
        used = sorted({w for w, _ in origins})
        self.worlds = {w: self.worlds[w] for w in used}
        index = {w: i for i, w in enumerate(used)}
        runs: list[list[int]] = []
        for w, row in origins:
            if runs and runs[-1][0] == index[w] and runs[-1][1] + runs[-1][2] == row:
                runs[-1][2] += 1
            else:
                runs.append([index[w], row, 1])
        return workers_plan([self.worlds[w] for w in used],
                            [(w, first, count) for w, first, count in runs])

    def table(self, assignment: Sequence[tuple[str, int]]) -> list[list[object]]:
        """:meth:`plan` as the rows themselves, in rank order."""
        return worker_rows(self.plan(assignment))

    def leave(self, host: str) -> None:
        """Every worker of ``host`` leaves the job (the host failed or is gone)."""
        self.origin = {s: o for s, o in self.origin.items() if s[0] != host}
