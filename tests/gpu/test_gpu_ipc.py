"""The CUDA IPC transport: which transport a placement gets, the forced fallback, chunked steps,
process sets and join on device tensors, the buffers' lifetime across peers, re-init.

Ranks that share a GPU (``NP=2`` or 4 on a one-GPU host) take IPC for every device collective;
``ipc="always"`` forces it at any rank count, so these tests also run at 1 rank.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from mpi4py import MPI  # noqa: E402
from mpi_util import all_inputs, reference_allreduce  # noqa: E402

from hvdlite._api import default_engine  # noqa: E402


def _backend(set_id: int = 0) -> Any:
    return default_engine().channel_for(set_id).backends["cuda"]


def _shares_gpu() -> bool:
    """True if some ranks of the job share a GPU (so NCCL cannot run)."""
    import socket

    me = (socket.gethostname(), cupy.cuda.Device().pci_bus_id)
    everyone = MPI.COMM_WORLD.allgather(me)
    return len(set(everyone)) < len(everyone)


def _exact(got: Any, want: np.ndarray, what: str) -> None:
    host = cupy.asnumpy(got)
    assert host.dtype == want.dtype and host.shape == want.shape, (what, host.shape)
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(host, want, err_msg=what)
    else:
        np.testing.assert_allclose(host, want, rtol=1e-6, err_msg=what)


def test_transport_follows_the_placement(hvd: Any) -> None:
    hvd.allreduce(cupy.ones(4, cupy.float32), name="placement.probe", op=hvd.Sum)
    backend = _backend()
    assert backend.transport == ("ipc" if _shares_gpu() else "nccl")
    assert backend.placement.one_host == (len(set(MPI.COMM_WORLD.allgather(
        __import__("socket").gethostname()))) == 1)


def test_ipc_off_on_a_shared_gpu_is_the_clear_error(hvd: Any, restart: Any) -> None:
    if not _shares_gpu():
        pytest.skip("needs ranks that share a GPU")
    restart(ipc="off")
    with pytest.raises(hvd.BackendUnavailableError, match=r"share one GPU.*ipc is off"):
        hvd.allreduce(cupy.ones(4, cupy.float32), name="off.probe")
    # Decided alike on every rank, so nothing else is lost: host collectives go on.
    got = hvd.allreduce(np.ones(3, np.int64), name="off.host", op=hvd.Sum)
    np.testing.assert_array_equal(got, np.full(3, hvd.size()))
    restart()


def test_forced_ipc_in_chunks_of_a_small_slot(hvd: Any, restart: Any) -> None:
    restart(ipc="always", ipc_buffer_bytes="4KiB", fusion_threshold="64KiB")
    r, n = hvd.rank(), hvd.size()
    for dtype, count in (("float32", 5000), ("int64", 1500), ("uint8", 9000)):
        inputs = all_inputs(41, n, (count,), dtype)
        got = hvd.allreduce(cupy.asarray(inputs[r]), name=f"chunk.{dtype}", op=hvd.Sum)
        _exact(got, reference_allreduce(inputs, "Sum"), f"allreduce {dtype}")
        got = hvd.allreduce(cupy.asarray(inputs[r]), name=f"chunk.max.{dtype}", op=hvd.Max)
        _exact(got, reference_allreduce(inputs, "Max"), f"max {dtype}")
    assert _backend().transport == "ipc"
    parts = [all_inputs(42 + k, n, (700 * (k + 1), 3), "float64")[k] for k in range(n)]
    got = hvd.allgather(cupy.asarray(parts[r]), name="chunk.ag")
    _exact(got, np.concatenate(parts), "uneven allgather in chunks")
    big = all_inputs(43, n, (3000,), "float64")
    got = hvd.broadcast(cupy.asarray(big[r]), n - 1, name="chunk.bc")
    _exact(got, big[n - 1], "broadcast in chunks")
    rows = [[(s + d) % 2 * 400 + 300 for d in range(n)] for s in range(n)]
    data = [all_inputs(44, n, (sum(rows[s]), 2), "int32")[s] for s in range(n)]
    got = hvd.alltoall(cupy.asarray(data[r]), splits=rows[r], name="chunk.a2a")
    want = np.concatenate([np.split(data[s], np.cumsum(rows[s])[:-1])[r] for s in range(n)])
    _exact(got, want, "alltoall in chunks")
    total = 1000 * n + 1
    inputs = all_inputs(45, n, (total, 2), "float32")
    got = hvd.reducescatter(cupy.asarray(inputs[r]), name="chunk.rs", op=hvd.Sum)
    full = reference_allreduce(inputs, "Sum")
    base, extra = divmod(total, n)
    start = r * base + min(r, extra)
    _exact(got, full[start:start + base + (1 if r < extra else 0)], "reducescatter in chunks")
    restart()


def test_process_set_on_device(hvd: Any) -> None:
    n = hvd.size()
    if n < 2:
        pytest.skip("needs 2 ranks")
    # Every other rank (at 2 ranks the set [0, 1] is the global one: rank 1 alone then).
    members = list(range(0, n, 2)) if n > 2 else [1]
    ps = hvd.add_process_set(members)
    try:
        if hvd.rank() in members:
            inputs = all_inputs(51, len(members), (37,), "int32")
            mine = inputs[members.index(hvd.rank())]
            got = hvd.allreduce(cupy.asarray(mine), name="ps.ar", op=hvd.Sum, process_set=ps)
            _exact(got, reference_allreduce(inputs, "Sum"), "process set allreduce")
            got = hvd.allgather(cupy.asarray(mine), name="ps.ag", process_set=ps)
            _exact(got, np.concatenate(inputs), "process set allgather")
        # The global set goes on beside it.
        got = hvd.allreduce(cupy.full(3, hvd.rank(), cupy.int64), name="ps.global", op=hvd.Sum)
        _exact(got, np.full(3, sum(range(n)), np.int64), "global beside the set")
    finally:
        hvd.remove_process_set(ps)


def test_join_on_device(hvd: Any) -> None:
    n = hvd.size()
    if n < 2:
        pytest.skip("needs 2 ranks")
    if hvd.rank() == 0:
        last = hvd.join()
    else:
        x = cupy.full(5, float(hvd.rank()), cupy.float32)
        got = hvd.allreduce(x, name="join.ar", op=hvd.Sum)
        _exact(got, np.full(5, float(sum(range(1, n))), np.float32), "allreduce with rank 0 joined")
        last = hvd.join()
    assert 0 <= last < n


def test_buffers_live_until_every_peer_closed_them(hvd: Any) -> None:
    """Each rank frees its staging allocation only after every peer closed its mapping: the
    last rank to destroy holds the others' frees back."""
    from cupy.cuda import nccl

    from hvdlite._gpu.ipc import IpcCommunicator

    comm = MPI.COMM_WORLD
    r, n = comm.Get_rank(), comm.Get_size()
    stream = cupy.cuda.Stream(non_blocking=True)
    ipc = IpcCommunicator(comm, cupy, nccl, cupy.cuda.Device().id, 1 << 16,
                          lambda req: req.Wait())
    inputs = all_inputs(61, n, (1000,), "float32")
    x = cupy.asarray(inputs[r])
    out = cupy.empty_like(x)
    for _ in range(5):
        ipc.allReduce(x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                      stream.ptr)
    stream.synchronize()
    _exact(out, reference_allreduce(inputs, "Sum"), "direct IpcCommunicator")
    if r == n - 1:
        time.sleep(0.5)
    start = time.monotonic()
    ipc.destroy()
    took = time.monotonic() - start
    if n > 1 and r != n - 1:
        assert took > 0.4, f"rank {r} freed its buffer {took:.2f} s after starting: too soon"


