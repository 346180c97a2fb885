"""``DistributedOptimizer``'s buckets on an agreed schedule of the runtime
(``hvdlite/_control/agreed.py``, reached through ``hvdlite/_runtime_api.py``): the autograd
thread launches each bucket's allreduce itself, in the order every rank agreed.

Before an optimizer's first bucket is reduced, every member of the process set shows the
buckets it built (the runtime's one agreement: ``check_agreed``); a rank whose buckets differ
raises :class:`~hvdlite.errors.MismatchError` on every rank, naming the ranks and the first
differing bucket (rather than stalling on a bucket the others never reduce). The first step
then goes through the scheduler like any collective (its buckets are negotiated, which also
settles the device transport); at its end the members open a schedule of the buckets
(``open_schedule``: whether every member can, one more exchange). If all can, the later steps
take :class:`ScheduledBuckets`: per bucket, its gradients into its buffer (none with views)
and one launch; per step, one stream wait per bucket in ``step()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvdlite import _runtime_api as runtime
from hvdlite._ops import ReduceOp
from hvdlite._runtime_api import Slot
from hvdlite._torchref import numpy_dtype, stream_of
from hvdlite.errors import HvdliteError
from hvdlite.torch._buckets import Bucket

__all__ = ["ScheduledBuckets", "move_scheduled", "open_scheduled", "slots", "wire_name"]
VIAS = ("nccl", "ipc")

_WIRE_NAMES = {torch.bfloat16: "bfloat16"}


def wire_name(dtype: torch.dtype) -> str | None:
    """The name a slot gives ``dtype`` (a NumPy dtype name, or ``"bfloat16"``); None for a
    type neither knows."""
    np_dtype = numpy_dtype(dtype)
    return _WIRE_NAMES.get(dtype) or (np_dtype.name if np_dtype is not None else None)


def _buffer(bucket: Bucket) -> torch.Tensor | None:
    """The tensor the bucket's collective runs on: its wire (compressed twin), its view
    buffer or its staging buffer; None if it has none (sparse, or a non-cast compressor)."""
    if bucket.views:
        return bucket.wire if bucket.wire is not None else bucket.buffer
    return bucket.staging


def _why_not(buckets: Sequence[Bucket]) -> str:
    """'' if this rank's buckets can go on a schedule, else why not."""
    devices = {b.device for b in buckets}
    if len(devices) != 1:
        return "its buckets are not all on one device"
    if -1 in devices and not runtime.config().optimizer_host_schedule:
        return "its buckets are in host memory (optimizer_host_schedule is off: on the " \
               "negotiated route their allreduces run beside backward)"
    for b in buckets:
        if _buffer(b) is None:
            return f"bucket {b.name!r} has no buffer (a sparse gradient, or a compressor " \
                   "that is not a cast)"
    return ""


def slots(buckets: Sequence[Bucket], wires: Sequence[torch.dtype], op: Any, pre: float,
          post: float) -> list[Slot]:
    """What every rank must agree on for each bucket: name, size, the type it travels as
    (``wires``), op, factors."""
    return [Slot(b.name, b.total, wire_name(w) or str(w),
                 int(ReduceOp(op)), pre, post) for b, w in zip(buckets, wires, strict=True)]


def open_scheduled(buckets: Sequence[Bucket], agreed: Sequence[Slot], set_id: int,
                   name: str, via: str = "") -> tuple[ScheduledBuckets | None, str]:
    """(the scheduled buckets, '') if every member of the set can launch ``buckets`` on an
    agreed schedule (collective over the set: one exchange), else (None, why not): the
    optimizer keeps negotiating them. ``agreed``: the buckets' slots, checked alike on every
    rank before their first reduction; ``via``: the device transport ('': the knob's)."""
    why = _why_not(buckets)
    bufs: list[tuple[int, int]] = []
    if not why:
        for b in buckets:
            buf = _buffer(b)
            assert buf is not None
            bufs.append((buf.data_ptr(), buf.numel()))
    device = buckets[0].device if not why else -1
    schedule, why = runtime.open_schedule(name, agreed, bufs, device, set_id, why, via)
    if schedule is None:
        return None, why
    return ScheduledBuckets(schedule, buckets), ""


