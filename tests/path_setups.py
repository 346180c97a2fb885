"""The PATH set-ups of the interpreter tests (issue 42), for one host and across hosts.

The test environment (a virtual environment: ``.ci/run`` makes one) holds hvdlite and MPICH's
``mpiexec``; the system holds another ``python3`` and, from Debian's ``openmpi-bin``, Open
MPI's ``mpirun`` in ``/usr/bin``. Open MPI started by that absolute path takes it as
``--prefix /usr`` and puts ``/usr/bin`` first in the ranks' PATH unless told not to. Each
set-up is a PATH; the ranks' ``python3`` must be what ``command -v python3`` finds in it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

from hvdlite.run import find_mpiexec, mpi_flavor

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_BIN = os.path.dirname(sys.executable)
SETUPS = {
    "venv_first": f"{ENV_BIN}:{SYSTEM_PATH}",  # an activated virtual environment
    "system_first": f"{SYSTEM_PATH}:{ENV_BIN}",  # the reverse
    "venv_absent": SYSTEM_PATH,  # hvdliterun started by its full path, the venv not on PATH
}
LAUNCHERS = ("mpich", "openmpi")
# A rank's answer: one line, the interpreter it runs, its PATH and its host.
RANK_CODE = ("import json, os, socket, sys; print('RANK ' + json.dumps("
             "[sys.executable, os.environ['PATH'], socket.gethostname()]), flush=True)")


def command_v(name: str, path: str) -> str | None:
    """What ``command -v NAME`` prints in a shell whose PATH is ``path``."""
    proc = subprocess.run(["/bin/sh", "-c", f"command -v {name}"], env={"PATH": path},
                          capture_output=True, text=True, timeout=30, check=False)
    return proc.stdout.strip() or None


@functools.cache
def unavailable() -> str | None:
    """Why the set-ups cannot tell the interpreters apart here (one line), or None."""
    if sys.prefix == sys.base_prefix:
        return f"the tests do not run in a virtual environment ({sys.executable})"
    ours = command_v("python3", SETUPS["venv_first"])
    theirs = command_v("python3", SETUPS["system_first"])
    if ours is None or os.path.dirname(ours) != ENV_BIN:
        return f"no python3 in the test environment's {ENV_BIN}"
    if theirs is None or theirs == ours:
        return f"no python3 on {SYSTEM_PATH} besides the test environment's (Debian: python3)"
    return None


@functools.cache
def openmpi() -> str | None:
    """Open MPI's launcher on the system PATH (absolute), or None."""
    for name in ("mpirun.openmpi", "mpirun", "mpiexec"):
        found = shutil.which(name, path=SYSTEM_PATH)
        if found is not None and mpi_flavor(found) == "openmpi":
            return found
    return None


def launcher_args(kind: str) -> tuple[list[str], str | None]:
    """(hvdliterun's ``--mpiexec`` arguments for launcher ``kind``, why it cannot be used)."""
    if kind == "openmpi":
        found = openmpi()
        if found is None:
            return [], "Open MPI is not installed (Debian: apt-get install openmpi-bin)"
        return ["--mpiexec", found], None
    found = find_mpiexec()
    if found is None or mpi_flavor(found) != "hydra":
        return [], f"the test environment's mpiexec is not MPICH's Hydra: {found}"
    return [], None  # hvdliterun's default: the mpiexec beside the interpreter


def rank_answers(out: str) -> list[tuple[str, ...]]:
    """Every rank's (interpreter, PATH, host) from a job's output, in the order printed. The
    ranks share the launcher's stdout, so two answers can run together on one line: each is
    read from its marker to the end of its JSON list, wherever it starts."""
    decoder = json.JSONDecoder()
    answers = []
    at = out.find("RANK [")
    while at >= 0:
        value, end = decoder.raw_decode(out, at + len("RANK "))
        answers.append(tuple(value))
        at = out.find("RANK [", end)
    return answers
