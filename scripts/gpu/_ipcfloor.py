"""bench_ipc's floor of a one-shot allreduce between GPUs, on the device: what the I1 target
(IPC <= 0.5x NCCL's device time) can reach at best, measured beside it.

- an empty kernel: the stream's own cost of one launch between two events;
- a flag exchange: one kernel in which thread 0 writes this call's epoch into every peer's
  inbox (a release store at system scope through CUDA IPC) and spins until every peer's epoch
  has reached its own inbox (acquire loads): the one cross-GPU synchronisation every
  allreduce of data a peer wrote in its own call needs, with no data moved;
- the same exchange by stream memory operations, no kernel at all (where NVIDIA's
  ``cuda-python`` is installed): ``cuStreamWriteValue32`` of the epoch into every peer's inbox,
  then ``cuStreamWaitValue32`` (GEQ) on this rank's own inbox for each peer. With an empty
  kernel's time for the reduction, it bounds a one-shot allreduce that signals by memops
  (the transport's device semaphores) rather than from inside its kernel.

A one-shot allreduce's device time cannot be below the flag exchange's; where the exchange
alone takes 0.5x NCCL's allreduce or more, the I1 target is out of reach of any kernel of this
shape (NCCL's small allreduce sends its data and flags together in the same stores).

Beside the floor, a candidate for the library's one-shot kernel (``kernels.ipc_oneshot`` pulls:
it copies its input into its slot, publishes a flag, waits for the peers' flags, reads their
slots over NVLink, then publishes a second flag before the slot may be reused):

- an LL one-shot allreduce (float32 sum): every 4-byte word goes to every peer's inbox in one
  8-byte store together with the call's epoch (NCCL's LL layout: an aligned 8-byte store is
  seen whole), and each rank polls its own inbox until every peer's word carries the epoch,
  then reduces in rank order (the same bits on every rank). No fence, no separate flag, no
  read across NVLink, no second handshake: a call's inbox half (epoch parity) is written again
  two calls later, which a peer can only reach after this rank's next call has pushed its
  words, so after this rank's current call has ended (one stream per rank, calls in order).

It is timed at I1's sizes up to 64 KiB and checked exact first; where it reaches 0.5x NCCL and
the library's kernel does not, the library takes this shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import _gpulib as gl
import numpy as np

from hvdlite._gpu.semaphores import checked, driver

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

// The LL candidate: inboxes[r] is rank r's inbox (in this context): 2 halves (epoch parity)
// x ranks x `words` 8-byte lines {data, epoch}; the line of word w from rank p in half h is
// (h * ranks + p) * words + w. At most as many blocks as the GPU keeps resident at once (every
// block pushes before it polls, so a block never waits for one that has not started).
extern "C" __global__ void hvd_floor_ll_sum(const float* x, float* y, long long n,
                                            const unsigned long long* inboxes, int me,
                                            int ranks, unsigned int epoch, long long words) {
    const long long half = epoch & 1u;
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long w = first; w < n; w += step) {
        const unsigned int v = __float_as_uint(x[w]);
        for (int r = 0; r < ranks; ++r) {
            if (r == me) continue;
            unsigned int* at = (unsigned int*)inboxes[r] + 2 * ((half * ranks + me) * words + w);
            asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" :: "l"(at), "r"(v),
                         "r"(epoch) : "memory");
        }
    }
    const unsigned int* mine = (const unsigned int*)inboxes[me];
    for (long long w = first; w < n; w += step) {
        float acc = 0.0f;
        for (int r = 0; r < ranks; ++r) {
            float value;
            if (r == me) {
                value = x[w];
            } else {
                const unsigned int* at = mine + 2 * ((half * ranks + r) * words + w);
                unsigned int d, f;
                do {
                    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(d), "=r"(f)
                                 : "l"(at) : "memory");
                } while (f != epoch);
                value = __uint_as_float(d);
            }
            acc = r == 0 ? value : acc + value;
        }
        y[w] = acc;
    }
}
"""

LL_MAX_BYTES = 64 * 1024  # I1's target sizes
LL_SIZES = (4, 1024, 16 * 1024, 64 * 1024)
_LL_THREADS = 256
_LL_MAX_BLOCKS = 64  # resident at once on any GPU this runs on (see the kernel)


