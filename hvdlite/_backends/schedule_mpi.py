"""The host transport of an agreed schedule (the contract: ``_backends/base.py``,
:class:`~hvdlite._backends.base.ScheduleTransport`): slots as nonblocking in-place
``MPI_Iallreduce`` calls on the schedule's own communicator.

A launch comes from the thread that made its buffer ready (the autograd thread, say) while the
background thread runs its own cycles on other communicators, so this needs
``MPI_THREAD_MULTIPLE``; a request is tested under this transport's lock only (MPI forbids two
threads completing one request). Average is a Sum divided on completion, by the first
:meth:`done` that sees it (floats only: Horovod truncates integer averages, and that stays on
the negotiated route).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from hvdlite._backends.mpi import mpi_datatype, mpi_op
from hvdlite._ops import DTYPES, ReduceOp
from hvdlite._vocab.agreed import Slot
from hvdlite.errors import HvdliteError

__all__ = ["MpiScheduleTransport", "why_not"]


def why_not(slots: Sequence[Slot]) -> str:
    """'' if this transport can run ``slots``, else why not."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return "MPI does not provide THREAD_MULTIPLE"
    for s in slots:
        row = DTYPES.get(s.dtype)
        if row is None or row.name == "float16" or row.kind not in ("float", "int", "uint"):
            return f"slot {s.name!r}: dtype {s.dtype} on the host"
        if s.op == ReduceOp.ADASUM or (s.op == ReduceOp.AVERAGE and row.kind != "float"):
            return f"slot {s.name!r}: op {ReduceOp(s.op).name} of {s.dtype}"
    return ""


class MpiScheduleTransport:
    """Slots as in-place ``MPI_Iallreduce`` calls of fixed host buffers (``buffers[i]``:
    address and element count of slot ``i``'s buffer, alive as long as the schedule) on
    ``comm`` (the schedule's own; freed by :meth:`close`)."""

    kind = "mpi"

    device_id = -1

    def __init__(self, comm: MPI.Intracomm, slots: Sequence[Slot],
                 buffers: Sequence[tuple[int, int]]) -> None:
        self.comm: MPI.Intracomm | None = comm
        size = comm.Get_size()
        self._lock = threading.Lock()
        self._calls = []
        for slot, (address, count) in zip(slots, buffers, strict=True):
            row = DTYPES[slot.dtype]
            datatype, np_dtype = mpi_datatype(row)
            raw = (ctypes.c_char * (count * np_dtype.itemsize)).from_address(address)
            array = np.frombuffer(memoryview(raw).cast("B"), dtype=np_dtype, count=count)
            op = ReduceOp(slot.op)
            post = slot.post / size if op is ReduceOp.AVERAGE else slot.post
            self._calls.append(([array, datatype], array, mpi_op(row, op), slot.pre, post))
        self._requests: list[MPI.Request | None] = [None] * len(self._calls)

    def launch(self, i: int, stream: Any) -> None:
        buf, array, op, pre, _ = self._calls[i]
        if pre != 1.0:
            array *= pre
        comm = self.comm
        if comm is None:
            raise HvdliteError("the agreed schedule's communicator is closed")
        request = comm.Iallreduce(MPI.IN_PLACE, buf, op=op)
        with self._lock:
            self._requests[i] = request
            self._progress()

    def done(self, i: int) -> bool:
        with self._lock:
            if self._requests[i] is None:
                return True
            self._progress()
            return self._requests[i] is None

    def _progress(self) -> None:
        """Test every launch in flight, not only the one asked about (under the lock). A
        bucket past MPI's eager size moves by rendezvous, a handshake with the peer that
        advances only inside MPI calls on both sides; looked at one slot at a time, the
        handshakes of a step's slots follow one another, each waiting out a peer's nap
        between looks (32 slots of 16 KiB: 43 ms a step against 2.5 ms negotiated, on 2 CPU
        ranks). Looked at together, they overlap."""
        pending = [(j, r) for j, r in enumerate(self._requests) if r is not None]
        if not pending:
            return
        finished = MPI.Request.Testsome([r for _, r in pending])
        for k in finished or ():
            j = pending[k][0]
            _, array, _, _, post = self._calls[j]
            if post != 1.0:  # under the lock: no other thread sees it done before it is
                array *= post
            self._requests[j] = None

    def order(self, i: int, stream: Any) -> None:
        raise TypeError("a host schedule has no stream to order")

    def abort(self) -> None:
        # MPI cannot cancel a collective: waiters see the schedule aborted and raise; the
        # engine's exit guard ends the job if a peer is gone.
        with self._lock:
            self._requests = [None] * len(self._requests)

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None and comm != MPI.COMM_NULL:
            comm.Free()
