"""Kernels and helpers for the GPU tests: a producer that spins, then writes; re-init with a
config; warm-up; the transport's timeline phase. (The death tests' job runner is
``jobs_util.rank_one_goes``.)"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import cupy

# %globaltimer counts nanoseconds of wall time, unlike clock64() it does not depend on the SM
# clock (whose rate CUDA 13 no longer reports as a device attribute).
_SPIN = r"""
extern "C" __global__ void spin_then_fill(long long ns, int* flag, double* out,
                                          long long n, double value) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
        flag[0] = 1;
    }
    __syncthreads();
    // Only block 0 spins; the single block below writes everything after the spin.
    for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = value;
}
"""


@contextlib.contextmanager
def reinit(hvd: Any, **config: Any) -> Iterator[None]:
    """hvdlite restarted with ``config`` for the block, then restarted with the defaults (the
    session fixture's state) whatever the block did."""
    hvd.shutdown()
    hvd.init(**config)
    try:
        yield
    finally:
        hvd.shutdown()
        hvd.init()


@functools.cache
def _kernel() -> Any:
    return cupy.RawKernel(_SPIN, "spin_then_fill")


def slow_fill(out: Any, value: float, ms: float, stream: Any) -> None:
    """Enqueue on ``stream``: spin about ``ms`` milliseconds, then fill float64 ``out``."""
    assert out.dtype == cupy.float64 and out.flags.c_contiguous
    with stream:
        flag = cupy.zeros(1, dtype=cupy.int32)
        _kernel()((1,), (256,), (cupy.int64(int(ms * 1e6)), flag, out, cupy.int64(out.size),
                                 cupy.float64(value)))


def warm_up(hvd: Any, n: int) -> None:
    """One float64 allreduce of ``n`` elements and one small one, so the device context, the
    NCCL communicator and the memory pool exist before a test times anything: a first
    cudaMalloc / cudaHostAlloc may synchronise the whole device, which would wait for a
    spinning producer and hide what the test looks for."""
    for size in (n, 8):
        hvd.allreduce(cupy.ones(size, dtype=cupy.float64), name=f"warm-up.{size}", op=hvd.Sum)
    cupy.cuda.Device().synchronize()


def allreduce_phase(hvd: Any) -> str:
    """The timeline phase of a device allreduce's transport: NCCL_ALLREDUCE, or IPC_ALLREDUCE
    where the ranks share a GPU (or IPC is forced)."""
    from hvdlite._api import default_engine

    backend = default_engine().global_channel.backends.get("cuda")
    return "IPC_ALLREDUCE" if backend is not None and backend.transport == "ipc" else (
        "NCCL_ALLREDUCE")


def one_ipc_step(hvd: Any, nbytes: int, **config: Any) -> None:
    """Where the device data takes CUDA IPC, re-init with staging slots of ``nbytes``, so a
    collective that large is one step: in chunks, enqueueing them costs the host more than
    the device takes to run them, and a test of what is still running when wait() returns
    would see nothing running."""
    if allreduce_phase(hvd) == "IPC_ALLREDUCE":
        hvd.shutdown()
        hvd.init(ipc_buffer_bytes=nbytes, **config)
