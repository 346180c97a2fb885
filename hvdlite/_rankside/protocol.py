"""What ``hvdliterun`` and the processes it starts agree on: names, files and exit codes.

The launcher plane (:mod:`hvdlite.launcher`) and the runtime (the engine,
:mod:`hvdlite._rankside.ending`, ``hvdlite.elastic``) both import this module; neither imports
the other through it. The rank wrapper (:mod:`hvdlite.launcher.rankwrap`) runs in isolated mode
without hvdlite on the path and loads this file by path, so it uses the standard library only
and has no side effects.

- The report directory (``REPORT_DIR_ENV``): a rank that fails leaves ``rank-<N>.json``
  there (:func:`write_report`); ``live-<N>`` marks a rank program that still runs.
- The watchdog channel (``WATCHDOG_FD_ENV``): a socket from the rank wrapper into the rank
  (:mod:`hvdlite._rankside.watchdog` is its rank end). Its message types in
  ``RESERVED_TYPES`` belong to hvdlite: user code cannot send them.
- The worker identities (``WORKERS_ENV``): Horovod's per-worker variables of every rank,
  as a plan each rank's wrapper computes its own row from (:func:`workers_plan`,
  :func:`worker_row`), whose size grows with the hosts, not the ranks.
- Elastic jobs: the job directory and world number (``ELASTIC_DIR_ENV``, ``GENERATION_ENV``),
  the exit codes of a rank that leaves its world for a reset, and the driver's host-change
  notice (``HOSTS_UPDATED_MESSAGE`` on the channel, ``HOSTS_UPDATED_FILE`` on disk).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence

__all__ = ["ELASTIC_DIR_ENV", "EXIT_HOSTS_UPDATED", "EXIT_INTERNAL_ERROR", "GENERATION_ENV",
           "HOSTS_UPDATED_FILE", "HOSTS_UPDATED_MESSAGE", "LIVE_PREFIX", "RANK_ENVS",
           "REPORT_DIR_ENV", "RESERVED_TYPES", "RESET_EXIT_CODES", "UNREACHABLE_KEY",
           "WATCHDOG_FD_ENV", "WORKERS_ENV", "describe_status", "generation_dir",
           "rank_from_env", "worker_row", "worker_rows", "worker_table", "workers_plan",
           "write_report"]

REPORT_DIR_ENV = "HVDLITE_RUN_REPORT_DIR"
UNREACHABLE_KEY = "launcher_unreachable"  # in a report: see write_report
WATCHDOG_FD_ENV = "HVDLITE_WATCHDOG_FD"
LIVE_PREFIX = "live-"
RANK_ENVS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
# Message types of the launcher <-> rank channel that hvdlite itself sends: the monitor's own
# (hvdlite/launcher/monitor.py's RESERVED_TYPES: hello, beat, exit, orphaned, abort) and
# ``failing`` (hvdlite._exit, rank -> wrapper). The rank wrapper relays none of them from the
# rank to the launcher but ``failing``, which it turns into the exit report.
RESERVED_TYPES = frozenset({"hello", "beat", "exit", "orphaned", "abort", "failing"})

# The worker identities of a world's ranks (JSON: see workers_plan).
WORKERS_ENV = "HVDLITE_WORKERS"

ELASTIC_DIR_ENV = "HVDLITE_ELASTIC_DIR"
GENERATION_ENV = "HVDLITE_ELASTIC_GENERATION"
# A rank that leaves its world for a reset exits with one of these; any other failure of a
# rank is a failure of its host (the driver leaves the host out, as Horovod blacklists it).
EXIT_HOSTS_UPDATED = 75
EXIT_INTERNAL_ERROR = 76
RESET_EXIT_CODES = frozenset({EXIT_HOSTS_UPDATED, EXIT_INTERNAL_ERROR})
HOSTS_UPDATED_FILE = "hosts-updated"
HOSTS_UPDATED_MESSAGE = "elastic.hosts_updated"


def rank_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """The MPI rank of this process, from the variables MPICH, Open MPI or PMIx set."""
    for name in RANK_ENVS:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def describe_status(code: int) -> str:
    """``"exit code 3"`` or ``"signal 9 (SIGKILL)"`` for a ``Popen.returncode``."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown signal"
    return f"signal {-code} ({name})"


def generation_dir(job_dir: str, generation: int) -> str:
    """Where the elastic driver tells the ranks of world ``generation`` that hosts changed."""
    return os.path.join(job_dir, f"gen-{generation}")


