"""Root test configuration.

``tests/mpi/`` holds multi-rank tests. They only make sense under an MPI launcher, so a plain
``python -m pytest`` does not collect them; ``tests/test_mpi_jobs.py`` runs them instead, as
real ``mpiexec`` jobs at 1, 2 and 4 ranks. Under a launcher the roles flip: the job runners
are ignored so an ``mpiexec ... pytest`` never spawns nested jobs.
"""

from __future__ import annotations

import os

# Variables set by common launchers (MPICH/Hydra, Open MPI, PMIx) in every rank's environment.
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def _under_mpi_launcher() -> bool:
    if os.environ.get("HVDLITE_TESTS_MPI") == "1":
        return True
    return any(var in os.environ for var in _LAUNCHER_VARS)


collect_ignore = ["test_mpi_jobs.py"] if _under_mpi_launcher() else ["mpi"]