def test_shutdown_and_reinit_reopen_the_handles(hvd: Any, restart: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    for round_ in range(3):
        restart(ipc="always")
        inputs = all_inputs(70 + round_, n, (129,), "float64")
        got = hvd.allreduce(cupy.asarray(inputs[r]), name="reinit", op=hvd.Average)
        _exact(got, reference_allreduce(inputs, "Average"), f"after re-init {round_}")
    restart()


def test_mixed_policy_picks_per_bucket_size(hvd: Any, restart: Any) -> None:
    """ipc=auto with ipc_max_bytes on ranks with a GPU each (or one rank): small buckets take
    IPC, larger ones NCCL, both exact."""
    if _shares_gpu():
        pytest.skip("ranks that share a GPU take IPC for every bucket")
    restart(ipc_max_bytes="4KiB")
    r, n = hvd.rank(), hvd.size()
    for count in (100, 1024, 1025, 50_000):  # 400 B and 4 KiB: IPC; above: NCCL
        inputs = all_inputs(80, n, (count,), "float32")
        got = hvd.allreduce(cupy.asarray(inputs[r]), name=f"mixed.{count}", op=hvd.Sum)
        _exact(got, reference_allreduce(inputs, "Sum"), f"mixed {count}")
    backend = _backend()
    assert backend.transport == "mixed"
    assert {kind for kind, _ in backend._made} == {"ipc", "nccl"}
    restart()


def test_the_callers_current_stream_is_kept(hvd: Any, restart: Any) -> None:
    """An IPC collective leaves the caller's current CuPy stream current (the reduce kernels
    enter and leave a stream context of their own; afterwards the null stream was current,
    so the caller's next kernels ran unordered with its non-blocking stream)."""
    from cupy.cuda import nccl

    from hvdlite._gpu.ipc import IpcCommunicator

    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(64, cupy.float32)
    with stream:
        ipc = IpcCommunicator(MPI.COMM_WORLD, cupy, nccl, cupy.cuda.Device().id, 1 << 16,
                              lambda req: req.Wait())
        for _ in range(3):
            ipc.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                          stream.ptr)
            assert cupy.cuda.get_current_stream().ptr == stream.ptr
        stream.synchronize()
        ipc.destroy()
        restart(ipc="always")
        for i in range(3):  # the blocking repeat runs on this thread (the immediate path)
            hvd.allreduce(x, name="keep.stream", op=hvd.Sum)
            assert cupy.cuda.get_current_stream().ptr == stream.ptr, f"call {i}"
    restart()


