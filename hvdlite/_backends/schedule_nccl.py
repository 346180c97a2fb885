"""The NCCL transport of an agreed schedule (the contract: ``_backends/base.py``,
:class:`~hvdlite._backends.base.ScheduleTransport`).

Its own communicator and stream (``config.stream_priority``, high by default); slot ``i`` is,
on that stream, a wait on a READY event recorded on the producer's stream, the pre-scale (if
any), one in-place ``ncclAllReduce`` (``ncclAvg`` for a plain float Average), the post-scale (if
any) and a DONE event. No host wait, no lock, no allocation per launch: the calls are resolved
once, when the schedule opens (the NCCL types and ops from ``_backends/nccl.py``'s table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hvdlite._backends.nccl import nccl_dtype, nccl_op, new_communicator
from hvdlite._backends.schedule_device import DeviceSlots
from hvdlite._ops import DTYPES, ReduceOp
from hvdlite._vocab.agreed import Slot
from hvdlite.errors import HvdliteError

__all__ = ["NcclScheduleTransport", "why_not"]


def why_not(slots: Sequence[Slot]) -> str:
    """'' if this transport can run ``slots``, else why not."""
    for s in slots:
        if s.dtype == "bfloat16" and (s.pre != 1.0 or s.post != 1.0):
            return f"slot {s.name!r}: bfloat16 with scale factors"
        if s.dtype != "bfloat16" and s.dtype not in DTYPES:
            return f"slot {s.name!r}: dtype {s.dtype} has no NCCL type"
    return ""


class NcclScheduleTransport(DeviceSlots):
    """Slots as in-place NCCL allreduces of fixed device buffers (``buffers[i]``: address and
    element count of slot ``i``'s buffer, alive as long as the schedule)."""

    kind = "nccl"

    def __init__(self, cupy: Any, device_id: int, slots: Sequence[Slot],
                 buffers: Sequence[tuple[int, int]], uid: Any, rank: int, size: int,
                 max_ctas: int, priority: int) -> None:
        from cupy.cuda import nccl

        self.cupy, self.device_id, self.size = cupy, device_id, size
        self.comm: Any = new_communicator(cupy, nccl, device_id, size, uid, rank, max_ctas)
        super().__init__(cupy, device_id, len(slots), priority)
        self._calls = [self._call(nccl, s, b) for s, b in zip(slots, buffers, strict=True)]

    def _call(self, nccl: Any, slot: Slot, buf: tuple[int, int]) -> tuple[Any, ...]:
        dtype, per = nccl_dtype(nccl, slot.dtype)
        kind = "float" if slot.dtype == "bfloat16" else DTYPES[slot.dtype].kind
        op, pre, post = ReduceOp(slot.op), slot.pre, slot.post
        avg = getattr(nccl, "NCCL_AVG", None)
        if op is ReduceOp.AVERAGE and avg is not None and kind == "float" \
                and pre == 1.0 and post == 1.0:
            reduce_op = avg  # a premultiplied sum inside NCCL: DDP's divide-then-sum
        else:
            reduce_op = nccl_op(nccl, kind, op)
            if op is ReduceOp.AVERAGE:
                post = post / self.size
        view = None
        if pre != 1.0 or post != 1.0:
            np_dtype = DTYPES[slot.dtype].np_dtype
            mem = self.cupy.cuda.UnownedMemory(buf[0], buf[1] * np_dtype.itemsize, self)
            view = self.cupy.ndarray(buf[1], np_dtype, self.cupy.cuda.MemoryPointer(mem, 0))
        return buf[0], buf[1] * per, dtype, reduce_op, view, pre, post

    def launch(self, i: int, stream: Any) -> None:
        self.fork(i, stream)
        ptr, count, dtype, op, view, pre, post = self._calls[i]
        if view is not None and pre != 1.0:
            with self.stream:
                view *= pre
        comm = self.comm
        if comm is None:  # aborted by the background thread since the schedule's own check
            raise HvdliteError("the agreed schedule's NCCL communicator was aborted (the job "
                               "is ending with an error raised on every rank)")
        comm.allReduce(ptr, ptr, count, dtype, op, self.sptr)
        if view is not None and post != 1.0:
            with self.stream:
                view *= post
        self.join(i)

    def abort(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        # ncclCommAbort, which is local, rather than ncclCommDestroy, whose finalisation may
        # wait for peers that close their schedules in another order; once the stream is
        # idle, or after a bounded wait (a launch that can never complete, such as one a
        # peer never matched, must not hang the shutdown: the abort ends it).
        comm, self.comm = self.comm, None
        if comm is None:
            return
        self.idle()
        comm.abort()
