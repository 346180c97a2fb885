"""``DistributedOptimizer``'s buckets on an agreed schedule (``hvdlite/_gpu/schedule.py``): the
autograd thread launches each bucket's allreduce itself, in the order every rank agreed.

Before an optimizer's first bucket is reduced, every member of the process set shows the
buckets it built (:func:`check`: one exchange, once); a rank whose buckets differ raises
:class:`~hvdlite.errors.MismatchError` on every rank, naming the ranks and the first differing
bucket (rather than stalling on a bucket the others never reduce). The first step then goes
through the scheduler like any collective (its buckets are negotiated, which also settles the
transport); at its end the members agree whether each can launch the buckets itself (CUDA
buffers over NCCL, the ``optimizer_schedule`` knob on: :func:`open_lane`, one more exchange).
If all can, the optimizer's later steps take the :class:`Lane`: per bucket, its gradients into
its buffer (none with views), one stream wait, one NCCL call; per step, one stream wait per
bucket in ``step()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvdlite._engine import default_engine
from hvdlite._gpu.schedule import Schedule, Spec, agree, check
from hvdlite._ops import ReduceOp
from hvdlite._torchref import numpy_dtype, stream_of
from hvdlite.torch._buckets import Bucket

__all__ = ["Lane", "check", "open_lane", "specs"]

_WIRE_NAMES = {torch.bfloat16: "bfloat16"}


def _wire_name(dtype: torch.dtype) -> str | None:
    np_dtype = numpy_dtype(dtype)
    return _WIRE_NAMES.get(dtype) or (np_dtype.name if np_dtype is not None else None)


def _buffer(bucket: Bucket) -> torch.Tensor | None:
    """The tensor the bucket's collective runs on: its wire (compressed twin), its view
    buffer or its staging buffer; None if it has none (sparse, or a non-cast compressor)."""
    if bucket.views:
        return bucket.wire if bucket.wire is not None else bucket.buffer
    return bucket.staging


def _why_not(buckets: Sequence[Bucket], process_set_id: int, pre: float, post: float) -> str:
    """'' if this rank can launch ``buckets`` itself, else why not."""
    engine = default_engine()
    if not engine.config.optimizer_schedule:
        return "the optimizer_schedule knob is off"
    devices = {b.device for b in buckets}
    if len(devices) != 1 or -1 in devices:
        return "its buckets are not all on one CUDA device"
    for b in buckets:
        buf = _buffer(b)
        if buf is None:
            return f"bucket {b.name!r} has no buffer (a sparse gradient, or a compressor " \
                   "that is not a cast)"
        if buf.dtype == torch.bfloat16 and (pre != 1.0 or post != 1.0):
            return "bfloat16 buckets with scale factors"
    transport = engine.device_transport(process_set_id)
    if transport != "nccl":
        return f"its device buckets travel by {transport or 'an undecided transport'}, not NCCL"
    return ""


def specs(buckets: Sequence[Bucket], wires: Sequence[torch.dtype], op: Any, pre: float,
          post: float) -> list[Spec]:
    """What every rank must agree on for each bucket: name, size, the type it travels as
    (``wires``), op, factors."""
    return [Spec(b.name, sum(p.numel() for p in b.params), _wire_name(w) or str(w),
                 int(ReduceOp(op)), pre, post) for b, w in zip(buckets, wires, strict=True)]


def open_lane(buckets: Sequence[Bucket], checked: Sequence[Spec], pre: float, post: float,
              process_set_id: int, ranks: Sequence[int], rank: int,
              exchange: Any) -> tuple[Lane | None, str]:
    """(the lane, '') if every member of the set can launch ``buckets`` itself (collective
    over the set: one exchange), else (None, why not): the optimizer keeps negotiating them.
    ``checked``: the buckets' specs, found alike on every rank before their first reduction
    (:func:`check`)."""
    why = _why_not(buckets, process_set_id, pre, post)
    uid, why = agree(why, rank == ranks[0], exchange, ranks)
    if uid is None:
        return None, why
    device = buckets[0].device
    bufs = []
    for b in buckets:
        buf = _buffer(b)
        assert buf is not None
        bufs.append((buf.data_ptr(), buf.numel()))
    engine = default_engine()
    runtime = engine.gpu_runtime()
    schedule = Schedule(runtime.cupy, device, checked, bufs, uid, ranks.index(rank),
                        len(ranks), engine.config.optimizer_max_ctas)
    runtime.schedules.add(schedule)
    return Lane(schedule, buckets, engine), ""


class Lane:
    """Launches an optimizer's buckets on their schedule as they become ready, in order (a
    ready bucket waits for every earlier one, so every rank issues the same sequence), and
    hands the reduced gradients over in ``step()``."""

    __slots__ = ("schedule", "buckets", "pending", "next", "grads", "device", "engine",
                 "__weakref__")

    def __init__(self, schedule: Schedule, buckets: Sequence[Bucket], engine: Any) -> None:
        self.schedule = schedule
        self.engine = engine  # the engine it was agreed under (a re-init ends the lane)
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
        self.schedule.launch(i, stream_of(self.device))

    def finish(self, ordered: bool) -> None:
        """Launch the buckets no hook started (in order), then hand every member its reduced
        gradient: ``ordered``, the current stream waits for each bucket (no host wait), else
        the host waits (the timeline's CPU sync)."""
        n = len(self.pending)
        while self.next < n:
            self._launch(self.next)
            self.next += 1
        stream = stream_of(self.device) if ordered else None
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
