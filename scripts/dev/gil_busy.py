"""How long one small collective takes to complete while the main thread is busy in Python.

Each step submits one 4-byte ``allreduce_async`` and then runs pure-Python work until the
handle completes, like a training loop that keeps launching work. Prints the median time to
completion on rank 0. Compare ``HVDLITE_GIL_SWITCH_INTERVAL_US=0`` (Python's 5 ms default)
with the default cap.

    mpiexec -n 2 python scripts/dev/gil_busy.py [--steps 60]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import hvdlite as hvd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    hvd.init()
    x = np.ones(4, np.float32)
    waits = []
    for _ in range(args.steps):
        h = hvd.allreduce_async(x, name="gil_busy", op=hvd.Sum)
        t0 = time.perf_counter()
        work = 0
        while not h.poll():
            work += sum(range(200))
        waits.append(time.perf_counter() - t0)
        assert float(h.wait()[0]) == hvd.size()
    if hvd.rank() == 0:
        print(f"median completion while the main thread is busy: "
              f"{np.median(waits) * 1e6:.0f} us over {args.steps} steps")
    hvd.shutdown()


if __name__ == "__main__":
    main()
