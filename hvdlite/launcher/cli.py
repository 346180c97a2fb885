"""``hvdliterun``'s command line: start an hvdlite job under the MPI launcher that is installed.

    hvdliterun -np 4 [--config F] [--fusion-threshold 32MiB] [...] -- python train.py
    hvdliterun -np 4 [settings...] --check      # the doctor (hvdlite.doctor) on every rank

The configuration is resolved once here (flags > horovodrun's ``--config-file`` >
environment > ``--config`` YAML > defaults) and handed to every rank as ``HVDLITE_*``
variables. Each rank runs under a small wrapper (:mod:`hvdlite.launcher.rankwrap`) that reports
a failure and sets Horovod's per-worker variables; one world is watched by
:mod:`hvdlite.launcher.supervise`, an elastic job by :mod:`hvdlite.launcher.elastic`. See
``docs/config.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from hvdlite._rankside.protocol import REPORT_DIR_ENV, workers_plan
from hvdlite.config import CONFIG_ENV, KNOBS, Config, Knob, resolve
from hvdlite.errors import ConfigError
from hvdlite.launcher import compat, elastic, rankwrap, supervise
from hvdlite.launcher import hosts as launch_hosts
from hvdlite.launcher.common import await_ranks, say
from hvdlite.launcher.configdoc import default_yaml_text
from hvdlite.launcher.job import JobSpec, build_command, find_mpiexec, mpi_flavor
from hvdlite.launcher.monitor import Monitor
from hvdlite.launcher.verdict import Verdict

__all__ = ["JobSpec", "build_command", "build_parser", "find_mpiexec", "main", "mpi_flavor"]

EXIT_USAGE = 2
EXIT_NO_MPI = 127
EXIT_UNREACHABLE = 255  # as ssh's own
MONITOR_BEAT_S = 1.0
# With stall_shutdown_time_s set, a silent host is declared lost at most this long after it.
STALL_MARGIN_S = 3.0


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
                *k.flag_aliases,
                dest=k.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            metavar = "|".join(k.choices) or _METAVARS.get(k.unit, k.kind.upper())
            group.add_argument(
                k.flag,
                *k.flag_aliases,
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
    mpi.add_argument("-hostfile", "--hostfile", metavar="FILE", help="MPI hostfile")
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
        "--network-interfaces",
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
    compat.add_flags(parser)
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


def _overrides(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict[str, object]:
    """Knob values from the flags, above those of a horovodrun ``--config-file``."""
    out: dict[str, object] = {}
    if ns.config_file:
        try:
            out = compat.config_file_overrides(ns.config_file)
        except ValueError as exc:
            parser.error(str(exc))
    if ns.fusion_threshold_mb is not None:
        if ns.fusion_threshold is not None:
            parser.error("give the fusion threshold once: --fusion-threshold or "
                         "--fusion-threshold-mb, not both")
        if ns.fusion_threshold_mb < 0:
            parser.error(f"--fusion-threshold-mb must be >= 0, got {ns.fusion_threshold_mb}")
        ns.fusion_threshold = ns.fusion_threshold_mb * 1024 * 1024
    return out | {k.name: getattr(ns, k.name) for k in KNOBS if getattr(ns, k.name) is not None}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    launcher_args, command = _split_argv(argv)
    ns = parser.parse_args(launcher_args)
    ns.command = command
    if ns.print_default_config or ns.check_build:
        return ns
    if ns.np is None or ns.np < 1:
        parser.error("-np N is required and N must be >= 1")
    if ns.check and command:
        parser.error("--check runs the doctor on every rank; drop the command after it")
    if not command and not ns.check:
        parser.error("no command to run: put it after '--', e.g. hvdliterun -np 2 -- python x.py")
    if ns.timeout is not None and not 0 < ns.timeout < math.inf:
        parser.error(f"--timeout must be > 0 seconds (a finite number), got {ns.timeout:g}")
    if ns.ssh_port is not None and not 0 < ns.ssh_port < 65536:
        parser.error(f"--ssh-port must be between 1 and 65535, got {ns.ssh_port}")
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
        return resolve(ns.config, _overrides(parser, ns), os.environ, overrides_are_flags=True)
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
    return [sys.executable, "-m", "hvdlite.launcher.doctor", "--launcher-sources",
            json.dumps(chosen)]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hvdliterun``; returns the process exit code."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the job started: no traceback
        say("interrupted by SIGINT before the job started")
        return 128 + signal.SIGINT


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    ns = _parse(parser, sys.argv[1:] if argv is None else argv)
    if ns.print_default_config:
        sys.stdout.write(default_yaml_text())
        return 0
    if ns.check_build:
        sys.stdout.write(compat.check_build_text())
        return 0
    config, sources = _resolve(parser, ns)
    elastic_args = elastic.elastic_args(parser, ns, config) if elastic.is_elastic(ns) else None
    if ns.check:
        ns.command = _doctor_command(sources)
    mpiexec = find_mpiexec(ns.mpiexec)
    if mpiexec is None:
        say(
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
                say(f"host {host} cannot be reached: {what}")
            say(f"not started: {len(problems)} of {len(hosts)} hosts unreachable "
                 f"({', '.join(problems)}); fix them or leave them out of -H / --hostfile")
            return EXIT_UNREACHABLE
    try:
        iface, address = launch_hosts.choose_interface(ns.network_interface, remote)
    except OSError as exc:
        say(f"cannot choose the network interface: {exc}; name one with --network-interface")
        return EXIT_USAGE
    # A preset report directory (on a shared file system) lets ranks on other hosts report too.
    report_base = os.environ.get(REPORT_DIR_ENV) or None
    monitor_address = address if remote or ns.network_interface else "127.0.0.1"
    monitor = _monitor(config, monitor_address)
    with contextlib.closing(monitor), tempfile.TemporaryDirectory(
            prefix="hvdliterun-", dir=report_base) as report_dir:
        flavor = mpi_flavor(mpiexec)
        try:
            forward = launch_hosts.forwarded_env(dict(os.environ), ns.env)
        except ValueError as exc:
            parser.error(str(exc))
        net_args, net_env = launch_hosts.transport(flavor, iface, ns.tcp)
        ssh_launch_args, launcher_env = launch_hosts.ssh_for_mpi(flavor, ssh_args)
        net_args += ssh_launch_args
        forward |= {k: v for k, v in net_env.items() if k not in os.environ}
        # Only what was set (flag, environment, --config): a knob left at its default must
        # not shadow a rank's own init(config=...) file, which the environment would beat.
        chosen = [name for name, source in sources.items() if source != "default"]
        forward |= config.to_env(chosen) | monitor.env() | {REPORT_DIR_ENV: report_dir}
        if ns.output_filename:
            forward[rankwrap.OUTPUT_DIR_ENV] = os.path.abspath(ns.output_filename)
        if "PATH" in forward:  # the wrapper gives it back to the rank, as it is here
            forward[rankwrap.RANK_PATH_ENV] = forward["PATH"]
        slots = [(h.name, h.slots) for h in hosts] or [("localhost", ns.np)]
        # A plan each rank computes its own row from: the table itself passes Linux's 128 KiB
        # for one variable at about 2,900 ranks.
        forward[rankwrap.WORKERS_ENV] = workers_plan([(slots, ns.np)], [(0, 0, ns.np)])
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
        try:
            cmd = build_command(spec)
        except ValueError as exc:
            parser.error(str(exc))
        if ns.verbose:
            _print_verbose(cmd, config, sources)
        if elastic_args is not None:
            def world_monitor(assignment: list[tuple[str, int]]) -> Monitor:
                if remote or ns.network_interface:
                    return _monitor(config, monitor_address)
                return _monitor(config, _toward([h for h, _ in assignment]))

            return elastic.run_elastic(elastic_args, spec, env, report_dir, ns.timeout,
                                       world_monitor)
        try:
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        except OSError as exc:
            say(f"cannot start {mpiexec!r}: {exc}")
            return EXIT_NO_MPI
        verdict = Verdict(monitor, socket.gethostname())
        expected = [str(row[0]) for row in launch_hosts.worker_table(slots, ns.np)]
        outcome = supervise.supervise(proc, report_dir, ns.timeout, verdict,
                                      supervise.StartCheck(expected, config.start_timeout_s))
        # A rank on another host whose wrapper the MPI launcher killed still writes its
        # timeline: its guard's connection to the monitor closes when it has ended.
        await_ranks(report_dir, monitor.connected)
        return supervise.conclude(outcome, report_dir, ns.np, ns.timeout, verdict)


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


def _toward(hosts: list[str]) -> str:
    """The address the ranks on ``hosts`` dial the monitor at, for discovered hosts (known
    per world): that of the interface toward the first remote one this host routes to, else
    the loopback (a remote host that cannot be routed to cannot start its ranks either, and
    the elastic driver leaves it out)."""
    for host in hosts:
        if not launch_hosts.is_local(host):
            with contextlib.suppress(OSError, UnicodeError):
                return launch_hosts.interface_for(host)[1]
    return "127.0.0.1"


def _monitor(config: Config, address: str) -> Monitor:
    """The ranks' monitor (hvdlite/launcher/monitor.py), its timeout from the settings."""
    timeout = config.peer_timeout_s
    if config.stall_shutdown_time_s > 0:
        timeout = min(timeout, config.stall_shutdown_time_s + STALL_MARGIN_S)
    monitor = Monitor(address, beat_s=min(MONITOR_BEAT_S, timeout / 4), timeout_s=timeout)
    monitor.start()
    return monitor


if __name__ == "__main__":
    sys.exit(main())
