"""Importing hvdlite has no side effects: no MPI initialisation, no CuPy, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys
import hvdlite, hvdlite.config, hvdlite.errors
heavy = [m for m in ("mpi4py.MPI", "cupy", "torch") if m in sys.modules]
print(",".join(heavy) or "none")
"""


@pytest.mark.timeout(60)
def test_import_touches_neither_mpi_nor_gpu_nor_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=50, check=True)
    assert out.stdout.strip() == "none", out.stdout + out.stderr
