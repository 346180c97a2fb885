"""Probe: where the host time of one small IpcCommunicator.allReduce goes (cProfile over 2,000
calls after warm-up, plus the plain per-call time). Dev use only."""

from __future__ import annotations

import cProfile
import pstats
import time

import cupy as cp
from cupy.cuda import nccl
from mpi4py import MPI

from hvdlite._gpu.ipc import IpcCommunicator

comm = MPI.COMM_WORLD
cp.cuda.Device(0).use()
stream = cp.cuda.Stream(non_blocking=True)
ipc = IpcCommunicator(comm, cp, nccl, 0, 1 << 20, lambda r: r.Wait())
x = cp.ones(1024, cp.float32)
y = cp.empty_like(x)


def call() -> None:
    ipc.allReduce(x.data.ptr, y.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)


for _ in range(200):
    call()
stream.synchronize()
t0 = time.perf_counter()
for _ in range(2000):
    call()
t1 = time.perf_counter()
stream.synchronize()
print(f"host time per call: {(t1 - t0) / 2000 * 1e6:.1f} us", flush=True)
prof = cProfile.Profile()
prof.enable()
for _ in range(2000):
    call()
prof.disable()
stream.synchronize()
if comm.Get_rank() == 0:
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
ipc.destroy()
