"""Scheduling: per-rank submission orders, many requests in flight, automatic names."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
from mpi_util import (
    all_inputs,
    allgather_ints,
    assert_equal_result,
    make_input,
    reference_allreduce,
    seed_for,
)

DTYPES = ["float32", "int32", "float64", "uint8"]


def _case(i: int) -> tuple[tuple[int, ...], str, str]:
    """Shape, dtype and op of tensor ``i`` of a workload (varied to mix fusion buckets)."""
    shape = (i % 4 + 1, 3) if i % 3 else (17 * (i % 5 + 1),)
    return shape, DTYPES[i % len(DTYPES)], ("Sum", "Max", "Min")[i % 3]


def test_rank_dependent_submission_order(hvd: Any) -> None:
    """Every rank submits the same 20 tensors in its own order; all complete correctly."""
    rank, size = hvd.rank(), hvd.size()
    order = np.random.default_rng([7, rank]).permutation(20)
    handles = {}
    for i in order.tolist():
        shape, dtype, op = _case(i)
        x = make_input(seed_for("perm", i), rank, shape, dtype)
        handles[i] = hvd.allreduce_async(x, name=f"perm.{i}", op=getattr(hvd, op))
    for i, handle in sorted(handles.items()):
        shape, dtype, op = _case(i)
        want = reference_allreduce(all_inputs(seed_for("perm", i), size, shape, dtype), op)
        assert_equal_result(hvd.synchronize(handle), want, f"perm.{i}")


def test_mixed_collectives_in_rank_dependent_order(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("mixed")
    x = make_input(seed, rank, (rank + 2, 2), "int64")
    submit = {
        "allreduce": lambda: hvd.allreduce_async(x[:2], name="mixed.ar", op=hvd.Sum),
        "allgather": lambda: hvd.allgather_async(x, name="mixed.ag"),
        "broadcast": lambda: hvd.broadcast_async(x[:2], size - 1, name="mixed.bc"),
        "grouped": lambda: hvd.grouped_allreduce_async([x[:1], x[:2]], name="mixed.gr", op=hvd.Max),
    }
    keys = list(submit)
    order = np.random.default_rng([8, rank]).permutation(len(keys)).tolist()
    handles = {keys[k]: submit[keys[k]]() for k in order}
    inputs = [make_input(seed, r, (r + 2, 2), "int64") for r in range(size)]
    want_sum = reference_allreduce([a[:2] for a in inputs], "Sum")
    assert_equal_result(handles["allreduce"].wait(), want_sum)
    assert_equal_result(handles["allgather"].wait(), np.concatenate(inputs))
    assert_equal_result(handles["broadcast"].wait(), inputs[size - 1][:2])
    grouped = handles["grouped"].wait()
    assert_equal_result(grouped[0], reference_allreduce([a[:1] for a in inputs], "Max"))
    assert_equal_result(grouped[1], reference_allreduce([a[:2] for a in inputs], "Max"))


def test_many_requests_in_flight(hvd: Any) -> None:
    """200 async allreduces: some are seen still pending, all finish with the right values."""
    rank, size = hvd.rank(), hvd.size()
    count = 200
    handles = [
        hvd.allreduce_async(make_input(seed_for("flight", i), rank, (4,), "float32"),
                            name=f"flight.{i}", op=hvd.Sum)
        for i in range(count)
    ]  # fmt: skip
    # Polled newest first, right after submission: the background thread cannot have
    # negotiated the last ones yet.
    states = [hvd.poll(h) for h in reversed(handles)]
    assert not all(states), "every one of 200 just-submitted allreduces was already done"
    for i, handle in enumerate(handles):
        want = reference_allreduce(all_inputs(seed_for("flight", i), size, (4,), "float32"), "Sum")
        assert_equal_result(handle.wait(timeout=20), want, f"flight.{i}")
        assert handle.poll() and handle.done() and hvd.poll(handle)
        assert handle.exception() is None


def test_unnamed_requests_get_matching_names(hvd: Any) -> None:
    """Unnamed allreduces submitted in the same order on every rank pair up correctly."""
    rank, size = hvd.rank(), hvd.size()
    handles = []
    for i in range(10):
        shape, dtype, op = _case(i)
        x = make_input(seed_for("unnamed", i), rank, shape, dtype)
        handles.append(hvd.allreduce_async(x, op=getattr(hvd, op)))
    names = [h.name for h in handles]
    assert len(set(names)) == len(names), f"automatic names repeat: {names}"
    digest = zlib.crc32("\n".join(names).encode())
    assert allgather_ints(digest, "comparing automatic names") == [digest] * size
    for i, handle in enumerate(handles):
        shape, dtype, op = _case(i)
        want = reference_allreduce(all_inputs(seed_for("unnamed", i), size, shape, dtype), op)
        assert_equal_result(handle.wait(), want, f"unnamed #{i} ({names[i]})")
    for step in range(3):
        x = make_input(seed_for("unnamed_sync", step), rank, (3,), "int32")
        want = reference_allreduce(
            all_inputs(seed_for("unnamed_sync", step), size, (3,), "int32"), "Sum"
        )
        assert_equal_result(hvd.allreduce(x, op=hvd.Sum), want, f"unnamed blocking #{step}")


def test_idle_nap_is_cut_short_by_local_work() -> None:
    """A negotiation round entered while idle naps between polls; work submitted on this rank
    must end the nap, and the rest of the round is waited as busy (no more idle naps) instead
    of being slept through. Driven on COMM_SELF: the round is a receive whose message a timer
    sends a little after the local work arrived."""
    import threading

    from mpi4py import MPI

    from hvdlite._control.negotiator import Negotiator
    from hvdlite._observe.tracer import Tracer
    from hvdlite.config import load_config

    comm = MPI.COMM_SELF.Dup()
    naps: list[float] = []
    try:
        for arrive_on in (1, 3):  # local work arrives during the first / third idle nap
            timer = threading.Timer(
                0.05, lambda: comm.Send([np.ones(1, np.uint8), MPI.BYTE], dest=0, tag=5))

            def nap(seconds: float, arrive_on: int = arrive_on,
                    timer: threading.Timer = timer) -> bool:
                naps.append(seconds)
                if len(naps) == arrive_on:
                    timer.start()  # the round completes only later
                    return True
                return False

            neg = Negotiator(comm, load_config(None, {}), Tracer(None, False), False, nap)
            try:
                neg._busy = False  # an idle round
                buf = np.zeros(1, np.uint8)
                naps.clear()
                neg._wait(comm.Irecv([buf, MPI.BYTE], source=0, tag=5))
                timer.join()
                assert len(naps) == arrive_on, naps  # no idle nap once the work arrived
                assert buf[0] == 1
            finally:
                neg.failures.close()
    finally:
        comm.Free()


def test_engine_idle_nap_ends_when_work_is_submitted() -> None:
    """The engine's half (its scheduler's): its nap is a wait on the wake-up queue that a
    submission ends, and the token goes back so the loop's next wait for work does not sleep
    either."""
    import queue
    import threading
    import time
    from types import SimpleNamespace

    from hvdlite._control.scheduler import Scheduler

    wake: queue.SimpleQueue[None] = queue.SimpleQueue()
    fake = SimpleNamespace(wake=wake, napping=False)  # idle_nap uses nothing else
    assert Scheduler.idle_nap(fake, 0.01) is False  # nothing submitted: a plain nap
    timer = threading.Timer(0.02, wake.put, (None,))
    timer.start()
    t0 = time.perf_counter()
    assert Scheduler.idle_nap(fake, 30.0) is True
    assert time.perf_counter() - t0 < 20.0, "slept through the submission"
    timer.join()
    assert wake.get_nowait() is None  # the token is back for _wait_for_work


def test_shutdown_round_leaves_the_gil_while_a_peer_is_late() -> None:
    """The round that names who shut down first waits for every rank; while it waits for a
    late (or dead) peer, this rank's other threads must run: its timeline writer, its watchdog
    and its signal handlers end a rank whose peer died there. mpi4py's pickle-based
    ``allreduce`` held the GIL for the whole wait (a dead peer froze the rank until the rank
    wrapper's SIGKILL: the timeline was lost, issue 19's trace test failed in CI). Rank 0
    arrives late; the others count what their main thread did meanwhile, and every rank checks
    the reason it names."""
    import threading
    import time

    import pytest
    from mpi4py import MPI

    from hvdlite._control.negotiator import Negotiator
    from hvdlite._observe.tracer import Tracer
    from hvdlite.config import load_config

    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("needs at least two ranks")
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    stopping = rank == size - 1  # the last rank called shutdown(); it is the first to
    neg = Negotiator(comm, load_config(None, {}), Tracer(None, False))
    try:
        reasons: list[str] = []
        worker = threading.Thread(target=lambda: reasons.append(
            str(neg._shutdown_reason(stopping))))
        if rank == 0:
            time.sleep(0.5)  # late: the others wait in the round meanwhile
            worker.start()
            worker.join(30)
        else:
            worker.start()
            ran = 0
            while worker.is_alive() and ran < 3000:
                time.sleep(0.005)  # needs the GIL back after every sleep
                ran += 1
            worker.join(30)
            assert ran >= 10, f"rank {rank}'s main thread ran {ran} times in the round's wait"
        assert not worker.is_alive()
        want = ("shutdown() was called before it completed" if stopping
                else f"shut down by rank {size - 1}")
        assert len(reasons) == 1 and want in reasons[0], reasons
    finally:
        neg.failures.close()
        comm.Free()
