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

__all__ = ["Backend", "ScheduleTransport"]


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


class ScheduleTransport(Protocol):
    """The schedule contract: what a transport does for an agreed schedule (the runtime's
    :class:`~hvdlite._control.agreed.AgreedSchedule` keeps the order, the capture state, the
    watchdog and the errors; a transport only moves data).

    Slot ``i`` is an in-place allreduce of a buffer fixed when the schedule was opened; the
    transport has its own communicator (so its collectives' order is the schedule's alone)
    and, on a device, its own stream. Launches come from one thread at a time, in slot order.
    """

    device_id: int  # the CUDA device of every buffer, or -1 for host memory
    kind: str  # how the data travels: "nccl", "ipc" or "mpi" (a config value's words)

    def launch(self, i: int, stream: Any) -> None:
        """Enqueue slot ``i`` after the work on ``stream`` (a device transport: the producer's
        CuPy stream; host: None), without waiting for it on the host."""
        ...

    def done(self, i: int) -> bool:
        """Whether slot ``i``'s last launch completed (never blocks; any thread)."""
        ...

    def order(self, i: int, stream: Any) -> None:
        """Make ``stream`` wait for slot ``i``'s last launch (device transports only)."""
        ...

    def abort(self) -> None:
        """The job is ending with an error: unblock anything waiting on the transport."""
        ...

    def close(self) -> None:
        """Release the communicator once the launches completed (local: ranks may close
        their schedules in different orders)."""
        ...