# -- device semaphores (issue 40): no MPI and no host wait per step; the release -----------------
def _bindings() -> bool:
    import importlib.util

    return importlib.util.find_spec("cuda") is not None and \
        importlib.util.find_spec("cuda.bindings") is not None


def _direct(protocol: str, slot_bytes: int = 1 << 16) -> tuple[Any, list[int]]:
    """An IpcCommunicator over COMM_WORLD whose MPI waits are counted (every MPI request it
    makes goes through ``wait``)."""
    from cupy.cuda import nccl

    from hvdlite._gpu.ipc import IpcCommunicator

    calls = [0]

    def wait(req: MPI.Request) -> None:
        calls[0] += 1
        req.Wait()

    ipc = IpcCommunicator(MPI.COMM_WORLD, cupy, nccl, cupy.cuda.Device().id, slot_bytes, wait,
                          protocol=protocol)
    return ipc, calls


def test_the_engine_orders_ipc_steps_by_device_semaphores(hvd: Any, restart: Any) -> None:
    """With cuda-python installed, the engine's IPC communicator takes device semaphores."""
    restart(ipc="always")
    hvd.allreduce(cupy.ones(8, cupy.float32), name="sem.probe", op=hvd.Sum)
    comms = [c for (kind, _), c in _backend()._made.items() if kind == "ipc"]
    assert comms, "no IPC communicator was made under ipc=always"
    want = "flags" if _bindings() else "events"
    assert comms[0].protocol == want, comms[0].protocol_why
    restart()


