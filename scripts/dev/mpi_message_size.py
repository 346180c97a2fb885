"""Raw MPI on this machine: one Allreduce of the 102 MB ResNet-50 buffer vs the same bytes in
pieces, and a plain memcpy of it (no hvdlite). Explains C1's limit ratio on a given MPI build.

    mpiexec -n 2 python scripts/dev/mpi_message_size.py
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

ELEMENTS = 25_557_032  # float32 elements of the ResNet-50 gradient set (102.2 MB)


def main() -> None:
    comm = MPI.COMM_WORLD
    a = np.random.default_rng(comm.Get_rank()).random(ELEMENTS, dtype=np.float32)
    b = np.empty_like(a)
    times: dict[str, list[float]] = {}
    for _ in range(8):
        for mib in (None, 16, 4, 1):
            chunk = a.size if mib is None else mib * 1024 * 1024 // 4
            comm.Barrier()
            t0 = time.perf_counter()
            for s in range(0, a.size, chunk):
                comm.Allreduce(a[s:s + chunk], b[s:s + chunk])
            label = "one call" if mib is None else f"{mib} MiB pieces"
            times.setdefault(label, []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.setdefault("memcpy (np.copyto)", []).append(time.perf_counter() - t0)
    if comm.Get_rank() == 0:
        for label, ts in times.items():
            print(f"{label:20s} median {np.median(ts) * 1e3:7.1f} ms ({comm.Get_size()} ranks)")


if __name__ == "__main__":
    main()
