"""Handle semantics for host work: completion from other threads, timeouts, failures, ``then``.

Handles are completed the way the background thread does it (``set_result`` / ``fail``),
from real threads, so the waits below really block and wake.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from hvdlite._handles import Handle
from hvdlite.errors import MismatchError, ShutdownError

WAIT_S = 10.0  # upper bound for waits that must succeed; never reached when things work


def later(fn: Callable[[], Any], delay_s: float = 0.02) -> threading.Thread:
    """Run ``fn`` on a new thread after ``delay_s``; the caller joins the thread."""

    def run() -> None:
        time.sleep(delay_s)
        fn()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_poll_false_until_done_then_true() -> None:
    h = Handle("a")
    assert not h.poll() and not h.done()
    assert "pending" in repr(h)
    thread = later(lambda: h.set_result(42))
    assert h.wait(WAIT_S) == 42
    thread.join()
    assert h.poll() and h.done()
    assert h.exception() is None
    assert repr(h) == "<hvdlite.Handle 'a' done>"
    assert h.wait() == 42  # waiting again returns the same result
    assert h.synchronize() == 42


def test_grouped_call_is_one_result() -> None:
    """A grouped call is one collective: its handle's result is the list, set once."""
    h = Handle("g")
    assert not h.poll()
    thread = later(lambda: h.set_result(["a", "b", "c"]))
    assert h.wait(WAIT_S) == ["a", "b", "c"]
    thread.join()


def test_wait_timeout_then_completion() -> None:
    h = Handle("slow")
    with pytest.raises(TimeoutError, match="'slow' did not complete in 0.05 s"):
        h.wait(timeout=0.05)
    assert not h.poll()
    with pytest.raises(TimeoutError):
        h.exception(timeout=0.01)
    thread = later(lambda: h.set_result("late"))
    assert h.wait(WAIT_S) == "late"
    thread.join()


def test_failure_makes_wait_raise() -> None:
    h = Handle("m")
    err = MismatchError("tensor 'm.1': dtype differs across ranks")
    thread = later(lambda: h.fail(err))
    with pytest.raises(MismatchError) as info:
        h.wait(WAIT_S)
    thread.join()
    assert info.value is err
    assert h.poll()
    assert h.exception() is err
    assert repr(h) == "<hvdlite.Handle 'm' failed>"
    h.set_result("too late")  # ignored once failed
    with pytest.raises(MismatchError):
        h.wait()


def test_completion_after_success_is_ignored() -> None:
    h = Handle("s")
    h.set_result(1)
    h.fail(ShutdownError("gone"))
    h.set_result(2)
    assert h.wait() == 1
    assert h.exception() is None


def test_exception_waits_for_completion() -> None:
    h = Handle("e")
    err = ShutdownError("hvdlite was shut down")
    thread = later(lambda: h.fail(err))
    assert h.exception(WAIT_S) is err
    thread.join()


def test_many_waiters_all_wake() -> None:
    h = Handle("many")
    results: list[Any] = []
    lock = threading.Lock()

    def waiter() -> None:
        value = h.wait(WAIT_S)
        with lock:
            results.append(value)

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    h.set_result("x")
    for t in threads:
        t.join(WAIT_S)
    assert results == ["x"] * 4


def test_then_on_host_handle() -> None:
    h = Handle("t")
    child = h.then(lambda v: v * 2)
    assert child.name == "t.then"
    assert not child.poll()
    h.set_result(21)
    assert child.wait(WAIT_S) == 42


def test_then_chains() -> None:
    h = Handle("t2")
    grand = h.then(sum).then(lambda v: v + 1)
    h.set_result([3, 4])
    assert grand.wait(WAIT_S) == 8


def test_then_propagates_fn_exception() -> None:
    h = Handle("t3")

    def boom(value: Any) -> Any:
        raise ValueError(f"bad value {value}")

    child = h.then(boom)
    h.set_result(5)
    with pytest.raises(ValueError, match="bad value 5"):
        child.wait(WAIT_S)
    assert isinstance(child.exception(), ValueError)


def test_then_propagates_collective_failure() -> None:
    h = Handle("t4")
    calls: list[Any] = []
    child = h.then(calls.append)
    err = MismatchError("tensor 't4': shape differs")
    h.fail(err)
    assert child.exception(WAIT_S) is err
    assert calls == []


def test_wait_stream_on_host_handle_waits() -> None:
    h = Handle("ws")
    thread = later(lambda: h.set_result("v"), 0.05)
    h.wait_stream()
    assert h.poll()
    thread.join()


def test_wait_stream_raises_failure() -> None:
    h = Handle("ws3")
    thread = later(lambda: h.fail(ShutdownError("down")))
    with pytest.raises(ShutdownError, match="down"):
        h.wait_stream()
    thread.join()


class _DoneEvent:
    """Stands in for a DONE event in the handle's own protocol (no device involved): it only
    records which thread waited on it."""

    def __init__(self) -> None:
        self.waited_by: list[str] = []

    def synchronize(self) -> None:
        self.waited_by.append(threading.current_thread().name)


def _sync_device_handle() -> Handle:
    h = Handle("dev")
    h.attach_device(lambda handle, stream: None, False, 0)  # as _prepare_device, sync mode
    return h


