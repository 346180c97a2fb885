"""Importing hvdlite has no side effects: no MPI initialisation, no CuPy (nor cuda-python),
no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys
import hvdlite, hvdlite.config, hvdlite.errors
heavy = [m for m in ("mpi4py.MPI", "cupy", "torch", "cuda.bindings") if m in sys.modules]
print(",".join(heavy) or "none")
"""


@pytest.mark.timeout(60)
def test_import_touches_neither_mpi_nor_gpu_nor_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=50, check=True)
    assert out.stdout.strip() == "none", out.stdout + out.stderr


_HOST_JOB = """
import sys
import numpy as np
import hvdlite as hvd
hvd.init()
got = hvd.allreduce(np.arange(4.0), name="host", op=hvd.Sum)
assert got.tolist() == [0.0, 1.0, 2.0, 3.0], got
hvd.shutdown()
gpu = sorted(m for m in sys.modules if m.startswith(("hvdlite._gpu", "hvdlite._backends.nccl",
                                                     "cupy", "cuda.bindings")))
print(",".join(gpu) or "none")
"""


@pytest.mark.timeout(60)
def test_a_host_job_imports_no_gpu_code() -> None:
    """init, a host collective and shutdown load none of the device code (IPC, NCCL, CuPy)."""
    out = subprocess.run([sys.executable, "-c", _HOST_JOB], capture_output=True, text=True,
                         timeout=50, check=True)
    assert out.stdout.strip() == "none", out.stdout + out.stderr
