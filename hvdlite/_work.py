"""One rank's pending work item: the request it sent plus everything needed to run it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hvdlite._handles import Handle
from hvdlite._negotiation import Request
from hvdlite._tensors import TensorRef

__all__ = ["Entry", "finish_all"]


@dataclass(slots=True, eq=False)
class Entry:
    """A submitted tensor on this rank, from enqueue until its handle part completes.

    ``output`` is preallocated when its shape is known at the call (allreduce, broadcast) and
    is the input itself for in-place calls; otherwise the backend allocates it. ``ready`` is
    the device event recorded on the caller's stream at enqueue (None for host tensors).
    """

    request: Request
    tensor: TensorRef | None
    output: Any
    handle: Handle
    index: int = 0
    enqueued_at: float = 0.0
    ready: Any = None
    stream: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    stats: Any = None  # the engine's Stats, fed at completion

    def finish(self, value: Any, events: tuple[Any, ...] = ()) -> None:
        if self.stats is not None:
            self.stats.record_op(self.request.kind.name.lower(), self.nbytes(),
                                 time.perf_counter() - self.enqueued_at)
        self.handle._set_part(self.index, self._user_value(value), events)

    def nbytes(self) -> int:
        """Payload bytes of this rank's tensor (0 for barrier and join)."""
        return self.tensor.array.nbytes if self.tensor is not None else 0

    def _user_value(self, value: Any) -> Any:
        ref = self.tensor
        if "user" in self.extra:  # in place or out=: hand back the caller's own object
            return self.extra["user"]
        if ref is not None and value is not None and not isinstance(value, int):
            return ref.to_user(value)
        return value

    def fail(self, exc: BaseException) -> None:
        self.handle._fail(exc)


def finish_all(entries: list[Entry | None], values: list[Any]) -> None:
    """Complete a bucket's entries: one stats update, one handle update per handle (a grouped
    call's tensors share one), instead of a lock round trip per tensor."""
    live = [(e, v) for e, v in zip(entries, values, strict=True) if e is not None]
    if not live:
        return
    stats = live[0][0].stats
    if stats is not None:
        now = time.perf_counter()
        stats.record_ops(live[0][0].request.kind.name.lower(),
                         [(e.nbytes(), now - e.enqueued_at) for e, _ in live])
    by_handle: dict[int, tuple[Handle, list[tuple[int, Any]]]] = {}
    for e, v in live:
        by_handle.setdefault(id(e.handle), (e.handle, []))[1].append((e.index, e._user_value(v)))
    for handle, parts in by_handle.values():
        handle._set_parts(parts)
