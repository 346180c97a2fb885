"""The handles of ``hvdlite.torch`` collectives whose result is derived from the core's.

An allreduce returns the core's own :class:`hvdlite.Handle` (its result is the torch tensor
itself). :class:`Handle` here serves the rest: core handles plus a function that turns their
results into what the caller gets (alltoall's pair, bfloat16 rounding, raw views of dtypes
NumPy cannot hold, a sparse tensor rebuilt from its gathers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Handle", "SparseHandle"]


class Handle:
    """The pending result of a ``hvdlite.torch`` asynchronous collective.

    Pass it to :func:`~hvdlite.torch.poll` / :func:`~hvdlite.torch.synchronize` (or call
    ``handle.poll()`` / ``handle.wait()``). The result is computed once; later waits return
    it again.
    """

    __slots__ = ("_parts", "_finish", "_done", "_result", "_lock")

    def __init__(self, parts: Sequence[Any], finish: Callable[[list[Any]], Any]) -> None:
        self._parts = list(parts)
        self._finish = finish
        self._done = False
        self._result: Any = None
        self._lock = threading.Lock()

    def poll(self) -> bool:
        """True once every underlying collective has completed. Never blocks."""
        return self._done or all(p.poll() for p in self._parts)

    def wait(self) -> Any:
        """Block until done and return the result (raises the collective's error)."""
        with self._lock:
            if not self._done:
                results = [p.wait() for p in self._parts]
                self._result = self._finish(results)
                self._done = True
                self._parts = []
            return self._result

    synchronize = wait

    def wait_stream(self, stream: Any) -> Any:
        """The result with work on ``stream`` (a CuPy stream object) ordered after the
        collective. Here: :meth:`wait` (results made on the host need the host)."""
        return self.wait()


class SparseHandle:
    """The result of :func:`~hvdlite.torch.sparse_allreduce_async`: call it (``handle()``) to
    wait and get the reduced sparse tensor, as with Horovod; ``poll``/``synchronize`` work
    too."""

    __slots__ = ("_handle",)

    def __init__(self, handle: Handle) -> None:
        self._handle = handle

    def __call__(self) -> torch.Tensor:
        return self._handle.wait()

    def poll(self) -> bool:
        """True once the gathers completed."""
        return self._handle.poll()

    def wait(self) -> torch.Tensor:
        """Same as calling the handle."""
        return self._handle.wait()

    synchronize = wait