@pytest.mark.parametrize("protocol", ["flags", "events"])
def test_mpi_calls_per_step(hvd: Any, protocol: str) -> None:
    """Device semaphores make no MPI call per collective, chunked ones included; the event
    protocol makes one barrier per step (so the count is what it claims to be)."""
    if protocol == "flags" and not _bindings():
        pytest.skip("cuda-python (cuda-bindings) is not installed")
    from cupy.cuda import nccl

    r, n = hvd.rank(), hvd.size()
    ipc, calls = _direct(protocol, slot_bytes=4096)
    stream = cupy.cuda.Stream(non_blocking=True)
    at_setup = calls[0]
    steps = 0
    for count in (1, 1000, 1024, 5000, 40_000):  # up to 40 chunks of a 4 KiB slot
        inputs = all_inputs(90 + count % 7, n, (count,), "float32")
        x = cupy.asarray(inputs[r])
        out = cupy.empty_like(x)
        for _ in range(3):
            ipc.allReduce(x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                          stream.ptr)
            steps += -(-x.nbytes // 4096)
        stream.synchronize()
        _exact(out, reference_allreduce(inputs, "Sum"), f"{protocol} allreduce {count}")
    made = calls[0] - at_setup
    assert made == (0 if protocol == "flags" else steps), (protocol, made, steps)
    ipc.destroy()


def _flags_pair(hvd: Any) -> tuple[Any, Any, Any]:
    """A flags-protocol IPC communicator of every rank, a stream of its own and CuPy's nccl
    module (for the op and dtype codes); skips without cuda-python or a peer."""
    if not _bindings():
        pytest.skip("cuda-python (cuda-bindings) is not installed")
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    from cupy.cuda import nccl

    ipc, _ = _direct("flags")
    return ipc, cupy.cuda.Stream(non_blocking=True), nccl


def test_a_call_does_not_wait_for_a_late_peer(hvd: Any) -> None:
    """With device semaphores a rank's call returns while a peer has not called yet; its
    stream waits on the device, and the result is exact once the peer came."""
    ipc, stream, nccl = _flags_pair(hvd)
    r, n = hvd.rank(), hvd.size()
    inputs = all_inputs(97, n, (3000,), "float64")
    x = cupy.asarray(inputs[r])
    out = cupy.zeros_like(x)
    ipc.allReduce(x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT64, nccl.NCCL_SUM,
                  stream.ptr)  # warm: the reduce kernel is compiled on first use
    stream.synchronize()
    with stream:
        out[...] = 0
    MPI.COMM_WORLD.Barrier()
    late = 1.5
    if r == n - 1:
        time.sleep(late)
    t0 = time.monotonic()
    ipc.allReduce(x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT64, nccl.NCCL_SUM,
                  stream.ptr)
    returned = time.monotonic() - t0
    stream.synchronize()
    waited = time.monotonic() - t0
    _exact(out, reference_allreduce(inputs, "Sum"), "allreduce with a late peer")
    if r != n - 1:
        assert returned < late / 3, f"rank {r}'s call took {returned:.2f} s: it waited"
        assert waited > late / 2, f"rank {r}'s stream finished after {waited:.2f} s: too soon"
    ipc.destroy()


def test_release_lets_a_stream_past_a_peer_that_never_signals(hvd: Any) -> None:
    """Rank 0 enqueues one collective no peer matches (as if they had died): its stream is
    parked on a semaphore until release() sets its flags ahead; then it drains."""
    ipc, stream, nccl = _flags_pair(hvd)
    r = hvd.rank()
    x = cupy.ones(256, cupy.float32)
    cupy.cuda.Stream.null.synchronize()  # (x's fill ran on the default stream)
    ipc.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    stream.synchronize()
    MPI.COMM_WORLD.Barrier()
    if r == 0:
        ipc.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                      stream.ptr)
        time.sleep(0.5)
        assert not stream.done, "the unmatched step finished: nothing waited for the peers"
        t0 = time.monotonic()
        assert ipc.release(), "release() did not drain the stream"
        stream.synchronize()
        assert time.monotonic() - t0 < 3.0
    MPI.COMM_WORLD.Barrier()
    ipc.destroy()


