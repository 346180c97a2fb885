"""The ranks' ``python3`` is the caller's (issue 42): ``hvdliterun -np N -- python3 ...`` runs,
on every rank, the interpreter that ``command -v python3`` finds where hvdliterun starts, and
the ranks get that PATH as it is, first entry first. Under MPICH's Hydra and under Open MPI
(started by its absolute path, which Open MPI takes as ``--prefix``), on 1 and 2 ranks, with a
virtual environment ahead of the system's Python on PATH, the reverse, and without it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from jobs_util import REPO, clean_env
from path_setups import (
    LAUNCHERS,
    RANK_CODE,
    SETUPS,
    command_v,
    launcher_args,
    openmpi,
    rank_answers,
    unavailable,
)

from hvdlite.launcher.job import openmpi_prefix_args

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

JOB_TIMEOUT_S = 90
HOST = socket.gethostname()


def _job(path: str, np: int, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """``hvdliterun -np NP ARGS -- python3 -c RANK_CODE`` with ``PATH=path``; the result and
    what ``command -v python3`` finds on that PATH."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    env = clean_env(PATH=path, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "hvdlite.run", "-np", str(np), *args, "--", "python3", "-c",
         RANK_CODE],
        env=env, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=JOB_TIMEOUT_S, check=False)  # fmt: skip
    expected = command_v("python3", path)
    assert expected is not None
    return result, expected


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize(("setup", "np"), [("venv_first", 1), ("venv_first", 2),
                                           ("system_first", 1), ("system_first", 2),
                                           ("venv_absent", 2)])
def test_ranks_run_the_callers_python3(launcher: str, setup: str, np: int) -> None:
    args, why = launcher_args(launcher)
    if why is not None:
        pytest.skip(why)
    path = SETUPS[setup]
    result, expected = _job(path, np, *args)
    assert result.returncode == 0, result.stderr
    assert rank_answers(result.stdout) == [(expected, path, HOST)] * np, (expected, result.stdout)


def test_openmpi_given_a_prefix_still_leaves_the_path_to_the_caller() -> None:
    """``--mpi-args '--prefix DIR'``: Open MPI puts DIR/bin first for the rank wrapper, which
    gives the rank program the caller's PATH back."""
    found = openmpi()
    if found is None:
        pytest.skip("Open MPI is not installed (Debian: apt-get install openmpi-bin)")
    prefix = os.path.dirname(os.path.dirname(found))
    path = SETUPS["venv_first"]
    result, expected = _job(path, 1, "--mpiexec", found, "--mpi-args", f"--prefix {prefix}")
    assert result.returncode == 0, result.stderr
    assert rank_answers(result.stdout) == [(expected, path, HOST)], (expected, result.stdout)


def test_openmpi_prefix_args() -> None:
    # A system install: as if typed by hand; elsewhere Open MPI's prefix helps other hosts.
    assert openmpi_prefix_args("/usr/bin/mpirun") == ["--noprefix"]
    assert openmpi_prefix_args("/usr/local/bin/mpiexec") == ["--noprefix"]
    assert openmpi_prefix_args("/bin/mpirun") == ["--noprefix"]
    assert openmpi_prefix_args("/opt/openmpi/bin/mpirun") == []
    assert openmpi_prefix_args("mpirun") == []
    # The user's own choice stands.
    assert openmpi_prefix_args("/usr/bin/mpirun", ("--prefix", "/opt/x")) == []
    assert openmpi_prefix_args("/usr/bin/mpirun", ("-x", "A", "--noprefix")) == []
