"""Launcher tests start their own ``hvdliterun`` jobs, so they never run inside an MPI job."""

from __future__ import annotations

import os

_LAUNCHER_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")

collect_ignore_glob = ["test_*.py"] if any(v in os.environ for v in _LAUNCHER_VARS) else []