def test_one_shot_kernel_for_small_calls_with_a_gpu_each(hvd: Any, restart: Any) -> None:
    # With a GPU per rank, a small allreduce over IPC is one kernel (its fences done by the
    # kernel on the flag protocol's flags); larger ones are stream-memop steps; both in turn
    # over many steps (both slots, many epochs), every result exact, every op, a reduce too.
    if _shares_gpu():
        pytest.skip("ranks share a GPU: the one-shot kernel spins on an SM, so it is off")
    restart(ipc="always", fusion_threshold="1KiB")
    hvd.allreduce(cupy.ones(4, cupy.float32), name="one.probe", op=hvd.Sum)  # makes the backend
    comm = _backend().communicator(cupy.cuda.Device().id)
    if comm.protocol != "flags":
        pytest.skip(f"the one-shot kernel needs the flags protocol: {comm.protocol_why}")
    r, n = hvd.rank(), hvd.size()
    before = comm.oneshot_steps
    for step in range(40):
        for dtype, count in (("int32", 7), ("float64", 3000), ("float16", 100)):
            inputs = all_inputs(300 + step, n, (count,), dtype)
            op = ("Sum", "Max", "Min")[step % 3]
            got = hvd.allreduce(cupy.asarray(inputs[r]), name=f"one.{dtype}", op=getattr(hvd, op))
            _exact(got, reference_allreduce(inputs, op), f"step {step} {op} {dtype}")
        big = all_inputs(900 + step, n, (40_000,), "int64")  # 320 KB: stream-memop steps
        got = hvd.allreduce(cupy.asarray(big[r]), name="one.big", op=hvd.Sum)
        _exact(got, reference_allreduce(big, "Sum"), f"step {step} large")
    assert comm.oneshot_steps - before >= 40 * 3, comm.oneshot_steps - before
    restart()


def test_two_shot_allreduce_from_four_ranks(hvd: Any, restart: Any) -> None:
    # From 4 ranks a large allreduce over IPC is a reduce-scatter then an all-gather (each
    # rank reads 2(n-1)/n of the bytes instead of n-1 times them); in chunks of a small slot
    # too, in place and not, every result exact.
    from hvdlite._gpu.ipc import TWO_SHOT_BYTES, TWO_SHOT_RANKS

    r, n = hvd.rank(), hvd.size()
    if n < TWO_SHOT_RANKS:
        pytest.skip(f"the two-shot allreduce starts at {TWO_SHOT_RANKS} ranks")
    for slot in ("16MiB", "64KiB"):
        restart(ipc="always", ipc_buffer_bytes=slot)
        for dtype, op in (("int32", "Sum"), ("float64", "Max"), ("int64", "Min")):
            count = TWO_SHOT_BYTES // np.dtype(dtype).itemsize * 3 + 7  # uneven parts
            inputs = all_inputs(500, n, (count,), dtype)
            got = hvd.allreduce(cupy.asarray(inputs[r]), name=f"two.{dtype}", op=getattr(hvd, op))
            _exact(got, reference_allreduce(inputs, op), f"two-shot {op} {dtype}, slot {slot}")
            x = cupy.asarray(inputs[r])
            hvd.allreduce_(x, name=f"two.inplace.{dtype}", op=getattr(hvd, op))
            _exact(x, reference_allreduce(inputs, op), f"in place {op} {dtype}, slot {slot}")
    restart()
