"""CUDA IPC data plane: collectives between ranks of one host through each other's memory.

Ranks that share a GPU (where NCCL refuses to run) or whose GPUs have peer access move device
data here instead of through NCCL. :class:`IpcCommunicator` offers the calls of CuPy's
``NcclCommunicator`` that hvdlite's device backend makes (``allReduce``, ``allGather``,
``broadcast``, ``reduce``, ``reduceScatter``, a group of them) plus ``allToAllv``, with NCCL's
element and op codes, so every collective, fusion path and scaling rule of the backend runs on
either transport unchanged.

Buffers. Each rank owns one staging allocation of two slots (``ipc_buffer_bytes`` each),
allocated with ``cudaMalloc`` by hvdlite itself: user tensors are never exported. At creation
the ranks exchange, in one allgather each (so no order of opens can deadlock), the allocation's
IPC handle, the slots' offsets in it, and four interprocess events per rank: WRITTEN and
READ per slot. Each rank opens every peer's allocation once and caches it by (peer,
allocation, offset): an IPC handle names the *base* of an allocation, the offset says where a
slot lies in it. :meth:`IpcCommunicator.destroy` closes the peers' allocations, then waits at
a barrier for every peer to have closed this rank's, and only then frees it (freeing an
allocation a peer still has open is undefined behaviour).

One step (a collective, or a group, or one chunk of a large one) on slot ``s``::

    stream: wait READ(all, s) -> copy inputs in -> record WRITTEN(r, s)
    host:                                                             \\-- barrier --+
    stream:   wait WRITTEN(peers, s) -> read/reduce the slots -> record READ(r, s)

Why each fence:

- WRITTEN before the barrier, its wait after: a stream wait on an event captures the event's
  *latest record at the time of the wait call*. The barrier makes every peer's WRITTEN record
  of this step precede this rank's wait, so the wait cannot capture a stale record.
- READ(all, s) before the copy in: a slot is written again two steps later; every rank's reads
  of it (its own included, perhaps on another stream) recorded READ after barrier k, before
  reaching barrier k+1, which this rank passed before step k+2. Two slots let step k+1's copy
  overlap step k's reads; one would need a second barrier per step.
- Nothing spins on the device: every wait is a stream wait on an event whose record was issued
  before the barrier, so ranks that share one GPU (their contexts take turns on it) never need
  two kernels of different ranks running at once.

The barrier is nonblocking and waited on together with the peers' failure notices, so a rank
whose engine failed ends its peers' wait; a rank that dies outright is ended by the launcher
(``hvdliterun`` names it), as for host collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from hvdlite._gpu.kernels import ipc_reduce

__all__ = ["IpcCommunicator"]

_ALIGN = 256  # every piece starts on a 256-byte boundary of its slot
_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_D2D = 3  # cudaMemcpyDeviceToDevice
_HANDLE = 64  # bytes of a cudaIpcMemHandle_t / cudaIpcEventHandle_t
_RECORD = _HANDLE * 5 + 8  # one rank's exchange: memory, 4 events, slot capacity
_ALL = -1  # a piece every rank pushes

_NP_OF = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64")


@dataclass(slots=True)
class _Pull:
    """What this rank does with a piece once it is staged: copy rank ``src``'s copy of it to
    ``dst`` (``reduce`` is None), or reduce every rank's copy into ``dst``."""

    dst: int
    src: int = 0
    reduce: tuple[np.dtype, int] | None = None  # (element type, NCCL op code)


@dataclass(slots=True)
class _Piece:
    """Bytes a rank (or every rank: ``_ALL``) stages; ``src`` is this rank's input."""

    pusher: int
    nbytes: int
    src: int
    pulls: list[_Pull] = field(default_factory=list)
    unit: int = 1  # split only at multiples of this (a reduced piece's element size)
    offsets: list[int] = field(default_factory=list)  # per rank, in the slot (set by packing)


