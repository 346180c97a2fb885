"""The elastic ``hvdliterun``: a driver that runs an elastic job as a sequence of MPI worlds.

An MPI world cannot shrink or grow in place, so the driver starts one world on the slots that
are available, watches it, and when a rank fails or the hosts change it ends that world and
starts the next one on the slots that are there now (the ranks restore the newest commit, see
:mod:`hvdlite.elastic`). Hosts come from ``--host-discovery-script`` (polled every
``DISCOVERY_INTERVAL_S``) or from ``-H`` / ``localhost:-np``. A rank that fails takes its slot
out of the job; a rank that leaves for a reset (hosts updated, or a collective failed under
it) does not. ``--reset-limit`` bounds the restarts, ``--elastic-timeout`` the wait for enough
slots. Flags and meanings follow ``horovodrun`` (see ``docs/config.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from hvdlite import _rankwrap
from hvdlite._launch.verdict import Verdict
from hvdlite.elastic import _worker

__all__ = ["ElasticArgs", "add_flags", "elastic_args", "is_elastic", "parse_hosts",
           "run_elastic"]

DISCOVERY_INTERVAL_S = 1.0
DISCOVERY_TIMEOUT_S = 30.0
DEFAULT_ELASTIC_TIMEOUT_S = 600.0
ELASTIC_TIMEOUT_ENVS = ("HVDLITE_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT")
# After the first rank left for a reset, the others get this long to leave as well.
RESET_GRACE_S = 30.0
POLL_S = 0.05
EXIT_RESET_LIMIT = 1
EXIT_NO_SLOTS = 1


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Horovod's elastic flags on ``hvdliterun``'s parser."""
    group = parser.add_argument_group(
        "elastic training (enabled by --min-np or --host-discovery-script)")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                       help="fewest ranks training goes on with; below it, the job waits for "
                       "slots (up to --elastic-timeout). Default: -np")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                       help="most ranks the job grows to (default: unbounded)")
    group.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="executable printing the available hosts, one 'host[:slots]' a "
                       "line; polled every second")
    group.add_argument("--slots", "--slots-per-host", dest="slots", type=int, metavar="N",
                       help="slots of a host the discovery script prints without ':slots'")
    group.add_argument("--elastic-timeout", type=float, metavar="SECONDS",
                       help="how long to wait for enough slots (default 600; env "
                       "HOROVOD_ELASTIC_TIMEOUT)")
    group.add_argument("--reset-limit", type=int, metavar="N",
                       help="end the job when it would have to restart more than N times "
                       "(default: unbounded)")


def is_elastic(ns: argparse.Namespace) -> bool:
    """Horovod's rule: ``--min-np`` or ``--host-discovery-script`` makes a job elastic."""
    return getattr(ns, "min_np", None) is not None or \
        getattr(ns, "host_discovery_script", None) is not None


@dataclass(frozen=True)
class ElasticArgs:
    """The validated elastic settings of one job."""

    np: int
    min_np: int
    max_np: int | None
    discovery: str | None
    slots: int | None
    static_hosts: tuple[tuple[str, int], ...]
    elastic_timeout: float
    reset_limit: int | None


def parse_hosts(text: str, default_slots: int | None, what: str) -> list[tuple[str, int]]:
    """``"a:2,b"`` or lines ``a:2`` -> ``[("a", 2), ("b", default_slots)]``; ValueError."""
    hosts: list[tuple[str, int]] = []
    for item in text.replace(",", "\n").splitlines():
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        name, sep, count = item.partition(":")
        if sep:
            if not count.strip().isdigit() or int(count) < 1:
                raise ValueError(f"{what}: bad slot count in {item!r}: expected host:N, N >= 1")
            slots = int(count)
        elif default_slots is not None:
            slots = default_slots
        else:
            raise ValueError(f"{what}: {item!r} has no ':slots' and --slots is not given")
        if any(h == name for h, _ in hosts):
            raise ValueError(f"{what}: host {name!r} is listed twice")
        hosts.append((name.strip(), slots))
    return hosts


