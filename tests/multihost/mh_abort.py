"""Rank 3 (on the second host) ends the job through hvdlite's abort (MPI_Abort, exit code 3)
while the others run allreduces: the launcher must name rank 3's failure, not a lost host."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from hvdlite import _exit

hvd.init()
x = np.ones(16, dtype=np.float32)
for step in range(1000):
    if step == 20 and hvd.rank() == 3:
        _exit.abort_job(MPI.COMM_WORLD, "rank 3 gives up on purpose", exitcode=3)
    hvd.allreduce(x, name="step", op=hvd.Sum)
