"""CUDA IPC data plane: collectives between ranks of one host through each other's memory.

Ranks that share a GPU (where NCCL refuses to run) or whose GPUs have peer access move device
data here instead of through NCCL. :class:`IpcCommunicator` offers the calls of CuPy's
``NcclCommunicator`` that hvdlite's device backend makes (``allReduce``, ``allGather``,
``broadcast``, ``reduce``, ``reduceScatter``, a group of them) plus ``allToAllv``, with NCCL's
element and op codes, so every collective, fusion path and scaling rule of the backend runs on
either transport unchanged.

Buffers. Each rank owns one staging allocation of two slots (``ipc_buffer_bytes`` each),
allocated with ``cudaMalloc`` by hvdlite itself: user tensors are never exported. At creation
the ranks agree on a protocol (``_gpu/fences.py``: device semaphores where every rank can use
stream memory operations, else interprocess events and a barrier per step; the choice is
logged and the doctor prints it), then exchange, in one allgather (so no order of opens can
deadlock), the allocation's IPC handle and the protocol's handles (a semaphore inbox, or four
events). Each rank maps every peer's allocations once (``_gpu/mapping.py``: a handle names an
allocation's *base*, so the slots are offsets into it). :meth:`IpcCommunicator.destroy` closes
the peers' mappings, then waits at a barrier for every peer to have closed this rank's, and
only then frees them (freeing an allocation a peer still has open is undefined behaviour).

One step (a collective, or a group, or one chunk of a large one) number ``k`` uses slot
``s = k % 2`` in its epoch ``e = k // 2 + 1``; with device semaphores, all on the caller's
stream::

    wait READ(every rank, s) >= e - 1       (every rank read this rank's slot's last use)
    copy inputs into own slot s
    signal WRITTEN(s) = e to every peer;  wait WRITTEN(every peer, s) >= e
    read / reduce the slots s of the ranks
    signal READ(s) = e to every rank (itself included)

Why each fence:

- READ before the copy in: a slot is written again two steps later; every rank's reads of it
  (its own included, perhaps on another stream: so a rank signals itself too) are behind the
  READ epoch it awaits. Two slots let step k+1's copy in overlap step k's reads, so a chunked
  call pipelines: its chunks go out back to back, each stage ordered by flags alone.
- WRITTEN: a rank reads a peer's slot only after the peer's copy into it (the signal is a
  stream write with a memory fence: what the stream wrote before is visible first).
- Every signal of a stage before its waits, and every rank issues the same steps in the same
  order (the engine's agreed order), so no wait can hold up the signal it waits for.
- Nothing spins on an SM and no host thread waits: a wait is the stream's own, so ranks that
  share one GPU (their contexts take turns on it) never need two kernels of different ranks
  running at once. No MPI call is made per step.

One-shot steps. Where every rank has a GPU of its own and the flags protocol runs, a step
that is one small reduced piece (an allreduce, a reduce's root: ``ONESHOT_BYTES`` or less) is
one kernel (``kernels.ipc_oneshot``): it waits, copies, signals and reduces exactly as the
step above, its fences done by one thread spinning on the same flags instead of one stream
memory operation each, so the host issues one launch where the memop step issues about eight
driver calls (what bounded I1 in gpu-validation run 82). Ranks that share a GPU never take it:
their contexts take turns on the GPU, and a kernel spinning for a peer that cannot run would
crawl.

With events (the fallback) the step is the same, with WRITTEN and READ as event records and a
failure-aware MPI barrier between the WRITTEN records and their waits (``_gpu/fences.py``
says why).

Failure. A rank that dies while a peer's stream waits on it would leave that stream parked
forever (and with it any host thread that synchronises it, and the process's exit). The
engine's abort path (``NcclBackend.abort``, reached from ``Engine.stopped`` when the job ends
with an error) calls :meth:`IpcCommunicator.release`: the rank sets its own flags far ahead
from a private stream, so its waits pass and its streams drain (the entries were failed
first). A rank that dies outright is ended by the launcher (``hvdliterun`` names it), as for
host collectives; the driver frees its context.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from hvdlite._gpu import semaphores
from hvdlite._gpu.fences import HANDLE, EventFences, FlagFences
from hvdlite._gpu.kernels import ipc_oneshot, ipc_reduce
from hvdlite._gpu.mapping import PeerMappings
from hvdlite._lru import Bounded

__all__ = ["IpcCommunicator", "ONESHOT_BYTES", "PROTOCOLS", "TWO_SHOT_BYTES", "oneshot_pull",
           "two_shot_phases"]

log = logging.getLogger("hvdlite")

PROTOCOLS = ("auto", "flags", "events")
_SLOTS = 2
_STREAMS_KEPT = 64  # the raw streams a communicator keeps CuPy objects of, most recent
_ALIGN = 256  # every piece starts on a 256-byte boundary of its slot
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_D2D = 3  # cudaMemcpyDeviceToDevice
_MAPPINGS = 64  # unpinned peer mappings kept open (registered buffers; slots are pinned)
_ALL = -1  # a piece every rank pushes
# Largest allreduce run as one kernel (kernels.ipc_oneshot) where the ranks have a GPU each and
# the flags protocol runs: one block reduces it, and the crossover against the stream-memop
# step is to be measured (bench_ipc.py, I1) and recorded.
ONESHOT_BYTES = 64 * 1024
# From this many ranks, an allreduce larger than TWO_SHOT_BYTES (not in a group) goes in two
# phases: a reduce-scatter (each rank reduces its 1/n of every rank's input) and an all-gather
# of the reduced parts; each rank then reads 2(n-1)/n of the bytes from its peers instead of
# (n-1) times them. The crossover is to be measured at 4 GPUs (issue 41's I1-I2) and recorded.
TWO_SHOT_RANKS = 4
TWO_SHOT_BYTES = 256 * 1024

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
                 slot_bytes: int, wait: Callable[[MPI.Request], None],
                 protocol: str = "auto", oneshot_bytes: int = 0) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"IpcCommunicator protocol must be one of {PROTOCOLS}, got "
                             f"{protocol!r}")
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
        # CuPy objects for raw stream pointers, bounded (a caller making streams per step).
        self._streams: Bounded[int, Any] = Bounded(_STREAMS_KEPT)
        self._step = 0
        rt = cupy.cuda.runtime
        self.capacity = max(_ALIGN, slot_bytes // _ALIGN * _ALIGN)
        self._maps = PeerMappings(lambda h: int(rt.ipcOpenMemHandle(h, _LAZY_PEER_ACCESS)),
                                  rt.ipcCloseMemHandle, _MAPPINGS)
        with cupy.cuda.Device(device_id):
            self._agree(protocol)
            self._base = rt.malloc(_SLOTS * self.capacity)
            self.fences: EventFences | FlagFences = (
                FlagFences(semaphores.Semaphores(cupy, device_id, self.rank, self.size,
                                                 _SLOTS))
                if self.protocol == "flags" else
                EventFences(cupy, device_id, self.rank, self.size, _SLOTS, self.mpi, wait))
            self._exchange()
            # One-shot steps (``oneshot_bytes`` > 0: the caller's ranks have a GPU each):
            # every rank's slot and inbox pointers as device tables, made once.
            self.oneshot_bytes = oneshot_bytes if self.protocol == "flags" else 0
            self.oneshot_steps = 0  # steps run as one kernel (tests, the doctor)
            if self.oneshot_bytes:
                inboxes = self.fences.sem.inboxes  # type: ignore[union-attr]
                self._oneshot_tables = (
                    [cupy.asarray(np.array([self._slots[r][k] for r in range(self.size)],
                                           dtype=np.uint64)) for k in range(_SLOTS)],
                    cupy.asarray(np.array(inboxes, dtype=np.uint64)))

    # -- setup ------------------------------------------------------------------------------
    def _agree(self, protocol: str) -> None:
        """Every rank's slot size and whether it can use device semaphores, in one allgather:
        the protocol is the same on every rank (``semaphores.choose_protocol``)."""
        if protocol == "events":
            code = semaphores.FORCED_EVENTS
        else:
            code = semaphores.memops_support(self.cupy, self.device_id)
        mine = np.array([self.capacity, code], dtype=np.int64)
        table = np.empty((self.size, 2), dtype=np.int64)
        self._wait(self.mpi.Iallgather(mine, table))
        for r, cap in enumerate(table[:, 0].tolist()):
            if cap != self.capacity:
                raise ValueError(f"ipc_buffer_bytes differs across ranks: rank {r} has {cap}, "
                                 f"rank {self.rank} {self.capacity}; set one value everywhere")
        self.protocol, self.protocol_why = semaphores.choose_protocol(table[:, 1].tolist())
        if protocol == "flags" and self.protocol != "flags":
            raise RuntimeError(f"CUDA IPC with device semaphores was asked for, but "
                               f"{self.protocol_why}")
        if self.rank == 0:
            level = logging.INFO if self.protocol == "flags" or protocol == "events" \
                else logging.WARNING
            log.log(level, "hvdlite: CUDA IPC steps of %d ranks on GPU %d ordered by %s",
                    self.size, self.device_id, self.protocol_why)

    def _exchange(self) -> None:
        """One allgather of every rank's handles; each peer's mapped once (see module doc)."""
        rt = self.cupy.cuda.runtime
        record = HANDLE + self.fences.record
        mine = np.frombuffer(bytes(rt.ipcGetMemHandle(self._base)) + self.fences.handles(),
                             dtype=np.uint8).copy()
        assert mine.size == record
        table = np.empty((self.size, record), dtype=np.uint8)
        self._wait(self.mpi.Iallgather(mine, table))
        rows = [table[r].tobytes() for r in range(self.size)]
        self._slots: list[list[int]] = []  # [rank][slot] -> pointer in this context
        for r, row in enumerate(rows):
            base = self._base if r == self.rank else self._maps.get(r, row[:HANDLE],
                                                                    pinned=True)
            self._slots.append([base + i * self.capacity for i in range(_SLOTS)])
        self.fences.attach([row[HANDLE:] for row in rows],
                           lambda r, h: self._maps.get(r, h, pinned=True))

    def release(self) -> bool:
        """The job is ending with an error: let this rank's streams past every wait on a peer
        that may never signal (see the module docstring). True if its streams drained."""
        with self.cupy.cuda.Device(self.device_id):
            return self.fences.release()

    def destroy(self) -> None:
        """Close the peers' mappings, wait until every peer closed ours, then free ours
        (collective; after the last step was enqueued)."""
        rt = self.cupy.cuda.runtime
        with self.cupy.cuda.Device(self.device_id):
            rt.deviceSynchronize()  # no step of ours still reads a peer's slot
            self.fences.close_peers()
            self._maps.close_all()
            self._wait(self.mpi.Ibarrier())
            self.fences.free()
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
        if (self._group is None and self.size >= TWO_SHOT_RANKS
                and count * t.itemsize > TWO_SHOT_BYTES):
            for phase in two_shot_phases(send, recv, count, t, op, self.rank, self.size):
                self._run(phase, stream)  # the second phase reads what the first wrote
            return
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
                self.fences.end_call(stream)
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
        slot, epoch = semaphores.step_epoch(self._step, _SLOTS)
        first = self._step < _SLOTS
        self._step += 1
        me = self.rank
        one = oneshot_pull(step, self.oneshot_bytes)
        # The kernel keeps the memop step's flag protocol, so ranks may take either path for
        # one step (a reduce's root reduces; its other ranks only stage).
        if one is not None:
            self._oneshot(one[0], one[1], slot, epoch, first, stream)
            return
        fences = self.fences
        fences.before_write(stream, slot, epoch, first)
        mine = self._slots[me][slot]
        for piece in step:
            if piece.nbytes and piece.offsets[me] >= 0:
                rt.memcpyAsync(mine + piece.offsets[me], piece.src, piece.nbytes, _D2D, stream)
        fences.after_write(stream, slot, epoch)
        for piece in step:
            for pull in piece.pulls:
                if pull.reduce is None:
                    if piece.nbytes:
                        src = self._slots[pull.src][slot] + piece.offsets[pull.src]
                        rt.memcpyAsync(pull.dst, src, piece.nbytes, _D2D, stream)
                else:
                    self._reduce(piece, pull, slot, stream)
        fences.after_read(stream, slot, epoch)

    def _oneshot(self, piece: _Piece, pull: _Pull, slot: int, epoch: int, first: bool,
                 stream: int) -> None:
        dtype, op = pull.reduce  # type: ignore[misc]
        slots, inboxes = self._oneshot_tables
        self.oneshot_steps += 1
        self.fences.sem.awaits(epoch)  # type: ignore[union-attr]  # (what release() passes)
        with self._stream(stream):
            ipc_oneshot(self._ops[op], dtype.name, self.size, _SLOTS, piece.src, slots[slot],
                        inboxes, pull.dst, piece.nbytes // dtype.itemsize, self.rank, slot,
                        epoch, first)

    def _stream(self, stream: int) -> Any:
        """The CuPy object of a raw stream pointer (made once per stream)."""
        target = self._streams.get(stream)
        if target is None:
            target = self.cupy.cuda.ExternalStream(stream, self.device_id)
            self._streams.keep(stream, target)
        return target

    def _reduce(self, piece: _Piece, pull: _Pull, slot: int, stream: int) -> None:
        dtype, op = pull.reduce  # type: ignore[misc]
        count = piece.nbytes // dtype.itemsize
        if count == 0:
            return
        with self._stream(stream):  # (the caller's current stream is put back by _run)
            ipc_reduce(self._ops[op], dtype.name,
                       [self._slots[r][slot] + piece.offsets[r] for r in range(self.size)],
                       pull.dst, count)


def oneshot_pull(step: list[_Piece], limit: int) -> tuple[_Piece, _Pull] | None:
    """The piece and its reduction where ``step`` is one piece every rank pushes and this
    rank reduces (an allreduce; a reduce's root), of at most ``limit`` bytes: a step the
    one-shot kernel runs. Pure."""
    if len(step) != 1:
        return None
    piece = step[0]
    if piece.pusher != _ALL or len(piece.pulls) != 1 or not 0 < piece.nbytes <= limit:
        return None
    pull = piece.pulls[0]
    if pull.reduce is None or pull.reduce[0].itemsize == 0:
        return None
    return piece, pull


def two_shot_phases(send: int, recv: int, count: int, dtype: np.dtype, op: int, rank: int,
                    size: int) -> list[list[_Piece]]:
    """The pieces of a two-shot allreduce, by phase: every rank stages its whole input and
    rank ``r`` reduces part ``r`` (elements ``[r*count//size, (r+1)*count//size)``) into
    ``recv``; then rank ``r`` stages its reduced part and every other rank copies it into its
    ``recv``. Pure; each rank computes its own (the sizes are the same on all)."""
    item = dtype.itemsize
    bounds = [r * count // size for r in range(size + 1)]
    parts = [((bounds[r] * item), (bounds[r + 1] - bounds[r]) * item) for r in range(size)]
    scatter = [_Piece(_ALL, nb, send + off,
                      [_Pull(recv + off, reduce=(dtype, op))] if r == rank else [], item)
               for r, (off, nb) in enumerate(parts)]
    gather = [_Piece(r, nb, recv + off if r == rank else 0,
                     [] if r == rank else [_Pull(recv + off, r)])
              for r, (off, nb) in enumerate(parts)]
    return [scatter, gather]
