"""A rank that dies or raises while its peers stream device collectives: every survivor ends
within 15 s, the rank named, no traceback from hvdlite's code (for SIGKILL).

Real ``hvdliterun`` jobs of ``HVDLITE_TEST_JOB_RANKS`` ranks (default 2;
``jobs_util.job_ranks``). The transport they must take is
``HVDLITE_TEST_EXPECT_TRANSPORT`` (``ipc`` or ``nccl``); by default ``nccl`` where this host has
two GPUs or more (each rank gets its own: NCCL under the default policy) and ``ipc`` on one
GPU (the ranks share it). The job checks the transport its engine picked before anything else.

- ipc (device semaphores, issue 40, where cuda-python is installed): rank 1 goes *inside* an
  IPC collective, as below for NCCL: rank 0's stream is then parked on a semaphore rank 1
  never signals; the launcher (SIGKILL) or hvdlite's failure notice (raise: ``Engine.stopped``
  -> ``NcclBackend.abort`` -> ``IpcCommunicator.release``) must end it.
- nccl (the NCCL watchdog of the GPU-failures issue): rank 1 goes *inside* an NCCL collective.
  At round 300 rank 1 first queues ~1-2 s of matmuls on its stream that produce the input of
  one more allreduce, submits it, waits until hvdlite enqueued it on the device (so both
  ranks' NCCL kernels are queued, rank 0's already spinning for rank 1's, which waits behind
  the matmuls), then goes. Rank 0 is then blocked on an NCCL kernel that can never finish:
  the launcher (SIGKILL) or hvdlite's failure notice (raise: ``Engine._finish`` ->
  ``Channel.abort_device`` -> ``NcclBackend.abort``, ``ncclCommAbort``) must end it.

Run it outside any MPI launcher (it launches its own jobs):
``python3 -m pytest tests/gpu/test_gpu_ipc_death.py``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from jobs_util import GONE, rank_one_goes, under_mpi_launcher

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)
if under_mpi_launcher():
    pytest.skip("launches its own jobs: run it outside mpirun", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

EXPECT = os.environ.get("HVDLITE_TEST_EXPECT_TRANSPORT") or (
    "nccl" if cupy.cuda.runtime.getDeviceCount() >= 2 else "ipc")
# The IPC steps' ordering: device semaphores where cuda-python is installed (issue 40).
PROTOCOL = "flags" if importlib.util.find_spec("cuda") is not None and \
    importlib.util.find_spec("cuda.bindings") is not None else "events"
if EXPECT not in ("ipc", "nccl"):
    raise ValueError(f"HVDLITE_TEST_EXPECT_TRANSPORT must be ipc or nccl, got {EXPECT!r}")


_STREAM = """
import os, signal, sys, time
import cupy
import hvdlite as hvd
from hvdlite._api import default_engine
hvd.init()
cupy.cuda.Device(hvd.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
xs = [cupy.full(4096 * (k + 1), 1.0, cupy.float32) for k in range(8)]
hvd.allreduce(xs[0], name="warm-up")
backend = default_engine().global_channel.backends["cuda"]
transport = backend.transport
assert transport == {expect!r}, f"transport {{transport!r}}, expected {expect!r}"
if transport == "ipc":
    protocol = [c for (kind, _), c in backend._made.items() if kind == "ipc"][0].protocol
    assert protocol == {protocol!r}, f"IPC protocol {{protocol!r}}, expected {protocol!r}"
inside = {inside!r}
if inside:
    # Everything allocated and warmed now: a fresh cudaMalloc issued while the matmuls run
    # could wait for them (and let the collective complete before rank 1 goes).
    a = cupy.full((8192, 8192), 1e-4, cupy.float32)
    b = cupy.matmul(a, a)
    y = cupy.ones(1 << 22, cupy.float32)
    hvd.allreduce(y, name="inside", op=hvd.Sum)  # the pool keeps a block of the result's size
    cupy.cuda.Stream.null.synchronize()
for i in range(1_000_000):
    if inside and i == 300:
        if hvd.rank() == 1:
            for _ in range(100):  # ~1-2 s of device work before the input is ready
                cupy.matmul(a, a, out=b)
            y[...] = b.ravel()[:1 << 22]  # no allocation
        h = hvd.allreduce_async(y, name="inside", op=hvd.Sum)
        if hvd.rank() == 1:
            while not h._resolved:  # enqueued on the device behind the matmuls
                time.sleep(1e-4)
        else:
            h.wait()
    if hvd.rank() == 1 and i == 300:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        {how}
    handles = [hvd.allreduce_async(x, name=f"t{{k}}", op=hvd.Sum) for k, x in enumerate(xs)]
    for h in handles:
        h.wait()
"""

@pytest.mark.parametrize("how", list(GONE))
def test_a_rank_gone_mid_stream_ends_the_job(tmp_path: Path, how: str) -> None:
    job = _STREAM.format(how=GONE[how], expect=EXPECT, inside=True, protocol=PROTOCOL)
    rank_one_goes(tmp_path, job, how, EXPECT)
