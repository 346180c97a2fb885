"""Probe: IpcCommunicator.allReduce out of place on a user stream, sizes 4 B-64 MiB, with and
without a second communicator alive; prints NaN counts (dst poisoned first). Dev use only."""

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
stream.use()
two = "two" in sys.argv
ipc = IpcCommunicator(comm, cp, nccl, 0, 16 << 20, lambda r: r.Wait())
big = IpcCommunicator(comm, cp, nccl, 0, 256 << 20, lambda r: r.Wait()) if two else None
for nbytes in (4, 4096, 1 << 20, 64 << 20):
    n = max(nbytes // 4, 1)
    src = cp.arange(n, dtype=cp.float32) + rank
    want = cp.arange(n, dtype=cp.float32) * size + sum(range(size))
    for name, c in (("ipc", ipc), ("big", big)):
        if c is None:
            continue
        dst = cp.empty(n, dtype=cp.float32)
        dst.fill(float("nan"))
        stream.synchronize()
        c.allReduce(src.data.ptr, dst.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        stream.synchronize()
        bad = int((dst != want).sum())
        nan = int(cp.isnan(dst).sum())
        first = int(cp.argmax(dst != want)) if bad else -1
        print(f"rank {rank} {name} {nbytes} B: bad {bad} nan {nan} first {first}", flush=True)
    del src, want
    cp.get_default_memory_pool().free_all_blocks()
ipc.destroy()
if big is not None:
    big.destroy()
