"""``hvdliterun``: start an hvdlite job under the MPI launcher that is installed.

    hvdliterun -np 4 [--config F] [--fusion-threshold 32MiB] [...] -- python train.py
    hvdliterun -np 4 [settings...] --check      # the doctor (hvdlite.doctor) on every rank

The configuration is resolved once here (flags > environment > ``--config`` YAML > defaults)
and handed to every rank as ``HVDLITE_*`` variables. Each rank runs under a small wrapper
(:mod:`hvdlite._rankwrap`) that reports a failure, so when one rank fails the launcher ends
the whole job and names the rank that failed first. See ``docs/config.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from hvdlite import _rankwrap
from hvdlite._launch import hosts as launch_hosts
from hvdlite._launch.monitor import Monitor
from hvdlite._launch.verdict import Verdict
from hvdlite.config import CONFIG_ENV, KNOBS, Config, Knob, default_yaml_text, resolve
from hvdlite.elastic import driver as elastic
from hvdlite.errors import ConfigError

__all__ = ["build_command", "build_parser", "find_mpiexec", "main", "mpi_flavor"]

EXIT_USAGE = 2
EXIT_NO_MPI = 127
EXIT_TIMEOUT = 124
EXIT_UNREACHABLE = 255  # as ssh's own
EXIT_HOST_LOST = 1
MONITOR_BEAT_S = 1.0
# With stall_shutdown_time_s set, a silent host is declared lost at most this long after it.
STALL_MARGIN_S = 3.0
# After the surviving ranks were told to end: their wrappers escalate to SIGTERM, then SIGKILL.
LOST_GRACE_S = _rankwrap.ABORT_GRACE_S + _rankwrap.TERM_GRACE_S + 1.0
# After the MPI launcher failed, this long for the monitor to report a loss it caused.
SETTLE_S = 0.5
# After a rank failed, the MPI launcher gets this long to end the job itself.
FAILURE_GRACE_S = 3.0
# After SIGTERM to the job's process group, this long before SIGKILL.
KILL_GRACE_S = 2.0
POLL_S = 0.05
# Beyond the rank guard's grace, how long to wait for a rank program left by the launcher.
LIVE_SLACK_S = 3.0


_METAVARS = {"bytes": "SIZE", "ms": "MS", "s": "SECONDS", "entries": "N", "path": "PATH"}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _flag_type(k: Knob) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return k.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse.__name__ = k.name
    return parse


def _add_knob_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hvdlite settings (override env vars and --config)")
    for k in KNOBS:
        help_text = f"{k.help} Env {k.env}."
        if k.kind == "bool":
            group.add_argument(
                k.flag,
                dest=k.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            metavar = "|".join(k.choices) or _METAVARS.get(k.unit, k.kind.upper())
            group.add_argument(
                k.flag,
                dest=k.name,
                type=_flag_type(k),
                default=None,
                metavar=metavar,
                help=help_text,
            )


def build_parser() -> argparse.ArgumentParser:
    """The ``hvdliterun`` argument parser (the program and its arguments come after ``--``)."""
    parser = argparse.ArgumentParser(
        prog="hvdliterun",
        allow_abbrev=False,
        usage="hvdliterun -np N [options] -- COMMAND [ARGS...]",
        description="Run COMMAND as an hvdlite job of N ranks under mpiexec.",
    )
    parser.add_argument(
        "-np", "-n", "--num-proc", dest="np", type=int, metavar="N", help="number of ranks"
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file of hvdlite settings")
    _add_knob_flags(parser)
    mpi = parser.add_argument_group("MPI launcher")
    mpi.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="hosts and their slots")
    mpi.add_argument("--hostfile", metavar="FILE", help="MPI hostfile")
    mpi.add_argument(
        "--mpi-args",
        default="",
        metavar="'ARGS'",
        help="extra arguments for the MPI launcher (one shell-quoted string)",
    )
    mpi.add_argument(
        "--mpiexec", metavar="PATH", help="MPI launcher to use (default: next to python, then PATH)"
    )
    mpi.add_argument(
        "--network-interface",
        metavar="IFACE",
        help="network interface between the hosts, for the launcher's connections and MPI's "
        "(default with remote hosts: the one this host routes to the first remote host by)",
    )
    mpi.add_argument(
        "-p", "--ssh-port", type=int, metavar="PORT", help="ssh port on the hosts (Horovod's)"
    )
    mpi.add_argument(
        "-i",
        "--ssh-identity-file",
        metavar="FILE",
        help="ssh private key for the hosts (Horovod's)",
    )
    mpi.add_argument(
        "--tcp",
        action="store_true",
        help="MPI over TCP only (MPICH: ofi netmod, tcp provider; Open MPI: ob1/tcp), as "
        "Horovod's --tcp",
    )
    mpi.add_argument(
        "-x",
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="forward this environment variable to every rank (repeatable); HVDLITE_*, "
        "HOROVOD_*, PATH, PYTHONPATH, LD_LIBRARY_PATH and VIRTUAL_ENV always are",
    )
    parser.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="end the whole job after this many seconds"
    )
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="print the resolved command and settings first"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="run the hvdlite doctor (python -m hvdlite.doctor) on every rank instead of a "
        "command: versions, MPI, GPUs, settings and an allreduce self-test",
    )
    parser.add_argument(
        "--print-default-config",
        action="store_true",
        help="print configs/default.yaml (every knob, documented) and exit",
    )
    elastic.add_flags(parser)
    return parser


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split at the first ``--``; without one, the command starts at the first positional."""
    args = list(argv)
    if "--" in args:
        cut = args.index("--")
        return args[:cut], args[cut + 1 :]
    parser = build_parser()
    takes_value = {
        opt for action in parser._actions if action.nargs is None for opt in action.option_strings
    }
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or arg == "-":
            return args[:i], args[i:]
        i += 2 if arg in takes_value else 1
    return args, []


