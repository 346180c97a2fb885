"""MPI data plane for host (NumPy) memory: buffer-based mpi4py calls, never pickle.

Runs only on the background thread, on the data communicator hvdlite duplicated at init, in
the order every rank agreed on, so blocking collectives cannot cross each other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from hvdlite._adasum import adasum
from hvdlite._backends.failures import FailureChannel
from hvdlite._observe.tracer import Tracer
from hvdlite._ops import DTYPES, DType, ReduceOp, finish_reduce, scale_into
from hvdlite._vocab.entry import Entry, finish_all
from hvdlite._vocab.fusion import FusionBuffers
from hvdlite._vocab.messages import Kind, Response, is_unit
from hvdlite._vocab.plans import unit_groups
from hvdlite.errors import HvdliteError

__all__ = ["MPIBackend", "mpi_datatype", "mpi_op"]


_TYPES = {
    "bool": MPI.C_BOOL, "int8": MPI.INT8_T, "int16": MPI.INT16_T, "int32": MPI.INT32_T,
    "int64": MPI.INT64_T, "uint8": MPI.UINT8_T, "uint16": MPI.UINT16_T, "uint32": MPI.UINT32_T,
    "uint64": MPI.UINT64_T, "float32": MPI.FLOAT, "float64": MPI.DOUBLE,
    "complex64": MPI.C_FLOAT_COMPLEX, "complex128": MPI.C_DOUBLE_COMPLEX,
}  # fmt: skip


def mpi_datatype(row: DType) -> tuple[MPI.Datatype, np.dtype]:
    """The predefined MPI datatype for ``row`` (reductions are defined only on those) and the
    NumPy dtype that travels: float16 widens to float32 where this MPI cannot reduce halves."""
    if row.name == "float16":
        if _HALF_REDUCES:
            return MPI.FLOAT16_T, row.np_dtype
        return MPI.FLOAT, np.dtype(np.float32)
    return _TYPES[row.name], row.np_dtype


# Open MPI 4.1 names MPI_FLOAT16_T but refuses reductions on it (MPI_ERR_TYPE, seen on the GPU
# machine); MPICH reduces it. Elsewhere halves travel as floats (exact for what they hold).
_HALF_REDUCES = (MPI.FLOAT16_T != MPI.DATATYPE_NULL
                 and "MPICH" in MPI.Get_library_version().split("\n", 1)[0])


_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVERAGE: MPI.SUM,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD,
}
_LOGICAL_OPS = {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.MIN: MPI.LAND,
    ReduceOp.PRODUCT: MPI.LAND,
}


def mpi_op(row: DType, op: ReduceOp) -> MPI.Op:
    return (_LOGICAL_OPS if row.kind == "bool" else _OPS)[op]


def _rows_split(total: int, parts: int) -> list[int]:
    """Rows of dim 0 per rank for reducescatter: as even as possible, the first ranks get more."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


_Spec = tuple[DType, ReduceOp, MPI.Datatype, np.dtype, MPI.Op, bool]
_ADASUM_TAG = 7_200  # + level: the set's data communicator carries no other tagged traffic
_NO_NAMES: list[str] = []
_SPECS: dict[tuple[str, int], _Spec] = {}


def _spec(dtype: str, opv: int) -> _Spec:
    """Everything an allreduce of (dtype, op) needs, looked up once per pair."""
    row = DTYPES[dtype]
    op = ReduceOp(opv)
    mtype, wire = mpi_datatype(row)
    # Adasum has no MPI op: _reduce runs hvdlite/_adasum.py on the region (never "native").
    adasum_op = op is ReduceOp.ADASUM
    spec: _Spec = (row, op, mtype, wire, MPI.OP_NULL if adasum_op else mpi_op(row, op),
                   wire == row.np_dtype and not adasum_op)
    _SPECS[(dtype, opv)] = spec
    return spec


