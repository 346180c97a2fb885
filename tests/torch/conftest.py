"""Shared fate for the ``hvdlite.torch`` tests (run under ``mpiexec -n 2 ... pytest``).

The rules of ``tests/mpi/conftest.py``, reused from there (as ``tests/gpu`` does): the ranks
meet before every test, a test that fails on one rank fails on all, every test has a timeout,
and each rank writes a JSON tally (the root conftest) for ``tests/test_torch_jobs.py``.
Without torch nothing here is collected.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jobs_util import HAS_TORCH

_MPI_DIR = Path(__file__).resolve().parent.parent / "mpi"
sys.path.insert(0, str(_MPI_DIR))

if not HAS_TORCH:
    collect_ignore_glob = ["test_*.py"]

_spec = importlib.util.spec_from_file_location("_hvdlite_shared_fate", _MPI_DIR / "conftest.py")
assert _spec is not None and _spec.loader is not None
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)
for _name in dir(_shared):
    if _name.startswith("pytest_"):
        globals()[_name] = getattr(_shared, _name)


@pytest.fixture(scope="session")
def hvd() -> Iterator[Any]:
    """``hvdlite.torch``, initialised once for the job and shut down at its end."""
    import hvdlite.torch as hvd_torch

    hvd_torch.init()
    yield hvd_torch
    hvd_torch.shutdown()