def _overrides(ns: argparse.Namespace) -> dict[str, object]:
    return {k.name: getattr(ns, k.name) for k in KNOBS if getattr(ns, k.name) is not None}


# ---------------------------------------------------------------------------------------------
# MPI launcher
# ---------------------------------------------------------------------------------------------


def find_mpiexec(explicit: str | None = None) -> str | None:
    """The MPI launcher: ``explicit``, else ``mpiexec`` next to ``sys.executable``, else PATH."""
    if explicit:
        return shutil.which(explicit)
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def mpi_flavor(mpiexec: str) -> str:
    """``"openmpi"``, ``"hydra"`` (MPICH, Intel MPI, MVAPICH) or ``"unknown"``."""
    try:
        probe = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (probe.stdout + probe.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text or "prrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return "hydra"
    return "unknown"


@dataclass(frozen=True)
class JobSpec:
    """Everything :func:`build_command` needs."""

    mpiexec: str
    flavor: str
    np: int
    command: tuple[str, ...]
    forward_env: tuple[tuple[str, str], ...]
    hosts: str | None = None
    hostfile: str | None = None
    mpi_args: tuple[str, ...] = ()
    is_root: bool = False


def build_command(spec: JobSpec) -> list[str]:
    """The full MPI launcher command line for ``spec``."""
    wrapper = [sys.executable, "-I", os.path.abspath(_rankwrap.__file__)]
    if spec.flavor == "openmpi":
        cmd = [spec.mpiexec, "-np", str(spec.np), "--oversubscribe", "--bind-to", "none"]
        if spec.is_root:
            cmd.append("--allow-run-as-root")
        cmd += ["-H", spec.hosts] if spec.hosts else []
        cmd += ["--hostfile", spec.hostfile] if spec.hostfile else []
        for name, _ in spec.forward_env:
            cmd += ["-x", name]
    else:
        cmd = [spec.mpiexec, "-n", str(spec.np)]
        cmd += ["-hosts", spec.hosts] if spec.hosts else []
        cmd += ["-f", spec.hostfile] if spec.hostfile else []
        if spec.flavor == "hydra":
            for name, value in spec.forward_env:
                cmd += ["-genv", name, value]
    return cmd + list(spec.mpi_args) + wrapper + list(spec.command)


# ---------------------------------------------------------------------------------------------
# Running and supervising the job
# ---------------------------------------------------------------------------------------------


def _say(message: str) -> None:
    print(f"hvdliterun: {message}", file=sys.stderr, flush=True)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _end_job(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the job's process group, then SIGKILL what is left after a grace period."""
    _kill_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE_S)
    _kill_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _await_ranks(report_dir: str, monitor: Monitor) -> None:
    """Wait (bounded) until every rank program the launcher left behind has ended.

    When a rank fails, the MPI launcher SIGKILLs the other ranks' wrappers; their programs run
    in process groups of their own and get SIGTERM instead, so they can write their timelines.
    Each wrapper's ``live-<rank>`` marker stays until its program ended (its guard process
    SIGKILLs it ``GUARD_GRACE_S`` after the wrapper died), so the job's files are complete
    when hvdliterun returns.
    """
    deadline = time.monotonic() + _rankwrap.GUARD_GRACE_S + LIVE_SLACK_S
    while any(Path(report_dir).glob(f"{_rankwrap.LIVE_PREFIX}*")) or monitor.running():
        if time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


def _read_reports(directory: str) -> list[dict[str, Any]]:
    reports = []
    for path in Path(directory).glob("rank-*.json"):
        try:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return reports


def _first_failure(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failure that started it: ranks that were signalled by the job's teardown come last."""
    if not reports:
        return None
    return min(reports, key=lambda r: (bool(r.get("signalled")), r["time"], r["rank"] or 0))


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


@dataclass
class _Outcome:
    returncode: int
    timed_out: bool
    interrupted: int | None


def _supervise(proc: subprocess.Popen[bytes], report_dir: str, timeout: float | None,
               verdict: Verdict) -> _Outcome:
    """Wait for the job; end it early on a rank failure, a lost host, a signal to us, or the
    timeout. A lost host: the other ranks are told to end (they write their timelines)."""
    start = time.monotonic()
    end_by: float | None = None  # when to stop waiting for the MPI launcher to end the job
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal end_by
        interrupted.append(signum)
        _kill_group(proc.pid, signum)
        end_by = time.monotonic() + (KILL_GRACE_S if len(interrupted) == 1 else 0.0)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = proc.wait(timeout=POLL_S)
                if code != 0:
                    _settle(verdict, report_dir)
                _kill_group(proc.pid, signal.SIGKILL)  # stragglers whose launcher is gone
                return _Outcome(code, False, interrupted[0] if interrupted else None)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                _end_job(proc)
                return _Outcome(proc.returncode, True, None)
            if _lost(verdict, now, report_dir):
                end_by = now + LOST_GRACE_S
            if verdict.lost_host and not verdict.monitor.running() and end_by:
                # Every rank that can still be reached has ended; the MPI launcher may wait
                # long for the lost host's proxy (a cut link): do not wait for it.
                end_by = min(end_by, now + FAILURE_GRACE_S / 3)
            if end_by is None and (verdict.failures or any(Path(report_dir).glob("rank-*.json"))):
                end_by = now + FAILURE_GRACE_S
            if end_by is not None and now > end_by:
                _end_job(proc)
                return _Outcome(proc.returncode, False, interrupted[0] if interrupted else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _lost(verdict: Verdict, now: float, report_dir: str) -> bool:
    """Read the monitor; when ranks were lost, tell the others to end (True, once)."""
    verdict.poll()
    lost = verdict.loss(now, _read_reports(report_dir)) if verdict.pending else None
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


def _conclude(outcome: _Outcome, report_dir: str, np: int, timeout: float | None,
              verdict: Verdict) -> int:
    if outcome.timed_out:
        _say(f"job of {_ranks(np)} exceeded --timeout {timeout:g} s; all ranks were killed")
        return EXIT_TIMEOUT
    if verdict.lost_host:
        _say(f"{verdict.lost_host}; the job of {_ranks(np)} was ended (the other ranks were "
             "told to end and write their timelines)")
        return EXIT_HOST_LOST
    first = _first_failure(_read_reports(report_dir) + verdict.failures)
    if first is not None:
        status = _rankwrap.describe_status(first["code"])
        _say(
            f"rank {first['rank']} (host {first['host']}) failed first with {status}; "
            f"the job of {_ranks(np)} was ended"
        )
        return _exit_code(first["code"]) or 1
    if outcome.interrupted is not None:
        _say(f"interrupted by {signal.Signals(outcome.interrupted).name}; job ended")
        return 128 + outcome.interrupted
    if outcome.returncode != 0:
        status = _rankwrap.describe_status(outcome.returncode)
        _say(f"the MPI launcher ended the job with {status} and no rank reported a failure "
             f"(see the messages above)")
        return _exit_code(outcome.returncode)
    return 0


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    launcher_args, command = _split_argv(argv)
    ns = parser.parse_args(launcher_args)
    ns.command = command
    if ns.print_default_config:
        return ns
    if ns.np is None or ns.np < 1:
        parser.error("-np N is required and N must be >= 1")
    if ns.check and command:
        parser.error("--check runs the doctor on every rank; drop the command after it")
    if not command and not ns.check:
        parser.error("no command to run: put it after '--', e.g. hvdliterun -np 2 -- python x.py")
    if ns.timeout is not None and ns.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {ns.timeout:g}")
    try:
        ns.mpi_args = shlex.split(ns.mpi_args)
    except ValueError as exc:
        parser.error(f"--mpi-args: {exc}: {ns.mpi_args!r}")
    return ns


def _resolve(
    parser: argparse.ArgumentParser, ns: argparse.Namespace
) -> tuple[Config, dict[str, str]]:
    """Resolve the settings once: flags > environment > --config / HVDLITE_CONFIG > defaults."""
    try:
        return resolve(ns.config, _overrides(ns), os.environ, overrides_are_flags=True)
    except ConfigError as exc:
        parser.error(str(exc))


def _print_verbose(cmd: list[str], config: Config, sources: dict[str, str]) -> None:
    print(f"hvdliterun: command: {shlex.join(cmd)}", flush=True)
    for k in KNOBS:
        print(f"hvdliterun: {k.name} = {getattr(config, k.name)!r}  [{sources[k.name]}]")
    sys.stdout.flush()


def _doctor_command(sources: dict[str, str]) -> list[str]:
    """The doctor on a rank, told where the launcher's settings came from."""
    chosen = {name: source for name, source in sources.items() if source != "default"}
    return [sys.executable, "-m", "hvdlite.doctor", "--launcher-sources", json.dumps(chosen)]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hvdliterun``; returns the process exit code."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the job started: no traceback
        _say("interrupted by SIGINT before the job started")
        return 128 + signal.SIGINT


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    ns = _parse(parser, sys.argv[1:] if argv is None else argv)
    if ns.print_default_config:
        sys.stdout.write(default_yaml_text())
        return 0
    config, sources = _resolve(parser, ns)
    elastic_args = elastic.elastic_args(parser, ns) if elastic.is_elastic(ns) else None
    if ns.check:
        ns.command = _doctor_command(sources)
    mpiexec = find_mpiexec(ns.mpiexec)
    if mpiexec is None:
        _say(
            "no MPI launcher found (looked for mpiexec next to python and mpiexec/mpirun on "
            "PATH); install one, e.g. pip install 'hvdlite[local]'"
        )
        return EXIT_NO_MPI
    hosts = _hosts(parser, ns)
    remote = [h.name for h in hosts if not launch_hosts.is_local(h.name)]
    try:
        ssh_args = launch_hosts.ssh_options(ns.ssh_port, ns.ssh_identity_file)
    except ValueError as exc:
        parser.error(str(exc))
    if remote:
        problems = launch_hosts.check_ssh(remote, sys.executable, ssh_args)
        if problems:
            for host, what in problems.items():
                _say(f"host {host} cannot be reached: {what}")
            _say(f"not started: {len(problems)} of {len(hosts)} hosts unreachable "
                 f"({', '.join(problems)}); fix them or leave them out of -H / --hostfile")
            return EXIT_UNREACHABLE
    try:
        iface, address = launch_hosts.choose_interface(ns.network_interface, remote)
    except OSError as exc:
        _say(f"cannot choose the network interface: {exc}; name one with --network-interface")
        return EXIT_USAGE
    # A preset report directory (on a shared file system) lets ranks on other hosts report too.
    report_base = os.environ.get(_rankwrap.REPORT_DIR_ENV) or None
    monitor_address = address if remote or ns.network_interface else "127.0.0.1"
    monitor = _monitor(config, monitor_address)
    with contextlib.closing(monitor), tempfile.TemporaryDirectory(
            prefix="hvdliterun-", dir=report_base) as report_dir:
        flavor = mpi_flavor(mpiexec)
        try:
            forward = launch_hosts.forwarded_env(dict(os.environ), ns.env,
                                                 os.path.dirname(sys.executable))
        except ValueError as exc:
            parser.error(str(exc))
        net_args, net_env = launch_hosts.transport(flavor, iface, ns.tcp)
        ssh_launch_args, launcher_env = launch_hosts.ssh_for_mpi(flavor, ssh_args)
        net_args += ssh_launch_args
        forward |= {k: v for k, v in net_env.items() if k not in os.environ}
        # Only what was set (flag, environment, --config): a knob left at its default must
        # not shadow a rank's own init(config=...) file, which the environment would beat.
        chosen = [name for name, source in sources.items() if source != "default"]
        forward |= config.to_env(chosen) | monitor.env() | {_rankwrap.REPORT_DIR_ENV: report_dir}
        env = {k: v for k, v in os.environ.items()
               if k not in launch_hosts.PRIVATE_NAMES and k != CONFIG_ENV}
        env |= forward | launcher_env
        spec = JobSpec(
            mpiexec=mpiexec,
            flavor=flavor,
            np=ns.np,
            command=tuple(ns.command),
            forward_env=tuple(forward.items()),
            # One form for every MPI: hostfile formats differ (MPICH's has no slots=N).
            hosts=",".join(f"{h.name}:{h.slots}" for h in hosts) or None,
            mpi_args=tuple(net_args + ns.mpi_args),
            is_root=os.geteuid() == 0,
        )
        cmd = build_command(spec)
        if ns.verbose:
            _print_verbose(cmd, config, sources)
        if elastic_args is not None:
            return elastic.run_elastic(elastic_args, spec, env, report_dir, build_command,
                                       ns.timeout, lambda: _monitor(config, monitor_address))
        try:
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        except OSError as exc:
            _say(f"cannot start {mpiexec!r}: {exc}")
            return EXIT_NO_MPI
        verdict = Verdict(monitor, socket.gethostname())
        outcome = _supervise(proc, report_dir, ns.timeout, verdict)
        _await_ranks(report_dir, monitor)
        return _conclude(outcome, report_dir, ns.np, ns.timeout, verdict)


def _hosts(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> list[launch_hosts.Host]:
    """The job's hosts from -H or --hostfile (empty: this host only)."""
    try:
        if ns.hosts:
            return launch_hosts.parse_hosts(ns.hosts)
        if ns.hostfile:
            return launch_hosts.parse_hostfile(ns.hostfile)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    return []


def _monitor(config: Config, address: str) -> Monitor:
    """The ranks' monitor (hvdlite/_launch/monitor.py), its timeout from the settings."""
    timeout = config.peer_timeout_s
    if config.stall_shutdown_time_s > 0:
        timeout = min(timeout, config.stall_shutdown_time_s + STALL_MARGIN_S)
    monitor = Monitor(address, beat_s=min(MONITOR_BEAT_S, timeout / 4), timeout_s=timeout)
    monitor.start()
    return monitor


if __name__ == "__main__":
    sys.exit(main())
