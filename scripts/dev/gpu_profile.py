"""Where a small synchronous device allreduce spends its host time (cProfile, one process).

With progress on wait the caller runs the whole cycle on its own thread, so a profile of the
calling thread sees submit, negotiation, the NCCL enqueue and the completion wait.

    mpirun -n 1 python3 scripts/dev/gpu_profile.py [--async-completion]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import cupy

import hvdlite as hvd


def main() -> None:
    on = "--async-completion" in sys.argv
    hvd.init(async_completion=on)
    cupy.cuda.Device(hvd.local_rank()).use()
    x = cupy.ones(1024, dtype=cupy.float32)
    y = cupy.empty_like(x)
    stream = cupy.cuda.get_current_stream()
    for _ in range(300):
        hvd.allreduce(x, name="p", op=hvd.Sum, out=y)
    stream.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        hvd.allreduce(x, name="p", op=hvd.Sum, out=y)
    stream.synchronize()
    print(f"async_completion={on}: {(time.perf_counter() - t0) / n * 1e6:.1f} us per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        hvd.allreduce(x, name="p", op=hvd.Sum, out=y)
    stream.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    hvd.shutdown()


if __name__ == "__main__":
    main()
