"""Kernels and helpers for the GPU tests: a producer that spins, then writes; the death tests'
job runner."""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cupy
from jobs_util import clean_env, run_group

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


# How rank 1 goes in the death tests (a line of its job script).
GONE = {
    "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
    "raise": "raise RuntimeError('user code failed on rank 1')",
}
_HVDLITE_FRAME = re.compile(r'File "[^"]*/hvdlite/')


def rank_one_goes(tmp_path: Path, job: str, how: str, label: str) -> None:
    """Run ``job`` (a script that writes the time rank 1 goes to its first argument, then
    goes ``how``) as a 2-rank ``hvdliterun`` job: it must end with an error within 15 s of
    rank 1 going, naming rank 1, with no traceback through hvdlite's code for a SIGKILL (a
    raising rank prints its own, as Python does)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(job), encoding="utf-8")
    stamp = tmp_path / "gone"
    code, out = run_group([sys.executable, "-m", "hvdlite.run", "-np", "2", "--",
                           sys.executable, str(script), str(stamp)], clean_env(), 90.0)
    ended = time.time()
    assert code is not None and code != 0, out
    assert stamp.exists(), f"rank 1 never reached the failure point:\n{out}"
    took = ended - float(stamp.read_text())
    print(f"{how} ({label}): the job ended {took:.1f} s after rank 1 went", flush=True)
    assert took < 15, f"the job took {took:.1f} s to end after rank 1 went:\n{out}"
    assert "rank 1" in out, out
    if how == "SIGKILL":
        assert not _HVDLITE_FRAME.search(out), f"a traceback through hvdlite's code:\n{out}"
    else:
        assert "user code failed on rank 1" in out, out
