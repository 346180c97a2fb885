"""The one handle type every asynchronous collective returns."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Handle"]


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
        self._results: list[Any] = [None] * parts
        self._exc: BaseException | None = None
        # Completion events (one per device) when the work was only enqueued on a device.
        self._events: list[Any] = []
        # Objects that must stay alive until the device finished with them (inputs, buffers).
        self._keep: list[Any] = []
        # Set by the GPU layer: makes the device side of `wait` happen (CPU block or stream wait).
        self._waiter: Callable[[Handle, Any], None] | None = None

    # -- completion, called by hvdlite's threads ------------------------------------------
    def _set_part(self, index: int, value: Any, events: Sequence[Any] = ()) -> None:
        with self._cond:
            if self._remaining <= 0:
                return
            self._results[index] = value
            self._events.extend(events)
            self._remaining -= 1
            if self._remaining == 0:
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
        with self._cond:
            if not self._cond.wait_for(self.poll, timeout):
                raise TimeoutError(f"collective {self.name!r} did not complete in {timeout} s")
        if self._exc is not None:
            raise self._exc
        if self._waiter is not None:
            self._waiter(self, None)
        return self._results if self._as_list else self._results[0]

    synchronize = wait

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait like :meth:`wait`, then return the failure (``None`` on success)."""
        with self._cond:
            if not self._cond.wait_for(self.poll, timeout):
                raise TimeoutError(f"collective {self.name!r} did not complete in {timeout} s")
        return self._exc

    def __repr__(self) -> str:
        state = "pending" if not self.poll() else ("failed" if self._exc else "done")
        return f"<hvdlite.Handle {self.name!r} {state}>"
