"""``python -m hvdlite.run`` and the old import path of ``hvdliterun``: the launcher plane lives
in :mod:`hvdlite.launcher` (this module re-exports its command line, :mod:`hvdlite.launcher.cli`).
"""

from __future__ import annotations

import sys

from hvdlite.launcher.cli import (
    JobSpec,
    build_command,
    build_parser,
    find_mpiexec,
    main,
    mpi_flavor,
)

__all__ = ["JobSpec", "build_command", "build_parser", "find_mpiexec", "main", "mpi_flavor"]

if __name__ == "__main__":
    sys.exit(main())
