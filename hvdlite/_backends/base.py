"""The contract every data plane keeps (MPI for host memory, NCCL for device memory, and any
transport added later, such as CUDA IPC within a host).

The engine hands a backend one bucket at a time, in the order every rank agreed on, from the
one thread that holds the cycle lock. A backend runs the bucket's collective (dispatching on
``bucket[0].kind``; the collectives are described in ``SPECS``), completes each live entry
through its handle (``Entry.finish`` / ``finish_all``, or the device runtime's completion),
and raises on a transport failure (the engine fails the bucket's entries and stops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hvdlite._vocab.entry import Entry
    from hvdlite._vocab.messages import Response

__all__ = ["Backend"]


class Backend(Protocol):
    """A data plane for one kind of memory: every method any caller uses, one signature.

    Not thread-safe: called under the scheduler's cycle lock only (``shutdown`` and
    ``abort`` after the cycles stopped)."""

    def run(self, bucket: list[Response], entries: list[Entry | None]) -> None:
        """Execute one agreed bucket; ``entries[i]`` is None where this rank has joined (it
        contributes the op's identity and receives nothing)."""
        ...

    def direct(self, resp: Response) -> Any:
        """What :meth:`reduce_now` needs for ``resp`` when it is one allreduce of one tensor
        this transport runs as a single call (opaque to the caller), else None."""
        ...

    def reduce_now(self, resp: Response, src: Any, out: Any, spec: Any, device_id: int = -1,
                   stream: Any = None) -> Any:
        """``out = allreduce(src)`` at once, on the calling thread (a cycle of one tensor
        alone, ``_control/immediate.py``); ``spec`` from :meth:`direct`; device memory: on
        ``stream`` (the caller's) of device ``device_id``."""
        ...

    def unit_now(self, resp: Response, members: Any, outputs: Any, span: Any,
                 device_id: int = -1, stream: Any = None) -> bool:
        """Reduce a grouped call (one unit) at once, on the calling thread; False (nothing
        done) if this transport cannot for ``resp`` (mixed dtypes, joined ranks, ...)."""
        ...

    def abort(self) -> None:
        """The job is ending with an error: unblock anything waiting on the transport."""
        ...

    def shutdown(self) -> None:
        """Release the transport's resources (after the cycles stopped calling ``run``)."""
        ...
