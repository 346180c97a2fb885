"""bench_ipc's floor of a one-shot allreduce between GPUs, on the device: what the I1 target
(IPC <= 0.5x NCCL's device time) can reach at best, measured beside it.

- an empty kernel: the stream's own cost of one launch between two events;
- a flag exchange: one kernel in which thread 0 writes this call's epoch into every peer's
  inbox (a release store at system scope through CUDA IPC) and spins until every peer's epoch
  has reached its own inbox (acquire loads): the one cross-GPU synchronisation every
  allreduce of data a peer wrote in its own call needs, with no data moved.

A one-shot allreduce's device time cannot be below the flag exchange's; where the exchange
alone takes 0.5x NCCL's allreduce or more, the I1 target is out of reach of any kernel of this
shape (NCCL's small allreduce sends its data and flags together in the same stores).
"""

from __future__ import annotations

from typing import Any

import _gpulib as gl
import numpy as np

_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess

SOURCE = r"""
extern "C" __global__ void hvd_floor_empty() {}

extern "C" __global__ void hvd_floor_exchange(const unsigned long long* inboxes, int me,
                                              int ranks, unsigned int epoch) {
    if (threadIdx.x != 0) return;
    for (int r = 0; r < ranks; ++r) {
        if (r == me) continue;
        unsigned int* at = (unsigned int*)inboxes[r] + me;
        asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(at), "r"(epoch) : "memory");
    }
    const unsigned int* mine = (const unsigned int*)inboxes[me];
    for (int r = 0; r < ranks; ++r) {
        if (r == me) continue;
        unsigned int v;
        do {
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mine + r)
                         : "memory");
        } while ((int)(v - epoch) < 0);
    }
}
"""


class Floor:
    """Every rank's inbox (one 32-bit epoch per rank), opened in every peer (a GPU each)."""

    def __init__(self, gpu: Any) -> None:
        cp = gpu.cupy
        rt = cp.cuda.runtime
        self.gpu, self.rt = gpu, rt
        module = cp.RawModule(code=SOURCE)
        self.empty_kernel = module.get_function("hvd_floor_empty")
        self.exchange_kernel = module.get_function("hvd_floor_exchange")
        self.own = rt.malloc(4 * gpu.size)
        rt.memset(self.own, 0, 4 * gpu.size)
        handles = gpu.comm.allgather(bytes(rt.ipcGetMemHandle(self.own)))
        self.peers = {r: int(rt.ipcOpenMemHandle(h, _LAZY_PEER_ACCESS))
                      for r, h in enumerate(handles) if r != gpu.rank}
        table = [self.own if r == gpu.rank else self.peers[r] for r in range(gpu.size)]
        self.table = cp.asarray(np.array(table, dtype=np.uint64))
        self.epoch = 0
        gpu.sync()
        gpu.barrier()

    def empty(self) -> None:
        with self.gpu.stream:  # (a kernel launches on CuPy's current stream)
            self.empty_kernel((1,), (1,), ())

    def exchange(self) -> None:
        # Every rank calls this the same number of times (the timing loops do), so the
        # epochs agree without any host exchange.
        self.epoch += 1
        gpu = self.gpu
        with gpu.stream:
            self.exchange_kernel((1,), (32,), (self.table, np.int32(gpu.rank),
                                               np.int32(gpu.size), np.uint32(self.epoch)))

    def close(self) -> None:
        self.gpu.sync()
        self.gpu.barrier()  # no peer still spins on this rank's inbox
        for ptr in self.peers.values():
            self.rt.ipcCloseMemHandle(ptr)
        self.gpu.barrier()  # every peer closed its mapping of this rank's inbox
        self.rt.free(self.own)


def bench_floor(gpu: Any, reps: int) -> dict[str, dict[str, float]]:
    """The floor's two kernels timed as I1's calls are (back to back and held)."""
    floor = Floor(gpu)
    out: dict[str, dict[str, float]] = {}
    try:
        for name, fn in (("floor: empty kernel", floor.empty),
                         ("floor: flag exchange", floor.exchange)):
            device, host = gl.device_and_host_time(gpu, fn, reps, 20)
            held, late = gl.held_device_time(gpu, fn, reps, 2)
            out[name] = {**gl.stats(device), "host_median_s": float(np.median(host)),
                         "held_median_s": float(np.median(held)),
                         "held_p99_s": float(np.percentile(held, 99)), "held_late": late}
    finally:
        floor.close()
    return out
