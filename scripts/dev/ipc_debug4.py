"""Probe: does IpcCommunicator.allReduce leave the caller's current CuPy stream as it was?"""

from __future__ import annotations

import cupy as cp
from cupy.cuda import nccl
from mpi4py import MPI

from hvdlite._gpu.ipc import IpcCommunicator

comm = MPI.COMM_WORLD
cp.cuda.Device(0).use()
stream = cp.cuda.Stream(non_blocking=True)
stream.use()
ipc = IpcCommunicator(comm, cp, nccl, 0, 1 << 20, lambda r: r.Wait())
x = cp.ones(16, cp.float32)
print("before:", cp.cuda.get_current_stream().ptr == stream.ptr, flush=True)
for i in range(3):
    ipc.allReduce(x.data.ptr, x.data.ptr, 16, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    cur = cp.cuda.get_current_stream()
    print(f"after call {i}: current is the caller's: {cur.ptr == stream.ptr} (ptr {cur.ptr:#x}, "
          f"caller {stream.ptr:#x})", flush=True)
ipc.destroy()