class IpcCommunicator:
    """Device collectives of one process set's ranks through CUDA IPC staging slots.

    Not thread-safe: like an NCCL communicator, it is used by whichever thread holds the
    engine's cycle lock, in the agreed order on every rank.
    """

    phase = "IPC"  # timeline and NVTX phase prefix (IPC_ALLREDUCE, ...)

    def __init__(self, comm: MPI.Intracomm, cupy: Any, nccl: Any, device_id: int,
                 slot_bytes: int, wait: Callable[[MPI.Request], None]) -> None:
        self.cupy, self.device_id = cupy, device_id
        self.mpi = comm.Dup()
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        self._wait = wait
        self._types = {getattr(nccl, f"NCCL_{n.upper()}"): np.dtype(n) for n in _NP_OF}
        self._ops = {nccl.NCCL_SUM: "sum", nccl.NCCL_PROD: "prod", nccl.NCCL_MAX: "max",
                     nccl.NCCL_MIN: "min"}
        if hasattr(nccl, "NCCL_AVG"):
            self._ops[nccl.NCCL_AVG] = "avg"
        self._group: list[_Piece] | None = None
        self._group_stream = 0
        self._streams: dict[int, Any] = {}  # CuPy objects for raw stream pointers
        self._step = 0
        rt = cupy.cuda.runtime
        self.capacity = max(_ALIGN, slot_bytes // _ALIGN * _ALIGN)
        with cupy.cuda.Device(device_id):
            self._base = rt.malloc(2 * self.capacity)
            self._events = [rt.eventCreateWithFlags(_EVENT_FLAGS) for _ in range(4)]
            self._exchange()

    # -- handles ------------------------------------------------------------------------
    def _exchange(self) -> None:
        """One allgather of every rank's handles; each peer's opened once (see module doc)."""
        rt = self.cupy.cuda.runtime
        mine = np.zeros(_RECORD, dtype=np.uint8)
        parts = [rt.ipcGetMemHandle(self._base)] + [rt.ipcGetEventHandle(e)
                                                    for e in self._events]
        mine[:_HANDLE * 5] = np.frombuffer(b"".join(parts), dtype=np.uint8)
        mine[_HANDLE * 5:] = np.frombuffer(np.int64(self.capacity).tobytes(), dtype=np.uint8)
        table = np.empty((self.size, _RECORD), dtype=np.uint8)
        self._wait(self.mpi.Iallgather(mine, table))
        self._slots: list[list[int]] = []  # [rank][slot] -> pointer in this context
        self._written: list[list[int]] = []
        self._read: list[list[int]] = []
        self._opened: dict[tuple[int, bytes, int], int] = {}
        for r in range(self.size):
            row = table[r].tobytes()
            cap = int(np.frombuffer(row[_HANDLE * 5:], dtype=np.int64)[0])
            if cap != self.capacity:
                raise ValueError(f"ipc_buffer_bytes differs across ranks: rank {r} has {cap}, "
                                 f"rank {self.rank} {self.capacity}; set one value everywhere")
            if r == self.rank:
                base, events = self._base, self._events
            else:
                base = self._open(r, row[:_HANDLE], 0)
                events = [rt.ipcOpenEventHandle(row[_HANDLE * (i + 1):_HANDLE * (i + 2)])
                          for i in range(4)]
            self._slots.append([base, base + self.capacity])
            self._written.append(events[:2])
            self._read.append(events[2:])

    def _open(self, peer: int, handle: bytes, offset: int) -> int:
        key = (peer, handle, offset)
        ptr = self._opened.get(key)
        if ptr is None:
            base = self.cupy.cuda.runtime.ipcOpenMemHandle(handle, _LAZY_PEER_ACCESS)
            ptr = self._opened[key] = base + offset
        return ptr

    def destroy(self) -> None:
        """Close the peers' allocations, wait until every peer closed ours, then free it
        (collective; after the last step was enqueued)."""
        rt = self.cupy.cuda.runtime
        with self.cupy.cuda.Device(self.device_id):
            rt.deviceSynchronize()  # no step of ours still reads a peer's slot
            for (_, _, offset), ptr in self._opened.items():
                rt.ipcCloseMemHandle(ptr - offset)
            self._opened.clear()
            for r, events in enumerate(zip(self._written, self._read, strict=True)):
                if r != self.rank:
                    for e in (*events[0], *events[1]):
                        rt.eventDestroy(e)
            self._wait(self.mpi.Ibarrier())
            for e in self._events:
                rt.eventDestroy(e)
            rt.free(self._base)
        self.mpi.Free()

    # -- NCCL's call surface --------------------------------------------------------------
    def groupStart(self) -> None:  # noqa: N802 (NCCL's name)
        self._group = []

    def groupEnd(self) -> None:  # noqa: N802
        pieces, self._group = self._group or [], None
        if pieces:
            self._run(pieces, self._group_stream)

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        t = self._types[dtype]
        self._add([_Piece(_ALL, count * t.itemsize, send,
                          [_Pull(recv, reduce=(t, op))], t.itemsize)], stream)

    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int,
               stream: int) -> None:
        t = self._types[dtype]
        pulls = [_Pull(recv, reduce=(t, op))] if self.rank == root else []
        self._add([_Piece(_ALL, count * t.itemsize, send, pulls, t.itemsize)], stream)

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int,
                  stream: int) -> None:
        t = self._types[dtype]
        self._add([_Piece(root, count * t.itemsize, send, [_Pull(recv, root)])], stream)

    def allGather(self, send: int, recv: int, count: int, dtype: int,  # noqa: N802
                  stream: int) -> None:
        nb = count * self._types[dtype].itemsize
        self._add([_Piece(r, nb, send, [_Pull(recv + r * nb, r)]) for r in range(self.size)],
                  stream)

    def reduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int,  # noqa: N802
                      stream: int) -> None:
        t = self._types[dtype]
        nb = count * t.itemsize
        self._add([_Piece(_ALL, nb, send + r * nb,
                          [_Pull(recv, reduce=(t, op))] if r == self.rank else [], t.itemsize)
                   for r in range(self.size)], stream)

    def allToAllv(self, send: int, recv: int, splits: np.ndarray, row_bytes: int,  # noqa: N802
                  stream: int) -> None:
        """Rank s sends ``splits[s, d]`` rows of ``row_bytes`` to rank d, in rank order on
        both sides (the layout every rank knows from the agreed splits)."""
        pieces = []
        recv_off = 0
        for s in range(self.size):
            send_off = 0
            for d in range(self.size):
                nb = int(splits[s, d]) * row_bytes
                if d == self.rank:
                    pulls = [_Pull(recv + recv_off, s)]
                    recv_off += nb
                else:
                    pulls = []
                src = send + send_off if s == self.rank else 0
                pieces.append(_Piece(s, nb, src, pulls))
                send_off += nb
        self._add(pieces, stream)

    def _add(self, pieces: list[_Piece], stream: int) -> None:
        if self._group is not None:
            self._group.extend(pieces)
            self._group_stream = stream
        else:
            self._run(pieces, stream)

    # -- steps ----------------------------------------------------------------------------
    def _run(self, pieces: list[_Piece], stream: int) -> None:
        # After a call (it enters and leaves a device context, and a stream context for its
        # reduce kernels) CuPy's current stream was the null stream, not the caller's: every
        # later CuPy call of the caller (or of the backend: Adasum's dot products) would then
        # run unordered with a non-blocking stream. So the caller's current stream is put
        # back, whatever happens.
        cuda = self.cupy.cuda
        with cuda.Device(self.device_id):
            current = cuda.get_current_stream()
            try:
                for step in self._pack(pieces):
                    self._do_step(step, stream)
            finally:
                current.use()

    def _pack(self, pieces: list[_Piece]) -> Iterator[list[_Piece]]:
        """Pieces split to fit a slot, then packed into steps; every rank computes the same
        offsets, since every piece's size is known to all (its rank's share of the call)."""
        used = [0] * self.size
        step: list[_Piece] = []
        for piece in (p for whole in pieces for p in self._split(whole)):
            if piece.nbytes == 0:
                continue  # (every rank knows every size, so all skip it alike)
            ranks = range(self.size) if piece.pusher == _ALL else (piece.pusher,)
            if step and any(used[r] + piece.nbytes > self.capacity for r in ranks):
                yield step
                used, step = [0] * self.size, []
            piece.offsets = [-1] * self.size
            for r in ranks:
                piece.offsets[r] = used[r]
                used[r] += -(-piece.nbytes // _ALIGN) * _ALIGN
            step.append(piece)
        if step:
            yield step

    def _split(self, piece: _Piece) -> Iterator[_Piece]:
        chunk = self.capacity // math.lcm(piece.unit, _ALIGN) * math.lcm(piece.unit, _ALIGN)
        if piece.nbytes <= self.capacity or chunk == 0:
            if piece.nbytes > self.capacity:
                raise ValueError(f"one row of {piece.nbytes} bytes exceeds ipc_buffer_bytes "
                                 f"({self.capacity}); raise ipc_buffer_bytes")
            yield piece
            return
        for at in range(0, piece.nbytes, chunk):
            n = min(chunk, piece.nbytes - at)
            yield _Piece(piece.pusher, n, piece.src + at if piece.src else 0,
                         [_Pull(p.dst + at, p.src, p.reduce) for p in piece.pulls], piece.unit)

    def _do_step(self, step: list[_Piece], stream: int) -> None:
        rt = self.cupy.cuda.runtime
        slot = self._step & 1
        self._step += 1
        me = self.rank
        for r in range(self.size):
            rt.streamWaitEvent(stream, self._read[r][slot], 0)
        mine = self._slots[me][slot]
        for piece in step:
            if piece.nbytes and piece.offsets[me] >= 0:
                rt.memcpyAsync(mine + piece.offsets[me], piece.src, piece.nbytes, _D2D, stream)
        rt.eventRecord(self._written[me][slot], stream)
        self._wait(self.mpi.Ibarrier())
        for r in range(self.size):
            if r != me:
                rt.streamWaitEvent(stream, self._written[r][slot], 0)
        for piece in step:
            for pull in piece.pulls:
                if pull.reduce is None:
                    if piece.nbytes:
                        src = self._slots[pull.src][slot] + piece.offsets[pull.src]
                        rt.memcpyAsync(pull.dst, src, piece.nbytes, _D2D, stream)
                else:
                    self._reduce(piece, pull, slot, stream)
        rt.eventRecord(self._read[me][slot], stream)

    def _reduce(self, piece: _Piece, pull: _Pull, slot: int, stream: int) -> None:
        dtype, op = pull.reduce  # type: ignore[misc]
        count = piece.nbytes // dtype.itemsize
        if count == 0:
            return
        target = self._streams.get(stream)
        if target is None:
            target = self._streams[stream] = self.cupy.cuda.ExternalStream(stream,
                                                                           self.device_id)
        with target:  # (the caller's current stream is put back by _run)
            ipc_reduce(self._ops[op], dtype.name,
                       [self._slots[r][slot] + piece.offsets[r] for r in range(self.size)],
                       pull.dst, count)