@pytest.mark.timeout(10)  # a regression here is a hang
def test_sync_device_wait_completes_on_the_waiting_thread() -> None:
    """The loop enqueues after wait() began (the usual case for a small collective) and hands
    over a completion; the waiter runs it itself instead of waiting for retirement."""
    h = _sync_device_handle()
    ev = _DoneEvent()
    ran_on: list[str] = []

    def complete() -> None:
        ran_on.append(threading.current_thread().name)
        h.set_result("result")

    def loop_enqueues() -> None:  # what GpuRuntime.complete does for sync completion
        h.enqueued((ev,), complete)

    t = later(loop_enqueues, 0.05)
    assert h.wait() == "result"
    t.join(WAIT_S)
    me = threading.current_thread().name
    assert ev.waited_by == [me] and ran_on == [me]


@pytest.mark.timeout(10)
def test_sync_device_wait_raises_failure_before_enqueue() -> None:
    h = _sync_device_handle()
    t = later(lambda: h.fail(MismatchError("tensor 'dev': shapes differ")))
    with pytest.raises(MismatchError, match="shapes differ"):
        h.wait()
    t.join(WAIT_S)


@pytest.mark.timeout(10)
def test_sync_device_wait_with_timeout_leaves_completion_to_others() -> None:
    """With a timeout the waiter does not block on DONE itself; retirement's completion
    (here: another thread) wakes it."""
    h = _sync_device_handle()
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.01)
    t = later(lambda: h.set_result(7))
    assert h.wait(timeout=WAIT_S) == 7
    t.join(WAIT_S)


# -- derived handles (a frontend's result made from several collectives) ------------------


def test_derived_resolves_from_its_parts_once() -> None:
    """Its function runs once, on the waiting thread, on every part's result, in order."""
    a, b = Handle("a"), Handle("b")
    calls: list[list[Any]] = []

    def finish(results: list[Any]) -> Any:
        calls.append(results)
        return (results[1], results[0])

    h = Handle.derived("pair", [a, b], finish)
    assert type(h) is Handle and h.name == "pair"
    assert not h.poll() and "pending" in repr(h)
    thread = later(lambda: (a.set_result("x"), b.set_result("y")))
    assert h.wait(WAIT_S) == ("y", "x")
    thread.join()
    assert h.poll() and h.wait() == ("y", "x") and h() == ("y", "x")
    assert calls == [["x", "y"]]


def test_derived_poll_asks_the_parts_and_the_wait_computes() -> None:
    """poll runs no function (on a device its work belongs on the waiter's stream)."""
    a, b = Handle("a"), Handle("b")
    calls: list[int] = []
    h = Handle.derived("d", [a, b], lambda r: calls.append(1) or r[0] + r[1])
    a.set_result(1)
    assert not h.poll()  # b pending
    b.set_result(2)
    assert h.poll() and h.done() and calls == []
    assert repr(h) == "<hvdlite.Handle 'd' done>" and h.wait() == 3 and calls == [1]


def test_derived_many_waiters_one_result() -> None:
    parts = [Handle(f"p{i}") for i in range(3)]
    calls: list[int] = []
    h = Handle.derived("many", parts, lambda r: calls.append(1) or sum(r))
    got: list[Any] = []
    waiters = [threading.Thread(target=lambda: got.append(h.wait(WAIT_S))) for _ in range(6)]
    for t in waiters:
        t.start()
    thread = later(lambda: [p.set_result(i + 1) for i, p in enumerate(parts)])
    for t in [*waiters, thread]:
        t.join(WAIT_S)
    assert got == [6] * 6 and calls == [1]


def test_derived_timeout_then_completion() -> None:
    a = Handle("a")
    h = Handle.derived("slow pair", [a], lambda r: r[0] * 2)
    with pytest.raises(TimeoutError, match="'slow pair' did not complete in 0.05 s"):
        h.wait(timeout=0.05)
    a.set_result(21)
    assert h.wait(WAIT_S) == 42


def test_derived_carries_a_parts_failure_to_every_wait() -> None:
    a, b = Handle("a"), Handle("b")
    h = Handle.derived("d", [a, b], lambda r: pytest.fail("finish ran after a failure"))
    a.set_result(1)
    b.fail(MismatchError("b: shapes differ across ranks"))
    for _ in range(2):
        with pytest.raises(MismatchError, match="shapes differ"):
            h.wait(WAIT_S)
    assert h.poll() and isinstance(h.exception(), MismatchError)
    assert "failed" in repr(h)


def test_derived_function_error_is_the_handles_error() -> None:
    a = Handle("a")
    a.set_result(1)
    h = Handle.derived("bad", [a], lambda r: {}["missing"])
    with pytest.raises(KeyError):
        h.wait(WAIT_S)
    with pytest.raises(KeyError):
        h()


def test_derived_then_and_wait_stream() -> None:
    a = Handle("a")
    h = Handle.derived("d", [a], lambda r: r[0] + 1)
    child = h.then(lambda v: v * 10)
    thread = later(lambda: a.set_result(4))
    h.wait_stream(None)  # host parts: waits
    assert child.wait(WAIT_S) == 50
    thread.join()


class _Alarm(BaseException):
    """What a signal handler raises in the waiting thread (as pytest-timeout's does)."""


def test_an_interrupt_abandons_a_derived_wait_and_nothing_else() -> None:
    """A signal handler's exception in the waiting thread ends that wait only: the handle
    stays pending, and the next wait gets the result."""
    import signal

    def alarm(*_: object) -> None:
        raise _Alarm

    a = Handle("a")
    h = Handle.derived("interrupted", [a], lambda r: r[0] + 1)
    before = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(_Alarm):
            h.wait(WAIT_S)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert not h.poll() and "pending" in repr(h)
    a.set_result(1)
    assert h.wait(WAIT_S) == 2 and h.exception() is None
