"""The one handle type every asynchronous collective returns."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Handle"]

_SPIN_S = 50e-6  # hot poll in wait() before blocking

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
    """The pending result of one collective (or one group of them).

    Every ``*_async`` function returns a ``Handle``. It completes once the background thread
    has executed the collective on every part of the request; its result is the output array
    (a list of arrays for grouped calls, the last joined rank for :func:`hvdlite.join`).

    Thread-safety: any thread may poll or wait on a handle; it is completed by hvdlite's own
    threads. GPU semantics (``wait_stream``, ``then``, asynchronous completion) are described
    on those methods.
    """

    __slots__ = (
        "name",
        "_as_list",
        "_async",
        "_completions",
        "_device",
        "_unenqueued",
        "_cond",
        "_events",
        "_exc",
        "_keep",
        "_remaining",
        "_results",
        "_waiter",
    )

    def __init__(self, name: str, parts: int = 1, as_list: bool = False) -> None:
        self.name = name
        self._as_list = as_list
        self._cond = threading.Condition(threading.Lock())
        self._remaining = parts
        self._unenqueued = parts  # parts whose device work is not yet enqueued
        self._async = False  # device handle completing at enqueue (async completion)
        self._device = -1  # CUDA device of a device handle
        # Sync completion of device work: callables that complete the parts once the DONE
        # events finished. The finalizer runs them, or the waiting caller does first.
        self._completions: list[Any] = []
        self._results: list[Any] = [None] * parts
        self._exc: BaseException | None = None
        # Completion events (one per device) when the work was only enqueued on a device.
        self._events: list[Any] = []
        # Objects that must stay alive until the device finished with them (inputs, buffers).
        self._keep: list[Any] = []
        # Set by the GPU layer: makes the device side of `wait` happen (CPU block or stream wait).
        self._waiter: Callable[[Handle, Any], None] | None = None

    # -- completion, called by hvdlite's threads ------------------------------------------
    def _enqueued(self, events: Sequence[Any]) -> None:
        """One part's device work is enqueued; ``events`` complete when it has run."""
        with self._cond:
            self._events.extend(events)
            self._unenqueued -= 1
            if self._unenqueued == 0:
                self._cond.notify_all()

    def _is_enqueued(self) -> bool:
        return self._unenqueued <= 0 or self._remaining <= 0

    def _set_part(self, index: int, value: Any, events: Sequence[Any] = ()) -> None:
        with self._cond:
            if self._remaining <= 0:
                return
            self._results[index] = value
            self._events.extend(events)
            self._remaining -= 1
            if self._remaining == 0:
                self._cond.notify_all()

    def _set_parts(self, parts: Sequence[tuple[int, Any]]) -> None:
        """Several parts at once (one bucket's members of a grouped call): one lock trip."""
        with self._cond:
            if self._remaining <= 0:
                return
            for index, value in parts:
                self._results[index] = value
            self._remaining -= len(parts)
            if self._remaining <= 0:
                self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._remaining <= 0:
                return
            self._exc = exc
            self._remaining = 0
            self._keep.clear()
            self._cond.notify_all()

    # -- public -------------------------------------------------------------------------
    def poll(self) -> bool:
        """True once the handle completed (successfully or not). Never blocks."""
        return self._remaining <= 0

    done = poll

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective completed and return its result.

        Raises the collective's :class:`hvdlite.HvdliteError` if it failed, and ``TimeoutError``
        if ``timeout`` seconds pass first (the work goes on; wait again later). For device
        arrays with asynchronous completion on, this returns once the work is enqueued and the
        caller's current stream is ordered after it (no CPU block on the device).
        """
        # Sync completion of device work: wait for the DONE events on this thread rather than
        # for the finalizer to do it and wake us (one thread hand-off less). Decided by the
        # handle's kind: the loop attaches the completions only once the work is enqueued.
        here = self._device >= 0 and not self._async and timeout is None
        ready = self._is_enqueued if here else self.poll
        if not ready():
            # A short hot poll first: a condition-variable wake-up costs tens of microseconds.
            until = time.perf_counter() + _SPIN_S
            while not ready() and time.perf_counter() < until:
                os.sched_yield()
        if here and not self.poll():
            self._complete_here()
        with self._cond:
            if not self._cond.wait_for(self.poll, timeout):
                raise TimeoutError(f"collective {self.name!r} did not complete in {timeout} s")
        if self._exc is not None:
            raise self._exc
        if self._waiter is not None:
            self._waiter(self, None)
        return self._results if self._as_list else self._results[0]

    synchronize = wait

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the caller's current stream) wait for this collective.

        Never waits for the device: it returns as soon as the collective has been enqueued on
        hvdlite's stream (a short CPU wait while it is still being negotiated), after a
        ``cudaStreamWaitEvent`` on its DONE events; work the caller then puts on ``stream``
        sees the result. On host tensors it is :meth:`wait` without a return value.
        """
        with self._cond:
            self._cond.wait_for(self._is_enqueued)
        if self._exc is not None:
            raise self._exc
        if self._waiter is None:
            self.wait()
            return
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
        child._waiter, child._async, child._device = self._waiter, self._async, self._device
        _callbacks().put((self, fn, child))
        return child

    def _run_then(self, fn: Callable[[Any], Any], child: Handle) -> None:
        try:
            if self._waiter is None:
                child._set_part(0, fn(self.wait()))
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
            child._enqueued((done,))
            if not self._async:
                done.synchronize()
            child._set_part(0, out)
        except BaseException as exc:  # noqa: BLE001 - delivered through the child handle
            child._fail(exc)

    def _complete_here(self) -> None:
        """Sync completion: wait for the DONE events on this thread and complete the parts
        here, instead of waiting for the finalizer thread to do it and then wake us (one
        thread hand-off saved on every blocking device collective)."""
        with self._cond:
            self._cond.wait_for(self._is_enqueued)
        if self.poll():
            return
        for event in list(self._events):
            event.synchronize()  # CuPy releases the GIL while it waits
        for completion in list(self._completions):
            completion()

    def _result_without_stream_wait(self) -> Any:
        """The result, without ``wait``'s stream wait on the calling thread's current stream
        (``then`` orders its own side stream instead)."""
        with self._cond:
            self._cond.wait_for(self.poll)
        if self._exc is not None:
            raise self._exc
        return self._results if self._as_list else self._results[0]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait like :meth:`wait`, then return the failure (``None`` on success)."""
        with self._cond:
            if not self._cond.wait_for(self.poll, timeout):
                raise TimeoutError(f"collective {self.name!r} did not complete in {timeout} s")
        return self._exc

    def __repr__(self) -> str:
        state = "pending" if not self.poll() else ("failed" if self._exc else "done")
        return f"<hvdlite.Handle {self.name!r} {state}>"
