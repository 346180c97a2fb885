"""Allreduce of many device arrays in few launches, replayed while their addresses hold.

Two shapes of work reach here, both on hvdlite's stream, in the agreed order:

- a *span*: the outputs lie end to end in one buffer (a grouped call's own result buffer, or
  the caller's bucket layout). One batched kernel copies the inputs into it (none when the
  call is in place), one NCCL call reduces it in place: nothing is copied out.
- scattered members (a bucket of separate calls, or a grouped call in place on scattered
  tensors): members of ``fusion_direct_bytes`` or more are reduced straight from input to
  output (no copy); the rest are copied into the fusion buffer by one kernel, reduced by one
  NCCL call and copied out by one kernel. Every NCCL call of the bucket is one NCCL group.

The kernels read their pointer tables from device memory. A table is built and uploaded once
per bucket (its :class:`~hvdlite._vocab.plans.MemberPlan`) and re-uploaded only when an
address changed, so a repeated step launches with no host-to-device copy at all::

    hvdlite stream:  [copy-in kernel] -> [NCCL group: directs + fused region] -> [copy-out]
                     (tables already on the device; the region is the span or the buffer)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvdlite._gpu.kernels import batched_copy
from hvdlite._gpu.runtime import DeviceContext
from hvdlite._lru import Bounded
from hvdlite._ops import DType, ReduceOp, finish_reduce, scale_into
from hvdlite._vocab.fusion import FusionBuffers
from hvdlite._vocab.plans import MemberPlan

__all__ = ["FusedAllreduce", "Reduction", "group", "transport_name"]


Phase = Callable[[str, dict[str, Any] | None], contextlib.AbstractContextManager[Any]]


class Reduction:
    """What one allreduce computes, resolved once per (dtype, op, factors, size): the NCCL
    element type and op, elements per value, and what is left to do after NCCL."""

    __slots__ = ("row", "wire", "dtype", "per", "op", "nccl_op", "prescale", "postscale",
                 "divisor", "finish", "copy_scale", "copy_op")

    def __init__(self, row: DType, wire: str, dtype: int, per: int, op: ReduceOp,
                 nccl_op: int, averaged_by_nccl: bool, prescale: float, postscale: float,
                 contributors: int, sum_op: int) -> None:
        self.row, self.wire, self.dtype, self.per = row, wire, dtype, per
        self.op, self.nccl_op = op, nccl_op
        self.prescale, self.postscale = prescale, postscale
        self.divisor = contributors if op is ReduceOp.AVERAGE and not averaged_by_nccl else 1
        self.finish = self.divisor > 1 or postscale != 1.0
        # Members copied into a region anyway take NCCL's Average there, the way NCCL computes
        # it for floats (premultiplied by 1/n, then summed): the region is reduced with Sum,
        # which costs no pass of its own where ncclAvg costs one (at 1 rank: a whole pass).
        if averaged_by_nccl:
            self.copy_scale, self.copy_op = prescale / contributors, sum_op
        else:
            self.copy_scale, self.copy_op = prescale, nccl_op

    def complete(self, cupy: Any, out: Any) -> None:
        """Average (when NCCL did not) and postscale ``out`` in place."""
        if self.finish:
            finish_reduce(cupy, out, self.op, self.divisor, self.postscale, self.row)


class FusedAllreduce:
    """Runs fused allreduces on one NCCL data plane; keeps their member plans."""

    def __init__(self, cupy: Any, nccl: Any, fusion: FusionBuffers, direct_bytes: int,
                 capacity: int) -> None:
        self.cupy, self.nccl = cupy, nccl
        self.fusion = fusion
        self.direct_bytes = direct_bytes
        self.copy_kernels = 0  # batched copy kernels launched (a zero-copy bucket adds none)
        self.plans_built = 0  # member plans made (a repeated step makes none)
        # Plans of at most cache_capacity members in all, least recently used out (0: none).
        self._plans: Bounded[tuple[int, int], tuple[object, MemberPlan]] = Bounded(capacity)

    def _plan(self, owner: object, part: int, srcs: Sequence[Any], per: int,
              itemsize: int) -> MemberPlan:
        """The member plan of ``owner``'s ``part`` (an agreed response or bucket: the same
        object every step while cached upstream, held here so its id is not reused; its
        shapes, so the members' counts, are part of it)."""
        key = (id(owner), part)
        hit = self._plans.used(key)
        if hit is not None and hit[0] is owner:
            return hit[1]
        plan = MemberPlan([a.size * per for a in srcs], itemsize, self.direct_bytes)
        self._plans.keep(key, (owner, plan), len(srcs))  # weighed by its members
        self.plans_built += 1
        return plan

    def run(self, ctx: DeviceContext, comm: Any, owner: object, part: int, red: Reduction,
            srcs: Sequence[Any], dsts: Sequence[Any], span: Any, phase: Phase | None,
            stream: Any = None) -> None:
        """Enqueue ``dsts[i] = allreduce(srcs[i])`` for every member (in place when ``srcs is
        dsts``); ``span``: one flat array the outputs lie in, end to end, or None. ``owner``
        and ``part`` name the plan to replay. Everything goes on ``stream`` (default
        hvdlite's), which must be the current stream (the copy kernels launch there)."""
        plan = self._plan(owner, part, srcs, red.per, np.dtype(red.wire).itemsize)
        target = ctx.stream if stream is None else stream
        if span is not None:
            self._span(ctx, target, comm, plan, red, srcs, dsts, span, phase)
        else:
            self._scattered(ctx, target, comm, plan, red, srcs, dsts, phase)

    def _span(self, ctx: DeviceContext, stream: Any, comm: Any, plan: MemberPlan,
              red: Reduction, srcs: Sequence[Any], dsts: Sequence[Any], span: Any,
              phase: Phase | None) -> None:
        total = span.size * red.per
        with _maybe(phase, "MEMCPY_IN_FUSION_BUFFER", None):
            if srcs is not dsts:
                # A lane hands the same tuple of the same arrays every step: same addresses.
                if plan.source is not srcs:
                    key = tuple([a.data.ptr for a in srcs])
                    if plan.key != key:
                        offs = np.zeros(len(srcs) + 1, dtype=np.int64)
                        np.cumsum(plan.counts, out=offs[1:])
                        plan.tables = self._upload(ctx, stream, plan.tables,
                                                   [offs, np.array(key, np.int64)])
                        plan.key = key
                    plan.source = srcs if type(srcs) is tuple else None
                batched_copy(red.wire, plan.tables, len(srcs), span, total, mode=0,
                             scale=red.copy_scale, divisor=1)
                self.copy_kernels += 1
                op = red.copy_op
            else:
                op = red.nccl_op
                if red.prescale != 1.0:
                    scale_into(self.cupy, span, span, red.prescale)
        with _maybe(phase, f"{transport_name(comm)}_ALLREDUCE" if phase else "",
                    {"bytes": total * np.dtype(red.wire).itemsize}):
            ptr = span.data.ptr
            comm.allReduce(ptr, ptr, total, red.dtype, op, stream.ptr)
        if red.finish:  # the results are in place: only averaging or scaling is left
            with _maybe(phase, "MEMCPY_OUT_FUSION_BUFFER", None):
                red.complete(self.cupy, span)

    def _scattered(self, ctx: DeviceContext, target: Any, comm: Any, plan: MemberPlan,
                   red: Reduction, srcs: Sequence[Any], dsts: Sequence[Any],
                   phase: Phase | None) -> None:
        fused = plan.fused
        if fused:
            key = (tuple([srcs[i].data.ptr for i in fused]),
                   tuple([dsts[i].data.ptr for i in fused]))
            if plan.key != key:
                offs = np.array(plan.offsets, dtype=np.int64)
                ins, outs = plan.tables if plan.tables is not None else (None, None)
                plan.tables = (
                    self._upload(ctx, target, ins, [offs, np.array(key[0], np.int64)]),
                    self._upload(ctx, target, outs, [offs, np.array(key[1], np.int64)]))
                plan.key = key
            buf = self.fusion.get(f"cuda:{ctx.device_id}", np.dtype(red.wire), plan.total)
        stream = target.ptr
        directs = [(srcs[i], dsts[i], plan.counts[i]) for i in plan.direct]
        with _maybe(phase, "MEMCPY_IN_FUSION_BUFFER", None):
            if red.prescale != 1.0:
                for src, dst, _ in directs:
                    scale_into(self.cupy, dst, src, red.prescale)
                directs = [(dst, dst, n) for _, dst, n in directs]
            if fused:
                batched_copy(red.wire, plan.tables[0], len(fused), buf, plan.total, mode=0,
                             scale=red.copy_scale, divisor=1)
                self.copy_kernels += 1
        nbytes = sum(plan.counts) * np.dtype(red.wire).itemsize
        with _maybe(phase, f"{transport_name(comm)}_ALLREDUCE" if phase else "",
                    {"bytes": nbytes}):
            grouped = len(directs) + bool(fused) > 1
            if grouped:
                start, end = group(self.nccl, comm)
                start()
            for src, dst, n in directs:
                comm.allReduce(src.data.ptr, dst.data.ptr, n, red.dtype, red.nccl_op, stream)
            if fused:
                ptr = buf.data.ptr
                comm.allReduce(ptr, ptr, plan.total, red.dtype, red.copy_op, stream)
            if grouped:
                end()
        with _maybe(phase, "MEMCPY_OUT_FUSION_BUFFER", None):
            if fused:
                batched_copy(red.wire, plan.tables[1], len(fused), buf, plan.total, mode=1,
                             scale=red.postscale, divisor=red.divisor)
                self.copy_kernels += 1
            for _, dst, _ in directs:
                red.complete(self.cupy, dst)

    def _upload(self, ctx: DeviceContext, stream: Any, table: Any,
                parts: list[np.ndarray]) -> Any:
        """Copy the int64 ``parts`` into the persistent device ``table`` (a new one if its
        size changed), in ``stream``'s order: the kernels of earlier steps that read the old
        table on that stream have run before the copy lands. (A plan runs on the caller's
        stream only on the immediate path, which synchronises that stream before it returns,
        so no kernel of it is left reading a table another stream rewrites.)"""
        values = np.concatenate(parts)
        staged = ctx.upload_meta(values)
        if table is None or table.size != values.size:
            with self.cupy.cuda.Device(ctx.device_id):
                table = self.cupy.empty(values.size, dtype=np.int64)
        runtime = self.cupy.cuda.runtime
        if stream is not ctx.stream:  # the staging copy went on hvdlite's stream
            ctx.stream.synchronize()
        runtime.memcpyAsync(table.data.ptr, staged.data.ptr, values.size * 8,
                            runtime.memcpyDeviceToDevice, stream.ptr)
        return table

    def release(self) -> None:
        self._plans.clear()


def transport_name(comm: Any) -> str:
    """"NCCL" or "IPC": the prefix of a communicator's timeline phases."""
    return getattr(comm, "phase", "NCCL")


def group(nccl: Any, comm: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """(start, end) of a group of calls on ``comm``: NCCL's module-level group calls, or the
    IPC communicator's own (which packs the group into shared steps)."""
    start = getattr(comm, "groupStart", None)
    return (start, comm.groupEnd) if start is not None else (nccl.groupStart, nccl.groupEnd)


def _maybe(phase: Phase | None, name: str,
           args: dict[str, Any] | None) -> contextlib.AbstractContextManager[Any]:
    return phase(name, args) if phase is not None else contextlib.nullcontext()
