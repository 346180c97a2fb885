"""The handles ``hvdlite.torch``'s asynchronous collectives return.

:class:`Handle` is the general one: core handles plus a function that turns their results
into what the caller gets (alltoall's pair, bfloat16 rounding, ...). The allreduce fast path
uses two leaner kinds that do no torch work at submission: :class:`InPlaceHandle` (the result
is the caller's own tensor or list) and :class:`FreshHandle` (the core's new output arrays,
seen as torch tensors at the first wait). On CUDA both order torch's current stream after the
collective before returning (asynchronous completion), as the core does for CuPy's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hvdlite._torchref import to_torch

__all__ = ["Handle", "InPlaceHandle", "FreshHandle", "SparseHandle"]


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


class InPlaceHandle(Handle):
    """One core collective whose result is ``value``: the caller's tensor (or list of
    tensors) written in place, or an output tensor the core wrote into. ``stream``: the CuPy
    object of torch's stream to order after the collective (asynchronous completion on
    CUDA), else None."""

    __slots__ = ("_part", "_value", "_stream")

    def __init__(self, part: Any, value: Any, stream: Any) -> None:
        self._part = part
        self._value = value
        self._stream = stream

    def poll(self) -> bool:
        """True once the collective has completed. Never blocks."""
        return bool(self._part.poll())

    def wait(self) -> Any:
        """Block until done and return the tensor(s) (raises the collective's error)."""
        part = self._part
        if self._stream is not None:
            part.wait_stream(self._stream)
        part.wait()
        return self._value

    synchronize = wait

    def wait_stream(self, stream: Any) -> Any:
        """The tensor(s), once ``stream`` (a CuPy stream object: torch's stream that will
        read them) is ordered after the collective: no host wait on the device in either
        completion mode (only, while it is still negotiated, for its enqueue). Host tensors:
        :meth:`wait`."""
        self._part.wait_stream(stream)
        return self._value


class FreshHandle(Handle):
    """One core collective with new outputs: its arrays become torch tensors (no copy) at the
    first wait, on the waiting thread; later waits return the same tensors. ``stream`` as for
    :class:`InPlaceHandle`; ``group``: the result is a list."""

    __slots__ = ("_part", "_value", "_stream", "_group")

    def __init__(self, part: Any, stream: Any, group: bool) -> None:
        self._part = part
        self._value: Any = None
        self._stream = stream
        self._group = group

    def poll(self) -> bool:
        """True once the collective has completed. Never blocks."""
        return bool(self._part.poll())

    def wait(self) -> Any:
        """Block until done and return the new tensor(s) (raises the collective's error)."""
        value = self._value
        if value is not None:
            return value
        part = self._part
        if self._stream is not None:
            part.wait_stream(self._stream)
        arrays = part.wait()
        if type(arrays) is np.ndarray:
            value = self._value = torch.from_numpy(arrays)
            return value
        # Two racing waiters may each build a view; both alias the same output.
        value = [to_torch(a) for a in arrays] if self._group else to_torch(arrays)
        self._value = value
        return value

    synchronize = wait


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
