"""Probe: where the IPC slots lie in their allocation, and which chunks of a chunked
out-of-place IpcCommunicator.allReduce come out wrong. Dev use only."""

from __future__ import annotations

import cupy as cp
from cupy.cuda import nccl
from mpi4py import MPI

from hvdlite._gpu.ipc import IpcCommunicator

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
cp.cuda.Device(0).use()
drv = cp.cuda.driver
print("driver.memGetAddressRange:", hasattr(drv, "memGetAddressRange"), flush=True)
try:
    import cuda.bindings.driver as cbd  # noqa: F401
    print("cuda-python bindings: yes", flush=True)
except Exception as exc:
    print("cuda-python bindings:", exc, flush=True)
stream = cp.cuda.Stream(non_blocking=True)
for slot_mib, data_mib in ((16, 32), (16, 64), (64, 64), (1, 4)):
    ipc = IpcCommunicator(comm, cp, nccl, 0, slot_mib << 20, lambda r: r.Wait())
    if hasattr(drv, "memGetAddressRange"):
        base, length = drv.memGetAddressRange(ipc._base)
        print(f"rank {rank} slot {slot_mib} MiB: malloc {ipc._base:#x} base {base:#x} "
              f"offset {ipc._base - base} length {length}", flush=True)
    n = (data_mib << 20) // 4
    src = cp.arange(n, dtype=cp.float32) % 1000 + rank
    want = cp.arange(n, dtype=cp.float32) % 1000 * size + sum(range(size))
    dst = cp.full(n, float("nan"), dtype=cp.float32)
    cp.cuda.Device().synchronize()
    ipc.allReduce(src.data.ptr, dst.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    stream.synchronize()
    per = (slot_mib << 20) // 4
    chunks = [int((dst[i:i + per] != want[i:i + per]).sum()) for i in range(0, n, per)]
    print(f"rank {rank} slot {slot_mib} MiB data {data_mib} MiB: bad per chunk {chunks}",
          flush=True)
    ipc.destroy()