def write_report(rank: int | None, code: int, signalled: bool,
                 launcher_unreachable: bool = False) -> bool:
    """Drop this rank's failure report (``rank-<N>.json``) into the report directory;
    False when there is none (not under ``hvdliterun``) or it cannot be written.
    ``launcher_unreachable``: the wrapper ended the rank because the launcher stopped
    answering (this host is cut off), so the report names no cause (the launcher's monitor
    names the host); it is the report's key ``UNREACHABLE_KEY``."""
    directory = os.environ.get(REPORT_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return False
    report = {"rank": rank, "code": code, "time": time.time(), "signalled": signalled,
              "host": socket.gethostname(), UNREACHABLE_KEY: launcher_unreachable}
    final = os.path.join(directory, f"rank-{rank if rank is not None else os.getpid()}.json")
    partial = f"{final}.{os.getpid()}.tmp"
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump(report, handle)
        os.replace(partial, final)
    except OSError:
        return False
    return True


def worker_table(slots: Sequence[tuple[str, int]], np: int) -> list[list[object]]:
    """Horovod's slot assignment of ``np`` ranks on ``slots`` ((host, slots) in order; ranks
    fill a host before the next, as ``mpiexec -hosts h:n,...`` places them, wrapping around
    when ``np`` exceeds the slots): per rank ``[host, rank, size, local_rank, local_size,
    cross_rank, cross_size]``, the values of ``HOROVOD_HOSTNAME``, ``HOROVOD_RANK``, ...
    (a rank's cross rank is its host's index among the hosts that have its local rank).
    Linear in ``np``; ValueError for ``np`` < 1 or a host without slots."""
    if np < 1 or not slots or any(n < 1 for _, n in slots):
        raise ValueError(f"worker_table needs np >= 1 and hosts with slots >= 1, got np={np} "
                         f"and {list(slots)}")
    placed: list[tuple[str, int]] = []  # (host, local_rank) per rank
    count: dict[str, int] = {}
    while len(placed) < np:
        for host, n in slots:
            take = min(n, np - len(placed))
            base = count.get(host, 0)
            placed += [(host, base + i) for i in range(take)]
            count[host] = base + take
    cross: dict[int, dict[str, int]] = {}  # local rank -> {host: its index among them}
    for host, local in placed:
        hosts = cross.setdefault(local, {})
        hosts.setdefault(host, len(hosts))
    return [[host, rank, np, local, count[host], cross[local][host], len(cross[local])]
            for rank, (host, local) in enumerate(placed)]


def workers_plan(worlds: Sequence[tuple[Sequence[tuple[str, int]], int]],
                 runs: Sequence[tuple[int, int, int]]) -> str:
    """The text of ``WORKERS_ENV``: the identities of a world's ranks, in rank order, as
    ``runs`` of rows of earlier worlds' tables: ``(world, first_row, count)`` takes ``count``
    rows from row ``first_row`` on of ``worker_table(*worlds[world])`` (an elastic worker
    keeps the identity of the world it started in). A plain world is ``[(slots, np)]`` and
    ``[(0, 0, np)]``. Its size grows with the hosts and runs, never with the ranks alone (one
    variable holds at most 128 KiB on Linux)."""
    return json.dumps({"worlds": [[[[h, n] for h, n in slots], np] for slots, np in worlds],
                       "runs": [list(run) for run in runs]}, separators=(",", ":"))


def _plan(text: str) -> tuple[list[tuple[list[tuple[str, int]], int]], list[tuple[int, ...]]]:
    plan = json.loads(text)
    worlds = [([(str(h), int(n)) for h, n in slots], int(np)) for slots, np in plan["worlds"]]
    runs = [tuple(int(x) for x in run) for run in plan["runs"]]
    if any(len(run) != 3 or not 0 <= run[0] < len(worlds) or min(run[1:]) < 0
           for run in runs):
        raise ValueError(f"{WORKERS_ENV}: a run out of range in {text[:200]!r}")
    return worlds, runs


def worker_row(text: str, rank: int) -> list[object] | None:
    """Rank ``rank``'s identity row from a :func:`workers_plan` text; None when the text is
    not one or has no such rank."""
    if rank < 0:
        return None
    try:
        worlds, runs = _plan(text)
        for world, first, count in runs:
            if rank < count:
                return worker_table(*worlds[world])[first + rank]
            rank -= count
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None
    return None


def worker_rows(text: str) -> list[list[object]]:
    """Every row of a :func:`workers_plan` text, in rank order; ValueError if it is not one."""
    try:
        worlds, runs = _plan(text)
        tables = {w: worker_table(*worlds[w]) for w in {run[0] for run in runs}}
        return [tables[w][first + i] for w, first, count in runs for i in range(count)]
    except (TypeError, KeyError, IndexError) as exc:
        raise ValueError(f"{WORKERS_ENV}: not a worker plan: {text[:200]!r}") from exc
