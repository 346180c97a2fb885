"""The elastic ``hvdliterun``: a driver that runs an elastic job as a sequence of MPI worlds.

An MPI world cannot shrink or grow in place, so the driver starts one world on the slots that
are available, watches it, and when a rank fails or the hosts change it ends that world and
starts the next one on the slots that are there now (the ranks restore the newest commit, see
:mod:`hvdlite.elastic`). Hosts come from ``--host-discovery-script`` (run every
``discovery_interval_s``) or ``-H`` / ``localhost:-np`` (:mod:`hvdlite.launcher.discovery`).

Horovod's rules: a rank that fails (not one that leaves for a reset: hosts updated, or a
collective failed under it) gets its **host** blacklisted, with ``--blacklist-cooldown-range``
for a while; when every host of a world failed (or was lost) the job ends at once with an
error, with no wait for slots that cannot come back; ``--reset-limit`` bounds the restarts,
``elastic_timeout_s`` the wait for ``--min-np`` slots. Each rank gets Horovod's per-worker
variables of its worker (``HOROVOD_RANK``: the rank its worker had when it was started). The
ranks are told of changed hosts on the control channel (``state._host_messages``), and MPICH's
"BAD TERMINATION" banner and its process manager's teardown lines (``assert (!closed)
failed``, ...) are left out of a world the driver ends or explains (:mod:`.worldout`).
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from hvdlite._rankside import protocol
from hvdlite.config import Config
from hvdlite.launcher import rankwrap
from hvdlite.launcher.common import (
    POLL_S,
    await_ranks,
    describe_status,
    end_group,
    kill_group,
    ranks_text,
    read_reports,
    say,
)
from hvdlite.launcher.discovery import Hosts, Workers, describe, parse_hosts, size
from hvdlite.launcher.job import JobSpec, build_command
from hvdlite.launcher.verdict import Verdict
from hvdlite.launcher.worldout import BannerFilter, NoiseFilter

__all__ = ["ElasticArgs", "add_flags", "elastic_args", "is_elastic", "run_elastic"]

# After the first rank left for a reset, the others get this long to leave as well.
RESET_GRACE_S = 30.0
EXIT_RESET_LIMIT = 1
EXIT_NO_SLOTS = 1
EXIT_ALL_FAILED = 1
RESET_LIMIT_MESSAGE = ("Horovod was shutdown because number of resets during elastic job "
                       "exceeded limit: {}")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Horovod's elastic flags on ``hvdliterun``'s parser (``--elastic-timeout`` and
    ``--discovery-interval-s`` are knobs: :mod:`hvdlite.config`)."""
    group = parser.add_argument_group(
        "elastic training (enabled by --min-np or --host-discovery-script)")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                       help="fewest ranks training goes on with; below it, the job waits for "
                       "slots (up to --elastic-timeout). Default: -np")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                       help="most ranks the job grows to (default: unbounded)")
    group.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="executable printing the available hosts, one 'host[:slots]' a "
                       "line; run every --discovery-interval-s")
    group.add_argument("--slots", "--slots-per-host", dest="slots", type=int, metavar="N",
                       help="slots of a host the discovery script prints without ':slots'")
    group.add_argument("--reset-limit", type=int, metavar="N",
                       help="end the job when it would have to restart more than N times "
                       "(default: unbounded)")
    group.add_argument("--blacklist-cooldown-range", dest="cooldown", type=int, nargs=2,
                       metavar=("MIN", "MAX"),
                       help="a failed host returns after a cool-down of MIN*2^n + U(0, MIN) s "
                       "within [MIN, MAX] (n: its failures; Horovod's); default: never")


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
    discovery_interval: float = 1.0
    cooldown: tuple[int, int] | None = None


def elastic_args(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 config: Config) -> ElasticArgs:
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
    cooldown = tuple(ns.cooldown) if ns.cooldown else None
    if cooldown is not None and not (1 <= cooldown[0] <= cooldown[1] <= 3600):
        parser.error(f"--blacklist-cooldown-range MIN MAX needs 1 <= MIN <= MAX <= 3600 "
                     f"seconds (Horovod's bounds), got {cooldown[0]} {cooldown[1]}")
    static: list[tuple[str, int]] = []
    if ns.host_discovery_script is None:
        try:
            static = parse_hosts(ns.hosts, ns.slots, "-H") if ns.hosts else [("localhost",
                                                                             ns.np)]
        except ValueError as exc:
            parser.error(str(exc))
    return ElasticArgs(ns.np, min_np, ns.max_np, ns.host_discovery_script, ns.slots,
                       tuple(static), config.elastic_timeout_s, ns.reset_limit,
                       config.discovery_interval_s, cooldown)


