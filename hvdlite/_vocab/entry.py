"""One rank's pending work item: the request it sent plus everything needed to run it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hvdlite._handles import Handle
from hvdlite._vocab.messages import Request

__all__ = ["Entry", "finish_all"]


class Entry:
    """A submitted tensor (or grouped call) on this rank, from enqueue until its handle
    completes.

    ``array`` is the input as a NumPy (host) or CuPy (device) array; ``device_id`` its CUDA
    device (-1: host); ``to_user`` turns a result array back into the caller's framework type
    (None: it already is one). ``output`` is preallocated when its shape is known at the call
    (allreduce, broadcast) and is the input itself for in-place calls; otherwise the backend
    allocates it. ``user`` is the caller's own object to hand back (in place or ``out=``), else
    None. ``ready`` is the device event recorded on the caller's stream at enqueue;
    ``ready_mark`` says where: (the stream's handle, its device, the recording thread, a
    sequence number that grows with every record), so that of two READY events one thread
    recorded on one stream the later one stands for both (stream order); ``ready_done`` is set
    once negotiation saw it complete (its producer has finished, so hvdlite's stream need not
    wait on it).

    A grouped call is one entry (one *unit*): ``members`` are its input arrays, ``outputs``
    their result arrays (the inputs when in place), ``span`` one flat array over all outputs
    when they lie end to end in one buffer (hvdlite's own result buffer, or the caller's
    bucket layout), else None; ``array`` is the first member and ``output`` is None.
    """

    __slots__ = ("request", "array", "output", "handle", "enqueued_at", "ready",
                 "user", "stats", "channel", "device_id", "to_user", "members", "outputs",
                 "span", "size", "ready_done", "ready_mark")

    def __init__(self, request: Request, array: Any, output: Any, handle: Handle,
                 user: Any = None, device_id: int = -1,
                 to_user: Callable[[Any], Any] | None = None) -> None:
        self.request = request
        self.array = array
        self.output = output
        self.handle = handle
        self.user = user
        self.device_id = device_id
        self.to_user = to_user
        self.enqueued_at = 0.0
        self.ready: Any = None
        self.ready_done = False
        self.ready_mark: tuple[int, int, int, int] | None = None
        self.stats: Any = None  # the engine's Stats, fed at completion
        self.channel: Any = None  # the process set's Channel it was submitted on
        self.members: list[Any] | None = None
        self.outputs: list[Any] | None = None
        self.span: Any = None
        self.size = -1  # payload bytes of a unit (known from its lane)

    def finish(self, value: Any) -> None:
        """Complete this entry's handle with ``value`` (host work, barrier, join)."""
        if self.stats is not None:
            self.stats.record_op(self.request.kind.name.lower(), self.nbytes(),
                                 time.perf_counter() - self.enqueued_at)
        self.handle.set_result(self.user_value(value))

    def nbytes(self) -> int:
        """Payload bytes of this rank's tensor(s) (0 for barrier and join)."""
        if self.size >= 0:
            return self.size
        return self.array.nbytes if self.array is not None else 0

    def user_value(self, value: Any) -> Any:
        if self.user is not None:  # in place or out=: hand back the caller's own object(s)
            return list(self.user) if self.members is not None else self.user
        if self.members is not None:  # a unit: the list of its results
            convert = self.to_user
            return list(value) if convert is None else [convert(v) for v in value]
        if self.to_user is not None and value is not None and not isinstance(value, int):
            return self.to_user(value)
        return value

    def fail(self, exc: BaseException) -> None:
        self.handle.fail(exc)


def finish_all(entries: list[Entry | None], values: list[Any],
               events: tuple[Any, ...] = ()) -> None:
    """Complete a bucket's entries: one stats update, then each entry's handle (every entry
    has a handle of its own: a grouped call is one entry). ``events`` are passed to
    :meth:`Handle.set_result`."""
    live = [(e, v) for e, v in zip(entries, values, strict=True) if e is not None]
    if not live:
        return
    stats = live[0][0].stats
    if stats is not None:
        now = time.perf_counter()
        stats.record_ops(live[0][0].request.kind.name.lower(),
                         [(e.nbytes(), now - e.enqueued_at) for e, _ in live])
    for e, v in live:
        e.handle.set_result(e.user_value(v), events)
