"""Helpers of the multi-host tests: running hvdliterun on host 1 of the cluster, waiting for a
job that lost a host to end, and reading how it ended."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cluster import Cluster
from jobs_util import REPO, clean_env

from timeline._trace import load

HERE = Path(__file__).resolve().parent
CLOCK_OFFSET_S = 37  # host 2's monotonic clock runs this far ahead (a time namespace)


@dataclass
class Ran:
    rc: int | None
    out: str
    err: str
    seconds: float


def hosts_arg(cluster: Cluster, slots: int = 2) -> str:
    return ",".join(f"{h.name}:{slots}" for h in cluster.hosts)


def rank_env(**extra: str) -> dict[str, str]:
    """The test's environment for hvdliterun on host 1 (this checkout first on the path)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return clean_env(PYTHONPATH=path, **extra)


def hvdliterun(cluster: Cluster, *args: str, timeout: float = 120, **env: str) -> Ran:
    """``hvdliterun ARGS`` started on host 1 (``python -m hvdlite.run``)."""
    start = time.monotonic()
    proc = cluster.popen(1, [sys.executable, "-m", "hvdlite.run", *args], env=rank_env(**env),
                         cwd=str(REPO))
    try:
        out, err = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except Exception:
        proc.kill()
        out, err = proc.communicate()
        rc = None
    return Ran(rc, out, err, time.monotonic() - start)


# A killed host's job ends within this (the launcher's monitor sees its connection close).
KILLED_BOUND_S = 15.0


def ended_within(proc: Any, bound: float) -> tuple[int | None, str, float]:
    """Wait for a started hvdliterun to end (fail the test 30 s past ``bound``); returns its
    exit code, its stderr and the seconds it took from now."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=bound + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"hvdliterun still running {bound + 30:.0f} s after the host was lost:\n"
                    f"{err[-3000:]}")
    return proc.returncode, err, time.monotonic() - start


def survivors_traces(out: Path, ranks: list[int], err: str = "") -> None:
    """The timelines of ``ranks`` under ``out`` hold their allreduces and a closing event;
    ``err``, hvdliterun's output, goes into the failure (how the ranks ended)."""
    for r in ranks:
        trace = load(str(out / f"trace.{r}.json"))
        names = {e.get("name") for e in trace.events}
        assert "MPI_ALLREDUCE" in names and "trace_end" in names, \
            (r, sorted(map(str, names)), err[-4000:])


def verdict_line(err: str) -> str:
    """hvdliterun's last line: how the job ended."""
    return [line for line in err.splitlines() if line.startswith("hvdliterun:")][-1]
