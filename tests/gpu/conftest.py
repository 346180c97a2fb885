"""GPU tests: run on the GPU machine under ``mpirun -n 2 python -m mpi4py -m pytest tests/gpu``.

Without CuPy or a CUDA device every module here skips itself (``pytest.importorskip`` plus a
device check), so the CPU CI collects them as skipped. Under an MPI launcher this directory
reuses the shared-fate hooks of ``tests/mpi`` (barrier with deadline around every test, a
failure on one rank fails all) and initialises hvdlite with one GPU per rank.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jobs_util import under_mpi_launcher

_MPI_DIR = Path(__file__).resolve().parent.parent / "mpi"
_LAUNCHED = under_mpi_launcher()


def _cuda_devices() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


CUDA_DEVICES = _cuda_devices()

if CUDA_DEVICES and _LAUNCHED:
    sys.path.insert(0, str(_MPI_DIR))
    _spec = importlib.util.spec_from_file_location("_hvdlite_shared_fate", _MPI_DIR / "conftest.py")
    assert _spec is not None and _spec.loader is not None
    _shared = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_shared)
    for _name in dir(_shared):
        if _name.startswith("pytest_") or _name in ("comm", "restart"):
            globals()[_name] = getattr(_shared, _name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    hook = globals().get("_shared")
    for item in items:
        item.add_marker(pytest.mark.gpu)
    if hook is not None:
        hook.pytest_collection_modifyitems(config, items)


@pytest.fixture(scope="session")
def hvd() -> Iterator[Any]:
    """hvdlite initialised once, each rank on GPU ``local_rank % devices``."""
    import cupy

    import hvdlite

    hvdlite.init()
    cupy.cuda.Device(hvdlite.local_rank() % CUDA_DEVICES).use()
    yield hvdlite
    hvdlite.shutdown()