def move_scheduled(scheduled: ScheduledBuckets | None, buckets: Sequence[Bucket],
                   agreed: Sequence[Slot], set_id: int, name: str,
                   via: str) -> tuple[ScheduledBuckets | None, str]:
    """``buckets`` on a schedule over ``via`` ("nccl" or "ipc"): (the new one, '') once every
    member opened it (the old one, ``scheduled``, closed), else (``scheduled``, why not: the
    same on every member). Buckets on no schedule (None) open one over "ipc": where ranks share
    a GPU, NCCL refuses them and their steps negotiate, but their schedule's waits can be
    stream memory operations (``_backends/schedule_ipc.py``), which a captured step needs.
    Between steps only (no bucket launched and not waited for); collective over the set, like
    the opening."""
    if scheduled is None:
        if via != "ipc":
            return None, f"its buckets are on no schedule to move to {via}"
        return open_scheduled(buckets, agreed, set_id, f"{name}.{via}", via)
    old = scheduled.schedule
    if old.via == via:
        return scheduled, ""
    if scheduled.next or any(scheduled.pending):
        raise HvdliteError(f"{name}: its schedule can move to {via} only between steps (a "
                           "bucket of this step was already launched)")
    if scheduled.device < 0:
        return scheduled, "its buckets are in host memory (their schedule runs over MPI)"
    moved, why = open_scheduled(scheduled.buckets, agreed, set_id, f"{name}.{via}", via)
    if moved is None:
        return scheduled, why
    old.close()
    return moved, ""


class ScheduledBuckets:
    """Launches an optimizer's buckets on their schedule as they become ready, in order (a
    ready bucket waits for every earlier one, so every rank launches the same sequence), and
    hands the reduced gradients over in ``step()``."""

    __slots__ = ("schedule", "buckets", "pending", "next", "grads", "device", "world",
                 "__weakref__")

    def __init__(self, schedule: Any, buckets: Sequence[Bucket]) -> None:
        self.schedule = schedule
        self.world = runtime.running()  # the engine it was agreed under (a re-init ends it)
        self.buckets = tuple(buckets)
        self.pending = [False] * len(buckets)
        self.next = 0
        self.grads: list[list[torch.Tensor]] = [[] for _ in buckets]
        self.device = buckets[0].device

    def ready(self, index: int) -> None:
        """Bucket ``index``'s gradients are ready: launch it and every ready one after it
        whose turn has come."""
        pending = self.pending
        pending[index] = True
        n = len(pending)
        while self.next < n and pending[self.next]:
            self._launch(self.next)
            self.next += 1

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        if bucket.views:
            if not bucket.realias():
                raise TypeError(f"DistributedOptimizer: a gradient of bucket {bucket.name!r} "
                                "became sparse after its buckets were agreed at the first "
                                "step; pass sparse_as_dense=True")
            if bucket.wire is not None:
                assert bucket.buffer is not None
                bucket.wire.copy_(bucket.buffer)
        else:
            grads = []
            for p in bucket.params:
                grad = p.grad
                if grad is None:
                    grad = p.grad = torch.zeros_like(p)
                elif grad.is_sparse:
                    raise TypeError(f"DistributedOptimizer: the gradient of a parameter of "
                                    f"bucket {bucket.name!r} became sparse after its buckets "
                                    "were agreed at the first step; pass sparse_as_dense=True")
                grads.append(grad)
            torch._foreach_copy_(bucket.staged, grads)
            self.grads[i] = grads
        self.schedule.launch(i, stream_of(self.device) if self.device >= 0 else None)

    def finish(self, ordered: bool) -> None:
        """Launch the buckets no hook started (in order), then hand every member its reduced
        gradient: ``ordered``, the current stream waits for each bucket (no host wait), else
        the host waits (host buckets, or the timeline's CPU sync)."""
        n = len(self.pending)
        while self.next < n:
            self._launch(self.next)
            self.next += 1
        stream = stream_of(self.device) if ordered and self.device >= 0 else None
        for i, bucket in enumerate(self.buckets):
            self.schedule.wait(i, stream)
            if bucket.views:
                if bucket.wire is not None:
                    assert bucket.buffer is not None
                    bucket.buffer.copy_(bucket.wire)
                bucket.repoint()
            else:
                bucket.hand_back(self.grads[i])
                self.grads[i] = []
        self.pending = [False] * len(self.pending)
        self.next = 0