@dataclass
class _World:
    generation: int
    assignment: list[tuple[str, int]]
    report_dir: str
    proc: subprocess.Popen[bytes]
    started: float
    verdict: Verdict | None = None
    lost_hosts: list[str] = field(default_factory=list)
    output: BannerFilter | None = None
    errors: NoiseFilter | None = None

    def reports(self) -> list[dict[str, Any]]:
        """Failure reports: the wrappers' files and, from the monitor, their exit reports."""
        found = {r["rank"]: r for r in read_reports(self.report_dir, causes=True)}
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
    def __init__(self, args: ElasticArgs, spec: JobSpec, env: dict[str, str], report_dir: str,
                 timeout: float | None,
                 new_monitor: Callable[[list[tuple[str, int]]], Any] | None) -> None:
        self.args = args
        self.new_monitor = new_monitor
        self.spec = spec
        self.env = env
        self.report_dir = report_dir
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.hosts = Hosts(args.discovery, args.static_hosts, args.slots, args.max_np,
                           args.discovery_interval, args.cooldown)
        self.workers = Workers()
        self.job_dir = tempfile.mkdtemp(prefix="hvdlite-elastic-", dir=report_dir)
        self.interrupted: list[int] = []

    # -- slots ------------------------------------------------------------------------------

    def wait_for_slots(self, need: int) -> list[tuple[str, int]] | None:
        """The assignment once it has ``need`` slots; None after the elastic timeout, or at
        once when no more slots can come."""
        give_up = time.monotonic() + self.args.elastic_timeout
        said = False
        while True:
            assignment = self.hosts.assignment()
            if size(assignment) >= need:
                return assignment
            if not self.hosts.can_return() or time.monotonic() > give_up or self.interrupted:
                return None
            if not said:
                say(f"waiting up to {self.args.elastic_timeout:g} s for {need} slots "
                    f"(have {size(assignment)}: {describe(assignment)})", "elastic")
                said = True
            time.sleep(max(0.0, min(self.hosts.next_poll - time.monotonic(), 0.2)))
            self.hosts.poll()

    # -- one world --------------------------------------------------------------------------

    def start(self, generation: int, assignment: list[tuple[str, int]]) -> _World:
        report_dir = os.path.join(self.report_dir, f"world-{generation}")
        os.makedirs(report_dir)
        os.makedirs(protocol.generation_dir(self.job_dir, generation), exist_ok=True)
        extra = {protocol.REPORT_DIR_ENV: report_dir, protocol.ELASTIC_DIR_ENV: self.job_dir,
                 protocol.GENERATION_ENV: str(generation), "HOROVOD_ELASTIC": "1",
                 rankwrap.WORKERS_ENV: self.workers.plan(assignment)}
        # A monitor of its own per world: rank numbers repeat from one world to the next.
        monitor = self.new_monitor(assignment) if self.new_monitor is not None else None
        if monitor is not None:
            extra |= monitor.env()
        forward = dict(self.spec.forward_env) | extra
        spec = dataclasses.replace(self.spec, np=size(assignment), hosts=describe(assignment),
                                   forward_env=tuple(forward.items()))
        try:
            proc = subprocess.Popen(build_command(spec), env=self.env | extra,
                                    start_new_session=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        except OSError:
            if monitor is not None:
                monitor.close()
            raise
        assert proc.stdout is not None and proc.stderr is not None
        output = BannerFilter(proc.stdout, sys.stdout.buffer)
        errors = NoiseFilter(proc.stderr, sys.stderr.buffer)
        verdict = Verdict(monitor, socket.gethostname()) if monitor is not None else None
        return _World(generation, assignment, report_dir, proc, time.monotonic(), verdict,
                      output=output, errors=errors)

    def watch(self, world: _World) -> _Ended:
        """Wait for ``world`` to end; end it early on a failure, a signal or the timeout, and
        tell its ranks when the hosts change."""
        end_by: float | None = None
        notice: dict[str, Any] | None = None
        told_at = 0.0
        while True:
            try:
                code = world.proc.wait(timeout=POLL_S)
                kill_group(world.proc.pid, signal.SIGKILL)
                if code != 0:
                    self.attribute_loss(world)
                return _Ended(code, world.reports())
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.interrupted:
                end_group(world.proc)
                return _Ended(world.proc.returncode, [], interrupted=self.interrupted[0])
            if self.deadline is not None and now > self.deadline:
                end_group(world.proc)
                return _Ended(world.proc.returncode, [], timed_out=True)
            reports = world.reports()
            if not reports and self.lost(world, now):
                end_group(world.proc)
                return _Ended(world.proc.returncode, [])
            if any(r["code"] not in protocol.RESET_EXIT_CODES for r in reports):
                end_group(world.proc)  # a rank failed: the commit on disk is all that is needed
                return _Ended(world.proc.returncode, reports)
            if reports and end_by is None:
                end_by = now + RESET_GRACE_S  # ranks are leaving for a reset
            if end_by is not None and now > end_by:
                end_group(world.proc)
                return _Ended(world.proc.returncode, world.reports())
            change = self.hosts.poll()
            if change and notice is None and self.hosts.assignment() != world.assignment \
                    and size(self.hosts.assignment()) >= self.args.min_np:
                notice = {"t": protocol.HOSTS_UPDATED_MESSAGE, "generation": world.generation,
                          "timestamp": int(time.time()), "res": change}
                say(f"hosts changed to {describe(self.hosts.assignment())}; asking the "
                    f"ranks to reset at their next commit", "elastic")
                # Also in the job directory, for ranks on this host without a monitor link.
                Path(protocol.generation_dir(self.job_dir, world.generation),
                     protocol.HOSTS_UPDATED_FILE).write_text(json.dumps(notice))
            if notice is not None and world.verdict is not None and \
                    now - told_at > self.args.discovery_interval:
                told_at = now  # again and again: a rank may not have been listening yet
                world.verdict.monitor.broadcast(notice)

    def lost(self, world: _World, now: float) -> bool:
        """The monitor lost ranks of ``world`` (their connections closed, or silence): their
        hosts go into ``world.lost_hosts``."""
        verdict = world.verdict
        lost = verdict.loss(now) if verdict is not None else None
        if verdict is None or lost is None:
            return False
        hosts = {world.host_of(rank) for rank in verdict.lost_ranks}
        world.lost_hosts = sorted(h for h in hosts if h is not None)
        say(f"{lost}; ending world {world.generation}", "elastic")
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

    def close(self, world: _World, ended: _Ended | None) -> None:
        """The world's output copied out (its MPI launcher's teardown lines only where the
        driver cannot say why it ended), its monitor closed."""
        if world.output is not None:
            world.output.join()
        if world.errors is not None:
            explained = ended is not None and (
                ended.code == 0 or bool(ended.reports) or bool(world.lost_hosts)
                or ended.interrupted is not None or ended.timed_out)
            world.errors.finish(keep=not explained)
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
            say(str(exc), "elastic")
            return EXIT_NO_SLOTS
        resets = 0
        generation = 0
        need = self.args.np
        while True:
            assignment = self.wait_for_slots(need)
            if self.interrupted:
                return 128 + self.interrupted[0]
            if assignment is None:
                return self.no_slots(need)
            say(f"world {generation}: {ranks_text(size(assignment))} on {describe(assignment)}",
                "elastic")
            try:
                world = self.start(generation, assignment)
            except OSError as exc:
                say(f"cannot start world {generation} ({self.spec.mpiexec!r} and the ranks' "
                    f"monitor): {exc}", "elastic")
                return 127
            ended: _Ended | None = None
            try:
                ended = self.watch(world)
                await_ranks(world.report_dir, None if world.verdict is None
                            else world.verdict.monitor.connected)
            finally:
                self.close(world, ended)
            if ended.interrupted is not None:
                say(f"interrupted by {signal.Signals(ended.interrupted).name}; job ended",
                    "elastic")
                return 128 + ended.interrupted
            if ended.timed_out:
                say(f"job exceeded --timeout {self.timeout:g} s; all ranks were killed",
                    "elastic")
                return 124
            if ended.code == 0 and not ended.reports:
                return 0
            cause = self.account(world, ended)
            hosts = [h for h, _ in world.assignment]
            if all(h in self.hosts.blacklisted for h in hosts):
                say(f"{cause}; every host of world {generation} ({', '.join(hosts)}) failed "
                    f"and was left out, so no worker is left to go on: the job was ended "
                    f"(Horovod: one or more processes exited with non-zero status)", "elastic")
                return EXIT_ALL_FAILED
            if self.args.reset_limit is not None and resets >= self.args.reset_limit:
                say(f"{cause}; the job was ended: "
                    f"{RESET_LIMIT_MESSAGE.format(self.args.reset_limit)} (--reset-limit)",
                    "elastic")
                return EXIT_RESET_LIMIT
            resets += 1
            generation += 1
            need = self.args.min_np
            self.hosts.discover()
            say(f"{cause}; reset {resets}"
                + (f" of at most {self.args.reset_limit}" if self.args.reset_limit is not None
                   else "") + ": restarting from the last commit", "elastic")

    def no_slots(self, need: int) -> int:
        have = self.hosts.assignment()
        if self.hosts.can_return():
            waited = f"after --elastic-timeout {self.args.elastic_timeout:g} s"
        else:
            waited = ("on the fixed hosts (no --host-discovery-script and no blacklist "
                      "cool-down to wait for)")
        out = ", ".join(f"{h} ({e.why})" for h, e in self.hosts.blacklisted.items())
        say(f"not enough slots: {need} needed (--min-np {self.args.min_np}, -np {self.args.np}"
            f"), {size(have)} available ({describe(have)}) {waited}"
            + (f"; left out: {out}" if out else "") + "; the job was ended", "elastic")
        return EXIT_NO_SLOTS

    def account(self, world: _World, ended: _Ended) -> str:
        """Blacklist the hosts that failed (Horovod's rule); a one-line cause of the end."""
        for host in world.lost_hosts:
            self.fail_host(host, "lost")
        if world.lost_hosts:
            return f"host(s) {', '.join(world.lost_hosts)} lost; left out"
        failures = [r for r in ended.reports if r["code"] not in protocol.RESET_EXIT_CODES
                    and not r.get("signalled")]
        for report in sorted(failures, key=lambda r: r["time"]):
            failed_host = world.host_of(report.get("rank"))
            if failed_host is not None:
                self.fail_host(failed_host, f"rank {report['rank']} failed with "
                               f"{describe_status(report['code'])}")
        if failures:
            first = min(failures, key=lambda r: r["time"])
            failed = sorted({h for r in failures if (h := world.host_of(r.get("rank")))})
            return (f"rank {first['rank']} (host {world.host_of(first['rank'])}) failed with "
                    f"{describe_status(first['code'])}; host(s) {', '.join(failed)} "
                    f"blacklisted" + self.cooldown_text(failed))
        if any(r["code"] == protocol.EXIT_HOSTS_UPDATED for r in ended.reports):
            self.leave_removed(world)
            return "the ranks left their world for the new hosts"
        if ended.reports:
            return "a collective failed; the ranks left their world"
        silent = self.never_started(world)
        if silent:
            for host in silent:
                self.fail_host(host, "no rank started there")
            return (f"the MPI launcher ended the world with "
                    f"{describe_status(ended.code or 0)} before any rank started on "
                    f"host(s) {', '.join(silent)} (unreachable?); left out")
        return (f"the MPI launcher ended the world with {describe_status(ended.code or 0)} "
                f"and no rank reported")

    def fail_host(self, host: str, why: str) -> None:
        self.hosts.blacklist(host, why)
        self.workers.leave(host)

    def leave_removed(self, world: _World) -> None:
        for host, _ in world.assignment:
            if host not in self.hosts.known:
                self.workers.leave(host)

    def cooldown_text(self, hosts: list[str]) -> str:
        ends = [self.hosts.blacklisted[h].until for h in hosts if h in self.hosts.blacklisted]
        if not ends or any(u is None for u in ends):
            return ""
        left = max(u for u in ends if u is not None) - time.monotonic()
        return f" for a cool-down of {left:.0f} s"

    @staticmethod
    def never_started(world: _World) -> list[str]:
        """Hosts of ``world`` where no rank reached the monitor while others did (a host the
        MPI launcher could not start ranks on)."""
        if world.verdict is None:
            return []
        joined = {world.host_of(rank) for rank in world.verdict.monitor.ranks()}
        silent = [host for host, _ in world.assignment if host not in joined]
        return silent if len(silent) < len(world.assignment) else []


def run_elastic(args: ElasticArgs, spec: JobSpec, env: dict[str, str], report_dir: str,
                timeout: float | None,
                new_monitor: Callable[[list[tuple[str, int]]], Any] | None = None) -> int:
    """Run the job elastically; the exit code of ``hvdliterun``. ``spec``: the job as
    ``hvdliterun`` would start it (each world changes its size, hosts and environment);
    ``new_monitor(assignment)``: a started ranks' monitor (:mod:`hvdlite.launcher.monitor`)
    for the world on ``assignment`` ((host, slots) pairs), whose lost hosts leave the job;
    OSError when it cannot be made."""
    return _Driver(args, spec, env, report_dir, timeout, new_monitor).run()