def elastic_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ElasticArgs:
    """Validate the elastic flags (``parser.error`` on bad ones)."""
    min_np = ns.min_np if ns.min_np is not None else ns.np
    if min_np < 1 or min_np > ns.np:
        parser.error(f"--min-np must be between 1 and -np ({ns.np}), got {min_np}")
    if ns.max_np is not None and ns.max_np < ns.np:
        parser.error(f"--max-np must be >= -np ({ns.np}), got {ns.max_np}")
    if ns.slots is not None and ns.slots < 1:
        parser.error(f"--slots must be >= 1, got {ns.slots}")
    if ns.reset_limit is not None and ns.reset_limit < 0:
        parser.error(f"--reset-limit must be >= 0, got {ns.reset_limit}")
    if ns.hostfile:
        parser.error("an elastic job takes its hosts from --host-discovery-script or -H, "
                     "not --hostfile")
    timeout = ns.elastic_timeout
    if timeout is None:
        env = next((os.environ[k] for k in ELASTIC_TIMEOUT_ENVS if os.environ.get(k)), None)
        try:
            timeout = float(env) if env else DEFAULT_ELASTIC_TIMEOUT_S
        except ValueError:
            parser.error(f"HOROVOD_ELASTIC_TIMEOUT must be a number of seconds, got {env!r}")
    if timeout <= 0:
        parser.error(f"--elastic-timeout must be > 0 seconds, got {timeout:g}")
    static: list[tuple[str, int]] = []
    if ns.host_discovery_script is None:
        try:
            static = parse_hosts(ns.hosts, ns.slots, "-H") if ns.hosts else [("localhost",
                                                                             ns.np)]
        except ValueError as exc:
            parser.error(str(exc))
    return ElasticArgs(ns.np, min_np, ns.max_np, ns.host_discovery_script, ns.slots,
                       tuple(static), timeout, ns.reset_limit)


def _say(message: str) -> None:
    print(f"hvdliterun: elastic: {message}", file=sys.stderr, flush=True)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass
class _Hosts:
    """The hosts the job may use, in the order they first appeared (ranks fill them in that
    order, so the hosts that hold the state keep the low ranks), less failed slots."""

    args: ElasticArgs
    known: dict[str, int] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)
    next_poll: float = 0.0

    def discover(self, first: bool = False) -> None:
        """Refresh from the discovery script (a failure ends the job only the first time)."""
        if self.args.discovery is None:
            self.known = dict(self.args.static_hosts)
        else:
            try:
                out = subprocess.run([self.args.discovery], capture_output=True, text=True,
                                     timeout=DISCOVERY_TIMEOUT_S, check=True).stdout
                self.known = dict(parse_hosts(out, self.args.slots, "host discovery script"))
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                if first:
                    raise RuntimeError(f"--host-discovery-script {self.args.discovery!r} "
                                       f"failed: {exc}") from exc
                _say(f"host discovery failed ({exc}); keeping the last hosts")
        self.order = [h for h in self.order if h in self.known] + \
            [h for h in self.known if h not in self.order]
        self.next_poll = time.monotonic() + DISCOVERY_INTERVAL_S

    def poll(self) -> bool:
        """Discover again if it is time; True if it ran."""
        if self.args.discovery is None or time.monotonic() < self.next_poll:
            return False
        self.discover()
        return True

    def assignment(self) -> list[tuple[str, int]]:
        """The slots a world started now would use: in host order, at most --max-np."""
        cap = self.args.max_np
        out: list[tuple[str, int]] = []
        total = 0
        for host in self.order:
            free = self.known[host] - self.failed.get(host, 0)
            if cap is not None:
                free = min(free, cap - total)
            if free > 0:
                out.append((host, free))
                total += free
        return out


def _size(assignment: Sequence[tuple[str, int]]) -> int:
    return sum(n for _, n in assignment)


