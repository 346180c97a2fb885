"""The data plane for device (CuPy) memory: NCCL through CuPy's binding, or CUDA IPC.

Each bucket goes to one communicator: CuPy's ``NcclCommunicator``, or an
:class:`~hvdlite._gpu.ipc.IpcCommunicator` (ranks that share a GPU, or IPC chosen by the
``ipc`` policy: ``_gpu/placement.py``), which takes the same calls, so every collective below
is written once for both. Runs under the engine's cycle lock, in the agreed order, so every
rank issues the same calls in the same sequence (NCCL deadlocks otherwise). Everything is
enqueued on hvdlite's own stream of the device, after a stream wait on each input's READY
event; nothing here waits for the device on the CPU (except with the timeline on: see
``_gpu/runtime.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from mpi4py import MPI

from hvdlite._gpu.fused import FusedAllreduce, Phase, Reduction, group, transport_name
from hvdlite._gpu.placement import Placement
from hvdlite._gpu.runtime import DeviceContext, GpuRuntime
from hvdlite._lru import Bounded
from hvdlite._observe.tracer import Tracer
from hvdlite._ops import DTYPES, DType, ReduceOp, finish_reduce, nccl_wire
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.fusion import FusionBuffers, nbytes
from hvdlite._vocab.messages import Kind, Response, is_unit
from hvdlite._vocab.plans import unit_groups
from hvdlite.config import Config

__all__ = ["NcclBackend", "nccl_dtype", "nccl_op", "new_communicator"]

log = logging.getLogger("hvdlite")

_MAX_REDUCTIONS = 256  # (dtype, op, factors) kept: a step uses a few
_NCCL_BFLOAT16 = 9  # ncclBfloat16 in nccl.h: CuPy's binding names it only in newer releases


def nccl_dtype(nccl: Any, dtype: str) -> tuple[int, int]:
    """(NCCL element type, elements per value) of ``dtype`` (a ``DTYPES`` key, or
    ``"bfloat16"``, which has no NumPy type); KeyError if NCCL carries none."""
    if dtype == "bfloat16":
        return getattr(nccl, "NCCL_BFLOAT16", _NCCL_BFLOAT16), 1
    name, per = nccl_wire(DTYPES[dtype])
    return getattr(nccl, f"NCCL_{name.upper()}"), per


def nccl_op(nccl: Any, kind: str, op: ReduceOp) -> int:
    """The NCCL op that reduces values of ``kind`` (a DType kind) by ``op`` (Average: Sum;
    the caller divides, or uses ncclAvg where :func:`averaged_by_nccl` says so)."""
    if kind == "bool":  # or / and on 0-1 bytes
        big = op in (ReduceOp.SUM, ReduceOp.MAX)
        return nccl.NCCL_MAX if big else nccl.NCCL_MIN
    return {ReduceOp.SUM: nccl.NCCL_SUM, ReduceOp.AVERAGE: nccl.NCCL_SUM,
            ReduceOp.MIN: nccl.NCCL_MIN, ReduceOp.MAX: nccl.NCCL_MAX,
            ReduceOp.PRODUCT: nccl.NCCL_PROD}[op]


@contextlib.contextmanager
def _max_ctas(n: int) -> Iterator[None]:
    # NCCL reads NCCL_MAX_CTAS at each communicator's init (CuPy's binding has no
    # ncclConfig_t): set it for this one only, the environment as it was afterwards.
    import os

    if n <= 0:
        yield
        return
    old = os.environ.get("NCCL_MAX_CTAS")
    os.environ["NCCL_MAX_CTAS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            del os.environ["NCCL_MAX_CTAS"]
        else:
            os.environ["NCCL_MAX_CTAS"] = old


def new_communicator(cupy: Any, nccl: Any, device_id: int, size: int, uid: Any, rank: int,
                     max_ctas: int = 0) -> Any:
    """An NCCL communicator of ``size`` ranks on ``device_id`` from the unique id ``uid``
    (collective: every rank calls it with the same id); ``max_ctas`` > 0 caps its thread
    blocks (NCCL_MAX_CTAS)."""
    with cupy.cuda.Device(device_id), _max_ctas(max_ctas):
        return nccl.NcclCommunicator(size, uid, rank)


class NcclBackend:
    """Executes agreed device responses; one cached NCCL communicator per device."""

    def __init__(self, comm: MPI.Intracomm, runtime: GpuRuntime, config: Config,
                 tracer: Tracer, wait: Callable[[MPI.Request], None]) -> None:
        from cupy.cuda import nccl

        self.tracer = tracer
        self.nccl = nccl
        self.cupy = runtime.cupy
        self.mpi = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.runtime = runtime
        self.config, self._wait = config, wait
        self.fusion = FusionBuffers(config.fusion_threshold, self._alloc)
        self.fused = FusedAllreduce(self.cupy, nccl, self.fusion, config.fusion_direct_bytes,
                                    config.cache_capacity)
        # By (dtype, op, factors): bounded, a schedule may change a factor every step.
        self._reductions: Bounded[tuple[Any, ...], Reduction] = Bounded(_MAX_REDUCTIONS)
        # The communicator of each device when one transport serves every bucket (the
        # common case: a dict lookup per bucket); empty under the "mixed" policy.
        self._comms: dict[int, Any] = {}
        self._made: dict[tuple[str, int], Any] = {}  # (transport, device) -> communicator
        self.transport: str | None = None  # "nccl", "ipc" or "mixed", decided at first use
        self.placement: Placement | None = None
        # ncclAvg divides inside the collective (no extra kernel) where NCCL has it.
        self._avg = getattr(nccl, "NCCL_AVG", None)
        self._directs: dict[tuple[str, int, bool], tuple[int, int, int] | None] = {}
        self._run: dict[Kind, Callable[[DeviceContext, Any, list[Response], list[Entry | None]],
                                       list[Any]]] = {
            Kind.ALLREDUCE: self._allreduce, Kind.ALLGATHER: self._allgather,
            Kind.BROADCAST: self._broadcast, Kind.ALLTOALL: self._alltoall,
            Kind.REDUCESCATTER: self._reducescatter,
        }

    def _alloc(self, device: str, nbytes: int) -> Any:
        with self.cupy.cuda.Device(int(device.split(":")[1])):
            return self.cupy.empty(max(nbytes, 0), dtype=np.uint8)

    def communicator(self, device_id: int, nbytes: int = 0) -> Any:
        """The communicator for a bucket of ``nbytes`` on ``device_id``, made on first use
        (collective over MPI: every rank of the set reaches it at the same bucket)."""
        if self.transport is None:
            from hvdlite._gpu.placement import placement, transport

            where = placement(self.mpi, self.cupy, device_id)
            self.transport = transport(where, self.config.ipc, self.config.ipc_max_bytes)
            self.placement = where
        kind = self.transport
        if kind == "mixed":
            kind = "ipc" if nbytes <= self.config.ipc_max_bytes else "nccl"
        comm = self._made.get((kind, device_id))
        if comm is None:
            comm = self._made[kind, device_id] = self._make(kind, device_id)
        if self.transport != "mixed":
            self._comms[device_id] = comm
        return comm

    def _make(self, kind: str, device_id: int) -> Any:
        if kind == "ipc":
            from hvdlite._gpu.ipc import ONESHOT_BYTES, IpcCommunicator

            # One-shot kernels spin on an SM: only where every rank has a GPU of its own.
            own = self.placement is not None and not self.placement.shared
            return IpcCommunicator(self.mpi, self.cupy, self.nccl, device_id,
                                   self.config.ipc_buffer_bytes, self._wait,
                                   oneshot_bytes=ONESHOT_BYTES if own else 0)
        uid = self.nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi.bcast(uid, root=0)
        return new_communicator(self.cupy, self.nccl, device_id, self.size, uid, self.rank)

    def run(self, bucket: list[Response], entries: list[Entry | None]) -> None:
        """Enqueue one bucket on the device and hand its completion to the runtime."""
        if len(bucket) == 1 and entries[0] is not None and not self.tracer.on \
                and not is_unit(bucket[0]):
            direct = self._direct_op(bucket[0])
            if direct is not None:
                self._run_direct(bucket[0], entries, direct)
                return
        live = [e for e in entries if e is not None]
        device_id = live[0].device_id if live else self.runtime.default_device
        ctx = self.runtime.context(device_id)
        comm = self._comms.get(device_id) or self.communicator(
            device_id, sum(nbytes(r) for r in bucket))
        self._timed: list[Any] = []
        cuda = self.cupy.cuda
        # Switch the device only when it differs (a waiting caller runs this on its own
        # thread, whose current device is normally already this one); hvdlite's stream is
        # made current for the CuPy kernels and allocations of the bucket.
        switch = cuda.runtime.getDevice() != device_id
        if switch:
            prev = cuda.runtime.getDevice()
            cuda.runtime.setDevice(device_id)
        try:
            with ctx.stream:
                self._enqueue(ctx, comm, bucket, entries, live)
        finally:
            if switch:
                cuda.runtime.setDevice(prev)
        self.runtime.complete(ctx, entries, self._outputs, self._timed)

    def direct(self, resp: Response) -> tuple[int, int, int] | None:
        """What :meth:`reduce_now` needs for ``resp``: see :meth:`_direct_op`; None also for a
        grouped call or while ranks have joined."""
        if is_unit(resp) or resp.joined:
            return None
        return self._direct_op(resp)

    def reduce_now(self, resp: Response, src: Any, out: Any, spec: tuple[int, int, int],
                   device_id: int = -1, stream: Any = None) -> None:
        """``out = allreduce(src)`` as one NCCL call on the caller's ``stream`` (the immediate
        path, see ``_control/immediate.py``: nothing else is pending, so the caller's stream
        orders the call exactly as a READY wait on hvdlite's stream would)."""
        comm = self._comms.get(device_id) or self.communicator(device_id, src.nbytes)
        dtype, per, op = spec
        comm.allReduce(src.data.ptr, out.data.ptr, src.size * per, dtype, op, stream.ptr)

    def unit_now(self, resp: Response, members: Any, outputs: Any, span: Any,
                 device_id: int = -1, stream: Any = None) -> bool:
        """Reduce a grouped call in its span on the caller's ``stream`` (the current one), as
        :meth:`_allreduce` would on hvdlite's (the immediate path: sync completion only, so
        the stream is synchronised before anything else can use the plan). False if it is
        not a single-dtype unit with a span."""
        if span is None or type(resp.dtype) is not str or resp.joined or \
                self.runtime.async_completion or resp.op == ReduceOp.ADASUM:
            return False
        ctx = self.runtime.context(device_id)
        comm = self._comms.get(device_id) or self.communicator(device_id, nbytes(resp))
        red = self._reduction(resp.dtype, resp)
        self.fused.run(ctx, comm, resp, 0, red, members, outputs, span, None, stream)
        return True

    def _direct_op(self, resp: Response) -> tuple[int, int, int] | None:
        """(NCCL dtype, elements per value, NCCL op) when ``resp`` is one NCCL call and
        nothing else (an unscaled allreduce whose op NCCL computes itself), else None."""
        if (resp.kind is not Kind.ALLREDUCE or resp.prescale != 1.0 or resp.postscale != 1.0
                or resp.op == ReduceOp.ADASUM):
            return None
        key = (resp.dtype, resp.op, bool(resp.joined))
        hit = self._directs.get(key, False)
        if hit is False:
            row = DTYPES[resp.dtype]
            op = ReduceOp(resp.op)
            dtype, per = self._wire(row)
            if op is not ReduceOp.AVERAGE:
                hit = (dtype, per, self._op(row, op))
            elif self._avg is not None and row.kind == "float":  # joined ranks add zeros
                hit = (dtype, per, self._avg)
            else:
                hit = None
            self._directs[key] = hit
        return hit  # type: ignore[return-value]

    def _run_direct(self, resp: Response, entries: list[Entry | None],
                    direct: tuple[int, int, int]) -> None:
        # The steady state of small allreduces: one stream wait, one NCCL call, one DONE
        # record; no CuPy stream context and no kernel (NCCL computes the op, Average
        # included), so nothing here depends on this thread's current device or stream.
        entry = entries[0]
        assert entry is not None
        device_id = entry.device_id
        ctx = self.runtime.context(device_id)
        comm = self._comms.get(device_id) or self.communicator(device_id, nbytes(resp))
        stream = ctx.stream
        if entry.ready is not None:
            if not entry.ready_done:
                stream.wait_event(entry.ready)
            ctx.release(entry.ready)
        src, out = entry.array, entry.output
        dtype, per, op = direct
        comm.allReduce(src.data.ptr, out.data.ptr, src.size * per, dtype, op, stream.ptr)
        self.runtime.complete(ctx, entries, [out])

    def _enqueue(self, ctx: DeviceContext, comm: Any, bucket: list[Response],
                 entries: list[Entry | None], live: list[Entry]) -> None:
        kind = bucket[0].kind
        tracing = self.tracer.on
        names = [r.name for r in bucket] if tracing else []
        readies = [e for e in live if e.ready is not None]
        if tracing:
            with self._phase(ctx, names, "WAIT_FOR_DATA"):
                self.runtime.wait_ready(ctx, readies)
        else:
            self.runtime.wait_ready(ctx, readies)
        if kind is Kind.ALLREDUCE or not tracing:
            # (an allreduce traces its copy and reduce phases itself)
            self._outputs = self._run[kind](ctx, comm, bucket, entries)
        else:
            with self._phase(ctx, names, f"{transport_name(comm)}_{kind.name}"):
                self._outputs = self._run[kind](ctx, comm, bucket, entries)

    # -- helpers --------------------------------------------------------------------------
    def _phase(self, ctx: DeviceContext, names: list[str], phase: str,
               args: dict[str, Any] | None = None) -> contextlib.AbstractContextManager[None]:
        """A device phase on the timeline: bracketed by a CUDA event pair (event-timed mode),
        or by host timestamps, the span ending after a stream sync (CPU-sync fallback)."""
        if not self.runtime.event_timed:
            sync = ctx.stream.synchronize if self.runtime.cpu_sync else None
            return self.tracer.phase(names, phase, args, sync=sync)
        return self._event_phase(ctx, names, phase, args)

    @contextlib.contextmanager
    def _event_phase(self, ctx: DeviceContext, names: list[str], phase: str,
                     args: dict[str, Any] | None) -> Iterator[None]:
        start = self.runtime.timing_event(ctx)
        yield
        self._timed.append((names, phase, start, self.runtime.timing_event(ctx), args))

    def _wire(self, row: DType) -> tuple[int, int]:
        return nccl_dtype(self.nccl, row.name)

    def _op(self, row: DType, op: ReduceOp) -> int:
        return nccl_op(self.nccl, row.kind, op)

    def _identity(self, resp: Response, row: DType) -> Any:
        return self.cupy.full(resp.shape, row.identity(ReduceOp(resp.op)), dtype=row.np_dtype)

    # -- allreduce ------------------------------------------------------------------------
    def _allreduce(self, ctx: DeviceContext, comm: Any, bucket: list[Response],
                   entries: list[Entry | None]) -> list[Any]:
        head = bucket[0]
        if head.op == ReduceOp.ADASUM:
            return self._adasum(ctx, comm, bucket, entries)
        phase = self._phases(ctx, bucket)
        if is_unit(head):
            entry = entries[0]
            for part, (dtype, srcs, dsts, span) in enumerate(
                    unit_groups(head, entry, self.cupy)):
                red = self._reduction(dtype, head)
                self.fused.run(ctx, comm, head, part, red, srcs, dsts, span, phase)
            return [None if entry is None else entry.outputs]
        red = self._reduction(head.dtype, head)
        srcs, dsts = [], []
        for resp, e in zip(bucket, entries, strict=True):
            if e is None:  # joined: contribute the identity
                scratch = self.cupy.full(resp.shape, red.row.identity(red.op),
                                         dtype=red.row.np_dtype)
                srcs.append(scratch)
                dsts.append(scratch)
            else:
                srcs.append(e.array)
                dsts.append(e.output)
        # A lone response is its own stable key; a fused bucket's list is cached upstream.
        owner = head if len(bucket) == 1 else bucket
        self.fused.run(ctx, comm, owner, 0, red, srcs, dsts, None, phase)
        return [None if e is None else e.output for e in entries]

    def _adasum(self, ctx: DeviceContext, comm: Any, bucket: list[Response],
                entries: list[Entry | None]) -> list[Any]:
        """Adasum of the bucket (``hvdlite/_adasum.py``) on hvdlite's stream: members packed
        into one buffer, halves exchanged with each level's partner, per-tensor dot products
        summed per block by one float64 allreduce; nothing waits for the device."""
        from hvdlite._adasum import adasum

        cupy, head = self.cupy, bucket[0]
        row = DTYPES[head.dtype]
        members: list[tuple[Any, Any]] = []  # (source, destination) per tensor
        if is_unit(head):
            entry = entries[0]
            for _, srcs, dsts, _ in unit_groups(head, entry, cupy):
                members.extend(zip(srcs, dsts, strict=True))
        else:
            for resp, e in zip(bucket, entries, strict=True):
                zero = None if e is not None else cupy.zeros(resp.shape, row.np_dtype)
                members.append((zero, zero) if e is None else (e.array, e.output))
        counts = [int(src.size) for src, _ in members]
        buf = cupy.concatenate([src.reshape(-1) for src, _ in members]) if members else (
            cupy.empty(0, row.np_dtype))
        if head.prescale != 1.0:
            buf *= head.prescale
        stream = ctx.stream.ptr
        dtype, _ = self._wire(row)
        f64 = self.nccl.NCCL_FLOAT64
        exchange = self._exchanger(comm, dtype, buf.dtype.itemsize, buf.size, stream)

        def block_sum(partials: Any, level: int) -> Any:
            block = self.rank >> (level + 1)
            slots = cupy.zeros((self.size >> (level + 1), *partials.shape), dtype=np.float64)
            slots[block] = partials
            comm.allReduce(slots.data.ptr, slots.data.ptr, slots.size, f64,
                           self.nccl.NCCL_SUM, stream)
            return slots[block]

        names = [r.name for r in bucket]
        with self._phase(ctx, names, f"{transport_name(comm)}_ADASUM_ALLREDUCE",
                         {"bytes": buf.nbytes}) if self.tracer.on else contextlib.nullcontext():
            adasum(cupy, buf, counts, self.rank, self.size, exchange, block_sum)
        if head.postscale != 1.0:
            buf *= head.postscale
        offset = 0
        for (_, dst), n in zip(members, counts, strict=True):
            dst.reshape(-1)[...] = buf[offset:offset + n]
            offset += n
        if is_unit(head):
            return [None if entries[0] is None else entries[0].outputs]
        return [None if e is None else e.output for e in entries]

    def _exchanger(self, comm: Any, dtype: int, itemsize: int, n: int,
                   stream: int) -> Callable[[Any, Any, int, int, bool], None]:
        """Adasum's pairwise exchange on ``comm``: NCCL send/recv in one group, or (IPC) an
        all-to-all in which only the pairs move data, its splits known to every rank."""
        if transport_name(comm) != "IPC":
            def nccl_exchange(send: Any, recv: Any, partner: int, level: int,
                              halving: bool) -> None:
                self.nccl.groupStart()
                comm.send(send.data.ptr, send.size, dtype, partner, stream)
                comm.recv(recv.data.ptr, recv.size, dtype, partner, stream)
                self.nccl.groupEnd()
            return nccl_exchange
        from hvdlite._adasum import schedule

        plans = [schedule(n, self.size, r) for r in range(self.size)]

        def ipc_exchange(send: Any, recv: Any, partner: int, level: int, halving: bool) -> None:
            splits = np.zeros((self.size, self.size), dtype=np.int64)
            for r, steps in enumerate(plans):
                _, peer, keep, give, _ = steps[level]
                lo, hi = give if halving else keep
                splits[r, peer] = hi - lo
            comm.allToAllv(send.data.ptr, recv.data.ptr, splits, itemsize, stream)
        return ipc_exchange

    def _phases(self, ctx: DeviceContext, bucket: list[Response]) -> Phase | None:
        if not self.tracer.on:
            return None
        names = [r.name for r in bucket]
        return lambda phase, args: self._phase(ctx, names, phase, args)

    def _reduction(self, dtype: str, head: Response) -> Reduction:
        key = (dtype, head.op, head.prescale, head.postscale)
        red = self._reductions.get(key)
        if red is None:
            row = DTYPES[dtype]
            op = ReduceOp(head.op)
            wire, per = nccl_wire(row)
            avg = self._avg if op is ReduceOp.AVERAGE and row.kind == "float" else None
            red = Reduction(
                row, wire, getattr(self.nccl, f"NCCL_{wire.upper()}"), per, op,
                avg if avg is not None else self._op(row, op), avg is not None,
                head.prescale, head.postscale, self.size, self.nccl.NCCL_SUM)
            self._reductions.keep(key, red)
        return red

    # -- the other collectives -------------------------------------------------------------
    def _allgather(self, ctx: DeviceContext, comm: Any, bucket: list[Response],
                   entries: list[Entry | None]) -> list[Any]:
        resp, entry = bucket[0], entries[0]
        row = DTYPES[resp.dtype]
        dtype, per = self._wire(row)
        trailing = resp.shape[1:]
        per_row = math.prod(trailing) * per
        out = self.cupy.empty((sum(resp.sizes), *trailing), dtype=row.np_dtype)
        send = entry.array if entry is not None and entry.array is not None else out
        if len(set(resp.sizes)) == 1:
            comm.allGather(send.data.ptr, out.data.ptr, resp.sizes[0] * per_row, dtype,
                           ctx.stream.ptr)
            return [out]
        # Uneven first dimensions: one broadcast per rank, fused by NCCL into one launch.
        itemsize = row.np_dtype.itemsize // per
        start, end = group(self.nccl, comm)
        start()
        offset = 0
        for r, rows in enumerate(resp.sizes):
            dst = out.data.ptr + offset * per_row * itemsize
            comm.broadcast(send.data.ptr if r == self.rank else dst, dst, rows * per_row,
                           dtype, r, ctx.stream.ptr)
            offset += rows
        end()
        return [out]

    def _broadcast(self, ctx: DeviceContext, comm: Any, bucket: list[Response],
                   entries: list[Entry | None]) -> list[Any]:
        resp, entry = bucket[0], entries[0]
        row = DTYPES[resp.dtype]
        dtype, per = self._wire(row)
        out = (self.cupy.empty(resp.shape, dtype=row.np_dtype) if entry is None
               else entry.output)
        src = entry.array if entry is not None and entry.array is not None else out
        comm.broadcast(src.data.ptr, out.data.ptr, out.size * per, dtype, resp.root,
                       ctx.stream.ptr)
        return [out]

    def _alltoall(self, ctx: DeviceContext, comm: Any, bucket: list[Response],
                  entries: list[Entry | None]) -> list[Any]:
        resp, entry = bucket[0], entries[0]
        assert entry is not None and entry.array is not None  # no alltoall with joined ranks
        row = DTYPES[resp.dtype]
        dtype, per = self._wire(row)
        src = entry.array
        trailing = src.shape[1:]
        row_bytes = math.prod(trailing) * row.np_dtype.itemsize
        splits = np.asarray(resp.sizes, dtype=np.int64).reshape(self.size, self.size)
        recv_rows = splits[:, self.rank]
        out = self.cupy.empty((int(recv_rows.sum()), *trailing), dtype=row.np_dtype)
        elems = math.prod(trailing) * per
        if transport_name(comm) == "IPC":
            comm.allToAllv(src.data.ptr, out.data.ptr, splits, row_bytes, ctx.stream.ptr)
            return [out]
        self.nccl.groupStart()
        s_off = r_off = 0
        for peer in range(self.size):
            n_send, n_recv = int(splits[self.rank, peer]), int(recv_rows[peer])
            comm.send(src.data.ptr + s_off * row_bytes, n_send * elems, dtype, peer,
                      ctx.stream.ptr)
            comm.recv(out.data.ptr + r_off * row_bytes, n_recv * elems, dtype, peer,
                      ctx.stream.ptr)
            s_off += n_send
            r_off += n_recv
        self.nccl.groupEnd()
        return [out]

    def _reducescatter(self, ctx: DeviceContext, comm: Any, bucket: list[Response],
                       entries: list[Entry | None]) -> list[Any]:
        resp, entry = bucket[0], entries[0]
        row = DTYPES[resp.dtype]
        op = ReduceOp(resp.op)
        dtype, per = self._wire(row)
        src = (self._identity(resp, row) if entry is None or entry.array is None
               else entry.array)
        trailing = resp.shape[1:]
        base, extra = divmod(resp.shape[0], self.size)
        rows = [base + (1 if r < extra else 0) for r in range(self.size)]
        out = self.cupy.empty((rows[self.rank], *trailing), dtype=row.np_dtype)
        elems = math.prod(trailing) * per
        row_bytes = math.prod(trailing) * row.np_dtype.itemsize
        if extra == 0:
            comm.reduceScatter(src.data.ptr, out.data.ptr, base * elems, dtype,
                               self._op(row, op), ctx.stream.ptr)
        else:  # uneven parts: one reduce per rank, grouped into one launch
            start, end = group(self.nccl, comm)
            start()
            offset = 0
            for r, n in enumerate(rows):
                comm.reduce(src.data.ptr + offset * row_bytes,
                            out.data.ptr if r == self.rank else src.data.ptr, n * elems,
                            dtype, self._op(row, op), r, ctx.stream.ptr)
                offset += n
            end()
        finish_reduce(self.cupy, out, op, self.size, 1.0, row)
        return [out]

    def abort(self) -> None:
        """The job is ending with an error: abort the NCCL communicators (``ncclCommAbort``),
        so NCCL kernels waiting for a rank that will never come return and a thread blocked
        on their completion wakes (the engine failed their entries first); and release the
        IPC communicators' device waits the same way (``IpcCommunicator.release``: a stream
        parked on a semaphore of a dead peer passes; the IPC ones stay for ``shutdown``)."""
        for key, comm in list(self._made.items()):
            if key[0] == "nccl":
                try:
                    comm.abort()
                finally:
                    del self._made[key]
                continue
            try:  # (a release that fails must not keep the NCCL ones from their abort)
                comm.release()
            except Exception:
                log.exception("hvdlite: releasing the CUDA IPC waits of GPU %d failed", key[1])
        self._comms.clear()

    def shutdown(self) -> None:
        """Destroy the communicators (after the background thread stopped using them; the
        IPC ones collectively, in the order they were made, the same on every rank)."""
        for comm in self._made.values():
            comm.destroy()
        self._made.clear()
        self._comms.clear()
        self.fusion.release()
        self.fused.release()
