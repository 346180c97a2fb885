"""The contract every data plane keeps (MPI for host memory, NCCL for device memory, and any
transport added later, such as CUDA IPC within a host).

The engine hands a backend one bucket at a time, in the order every rank agreed on, from the
one thread that holds the cycle lock. A backend runs the bucket's collective (dispatching on
``bucket[0].kind``; the collectives are described in ``SPECS``), completes each live entry
through its handle (``Entry.finish`` / ``finish_all``, or the device runtime's completion),
and raises on a transport failure (the engine fails the bucket's entries and stops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hvdlite._vocab.entry import Entry
    from hvdlite._vocab.messages import Response

__all__ = ["Backend"]


class Backend(Protocol):
    """A data plane for one kind of memory."""

    def run(self, bucket: list[Response], entries: list[Entry | None]) -> None:
        """Execute one agreed bucket; ``entries[i]`` is None where this rank has joined (it
        contributes the op's identity and receives nothing). Not thread-safe: the engine
        calls it under its cycle lock only."""
        ...

    def shutdown(self) -> None:
        """Release the transport's resources (after the engine stopped calling ``run``)."""
        ...
