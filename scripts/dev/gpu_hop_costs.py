"""Host cost of each hop of a small device allreduce, measured one by one on the GPU machine.

Each line times one operation the hot path performs (CuPy/NCCL calls, hvdlite's own steps),
N times in a loop, and prints the mean in microseconds, so the cost budget in
docs/architecture.md can name what each step costs where it runs.

    mpirun -n 1 python3 scripts/dev/gpu_hop_costs.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import cupy
import numpy as np
from cupy.cuda import nccl

import hvdlite as hvd
from hvdlite._engine import default_engine

N = 3000


def cost(label: str, fn: Callable[[], Any], n: int = N) -> None:
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    print(f"{(time.perf_counter() - t0) / n * 1e6:8.2f} us  {label}", flush=True)


def main() -> None:
    hvd.init()
    cupy.cuda.Device(hvd.local_rank()).use()
    x = cupy.ones(1024, dtype=cupy.float32)
    y = cupy.empty_like(x)
    stream = cupy.cuda.get_current_stream()
    side = cupy.cuda.Stream(non_blocking=True)
    ev = cupy.cuda.Event(block=False, disable_timing=True)
    uid = nccl.get_unique_id()
    comm = nccl.NcclCommunicator(1, uid, 0)
    hvd.allreduce(x, name="warm", op=hvd.Sum, out=y)
    eng = default_engine()
    rt = eng.gpu_runtime()
    ctx = rt.context(0)
    cost("cupy.cuda.get_current_stream()", lambda: cupy.cuda.get_current_stream())
    cost("Event() create", lambda: cupy.cuda.Event(block=False, disable_timing=True))
    cost("event.record(stream)", lambda: ev.record(stream))
    cost("side.wait_event(event)", lambda: side.wait_event(ev))
    cost("event.done (query, complete)", lambda: ev.done)
    cost("x.data.ptr", lambda: x.data.ptr)
    cost("x.flags.c_contiguous", lambda: x.flags.c_contiguous)
    cost("x.dtype / x.shape", lambda: (x.dtype, x.shape))
    cost("with side: (context enter/exit)", lambda: side.__enter__() and side.__exit__())
    cost("cupy.cuda.runtime.getDevice()", lambda: cupy.cuda.runtime.getDevice())

    def nccl_enqueue() -> None:
        comm.allReduce(x.data.ptr, y.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       side.ptr)

    cost("NCCL allReduce enqueue (1 rank)", nccl_enqueue)
    side.synchronize()

    def nccl_sync() -> None:
        nccl_enqueue()
        side.synchronize()

    cost("NCCL allReduce + stream sync", nccl_sync)

    def nccl_event_sync() -> None:
        nccl_enqueue()
        ev.record(side)
        ev.synchronize()

    cost("NCCL allReduce + record + event sync", nccl_event_sync)
    cost("rt.record_ready (current stream + pooled event record)",
         lambda: ctx.release(rt.record_ready("cupy", 0, None)))
    cost("ctx.done_event()", ctx.done_event)
    h = hvd.Handle("probe")
    cost("Handle()", lambda: hvd.Handle("p"))
    del h
    cost("hvd.allreduce_async(x, out=y) + wait() (sync)",
         lambda: hvd.allreduce_async(x, name="probe.a", op=hvd.Sum, out=y).wait())
    cost("hvd.allreduce(x, out=y) (sync)",
         lambda: hvd.allreduce(x, name="probe.s", op=hvd.Sum, out=y))
    hx = np.ones(1, np.float32)
    cost("hvd.allreduce(numpy 4 B) (host, same machine)",
         lambda: hvd.allreduce(hx, name="probe.h", op=hvd.Sum))
    comm.destroy()
    hvd.shutdown()


if __name__ == "__main__":
    main()
