"""Helpers of the multi-host tests: running hvdliterun on host 1 of the cluster."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster import Cluster
from jobs_util import REPO, clean_env

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
