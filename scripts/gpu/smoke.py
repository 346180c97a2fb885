"""GPU smoke run: every device collective once in both completion modes; stacks dumped on a hang.

Run: mpirun -n N python scripts/gpu/smoke.py  (N = 1 or 2, one GPU per rank).
"""

from __future__ import annotations

import faulthandler
import os
import time

import cupy
import numpy as np

import hvdlite as hvd

# A hang dumps every thread's stack and exits (SMOKE_HANG_S, e.g. longer under a profiler).
faulthandler.dump_traceback_later(float(os.environ.get("SMOKE_HANG_S", "25")), exit=True)


def step(msg: str) -> None:
    print(f"[rank {hvd.rank()}] {msg}", flush=True)


def main() -> None:
    for async_completion in (False, True):
        hvd.init(async_completion=async_completion)
        r, n = hvd.rank(), hvd.size()
        cupy.cuda.Device(hvd.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
        step(f"init async_completion={async_completion} size {n}")
        x = cupy.full(5, r + 1, dtype=cupy.float32)
        h = hvd.allreduce_async(x, name="one", op=hvd.Sum)
        step("submitted")
        out = h.wait()
        step(f"allreduce {cupy.asnumpy(out)}")
        assert float(out[0]) == n * (n + 1) / 2
        b = hvd.allreduce(cupy.array([r == 0, False]), name="bool", op=hvd.Sum)
        step(f"bool {b}")
        g = hvd.grouped_allreduce([cupy.full(3, r + 1.0), cupy.full(7, 2 * r + 1, cupy.int64)],
                                  name="grp", op=hvd.Average)
        step(f"grouped {g}")
        ag = hvd.allgather(cupy.full((r + 1, 2), r, cupy.int32), name="ag")
        step(f"allgather {ag.shape}")
        bc = hvd.broadcast(cupy.full(3, r, cupy.float64), 0, name="bc")
        step(f"bcast {bc}")
        rs = hvd.reducescatter(cupy.ones((2 * n + 1, 2), cupy.float32), name="rs", op=hvd.Sum)
        step(f"rs {rs.shape}")
        a2a = hvd.alltoall(cupy.arange(2 * n, dtype=cupy.float32), name="a2a")
        step(f"a2a {a2a}")
        t0 = time.perf_counter()
        for _ in range(200):
            hvd.allreduce(x, name="lat", op=hvd.Sum)
        step(f"latency {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")
        host = hvd.allreduce(np.ones(3), name="host", op=hvd.Sum)
        step(f"host {host}")
        step("shutting down")
        hvd.shutdown()
    print("SMOKE OK", flush=True)


if __name__ == "__main__":
    main()