class Floor:
    """Every rank's inbox (one 32-bit epoch per rank), opened in every peer (a GPU each)."""

    def __init__(self, gpu: Any) -> None:
        cp = gpu.cupy
        rt = cp.cuda.runtime
        self.gpu, self.rt = gpu, rt
        module = cp.RawModule(code=SOURCE)
        self.empty_kernel = module.get_function("hvd_floor_empty")
        self.exchange_kernel = module.get_function("hvd_floor_exchange")
        self.ll_kernel = module.get_function("hvd_floor_ll_sum")
        self.words = LL_MAX_BYTES // 4
        inbox_bytes = 2 * gpu.size * self.words * 8
        self.own = rt.malloc(4 * gpu.size)
        self.ll_own = rt.malloc(inbox_bytes)
        rt.memset(self.own, 0, 4 * gpu.size)
        rt.memset(self.ll_own, 0, inbox_bytes)
        self.m_own = rt.malloc(4 * gpu.size)  # the memops exchange's inbox
        rt.memset(self.m_own, 0, 4 * gpu.size)
        handles = gpu.comm.allgather((bytes(rt.ipcGetMemHandle(self.own)),
                                      bytes(rt.ipcGetMemHandle(self.ll_own)),
                                      bytes(rt.ipcGetMemHandle(self.m_own))))
        self.peers = {r: int(rt.ipcOpenMemHandle(h[0], _LAZY_PEER_ACCESS))
                      for r, h in enumerate(handles) if r != gpu.rank}
        self.ll_peers = {r: int(rt.ipcOpenMemHandle(h[1], _LAZY_PEER_ACCESS))
                         for r, h in enumerate(handles) if r != gpu.rank}
        self.m_peers = {r: int(rt.ipcOpenMemHandle(h[2], _LAZY_PEER_ACCESS))
                        for r, h in enumerate(handles) if r != gpu.rank}
        self.m_epoch = 0
        try:
            self.drv: Any = driver()
        except ImportError:
            self.drv = None
        table = [self.own if r == gpu.rank else self.peers[r] for r in range(gpu.size)]
        self.table = cp.asarray(np.array(table, dtype=np.uint64))
        ll_table = [self.ll_own if r == gpu.rank else self.ll_peers[r] for r in range(gpu.size)]
        self.ll_table = cp.asarray(np.array(ll_table, dtype=np.uint64))
        self.epoch = 0
        self.ll_epoch = 0
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

    def memops_exchange(self) -> None:
        """The flag exchange by stream memory operations: this call's epoch written into
        every peer's inbox (word ``rank``), then a wait on this rank's own inbox until every
        peer's word has reached it. Needs ``self.drv`` (cuda-python)."""
        self.m_epoch += 1
        drv, gpu, epoch = self.drv, self.gpu, self.m_epoch
        stream = gpu.stream.ptr
        for base in self.m_peers.values():
            checked(drv.cuStreamWriteValue32(stream, base + 4 * gpu.rank, epoch, 0),
                "cuStreamWriteValue32")
        geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        for r in self.m_peers:
            checked(drv.cuStreamWaitValue32(stream, self.m_own + 4 * r, epoch, geq),
                "cuStreamWaitValue32")

    def ll(self, x: Any, y: Any) -> None:
        """One LL one-shot allreduce (float32 sum) of ``x`` into ``y`` (CuPy arrays of at
        most ``LL_MAX_BYTES``); every rank calls it the same number of times (epochs)."""
        self.ll_epoch += 1
        gpu, n = self.gpu, int(x.size)
        blocks = max(1, min(-(-n // _LL_THREADS), _LL_MAX_BLOCKS))
        with gpu.stream:
            self.ll_kernel((blocks,), (_LL_THREADS,),
                           (x, y, np.int64(n), self.ll_table, np.int32(gpu.rank),
                            np.int32(gpu.size), np.uint32(self.ll_epoch),
                            np.int64(self.words)))

    def close(self) -> None:
        self.gpu.sync()
        self.gpu.barrier()  # no peer still spins on this rank's inbox
        for ptr in [*self.peers.values(), *self.ll_peers.values(), *self.m_peers.values()]:
            self.rt.ipcCloseMemHandle(ptr)
        self.gpu.barrier()  # every peer closed its mapping of this rank's inbox
        self.rt.free(self.own)
        self.rt.free(self.ll_own)
        self.rt.free(self.m_own)


def ll_check(floor: Floor, nbytes: int) -> tuple[Any, Any]:
    """Buffers for the LL candidate at ``nbytes``, after one call checked exact against the
    sum of every rank's inputs (integer-valued floats); raises AssertionError on a mismatch."""
    gpu = floor.gpu
    cp = gpu.cupy
    n = max(1, nbytes // 4)
    w = np.arange(n, dtype=np.float64) % 7 + 1
    x = cp.asarray((w * (gpu.rank + 1)).astype(np.float32))
    y = cp.zeros(n, dtype=cp.float32)
    for _ in range(3):  # both inbox halves, and a half written again
        y.fill(0)
        floor.ll(x, y)
        gpu.sync()
        want = (w * (gpu.size * (gpu.size + 1) // 2)).astype(np.float32)
        got = cp.asnumpy(y)
        assert np.array_equal(got, want), (
            f"LL one-shot at {nbytes} B on rank {gpu.rank}: {int((got != want).sum())} of {n} "
            "words differ from the sum of every rank's inputs")
    return x, y


def bench_floor(gpu: Any, reps: int) -> dict[str, dict[str, Any]]:
    """The floor's two kernels timed as I1's calls are (back to back and held)."""
    floor = Floor(gpu)
    out: dict[str, dict[str, Any]] = {}
    try:
        cases: list[tuple[str, Callable[[], None], int | None]] = [
            ("floor: empty kernel", floor.empty, None),
            ("floor: flag exchange", floor.exchange, None)]
        if floor.drv is not None:
            cases.append(("floor: flag exchange by stream memops", floor.memops_exchange, None))
        for size in LL_SIZES:
            x, y = ll_check(floor, size)
            cases.append((f"candidate: LL one-shot {gl.human_bytes(size)}",
                          functools.partial(floor.ll, x, y), size))
        for name, fn, nbytes in cases:
            device, host = gl.device_and_host_time(gpu, fn, reps, 20)
            held, late = gl.held_device_time(gpu, fn, reps, 2)
            out[name] = {**gl.stats(device), "host_median_s": float(np.median(host)),
                         "held_median_s": float(np.median(held)),
                         "held_p99_s": float(np.percentile(held, 99)), "held_late": late,
                         "nbytes": nbytes}
        for size in LL_SIZES:  # still exact after every timed call
            ll_check(floor, size)
    finally:
        floor.close()
    return out