def _describe(assignment: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{h}:{n}" for h, n in assignment) or "(none)"


@dataclass
class _World:
    generation: int
    assignment: list[tuple[str, int]]
    report_dir: str
    proc: subprocess.Popen[bytes]
    started: float
    verdict: Verdict | None = None
    lost_hosts: list[str] = field(default_factory=list)

    def reports(self) -> list[dict[str, Any]]:
        """Failure reports: the wrappers' files and, from the monitor, their exit reports."""
        found = {r["rank"]: r for r in _reports(self.report_dir)}
        if self.verdict is not None:
            self.verdict.poll()
            for r in self.verdict.failures:
                found.setdefault(r["rank"], r)
        return list(found.values())

    def host_of(self, rank: int | None) -> str | None:
        if rank is None:
            return None
        for host, n in self.assignment:
            if rank < n:
                return host
            rank -= n
        return None


@dataclass
class _Ended:
    code: int | None
    reports: list[dict[str, Any]]
    interrupted: int | None = None
    timed_out: bool = False


class _Driver:
    def __init__(self, args: ElasticArgs, spec: Any, env: dict[str, str], report_dir: str,
                 build_command: Any, timeout: float | None,
                 new_monitor: Callable[[], Any] | None) -> None:
        self.args = args
        self.new_monitor = new_monitor
        self.spec = spec
        self.env = env
        self.report_dir = report_dir
        self.build_command = build_command
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.hosts = _Hosts(args)
        self.job_dir = tempfile.mkdtemp(prefix="hvdlite-elastic-", dir=report_dir)
        self.interrupted: list[int] = []

    # -- slots ------------------------------------------------------------------------------

    def wait_for_slots(self, need: int) -> list[tuple[str, int]] | None:
        """The assignment once it has ``need`` slots; None after --elastic-timeout."""
        give_up = time.monotonic() + self.args.elastic_timeout
        said = False
        while True:
            assignment = self.hosts.assignment()
            if _size(assignment) >= need:
                return assignment
            if self.args.discovery is None or time.monotonic() > give_up or self.interrupted:
                return None
            if not said:
                _say(f"waiting up to {self.args.elastic_timeout:g} s for {need} slots "
                     f"(have {_size(assignment)}: {_describe(assignment)})")
                said = True
            time.sleep(max(0.0, self.hosts.next_poll - time.monotonic()))
            self.hosts.poll()

    # -- one world --------------------------------------------------------------------------

    def start(self, generation: int, assignment: list[tuple[str, int]]) -> _World:
        report_dir = os.path.join(self.report_dir, f"world-{generation}")
        os.makedirs(report_dir)
        os.makedirs(_worker.generation_dir(self.job_dir, generation), exist_ok=True)
        extra = {_rankwrap.REPORT_DIR_ENV: report_dir, _worker.ELASTIC_DIR_ENV: self.job_dir,
                 _worker.GENERATION_ENV: str(generation)}
        # A monitor of its own per world: rank numbers repeat from one world to the next.
        monitor = self.new_monitor() if self.new_monitor is not None else None
        if monitor is not None:
            extra |= monitor.env()
        forward = dict(self.spec.forward_env) | extra
        spec = dataclasses.replace(self.spec, np=_size(assignment),
                                   hosts=_describe(assignment),
                                   forward_env=tuple(forward.items()))
        try:
            proc = subprocess.Popen(self.build_command(spec), env=self.env | extra,
                                    start_new_session=True)
        except OSError:
            if monitor is not None:
                monitor.close()
            raise
        verdict = Verdict(monitor, socket.gethostname()) if monitor is not None else None
        return _World(generation, assignment, report_dir, proc, time.monotonic(), verdict)

    def watch(self, world: _World) -> _Ended:
        """Wait for ``world`` to end; end it early on a failure, a signal or the timeout, and
        tell its ranks when the hosts change."""
        end_by: float | None = None
        notified = False
        told_at = 0.0
        while True:
            try:
                code = world.proc.wait(timeout=POLL_S)
                _kill_group(world.proc.pid, signal.SIGKILL)
                if code != 0:
                    self.attribute_loss(world)
                return _Ended(code, world.reports())
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.interrupted:
                self.end(world)
                return _Ended(world.proc.returncode, [], interrupted=self.interrupted[0])
            if self.deadline is not None and now > self.deadline:
                self.end(world)
                return _Ended(world.proc.returncode, [], timed_out=True)
            reports = world.reports()
            if not reports and self.lost(world, now):
                self.end(world)
                return _Ended(world.proc.returncode, [])
            if any(r["code"] not in _worker.RESET_EXIT_CODES for r in reports):
                self.end(world)  # a rank failed: the commit on disk is all that is needed
                return _Ended(world.proc.returncode, reports)
            if reports and end_by is None:
                end_by = now + RESET_GRACE_S  # ranks are leaving for a reset
            if end_by is not None and now > end_by:
                self.end(world)
                return _Ended(world.proc.returncode, world.reports())
            if self.hosts.poll() and not notified and self.hosts.assignment() != \
                    world.assignment and _size(self.hosts.assignment()) >= self.args.min_np:
                notified = True
                _say(f"hosts changed to {_describe(self.hosts.assignment())}; asking the "
                     f"ranks to reset at their next commit")
                # Also in the job directory, for ranks on this host without a monitor link.
                Path(_worker.generation_dir(self.job_dir, world.generation),
                     _worker.HOSTS_UPDATED_FILE).touch()
            if notified and world.verdict is not None and now - told_at > DISCOVERY_INTERVAL_S:
                told_at = now  # again each second: a rank may not have been listening yet
                world.verdict.monitor.broadcast({"t": _worker.HOSTS_UPDATED_MESSAGE,
                                                 "generation": world.generation})

    def lost(self, world: _World, now: float) -> bool:
        """The monitor lost ranks of ``world`` (their connections closed, or silence): their
        hosts go into ``world.lost_hosts``."""
        verdict = world.verdict
        lost = verdict.loss(now) if verdict is not None else None
        if verdict is None or lost is None:
            return False
        gone = [st for st in verdict.monitor.ranks().values() if st.lost]
        if any(st.host != verdict.local_host for st in gone):  # as Verdict: the others' loss
            gone = [st for st in gone if st.host != verdict.local_host]  # is the teardown
        hosts = {world.host_of(st.rank) for st in gone}
        world.lost_hosts = sorted(h for h in hosts if h is not None)
        _say(f"{lost}; ending world {world.generation}")
        return True

    def attribute_loss(self, world: _World) -> None:
        """The MPI launcher failed first (its proxy on a dead host went with it): give the
        monitor the time it takes to name a lost host."""
        if world.verdict is None:
            return
        give_up = time.monotonic() + world.verdict.gather_s + 1.0
        while time.monotonic() < give_up:
            if world.reports() or self.lost(world, time.monotonic()):
                return
            time.sleep(POLL_S)

    def end(self, world: _World) -> None:
        """SIGTERM the world's process group, SIGKILL what is left shortly after."""
        _kill_group(world.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            world.proc.wait(timeout=2.0)
        _kill_group(world.proc.pid, signal.SIGKILL)
        world.proc.wait()

    def close(self, world: _World) -> None:
        if world.verdict is not None:
            world.verdict.monitor.close()

    # -- the job ----------------------------------------------------------------------------

    def run(self) -> int:
        previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self.loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shutil.rmtree(self.job_dir, ignore_errors=True)

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.interrupted.append(signum)

    def loop(self) -> int:
        try:
            self.hosts.discover(first=True)
        except RuntimeError as exc:
            _say(str(exc))
            return EXIT_NO_SLOTS
        resets = 0
        generation = 0
        need = self.args.np
        while True:
            assignment = self.wait_for_slots(need)
            if self.interrupted:
                return 128 + self.interrupted[0]
            if assignment is None:
                have = self.hosts.assignment()
                waited = (f"after --elastic-timeout {self.args.elastic_timeout:g} s"
                          if self.args.discovery is not None
                          else "on the fixed hosts (no --host-discovery-script to wait for)")
                _say(f"not enough slots: {need} needed (--min-np {self.args.min_np}, -np "
                     f"{self.args.np}), {_size(have)} available ({_describe(have)}) {waited}; "
                     f"the job was ended")
                return EXIT_NO_SLOTS
            _say(f"world {generation}: {_size(assignment)} ranks on {_describe(assignment)}")
            try:
                world = self.start(generation, assignment)
            except OSError as exc:
                _say(f"cannot start {self.spec.mpiexec!r}: {exc}")
                return 127
            try:
                ended = self.watch(world)
                _await_ranks(world.report_dir)
            finally:
                self.close(world)
            if ended.interrupted is not None:
                _say(f"interrupted by {signal.Signals(ended.interrupted).name}; job ended")
                return 128 + ended.interrupted
            if ended.timed_out:
                _say(f"job exceeded --timeout {self.timeout:g} s; all ranks were killed")
                return 124
            if ended.code == 0 and not ended.reports:
                return 0
            cause = self.account(world, ended)
            if self.args.reset_limit is not None and resets >= self.args.reset_limit:
                _say(f"{cause}; the job was ended because the number of resets reached "
                     f"--reset-limit {self.args.reset_limit} (Horovod: number of resets "
                     f"during elastic job exceeded limit)")
                return EXIT_RESET_LIMIT
            resets += 1
            generation += 1
            need = self.args.min_np
            self.hosts.discover()
            _say(f"{cause}; reset {resets}"
                 + (f" of at most {self.args.reset_limit}" if self.args.reset_limit is not None
                    else "") + ": restarting from the last commit")

    def account(self, world: _World, ended: _Ended) -> str:
        """Take failed slots out of the job; a one-line cause of the world's end."""
        for lost_host in world.lost_hosts:  # every slot of a lost host
            self.hosts.failed[lost_host] = self.hosts.known.get(lost_host, 0)
        if world.lost_hosts:
            return f"host(s) {', '.join(world.lost_hosts)} lost; left out"
        failures = [r for r in ended.reports if r["code"] not in _worker.RESET_EXIT_CODES
                    and not r.get("signalled")]
        for report in failures:
            host = world.host_of(report.get("rank"))
            if host is not None:
                self.hosts.failed[host] = self.hosts.failed.get(host, 0) + 1
        if failures:
            first = min(failures, key=lambda r: r["time"])
            return (f"rank {first['rank']} (host {first['host']}) failed with "
                    f"{_rankwrap.describe_status(first['code'])}; its slot is left out")
        if any(r["code"] == _worker.EXIT_HOSTS_UPDATED for r in ended.reports):
            return "the ranks left their world for the new hosts"
        if ended.reports:
            return "a collective failed; the ranks left their world"
        silent = self.never_started(world)
        if silent:
            for host in silent:
                self.hosts.failed[host] = self.hosts.known.get(host, 0)
            return (f"the MPI launcher ended the world with "
                    f"{_rankwrap.describe_status(ended.code or 0)} before any rank started on "
                    f"host(s) {', '.join(silent)} (unreachable?); left out")
        return (f"the MPI launcher ended the world with "
                f"{_rankwrap.describe_status(ended.code or 0)} and no rank reported")


    @staticmethod
    def never_started(world: _World) -> list[str]:
        """Hosts of ``world`` where no rank reached the monitor while others did (a host the
        MPI launcher could not start ranks on)."""
        if world.verdict is None:
            return []
        joined = {world.host_of(rank) for rank in world.verdict.monitor.ranks()}
        silent = [host for host, _ in world.assignment if host not in joined]
        return silent if len(silent) < len(world.assignment) else []


def _reports(directory: str) -> list[dict[str, Any]]:
    out = []
    for path in Path(directory).glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(path.read_text(encoding="utf-8")))
    return out


def _await_ranks(report_dir: str) -> None:
    """Wait (bounded) until the world's rank programs have ended, so that no rank of an old
    world still writes a commit while the next one starts."""
    deadline = time.monotonic() + _rankwrap.GUARD_GRACE_S + 3.0
    while any(Path(report_dir).glob(f"{_rankwrap.LIVE_PREFIX}*")):
        if time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


def run_elastic(args: ElasticArgs, spec: Any, env: dict[str, str], report_dir: str,
                build_command: Any, timeout: float | None,
                new_monitor: Callable[[], Any] | None = None) -> int:
    """Run the job elastically; the exit code of ``hvdliterun``. ``spec``: the job as
    ``hvdliterun`` would start it (a ``JobSpec``; each world changes its size, hosts and
    environment); ``new_monitor``: a started ranks' monitor (hvdlite/_launch/monitor.py) for
    each world, whose lost hosts leave the job."""
    return _Driver(args, spec, env, report_dir, build_command, timeout, new_monitor).run()
