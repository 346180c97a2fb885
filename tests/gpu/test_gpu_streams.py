"""Stream semantics on the device: READY events instead of CPU syncs, memory lifetime,
asynchronous completion, wait_stream and then()."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from jobs_util import import_torch

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from gpu_util import one_ipc_step, reinit, slow_fill, warm_up  # noqa: E402

N = 1 << 16  # elements per canary tensor


def _expect_sum(hvd: Any, value_of_rank: Any) -> float:
    return float(sum(value_of_rank(k) for k in range(hvd.size())))


@pytest.fixture(params=["sync", "async"])
def completion(request: pytest.FixtureRequest, hvd: Any) -> Any:
    with reinit(hvd, async_completion=request.param == "async"):
        warm_up(hvd, N)
        yield request.param


@pytest.fixture
def async_completion(hvd: Any) -> Any:
    """Async completion on for one test (not parametrized: its sync case would only skip)."""
    with reinit(hvd, async_completion=True):
        warm_up(hvd, N)
        yield


def test_race_canary_producer_on_side_stream(hvd: Any, completion: str) -> None:
    """A producer spins ~50 ms on a side stream, then writes the input; allreduce_async is
    called at once, with no host sync. The result must be exact: the collective waited."""
    side = cupy.cuda.Stream(non_blocking=True)
    for trial in range(3):
        x = cupy.zeros(N, dtype=cupy.float64)
        side.synchronize()
        slow_fill(x, hvd.rank() + 1 + trial, ms=50, stream=side)
        h = hvd.allreduce_async(x, name=f"race.{completion}.{trial}", op=hvd.Sum, stream=side)
        got = h.wait()
        cupy.cuda.get_current_stream().synchronize()
        want = _expect_sum(hvd, lambda k, t=trial: k + 1 + t)
        assert float(got.min()) == want and float(got.max()) == want, (trial, want)


def test_use_after_free_canary(hvd: Any, completion: str) -> None:
    """Submit, drop every reference to the input, refill the pool with a sentinel: the
    sentinel must never reach the result (hvdlite keeps the input until the device is done)."""
    stream = cupy.cuda.get_current_stream()
    sentinel = -12345.0
    for trial in range(3):
        x = cupy.empty(N, dtype=cupy.float64)
        slow_fill(x, hvd.rank() + 1, ms=30, stream=stream)
        h = hvd.allreduce_async(x, name=f"uaf.{completion}.{trial}", op=hvd.Sum)
        del x
        junk = [cupy.full(N, sentinel, dtype=cupy.float64) for _ in range(8)]
        got = h.wait()
        stream.synchronize()
        del junk
        host = cupy.asnumpy(got)
        assert not np.any(host == sentinel), "input memory reused before the device finished"
        assert np.all(host == _expect_sum(hvd, lambda k: k + 1))


def test_background_thread_does_not_block_on_inputs(hvd: Any, completion: str) -> None:
    """While a 200 ms producer spins under collective X, a host collective Y submitted
    afterwards completes first: the background thread moved on instead of waiting."""
    side = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(N, dtype=cupy.float64)
    slow_fill(x, 1.0, ms=200, stream=side)
    hx = hvd.allreduce_async(x, name=f"nb.x.{completion}", op=hvd.Sum, stream=side)
    y = np.full(8, hvd.rank() + 1, dtype=np.int64)
    hy = hvd.allreduce_async(y, name=f"nb.y.{completion}", op=hvd.Sum)
    got_y = hy.wait(timeout=30)
    # Y is done; X's producer (200 ms) is still spinning, so X cannot have finished.
    assert not side.done, "the producer finished before Y completed; the check proves nothing"
    if completion == "sync":
        assert not hx.poll(), "X completed before its input was written"
    np.testing.assert_array_equal(got_y, np.full(8, _expect_sum(hvd, lambda k: k + 1)))
    got_x = hx.wait()
    cupy.cuda.get_current_stream().synchronize()
    assert float(got_x.min()) == hvd.size()


@pytest.mark.usefixtures("async_completion")
def test_async_completion_wait_returns_before_device(hvd: Any) -> None:
    """With async completion on, wait() returns while the collective is still running on the
    device, and a consumer kernel on the caller's stream still reads the right result.

    The input is ready at the call (a producer still running would hold the collective back
    from negotiation, by design: see test_ready_collective_overtakes_unready_one), so the
    collective itself is made long: 512 MiB, about 2 ms of NCCL on the device."""
    one_ipc_step(hvd, 512 << 20, async_completion=True)
    n = 1 << 26
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.full(n, hvd.rank() + 1, dtype=cupy.float64)
        out = cupy.empty_like(x)
        stream.synchronize()
        t0 = time.perf_counter()
        h = hvd.allreduce_async(x, name="acw", op=hvd.Sum, out=out)
        deadline = t0 + 30
        while not h.poll() and time.perf_counter() < deadline:
            time.sleep(1e-5)
        enqueued_ms = (time.perf_counter() - t0) * 1e3
        assert h.poll(), "not enqueued within 30 s"
        t1 = time.perf_counter()
        got = h.wait()
        waited_us = (time.perf_counter() - t1) * 1e6
        (done,) = h._events
        pending = not done.done
        consumer = got * 2.0 + 1.0  # on `stream`, ordered after DONE by wait()
    stream.synchronize()
    print(f"[rank {hvd.rank()}] async: enqueued {enqueued_ms:.2f} ms after the call; wait() "
          f"then returned in {waited_us:.1f} us; collective still pending then: {pending}")
    assert pending, "wait() returned only after the device finished"
    want = _expect_sum(hvd, lambda k: k + 1)
    assert float(consumer.min()) == 2 * want + 1 and float(consumer.max()) == 2 * want + 1


def test_ready_collective_overtakes_unready_one(hvd: Any, completion: str) -> None:
    """Head-of-line (G7): A's producer spins 200 ms on a side stream; B, submitted after A,
    is ready at once. B's result is usable (its DONE complete) while A's producer still runs,
    in both completion modes, and both results are exact on every rank."""
    side = cupy.cuda.Stream(non_blocking=True)
    a = cupy.zeros(N, dtype=cupy.float64)
    b = cupy.full(N, float(hvd.rank() + 1), dtype=cupy.float64)
    cupy.cuda.get_current_stream().synchronize()
    slow_fill(a, 10.0 * (hvd.rank() + 1), ms=200, stream=side)
    ha = hvd.allreduce_async(a, name=f"hol.a.{completion}", op=hvd.Sum, stream=side)
    hb = hvd.allreduce_async(b, name=f"hol.b.{completion}", op=hvd.Sum)
    got_b = hb.wait()
    cupy.cuda.get_current_stream().synchronize()  # B usable on the host
    assert not side.done, "A's producer finished before B was usable: B waited behind A"
    assert float(got_b.min()) == float(got_b.max()) == _expect_sum(hvd, lambda k: k + 1)
    got_a = ha.wait()
    cupy.cuda.get_current_stream().synchronize()
    want_a = _expect_sum(hvd, lambda k: 10.0 * (k + 1))
    assert float(got_a.min()) == float(got_a.max()) == want_a


def test_wait_stream_orders_a_fresh_stream(hvd: Any, completion: str) -> None:
    side = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(N, dtype=cupy.float64)
    slow_fill(x, hvd.rank() + 1, ms=50, stream=side)
    h = hvd.allreduce_async(x, name=f"ws.{completion}", op=hvd.Sum, stream=side)
    consumer_stream = cupy.cuda.Stream(non_blocking=True)
    h.wait_stream(consumer_stream)
    with consumer_stream:
        y = h._result + 0.0 if h.poll() else None
    if y is None:  # sync mode, not yet complete: read through wait() instead
        got = h.wait()
        with consumer_stream:
            y = got + 0.0
    consumer_stream.synchronize()
    assert float(y.min()) == _expect_sum(hvd, lambda k: k + 1)


def test_then_runs_after_the_collective(hvd: Any, completion: str) -> None:
    side = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(N, dtype=cupy.float64)
    slow_fill(x, hvd.rank() + 1, ms=50, stream=side)
    h = hvd.allreduce_async(x, name=f"then.{completion}", op=hvd.Sum, stream=side)
    child = h.then(lambda r: r * 3.0)
    out = child.wait()
    cupy.cuda.get_current_stream().synchronize()
    assert float(out.min()) == 3 * _expect_sum(hvd, lambda k: k + 1)

    def boom(_: Any) -> None:
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        hvd.allreduce_async(cupy.ones(4), name=f"then-err.{completion}").then(boom).wait()


def test_torch_cuda_tensors(hvd: Any, completion: str) -> None:
    torch = import_torch()
    dev = torch.device("cuda", cupy.cuda.Device().id)
    t = torch.full((5, 3), float(hvd.rank() + 1), device=dev)
    got = hvd.allreduce(t, name=f"torch.{completion}", op=hvd.Sum)
    torch.cuda.current_stream(dev).synchronize()
    assert isinstance(got, torch.Tensor) and got.device == dev
    assert torch.all(got == _expect_sum(hvd, lambda k: k + 1))


@pytest.mark.parametrize("priority", ["high", "normal"])
def test_stream_priority_follows_the_knob(hvd: Any, priority: str) -> None:
    # Every stream hvdlite makes takes config.stream_priority: the device's greatest for high
    # (CUDA clamps the -1000 asked), 0 (DDP's default) for normal; results unchanged. The
    # device's range is CUDA's (-5 on an H200), not torch's priority_range (which stops at -3).
    from hvdlite._api import default_engine

    runtime = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python reads the range")
    device = cupy.cuda.runtime.getDevice()
    _, least, greatest = runtime.cudaDeviceGetStreamPriorityRange()
    want = greatest if priority == "high" else 0
    with reinit(hvd, stream_priority=priority):
        x = cupy.full(N, hvd.rank() + 1, dtype=cupy.int32)
        got = hvd.allreduce(x, op=hvd.Sum, name=f"prio.{priority}")
        cupy.cuda.get_current_stream().synchronize()
        assert (cupy.asnumpy(got) == int(_expect_sum(hvd, lambda k: k + 1))).all()
        gpu = default_engine().gpu_runtime()
        asked = cupy.cuda.runtime.streamGetPriority(gpu.context(device).stream.ptr)
        assert (gpu.priority, asked) == ({"high": -1000, "normal": 0}[priority], want), \
            f"stream priority range [{least}, {greatest}]"


def test_graph_captured_beside_work_in_flight(hvd: Any) -> None:
    # A CUDA graph captured on this thread in CUDA's global mode (torch.cuda.graph's default)
    # while hvdlite's background thread polls a collective still running: neither the capture
    # nor hvdlite may fail. In global mode the thread's event query would fail (and the
    # capture with it); hvdlite's thread is isolated from other threads' captures.
    torch = import_torch()
    pytest.importorskip("cuda.bindings", reason="cuda-python (pip install cuda-bindings) "
                        "isolates hvdlite's thread from other threads' captures")
    side = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(N, dtype=cupy.float64)
    slow_fill(x, hvd.rank() + 1, ms=400, stream=side)  # keeps the collective in flight
    h = hvd.allreduce_async(x, name="capture.beside", op=hvd.Sum, stream=side)
    a = torch.ones(1024, device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        b = a * 2
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode="global"
        b = a * 2
        time.sleep(0.2)  # hvdlite's cycles poll the collective meanwhile
        b = b + 1
    graph.replay()
    torch.cuda.synchronize()
    assert float(b.min()) == 3.0 and float(b.max()) == 3.0
    got = h.wait()
    cupy.cuda.get_current_stream().synchronize()
    want = _expect_sum(hvd, lambda k: k + 1)
    assert float(got.min()) == want and float(got.max()) == want
    again = hvd.allreduce(cupy.ones(8, dtype=cupy.float64), name="capture.after", op=hvd.Sum)
    assert float(again.sum()) == 8 * hvd.size()


def test_a_burst_waits_for_each_streams_own_producers(hvd: Any, completion: str) -> None:
    """READY events stand for one another only within one thread's stream (the latest of a
    stream covers the earlier ones: one event query and one stream wait per stream, not per
    tensor). Stream B's inputs, produced by a 150 ms spin, are submitted first; then a burst
    of 12 tensors on stream A, each produced by a short spin just before its call. A's
    completed READY events must not release B's: every result exact on every rank."""
    a_stream = cupy.cuda.Stream(non_blocking=True)
    b_stream = cupy.cuda.Stream(non_blocking=True)
    b = [cupy.zeros(N, dtype=cupy.float64) for _ in range(3)]
    a = [cupy.zeros(N, dtype=cupy.float64) for _ in range(12)]
    cupy.cuda.Device().synchronize()
    r = hvd.rank()
    handles = []
    for k, x in enumerate(b):
        slow_fill(x, 100.0 * (r + 1) + k, ms=150 if k == 0 else 1, stream=b_stream)
        handles.append(hvd.allreduce_async(x, name=f"burst.b{k}.{completion}", op=hvd.Sum,
                                           stream=b_stream))
    for k, x in enumerate(a):
        slow_fill(x, float(r + 1 + k), ms=0.2, stream=a_stream)
        handles.append(hvd.allreduce_async(x, name=f"burst.a{k}.{completion}", op=hvd.Sum,
                                           stream=a_stream))
    got = [h.wait() for h in handles]
    cupy.cuda.Device().synchronize()
    wants = [_expect_sum(hvd, lambda q, k=k: 100.0 * (q + 1) + k) for k in range(len(b))]
    wants += [_expect_sum(hvd, lambda q, k=k: q + 1 + k) for k in range(len(a))]
    for k, (g, want) in enumerate(zip(got, wants, strict=True)):
        assert float(g.min()) == float(g.max()) == want, (k, float(g.min()), want)