class MPIBackend:
    """Executes agreed responses on host arrays over one MPI communicator."""

    def __init__(self, comm: MPI.Intracomm, fusion: FusionBuffers, failures: FailureChannel,
                 tracer: Tracer, block_in_mpi: bool) -> None:
        self.comm = comm
        self.tracer = tracer
        self.failures = failures
        self.block_in_mpi = block_in_mpi
        self.in_caller = False  # see Negotiator.in_caller
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.fusion = fusion
        self._run: dict[Kind, Callable[[list[Response], list[Entry | None]], Any]] = {
            Kind.ALLREDUCE: self._allreduce,
            Kind.ALLGATHER: self._allgather,
            Kind.BROADCAST: self._broadcast,
            Kind.ALLTOALL: self._alltoall,
            Kind.REDUCESCATTER: self._reducescatter,
        }

    def run(self, bucket: list[Response], entries: list[Entry | None]) -> None:
        """Run one bucket; ``entries[i]`` is None where this rank has joined (no data)."""
        kind = bucket[0].kind
        if kind is Kind.ALLREDUCE:  # traces its own copy and reduce phases
            self._allreduce(bucket, entries)
            return
        with self.tracer.phase([r.name for r in bucket], f"MPI_{kind.name}"):
            out = self._run[kind](bucket, entries)
        # Completed only after the phase closed, so a caller woken by the handle never sees
        # a trace with this span still open.
        if entries[0] is not None:
            entries[0].finish(out)

    def abort(self) -> None:
        """Nothing to abort: every host wait polls the peers' failure notice."""

    def shutdown(self) -> None:
        """Nothing to release: the engine frees the communicator and the fusion buffers."""

    def wait(self, req: MPI.Request) -> None:
        # Nonblocking collective waited together with the peers' failure notice (a plain
        # blocking call would wait forever for a rank whose loop died): inside MPI when this
        # host has a core per rank, else polled with CPU yields.
        if self.block_in_mpi and not self.in_caller:
            self.failures.wait(req)
            return
        while True:
            try:
                while not req.Test():
                    self.failures.check()
                    os.sched_yield()  # GIL and CPU; sleep(0) would cost ~50 us of timer slack
                return
            except HvdliteError:
                raise
            except BaseException as exc:  # a signal handler's, in a waiting caller
                if not self.in_caller or exc is self.failures.last_raised:
                    raise  # (or the grace ran out: FailureChannel.check)
                self.failures.defer(exc)  # see FailureChannel.defer: finish the collective

    # -- allreduce --------------------------------------------------------------------
    def _allreduce(self, bucket: list[Response], entries: list[Entry | None]) -> None:
        head = bucket[0]
        names = [r.name for r in bucket] if self.tracer.on else []
        if is_unit(head):
            entry = entries[0]
            for dtype, srcs, dsts, span in unit_groups(head, entry, np):
                self._reduce(head, dtype, srcs, dsts, span, names)
            finish_all(entries, [None if entry is None else entry.outputs])
            return
        spec = _SPECS.get((head.dtype, head.op))
        if spec is None:
            spec = _SPECS[(head.dtype, head.op)] = _spec(head.dtype, head.op)
        if len(bucket) == 1 and spec[5]:
            self._one(head, entries[0], spec, names)
            return
        row, op = spec[0], spec[1]
        srcs, dsts = [], []
        for resp, e in zip(bucket, entries, strict=True):
            if e is None:  # joined: contribute the identity
                scratch = np.full(resp.shape, row.identity(op), dtype=row.np_dtype)
                srcs.append(scratch)
                dsts.append(scratch)
            else:
                srcs.append(e.array)
                dsts.append(e.output)
        self._reduce(head, head.dtype, srcs, dsts, None, names)
        finish_all(entries, [None if e is None else e.output for e in entries])

    def _one(self, head: Response, entry: Entry | None, spec: _Spec, names: list[str]) -> None:
        """One tensor in its native MPI type: reduced straight from the input."""
        row, op = spec[0], spec[1]
        if entry is None:
            out = np.full(head.shape, row.identity(op), dtype=row.np_dtype)
            self.reduce_now(head, out, out, spec, names=names)
        else:
            entry.finish(self.reduce_now(head, entry.array, entry.output, spec, names=names))

    def reduce_now(self, head: Response, src: np.ndarray, out: np.ndarray, spec: _Spec,
                   device_id: int = -1, stream: Any = None,
                   names: list[str] = _NO_NAMES) -> np.ndarray:
        """``out = allreduce(src)`` for one tensor of a native MPI type; returns ``out``
        (host memory: ``device_id`` and ``stream`` unused)."""
        row, op, mtype, _, mop, _ = spec
        if head.prescale != 1.0:
            scale_into(np, out, src, head.prescale)
            send: Any = MPI.IN_PLACE
        else:  # reduce straight from the input: no copy into the output first
            send = MPI.IN_PLACE if src is out else [src, mtype]
        if names:
            with self.tracer.phase(names, "MPI_ALLREDUCE", {"bytes": out.nbytes}):
                self.wait(self.comm.Iallreduce(send, [out, mtype], op=mop))
        else:
            self.wait(self.comm.Iallreduce(send, [out, mtype], op=mop))
        if op is ReduceOp.AVERAGE or head.postscale != 1.0:
            finish_reduce(np, out, op, self.size, head.postscale, row)
        return out

    def unit_now(self, resp: Response, members: Any, outputs: Any, span: Any,
                 device_id: int = -1, stream: Any = None) -> bool:
        """Reduce a grouped call of one dtype (the immediate path); False for mixed dtypes
        (host memory: ``device_id`` and ``stream`` unused)."""
        if type(resp.dtype) is not str or resp.joined:
            return False
        self._reduce(resp, resp.dtype, members, outputs, span, _NO_NAMES)
        return True

    def direct(self, head: Response) -> _Spec | None:
        """What :meth:`reduce_now` needs for ``head``, if it is one (not grouped) allreduce
        of a native MPI type; else None."""
        if head.kind is not Kind.ALLREDUCE or is_unit(head) or head.joined:
            return None
        spec = _SPECS.get((head.dtype, head.op)) or _spec(head.dtype, head.op)
        return spec if spec[5] else None

    def _reduce(self, head: Response, dtype: str, srcs: Sequence[np.ndarray],
                dsts: Sequence[np.ndarray], span: np.ndarray | None, names: list[str]) -> None:
        """Allreduce ``srcs`` into ``dsts`` (one dtype): in ``span`` when the outputs lie end
        to end in it (no copy out; no copy in either when in place), else through the fusion
        buffer. Joined ranks count as contributors (Horovod: they add zeros)."""
        row, op, mtype, wire, mop, native = _SPECS.get((dtype, head.op)) or _spec(dtype, head.op)
        counts = [a.size for a in srcs]
        total = sum(counts)
        if span is not None and native:
            region = span
        else:
            region = (self.fusion.get("cpu", wire, total) if total * wire.itemsize
                      <= self.fusion.threshold else np.empty(total, dtype=wire))
        copy_in = srcs is not dsts or region is not span  # else: in place, in the span
        if copy_in or head.prescale != 1.0:
            with self.tracer.phase(names, "MEMCPY_IN_FUSION_BUFFER"):
                if copy_in:  # flattened by NumPy itself: no view made per member
                    np.concatenate(srcs, axis=None, out=region, casting="unsafe")
                scale_into(np, region, region, head.prescale)
        if op is ReduceOp.ADASUM:
            with self.tracer.phase(names, "MPI_ADASUM_ALLREDUCE", {"bytes": region.nbytes}):
                self._adasum(region, counts)
        else:
            with self.tracer.phase(names, "MPI_ALLREDUCE", {"bytes": region.nbytes}):
                self.wait(self.comm.Iallreduce(MPI.IN_PLACE, [region, mtype], op=mop))
        if region is span and op is not ReduceOp.AVERAGE and head.postscale == 1.0:
            return  # the results are in place: nothing to scale, nothing to copy out
        with self.tracer.phase(names, "MEMCPY_OUT_FUSION_BUFFER"):
            # Scale once over the whole bucket, in the wire precision, before unpacking.
            finish_reduce(np, region, op, self.size, head.postscale, row)
            if region is not span:
                offset = 0
                for dst, n in zip(dsts, counts, strict=True):
                    np.copyto(dst if dst.ndim == 1 else dst.reshape(-1),
                              region[offset:offset + n], casting="unsafe")
                    offset += n

    def _adasum(self, region: np.ndarray, counts: Sequence[int]) -> None:
        """Adasum of ``region`` across the set (``hvdlite/_adasum.py``): point-to-point
        halves with the partner of each level, per-tensor dot products summed per block."""
        rank, size = self.rank, self.size

        def exchange(send: np.ndarray, recv: np.ndarray, partner: int, level: int,
                     halving: bool) -> None:
            # Raw bytes: the values move unchanged, whatever their type.
            rreq = self.comm.Irecv([recv, MPI.BYTE], source=partner, tag=_ADASUM_TAG + level)
            sreq = self.comm.Isend([send, MPI.BYTE], dest=partner, tag=_ADASUM_TAG + level)
            self.wait(rreq)
            self.wait(sreq)

        def block_sum(partials: np.ndarray, level: int) -> np.ndarray:
            # Every rank's partials in its block's slot, one allreduce over the set: no
            # communicator per level to create (and free) collectively.
            block = rank >> (level + 1)
            slots = np.zeros((size >> (level + 1), *partials.shape), dtype=np.float64)
            slots[block] = partials
            self.wait(self.comm.Iallreduce(MPI.IN_PLACE, [slots, MPI.DOUBLE], op=MPI.SUM))
            return slots[block]

        adasum(np, region, counts, rank, size, exchange, block_sum)

    # -- the other collectives (never fused) --------------------------------------------
    def _allgather(self, bucket: list[Response], entries: list[Entry | None]) -> Any:
        resp, entry = bucket[0], entries[0]
        row = DTYPES[resp.dtype]
        mtype, _ = mpi_datatype(row)
        trailing = resp.shape[1:]
        per_row = math.prod(trailing)
        out = np.empty((sum(resp.sizes), *trailing), dtype=row.np_dtype)
        send = (entry.array if entry is not None and entry.array is not None
                else np.empty((0, *trailing), dtype=row.np_dtype))
        counts = [s * per_row for s in resp.sizes]
        self.wait(self.comm.Iallgatherv([send, mtype], [out, (counts, _displs(counts)), mtype]))
        return out

    def _broadcast(self, bucket: list[Response], entries: list[Entry | None]) -> Any:
        resp, entry = bucket[0], entries[0]
        mtype, _ = mpi_datatype(DTYPES[resp.dtype])
        if entry is None:
            scratch = np.empty(resp.shape, dtype=DTYPES[resp.dtype].np_dtype)
            self.wait(self.comm.Ibcast([scratch, mtype], root=resp.root))
            return None
        assert entry.array is not None
        if self.rank == resp.root and entry.output is not entry.array:
            np.copyto(entry.output, entry.array)
        self.wait(self.comm.Ibcast([entry.output, mtype], root=resp.root))
        return entry.output

    def _alltoall(self, bucket: list[Response], entries: list[Entry | None]) -> Any:
        resp, entry = bucket[0], entries[0]
        assert entry is not None and entry.array is not None  # no alltoall with joined ranks
        row = DTYPES[resp.dtype]
        mtype, _ = mpi_datatype(row)
        trailing = entry.array.shape[1:]
        per_row = math.prod(trailing)
        splits = np.asarray(resp.sizes, dtype=np.int64).reshape(self.size, self.size)
        send_counts = [int(s) * per_row for s in splits[self.rank]]
        recv_rows = [int(s) for s in splits[:, self.rank]]
        recv_counts = [r * per_row for r in recv_rows]
        out = np.empty((sum(recv_rows), *trailing), dtype=row.np_dtype)
        self.wait(self.comm.Ialltoallv(
            [entry.array, (send_counts, _displs(send_counts)), mtype],
            [out, (recv_counts, _displs(recv_counts)), mtype]))
        return out

    def _reducescatter(self, bucket: list[Response], entries: list[Entry | None]) -> Any:
        resp, entry = bucket[0], entries[0]
        row = DTYPES[resp.dtype]
        op = ReduceOp(resp.op)
        mtype, wire = mpi_datatype(row)
        trailing = resp.shape[1:]
        per_row = math.prod(trailing)
        rows = _rows_split(resp.shape[0] if resp.shape else 0, self.size)
        if entry is None or entry.array is None:
            send = np.full(resp.shape, row.identity(op), dtype=wire)
        else:
            send = entry.array.astype(wire, copy=False)
        out = np.empty((rows[self.rank], *trailing), dtype=wire)
        self.wait(self.comm.Ireduce_scatter([send, mtype], [out, mtype],
                                             recvcounts=[r * per_row for r in rows],
                                             op=mpi_op(row, op)))
        finish_reduce(np, out, op, self.size, 1.0, row)
        return out.astype(row.np_dtype, copy=False)


def _displs(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def host_alloc(device: str, nbytes: int) -> Any:
    """Fusion-buffer allocator for host memory."""
    return np.empty(max(nbytes, 0), dtype=np.uint8)
