"""One rank's pending work item: the request it sent plus everything needed to run it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hvdlite._handles import Handle
from hvdlite._negotiation import Request
from hvdlite._tensors import TensorRef

__all__ = ["Entry"]


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
            nbytes = self.tensor.array.nbytes if self.tensor is not None else 0
            self.stats.record_op(self.request.kind.name.lower(), nbytes,
                                 time.perf_counter() - self.enqueued_at)
        ref = self.tensor
        if "user" in self.extra:  # in place or out=: hand back the caller's own object
            value = self.extra["user"]
        elif ref is not None and value is not None and not isinstance(value, int):
            value = ref.to_user(value)
        self.handle._set_part(self.index, value, events)

    def fail(self, exc: BaseException) -> None:
        self.handle._fail(exc)
