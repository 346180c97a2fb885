"""One rank's pending work item: the request it sent plus everything needed to run it."""

from __future__ import annotations

import time
from typing import Any

from hvdlite._control.negotiation import Request
from hvdlite._handles import Handle
from hvdlite._tensors import TensorRef

__all__ = ["Entry", "finish_all"]


class Entry:
    """A submitted tensor on this rank, from enqueue until its handle part completes.

    ``output`` is preallocated when its shape is known at the call (allreduce, broadcast) and
    is the input itself for in-place calls; otherwise the backend allocates it. ``user`` is the
    caller's own object to hand back (in place or ``out=``), else None. ``ready`` is the device
    event recorded on the caller's stream at enqueue (None for host tensors).
    """

    __slots__ = ("request", "tensor", "output", "handle", "index", "enqueued_at", "ready",
                 "user", "stats", "channel")

    def __init__(self, request: Request, tensor: TensorRef | None, output: Any, handle: Handle,
                 index: int = 0, user: Any = None) -> None:
        self.request = request
        self.tensor = tensor
        self.output = output
        self.handle = handle
        self.index = index
        self.user = user
        self.enqueued_at = 0.0
        self.ready: Any = None
        self.stats: Any = None  # the engine's Stats, fed at completion
        self.channel: Any = None  # the process set's Channel it was submitted on

    def finish(self, value: Any) -> None:
        """Complete this entry's part of its handle with ``value`` (host work, barrier, join)."""
        if self.stats is not None:
            self.stats.record_op(self.request.kind.name.lower(), self.nbytes(),
                                 time.perf_counter() - self.enqueued_at)
        self.handle.set_parts(((self.index, self.user_value(value)),))

    def nbytes(self) -> int:
        """Payload bytes of this rank's tensor (0 for barrier and join)."""
        return self.tensor.array.nbytes if self.tensor is not None else 0

    def user_value(self, value: Any) -> Any:
        if self.user is not None:  # in place or out=: hand back the caller's own object
            return self.user
        ref = self.tensor
        if ref is not None and value is not None and not isinstance(value, int):
            return ref.to_user(value)
        return value

    def fail(self, exc: BaseException) -> None:
        self.handle.fail(exc)


def finish_all(entries: list[Entry | None], values: list[Any], events: tuple[Any, ...] = (),
               was_enqueued: bool = False) -> None:
    """Complete a bucket's entries: one stats update, one handle update per handle (a grouped
    call's tensors share one), instead of a lock round trip per tensor. ``events`` and
    ``was_enqueued`` are passed to :meth:`Handle.set_parts`."""
    live = [(e, v) for e, v in zip(entries, values, strict=True) if e is not None]
    if not live:
        return
    first = live[0][0]
    stats = first.stats
    if stats is not None:
        now = time.perf_counter()
        stats.record_ops(first.request.kind.name.lower(),
                         [(e.nbytes(), now - e.enqueued_at) for e, _ in live])
    if len(live) == 1:
        first.handle.set_parts(((first.index, first.user_value(live[0][1])),), events,
                               was_enqueued)
        return
    if all(e.handle._as_list is False for e, _ in live):  # one handle per tensor
        for e, v in live:
            e.handle.set_parts(((e.index, e.user_value(v)),), events, was_enqueued)
        return
    by_handle: dict[int, tuple[Handle, list[tuple[int, Any]]]] = {}
    for e, v in live:
        by_handle.setdefault(id(e.handle), (e.handle, []))[1].append((e.index, e.user_value(v)))
    for handle, parts in by_handle.values():
        handle.set_parts(parts, events, was_enqueued)
