"""The one handle type every asynchronous collective returns.

A handle moves through three states, each set once, by named methods:

    pending --resolve--> resolved --finish--> done

*resolved* is when the background side is through with it: the result is set (host work, or
device work with async completion), the collective failed, or its device work is enqueued and
a DONE event attached (device work, sync completion). *done* follows at once except in that
last case, where it comes when DONE has completed on the device: the waiting thread
synchronises on DONE itself (no hand-off through another thread), or a poll or the engine's
retirement of finished device work does.

The hand-off from the thread that resolves to the thread that waits is one ``threading.Lock``
used as a gate (made held by the first thread that must block, released once at resolve): a
C-level acquire with the GIL released, several times cheaper than a ``Condition``. In the steady
state no gate is ever made: ``wait`` lets the scheduler run the pending cycle on the waiting
thread first (progress on wait, ``_control/scheduler.py``), which resolves the handle itself.
Bookkeeping of every handle shares one module lock: completions run inside cycles, one at a
time, so it is never contended there, and a lock per handle would cost an allocation per call.

A frontend whose result is made from several core collectives (alltoall's pair, a sparse
tensor rebuilt from two gathers, a bfloat16 result rounded back) returns the same type, made by
:meth:`Handle.derived`: it resolves on the first thread that waits for it, by applying the
frontend's function to its parts' results there.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Handle"]

# The empty list every handle starts with for its events and completions; they
# are replaced, never appended to, so one shared empty list saves two allocations per call.
_NONE: list[Any] = []

_BOOK = threading.Lock()  # every handle's completion bookkeeping (see the module docstring)
_callback_queue: queue.SimpleQueue[tuple[Handle, Callable[[Any], Any], Handle]] | None = None
_callback_lock = threading.Lock()


def _callbacks() -> queue.SimpleQueue[tuple[Handle, Callable[[Any], Any], Handle]]:
    """The queue of ``then`` callbacks, served by one daemon thread started on first use."""
    global _callback_queue
    with _callback_lock:
        if _callback_queue is None:
            q: queue.SimpleQueue[tuple[Handle, Callable[[Any], Any], Handle]] = (
                queue.SimpleQueue())

            def serve() -> None:
                while True:
                    parent, fn, child = q.get()
                    parent._run_then(fn, child)

            threading.Thread(target=serve, name="hvdlite-callbacks", daemon=True).start()
            _callback_queue = q
        return _callback_queue


class Handle:
    """The pending result of one collective (a grouped call is one collective).

    Every ``*_async`` function returns a ``Handle``. Its result is the output array (a list of
    arrays for grouped calls, the last joined rank for :func:`hvdlite.join`).

    Thread-safety: any thread may poll or wait on a handle; it is completed by hvdlite's own
    threads (or by the waiting thread itself, which may run the engine's pending cycle). GPU
    semantics (``wait_stream``, ``then``, asynchronous completion) are described on those
    methods.
    """

    __slots__ = (
        "name",
        "_async",
        "_completions",
        "_derive",
        "_device",
        "_done",
        "_driver",
        "_events",
        "_exc",
        "_gate",
        "_ready",
        "_resolved",
        "_result",
        "_waiter",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self._gate: threading.Lock | None = None  # made by the first thread that must block
        self._resolved = False
        self._done = False
        self._result: Any = None
        self._exc: BaseException | None = None
        # Device work: DONE events, the callables that complete the handle once DONE finished
        # (sync completion; whoever runs one first wins), the device, and the stream waiter.
        self._events: list[Any] = _NONE
        self._completions: list[Callable[[], None]] = _NONE
        self._async = False
        self._device = -1
        self._ready: Any = None  # the READY event of a device call (all its tensors share it)
        self._waiter: Callable[[Handle, Any], None] | None = None
        # The engine's progress function: runs pending cycles on a thread that would block.
        self._driver: Callable[[Handle], None] | None = None
        # A derived handle's parts, its function of their results, and the lock that runs it
        # once (see derived); None for a collective's own handle.
        self._derive: tuple[list[Handle], Callable[[list[Any]], Any], threading.Lock] | None = None

    @classmethod
    def derived(cls, name: str, parts: Sequence[Handle],
                finish: Callable[[list[Any]], Any]) -> Handle:
        """A handle whose result is ``finish([part.wait() for part in parts])``.

        For frontends whose result is made from core collectives' results (alltoall's
        output and splits, a sparse tensor from its gathers, a dtype NumPy cannot hold). Never
        blocks. ``finish`` runs once, on the first thread that waits for the handle, after the
        parts' waits there (device parts order that thread's current stream, as their own
        ``wait`` does, so ``finish``'s work on it sees their results); ``poll`` only asks the
        parts. Later waits return the same result. A part's error, or one raised by ``finish``, is
        the handle's error, raised by every later wait; an interrupt of the waiting thread
        (``KeyboardInterrupt``, a signal handler's exception) abandons only that wait.
        """
        handle = cls(name)
        handle._derive = (list(parts), finish, threading.Lock())
        return handle

    # -- set up by the collective at submission ------------------------------------------
    def attach_device(self, waiter: Callable[[Handle, Any], None], async_completion: bool,
                      device: int, ready: Any = None) -> None:
        """Mark this a device handle: ``waiter`` orders a stream after the DONE events;
        ``ready`` is the READY event recorded for its inputs."""
        self._waiter, self._async, self._device = waiter, async_completion, device
        self._ready = ready

    # -- completion, called by hvdlite's threads -----------------------------------------
    def set_result(self, value: Any, events: Sequence[Any] = ()) -> None:
        """The result (ignored once done or failed). ``events`` (device work, async
        completion): DONE events attached in the same step, so no waiter sees the result
        before it can order its stream after them."""
        with _BOOK:
            if self._done:
                return
            self._result = value
            if events:
                self._events = [*self._events, *events]
            self._done = True
            self._driver = None
            gate = None if self._resolved else self._gate
            self._resolved = True
        if gate is not None:
            gate.release()

    def enqueued(self, events: Sequence[Any], completion: Callable[[], None]) -> None:
        """Sync device completion: the work is enqueued, ``events`` complete when it has run,
        and ``completion`` then sets the result (whoever runs it first)."""
        with _BOOK:
            if self._done:
                return
            self._events = [*self._events, *events]
            self._completions = [*self._completions, completion]
            if self._resolved:
                return
            self._resolved = True
            self._driver = None
            gate = self._gate
        if gate is not None:
            gate.release()

    def fail(self, exc: BaseException) -> None:
        """The collective failed: every waiter raises ``exc``. Ignored once done."""
        with _BOOK:
            if self._done:
                return
            self._exc = exc
            self._done = True
            self._driver = None
            gate = None if self._resolved else self._gate
            self._resolved = True
        if gate is not None:
            gate.release()

    # -- public ---------------------------------------------------------------------------
    def poll(self) -> bool:
        """True once the handle completed (successfully or not). Never blocks.

        For device work with sync completion, true once the DONE events have completed on
        the device (checked with a non-blocking event query)."""
        if self._done:
            return True
        derive = self._derive
        if derive is not None:  # its function runs in a wait, on the waiter's stream
            return all(p.poll() for p in derive[0])
        if self._resolved and all(e.done for e in self._events):
            self._finish()
            return True
        return False

    done = poll

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective completed and return its result.

        Raises the collective's :class:`hvdlite.HvdliteError` if it failed, and ``TimeoutError``
        if ``timeout`` seconds pass first (the work goes on; wait again later). While the
        collective is pending, the calling thread may run hvdlite's pending negotiation cycle
        itself instead of waiting for the background thread to do it (one thread hand-off
        less). For device arrays with asynchronous completion on, this returns once the work
        is enqueued and the caller's current stream is ordered after it (no CPU block on the
        device); with sync completion, it blocks until the device has finished.
        """
        self._await_resolved(timeout)
        if not self._done:
            self._finish()
        if self._exc is not None:
            raise self._exc
        if self._async and self._waiter is not None:
            # Sync completion needs no stream wait: DONE has completed on the device.
            self._waiter(self, None)
        return self._result

    synchronize = wait

    def _await_resolved(self, timeout: float | None) -> None:
        if self._resolved:
            return
        if self._derive is not None:
            self._join(timeout)
            return
        driver = self._driver
        if driver is not None and timeout is None:
            driver(self)
            if self._resolved:
                return
        with _BOOK:
            if self._resolved:
                return
            gate = self._gate
            if gate is None:
                gate = self._gate = threading.Lock()
                gate.acquire()  # released once, at resolve
        if not gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise TimeoutError(f"collective {self.name!r} did not complete in {timeout} s")
        gate.release()  # let every other waiter through too

    def _join(self, timeout: float | None) -> None:
        """Resolve a derived handle: wait for its parts (on this thread, outside the lock, so
        concurrent waiters each wait), then run its function once."""
        derive = self._derive
        if derive is None:  # another thread resolved it meanwhile
            return
        parts, finish, lock = derive
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list[Any] = []
        error: BaseException | None = None
        for part in parts:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                results.append(part.wait(left))
            except Exception as exc:  # the part's error is this handle's; an interrupt
                # (KeyboardInterrupt, a signal handler's exception) only abandons this wait
                if isinstance(exc, TimeoutError) and left is not None:
                    raise TimeoutError(f"collective {self.name!r} did not complete in "
                                       f"{timeout} s") from None
                error = exc
                break
        with lock:
            if self._resolved:
                return
            try:
                if error is not None:
                    raise error
                value = finish(results)
            except Exception as exc:  # delivered to every waiter
                self.fail(exc)
            else:
                self.set_result(value)
            self._derive = None

    def _finish(self) -> None:
        """Sync completion of device work, on this thread: wait for DONE (CuPy releases the
        GIL), then complete the handle (a no-op if retirement got there first)."""
        for event in list(self._events):
            event.synchronize()
        for completion in list(self._completions):
            completion()

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the caller's current stream) wait for this collective.

        Never waits for the device: it returns as soon as the collective has been enqueued on
        hvdlite's stream (a short CPU wait while it is still being negotiated), after a
        ``cudaStreamWaitEvent`` on its DONE events; work the caller then puts on ``stream``
        sees the result. On host tensors it is :meth:`wait` without a return value.
        """
        if self._waiter is None:
            self.wait()
            return
        self._await_resolved(None)
        if self._exc is not None:
            raise self._exc
        self._waiter(self, stream)

    def then(self, fn: Callable[[Any], Any]) -> Handle:
        """Run ``fn(result)`` after this collective; return a handle for ``fn``'s result.

        ``fn`` runs on hvdlite's callback thread. For device tensors it runs with a side
        stream current that is ordered after the collective (seed: a CUDA-aware future), so
        kernels it launches see the result without a CPU wait; the new handle's completion
        covers that work, with the same completion mode as this one. An exception in ``fn``
        (or in this collective) becomes the new handle's error.
        """
        child = Handle(f"{self.name}.then")
        if self._waiter is not None:
            child.attach_device(self._waiter, self._async, self._device)
        _callbacks().put((self, fn, child))
        return child

    def _run_then(self, fn: Callable[[Any], Any], child: Handle) -> None:
        try:
            if self._waiter is None:
                child.set_result(fn(self.wait()))
                return
            import cupy

            value = self.wait() if not self._async else self._result_without_stream_wait()
            with cupy.cuda.Device(self._device):  # this thread's current device may differ
                stream = cupy.cuda.Stream(non_blocking=True)
                self._waiter(self, stream)
                with stream:
                    out = fn(value)
                done = cupy.cuda.Event(block=False, disable_timing=True)
                done.record(stream)
            if self._async:
                child.set_result(out, (done,))
            else:
                child.enqueued((done,), lambda: child.set_result(out))
        except BaseException as exc:  # noqa: BLE001 - delivered through the child handle
            child.fail(exc)

    def _result_without_stream_wait(self) -> Any:
        """The result, without ``wait``'s stream wait on the calling thread's current stream
        (``then`` orders its own side stream instead)."""
        self._await_resolved(None)
        if self._exc is not None:
            raise self._exc
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait like :meth:`wait`, then return the failure (``None`` on success)."""
        self._await_resolved(timeout)
        if not self._done:
            self._finish()
        return self._exc

    def __call__(self) -> Any:
        """:meth:`wait` (Horovod's ``sparse_allreduce_async`` returns a callable)."""
        return self.wait()

    def __repr__(self) -> str:
        state = "pending" if not self.poll() else ("failed" if self._exc else "done")
        return f"<hvdlite.Handle {self.name!r} {state}>"
