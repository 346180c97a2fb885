"""The MPI launcher under ``hvdliterun``: which one, its flavour, and its command line.

The variables the ranks get are named on the command line, never valued: their values (the
monitor's token among them) travel in the MPI launcher's environment, which other users
cannot read, where its command line is in every user's ``ps`` (Hydra's ``-genvlist``, Open
MPI's ``-x NAME``, as ``horovodrun`` passes them). Importing this module has no side effects.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hvdlite.launcher import rankwrap

__all__ = ["JobSpec", "build_command", "find_mpiexec", "mpi_flavor", "openmpi_prefix_args"]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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


# Open MPI takes a launcher started by its absolute path as ``--prefix`` of the folder above
# its own, and puts that prefix's ``bin`` and ``lib`` first in every rank's PATH and
# LD_LIBRARY_PATH. For a system install (``/usr/bin/mpirun``) that helps no host find Open MPI
# (those folders are searched anyway) but puts ``/usr/bin`` ahead of the user's virtual
# environment: ``python3`` becomes the system's. There ``--noprefix`` starts it as ``mpirun``
# typed by hand would be; an install elsewhere keeps the prefix, which lets other hosts find
# its daemon and libraries (the rank wrapper gives the rank the user's PATH either way).
SYSTEM_PREFIXES = frozenset({"/", "/usr", "/usr/local"})
_PREFIX_FLAGS = ("-prefix", "--prefix", "-noprefix", "--noprefix")


def openmpi_prefix_args(mpiexec: str, mpi_args: tuple[str, ...] = ()) -> list[str]:
    """``["--noprefix"]`` when Open MPI's ``mpiexec`` lives in a system prefix (``/usr/bin``,
    ``/usr/local/bin``, ``/bin``) and ``mpi_args`` choose no prefix themselves, else ``[]``."""
    if any(a in _PREFIX_FLAGS or a.startswith(("--prefix=", "-prefix=")) for a in mpi_args):
        return []
    prefix = os.path.dirname(os.path.dirname(os.path.normpath(mpiexec)))
    return ["--noprefix"] if os.path.isabs(mpiexec) and prefix in SYSTEM_PREFIXES else []


@dataclass(frozen=True)
class JobSpec:
    """Everything :func:`build_command` needs. ``forward_env``: the ranks' variables, whose
    values must also be in the MPI launcher's environment (the command names them only)."""

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
    """The full MPI launcher command line for ``spec``; ValueError for a variable name that
    is not ``[A-Za-z_][A-Za-z0-9_]*`` (Hydra's ``-genvlist`` is comma-separated)."""
    names = [name for name, _ in spec.forward_env]
    for name in names:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"cannot forward the environment variable {name!r} to the ranks: "
                             "a name of letters, digits and '_' is needed (not starting "
                             "with a digit)")
    wrapper = [sys.executable, "-I", os.path.abspath(rankwrap.__file__)]
    if spec.flavor == "openmpi":
        cmd = [spec.mpiexec, "-np", str(spec.np), "--oversubscribe", "--bind-to", "none"]
        if spec.is_root:
            cmd.append("--allow-run-as-root")
        cmd += openmpi_prefix_args(spec.mpiexec, spec.mpi_args)
        cmd += ["-H", spec.hosts] if spec.hosts else []
        cmd += ["--hostfile", spec.hostfile] if spec.hostfile else []
        for name in names:
            cmd += ["-x", name]
    else:
        cmd = [spec.mpiexec, "-n", str(spec.np)]
        cmd += ["-hosts", spec.hosts] if spec.hosts else []
        cmd += ["-f", spec.hostfile] if spec.hostfile else []
        if spec.flavor == "hydra" and names:
            cmd += ["-genvlist", ",".join(names)]
    return cmd + list(spec.mpi_args) + wrapper + list(spec.command)

