"""Micro-costs of the host-side pieces a device collective is made of, on the GPU machine.

Prints one line per probe: microseconds per operation (median of 5 batches). Used to set the
hot path's cost budget (docs/architecture.md); nothing of hvdlite is timed here.
"""
from __future__ import annotations

import statistics
import time

import cupy as cp
import numpy as np
from cupy.cuda import nccl
from mpi4py import MPI


def t(label, fn, n=20000):
    xs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        xs.append((time.perf_counter() - t0) / n * 1e6)
    print(f"{label:48s} {statistics.median(xs):8.3f} us")


a = cp.ones(1024, cp.float32)
buf = cp.empty(1 << 20, cp.float32)
mp = buf.data
s = cp.cuda.Stream(non_blocking=True)
ev = cp.cuda.Event(block=False, disable_timing=True)
x = np.ones(4, np.float32)
print("nccl version", nccl.get_version(), "NCCL_AVG" in dir(nccl), "cupy", cp.__version__)
t("pure python: 10 attr+add", lambda: sum((1, 2, 3, 4, 5, 6, 7, 8, 9, 10)))
t("dict get", lambda: {}.get("a"))
t("a.data.ptr", lambda: a.data.ptr)
t("a.shape", lambda: a.shape)
t("a.dtype", lambda: a.dtype)
t("a.flags.c_contiguous", lambda: a.flags.c_contiguous)
t("a._c_contiguous", lambda: getattr(a, "_c_contiguous", None))
t("a.data.device_id", lambda: a.data.device_id)
t("cp.empty(1024)", lambda: cp.empty(1024, cp.float32))
t("buf[0:1024]", lambda: buf[0:1024])
t("buf[0:1024].reshape(32,32)", lambda: buf[0:1024].reshape(32, 32))
t("cp.ndarray(shape, memptr=mp+off)", lambda: cp.ndarray((32, 32), cp.float32, mp + 4096))
t("get_current_stream()", lambda: cp.cuda.get_current_stream())
t("event.record(s)", lambda: ev.record(s))
t("s.wait_event(ev)", lambda: s.wait_event(ev))
t("ev.done", lambda: ev.done)
t("ev.synchronize (done)", lambda: ev.synchronize())
t("Event() create", lambda: cp.cuda.Event(block=False, disable_timing=True))
t("np.empty(4)", lambda: np.empty(4, np.float32))
t("threading.Lock()", __import__("threading").Lock)
comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
o = cp.empty_like(a)
t("nccl allReduce 4KiB enqueue",
  lambda: comm.allReduce(a.data.ptr, o.data.ptr, 1024, nccl.NCCL_FLOAT32, 0, s.ptr), 5000)
s.synchronize()
def sync_call():
    ev.record(cp.cuda.get_current_stream())
    s.wait_event(ev)
    comm.allReduce(a.data.ptr, o.data.ptr, 1024, nccl.NCCL_FLOAT32, 0, s.ptr)
    ev.record(s)
    ev.synchronize()
t("lean sync call (record/wait/nccl/record/sync)", sync_call, 5000)
try:
    comm.allReduce(a.data.ptr, o.data.ptr, 1024, nccl.NCCL_FLOAT32, 4, s.ptr)
    s.synchronize()
    print("ncclAvg (op 4) OK")
except Exception as exc:
    print("ncclAvg failed", exc)
w = MPI.COMM_WORLD
buf8 = bytearray(24)
t("mpi Iallreduce+Test size1",
  lambda: w.Iallreduce(MPI.IN_PLACE, [buf8, MPI.UINT64_T], op=MPI.BAND).Test())
t("mpi Allreduce 4B size1", lambda: w.Allreduce(x, np.empty_like(x)))
