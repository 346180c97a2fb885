"""How the ranks of an :class:`~hvdlite._gpu.ipc.IpcCommunicator` order one step on a slot.

A step (see ``_gpu/ipc.py``) is: wait until every rank finished reading this rank's slot from
its previous use; copy the inputs in; tell the peers the slot is WRITTEN and wait for theirs;
read or reduce the slots; tell every rank this rank has READ them. Two protocols carry the
WRITTEN and READ signals, with one interface (``before_write``, ``after_write``,
``after_read``, ``end_call``, ``release``):

- :class:`FlagFences` (the default where every rank can use it): device semaphores
  (``_gpu/semaphores.py``): stream writes into the peers' inboxes, stream waits on this
  rank's; no MPI call and no host wait per step.
- :class:`EventFences` (the fallback: no cuda-python, or a driver without stream memory
  operations): interprocess events, and a failure-aware MPI barrier per step between the
  WRITTEN records and their waits (a stream wait on an event takes the event's latest record
  *at the time of the wait call*: the barrier makes every peer's record of this step precede
  it).

Either way, the waits before a slot's copy-in include this rank's own READ (its reads of its
own slot may have run on another stream), and a slot is written again only after every rank
read it; see the module docstring of ``_gpu/ipc.py`` for why two slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from hvdlite._gpu.semaphores import MOD, READ, WRITTEN, Semaphores

__all__ = ["EventFences", "FlagFences", "HANDLE"]

HANDLE = 64  # bytes of a cudaIpcMemHandle_t / cudaIpcEventHandle_t
_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess


class EventFences:
    """WRITTEN and READ per slot as interprocess events, ordered by an MPI barrier per step."""

    name = "events"

    def __init__(self, cupy: Any, device_id: int, rank: int, size: int, slots: int,
                 mpi: MPI.Intracomm, wait: Callable[[MPI.Request], None]) -> None:
        self.rt = cupy.cuda.runtime
        self.rank, self.size, self.slots = rank, size, slots
        self.mpi, self._wait = mpi, wait
        self.own = [self.rt.eventCreateWithFlags(_EVENT_FLAGS) for _ in range(2 * slots)]
        self.record = HANDLE * 2 * slots  # bytes of this rank's part of the exchange
        self._written: list[list[int]] = []  # [rank][slot]
        self._read: list[list[int]] = []

    def handles(self) -> bytes:
        return b"".join(bytes(self.rt.ipcGetEventHandle(e)) for e in self.own)

    def attach(self, rows: list[bytes], open_peer: Callable[[int, bytes], int]) -> None:
        for r, row in enumerate(rows):
            events = self.own if r == self.rank else [
                self.rt.ipcOpenEventHandle(row[HANDLE * i:HANDLE * (i + 1)])
                for i in range(2 * self.slots)]
            self._written.append(events[:self.slots])
            self._read.append(events[self.slots:])

    def before_write(self, stream: int, slot: int, epoch: int, first: bool) -> None:
        for r in range(self.size):
            self.rt.streamWaitEvent(stream, self._read[r][slot], 0)

    def after_write(self, stream: int, slot: int, epoch: int) -> None:
        self.rt.eventRecord(self._written[self.rank][slot], stream)
        self._wait(self.mpi.Ibarrier())
        for r in range(self.size):
            if r != self.rank:
                self.rt.streamWaitEvent(stream, self._written[r][slot], 0)

    def after_read(self, stream: int, slot: int, epoch: int) -> None:
        self.rt.eventRecord(self._read[self.rank][slot], stream)

    def end_call(self, stream: int) -> None:
        """Nothing: every wait here is on a record issued before a failure-aware barrier."""

    def release(self) -> bool:
        """Nothing to release (see :meth:`end_call`)."""
        return True

    def close_peers(self) -> None:
        for r in range(len(self._written)):
            if r != self.rank:
                for e in (*self._written[r], *self._read[r]):
                    self.rt.eventDestroy(e)
        self._written, self._read = [], []

    def free(self) -> None:
        for e in self.own:
            self.rt.eventDestroy(e)


class FlagFences:
    """WRITTEN and READ per slot as epochs in device semaphores: no MPI, no host wait."""

    name = "flags"

    def __init__(self, sem: Semaphores) -> None:
        self.rank, self.size = sem.rank, sem.size
        self.sem = sem
        self.record = HANDLE

    def handles(self) -> bytes:
        return self.sem.handle()

    def attach(self, rows: list[bytes], open_peer: Callable[[int, bytes], int]) -> None:
        self.sem.attach([row[:HANDLE] for row in rows], open_peer)

    def before_write(self, stream: int, slot: int, epoch: int, first: bool) -> None:
        if first:  # (the flags start at 0: "epoch 0 read")
            return
        previous = (epoch - 1) % MOD
        for r in range(self.size):
            self.sem.wait(stream, READ, slot, r, previous)

    def after_write(self, stream: int, slot: int, epoch: int) -> None:
        # Every signal before any wait: a wait first could hold back a peer's own wait.
        for r in range(self.size):
            if r != self.rank:
                self.sem.signal(stream, r, WRITTEN, slot, epoch)
        for r in range(self.size):
            if r != self.rank:
                self.sem.wait(stream, WRITTEN, slot, r, epoch)

    def after_read(self, stream: int, slot: int, epoch: int) -> None:
        for r in range(self.size):
            self.sem.signal(stream, r, READ, slot, epoch)

    def end_call(self, stream: int) -> None:
        self.sem.mark(stream)

    def release(self) -> bool:
        return self.sem.release()

    def close_peers(self) -> None:
        """Nothing: the peers' inboxes are the communicator's pinned mappings."""

    def free(self) -> None:
        self.sem.free()
