"""Helpers for tests that start their own MPI jobs (the suite runner, examples, benchmarks,
the launcher): finding mpiexec, a clean environment, running a job in its own process group
with a hard timeout, and knowing whether we already are inside a job."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from hvdlite.run import find_mpiexec

REPO = Path(__file__).resolve().parent.parent

# Variables that common launchers (MPICH/Hydra, Open MPI, PMIx) set in every rank.
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                  "PMIX_RANK")


def under_mpi_launcher() -> bool:
    """True inside a rank of an MPI job (tests that start jobs must not nest them)."""
    return any(var in os.environ for var in _LAUNCHER_VARS)


def mpiexec() -> str:
    """The MPI launcher hvdliterun would use, or fail the test saying what to install."""
    found = find_mpiexec()
    if found is None:
        pytest.fail("mpiexec not found next to the interpreter or on PATH; install hvdlite[local]")
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without HVDLITE_*/HOROVOD_* (a stray knob must not change what a
    test checks), unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env | extra


def run_group(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group from the repository root; kill the whole group on
    timeout (the exit code is then None). Returns stdout and stderr together."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out
