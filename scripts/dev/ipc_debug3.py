"""Probe: a chunked out-of-place IpcCommunicator.allReduce after k earlier small calls on the
same communicator; per-chunk errors and the first wrong value. Dev use only."""

from __future__ import annotations

import sys

import cupy as cp
from cupy.cuda import nccl
from mpi4py import MPI

from hvdlite._gpu.ipc import IpcCommunicator

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
cp.cuda.Device(0).use()
stream = cp.cuda.Stream(non_blocking=True)
if "use" in sys.argv:
    stream.use()
for k in range(4):
    ipc = IpcCommunicator(comm, cp, nccl, 0, 1 << 20, lambda r: r.Wait())
    small = cp.ones(1, cp.float32)
    for _ in range(k):
        ipc.allReduce(small.data.ptr, small.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                      stream.ptr)
    n = (4 << 20) // 4
    src = cp.arange(n, dtype=cp.float32) % 1000 + rank
    want = cp.arange(n, dtype=cp.float32) % 1000 * size + sum(range(size))
    dst = cp.full(n, float("nan"), dtype=cp.float32)
    cp.cuda.Device().synchronize()
    ipc.allReduce(src.data.ptr, dst.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    stream.synchronize()
    per = (1 << 20) // 4
    chunks = [int((dst[i:i + per] != want[i:i + per]).sum()) for i in range(0, n, per)]
    bad = dst != want
    first = int(cp.argmax(bad)) if bool(bad.any()) else -1
    shown = (float(dst[first]), float(want[first])) if first >= 0 else ()
    print(f"rank {rank} k={k}: bad per chunk {chunks} first {first} got/want {shown}",
          flush=True)
    ipc.destroy()
