"""Latency of the first collective after an idle spell (the background loops backed off).

Every rank idles ``--idle-ms`` (long enough for the loops' idle backoff to reach its cap),
then all ranks submit one 4-byte allreduce right after a barrier; prints the median and max
time to completion over ``--trials`` (slowest rank per trial), next to the same call made
back to back (no idle spell). A large gap means a loop slept through new work.

    mpiexec -n 2 python scripts/dev/idle_latency.py [--idle-ms 200] [--trials 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import hvdlite as hvd


def timed(comm: MPI.Comm, x: np.ndarray, idle_s: float) -> float:
    time.sleep(idle_s)
    comm.Barrier()
    t0 = time.perf_counter()
    hvd.allreduce(x, name="idle", op=hvd.Sum)
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-ms", type=float, default=200.0)
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args()
    hvd.init()
    comm = MPI.COMM_WORLD
    x = np.ones(1, np.float32)
    for _ in range(5):
        hvd.allreduce(x, name="idle", op=hvd.Sum)
    after_idle = [timed(comm, x, args.idle_ms / 1e3) for _ in range(args.trials)]
    busy = [timed(comm, x, 0.0) for _ in range(args.trials)]
    if comm.Get_rank() == 0:
        for label, v in (("after idle", after_idle), ("back to back", busy)):
            print(f"{label:13s} median {np.median(v) * 1e3:7.3f} ms  max {max(v) * 1e3:7.3f} ms "
                  f"({args.trials} trials, {comm.Get_size()} ranks)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
