"""The CUDA IPC transport of an agreed schedule (the contract: ``_backends/base.py``,
:class:`~hvdlite._backends.base.ScheduleTransport`), for ranks with a GPU each on one host
(``schedule_transport = "ipc"``).

Every slot's buffer is fixed for the schedule's life, so each rank maps its peers' buffers
once, when the schedule opens (one IPC handle per allocation, an offset into it), and no rank
stages its own data for the others. Slot ``i``'s launch, on the schedule's own stream after
the producer's READY event, with each rank owning an equal share of the buffer:

1. WRITTEN: tell every peer this rank's buffer is final; wait for theirs;
2. pull: this rank's share of every peer's buffer copied into a scratch buffer by
   ``cudaMemcpyAsync`` over NVLink, which the copy engines run (no SM);
3. reduce: one kernel on a bounded number of blocks reduces the share from its own buffer and
   the scratch copies, in rank order (every rank's bits alike), reading local memory only, and
   writes the result over its own share;
4. REDUCED: signal, wait;
5. gather: the peers' reduced shares copied into this rank's buffer, on the copy engines;
6. GATHERED: signal, wait (a peer may still be copying this rank's share: the producer must
   not overwrite the buffer before), then DONE.

No share a peer reads is written while it reads it: a rank writes only its own share before
REDUCED and only the shares the peers finished with after. Launches run in order on the
schedule's one stream, so one scratch buffer, (ranks - 1) times the largest share, serves
every slot. A step captured by ``make_graphed_step`` replays its launches as captured, so a
wait cannot name an epoch the host counts. With a GPU per rank the flags' epochs live on the
device (``_gpu/kernels.py``'s schedule kernels: single-warp kernels that count, signal and
spin), and :meth:`abort` sets a word in mapped host memory that every wait polls, so a stream
parked on a dead peer drains. Ranks that share a GPU cannot spin (their contexts take turns on
it: a spinning wait would hold its peer off): their waits are stream memory operations
(``cuStreamWaitValue32``, in the GPU's front end, no SM), on flags that carry no epoch. A
signal writes 1 into the peer's flag, a wait waits for 1 in its own, then sets it back to 0;
a peer's next 1 for that flag comes only after a later signal of this rank, which follows the
reset on its stream (a slot's three kinds take turns, and its launches follow each other). There
:meth:`abort` sets every flag of the rank's inbox to 1 every millisecond from a thread of
its own, until :meth:`close`: the launches still queued (a captured step's replays queue on
the caller's stream, which the transport cannot watch drain) pass one round of waits per write.

A launch is three signals and waits, the copies and the reduce: about ten driver calls
from Python, which an eager (host-bound) step pays per bucket. Since nothing in a launch
changes from one to the next (fixed addresses, epochs on the device), each slot's launch is
captured once, at its first eager launch, into a CUDA graph of its own, and later eager
launches are one graph launch between the READY and DONE events. A launch that is itself being
captured (``make_graphed_step``) enqueues the work directly, as does every launch if a slot's
capture fails (logged once; the direct launch is the same work). At one rank a launch is its
two events alone: the buffer is already the result, and a one-rank job (which
``make_graphed_step`` moves to this transport) must not pay a pass over every bucket.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdlite._backends.schedule_device import DeviceSlots
from hvdlite._gpu import kernels
from hvdlite._gpu.mapping import PeerMappings
from hvdlite._gpu.semaphores import checked, choose_protocol, driver, memops_support
from hvdlite._ops import DTYPES, ReduceOp
from hvdlite._threads import start_quietly
from hvdlite._vocab.agreed import Slot
from hvdlite.errors import HvdliteError

__all__ = ["IpcScheduleSide", "IpcScheduleTransport", "LaunchPlan", "launch_plan", "meeting",
           "placement_why", "shared", "shares", "why_not"]

log = logging.getLogger("hvdlite")

WRITTEN, REDUCED, GATHERED = 0, 1, 2
_KINDS = 3
_ALIGN = 16  # bytes: every share starts on a 16-byte boundary (vector loads, copy engines)
_REDUCE_BLOCKS = 128  # the local reduce's blocks at most (to be tuned on the GPU: I3, T5)
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_D2D = 3  # cudaMemcpyDeviceToDevice
_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVERAGE: "avg", ReduceOp.MIN: "min",
        ReduceOp.MAX: "max", ReduceOp.PRODUCT: "prod"}


def why_not(slots: Sequence[Slot]) -> str:
    """'' if this transport can run ``slots``, else why not."""
    for s in slots:
        if s.dtype not in kernels.CTYPES or s.dtype == "bool":
            return f"slot {s.name!r}: dtype {s.dtype} has no CUDA IPC reduce kernel"
        if ReduceOp(s.op) not in _OPS:
            return f"slot {s.name!r}: op {ReduceOp(s.op).name} has no CUDA IPC reduce kernel"
        if s.pre != 1.0 or s.post != 1.0:
            return f"slot {s.name!r}: scale factors (pre {s.pre}, post {s.post})"
    return ""


def shares(count: int, itemsize: int, size: int) -> list[tuple[int, int]]:
    """Each rank's (first element, element count) of a ``count``-element buffer: equal
    shares, each starting on a 16-byte boundary (the last may be shorter, or empty)."""
    unit = max(1, _ALIGN // itemsize) if _ALIGN % itemsize == 0 else 1
    per = -(-count // size)
    per = -(-per // unit) * unit
    return [(min(r * per, count), max(0, min(per, count - r * per))) for r in range(size)]


def placement_why(records: Sequence[dict[str, Any]]) -> str:
    """'' if every rank of the agreement (``records``, in rank order) sits on one host with a
    GPU of its own, else why not (the same answer on every rank)."""
    hosts = {r["host"] for r in records}
    if len(hosts) > 1:
        return f"its ranks are on {len(hosts)} hosts ({', '.join(sorted(hosts))}); CUDA IPC " \
               "reaches the GPUs of one host"
    if shared(records):
        protocol, why = choose_protocol([r.get("memops", -1) for r in records])
        if protocol != "flags":
            return f"its ranks share a GPU, where the schedule's waits are stream memory " \
                   f"operations; {why.partition(': ')[2]}"
    return ""


def meeting(kind: int, slot: int, slots: int, me: int, size: int) -> list[tuple[str, int, int]]:
    """One signal-and-wait of ranks that share a GPU (see the module docstring), as the stream
    operations rank ``me`` enqueues, in order: ``("signal", r, f)`` writes 1 into flag ``f`` of
    rank ``r``'s inbox (the flag that says ``me`` reached ``kind`` of ``slot``); ``("wait", me,
    f)`` waits until this rank's flag ``f`` is 1; ``("reset", me, f)`` sets ``size`` flags of
    this rank's inbox, from ``f`` on (every peer's for ``kind`` of ``slot``), back to 0. Flags
    sit as the schedule kernels lay them out: ``[kind][slot][peer]``."""
    base = (kind * slots + slot) * size
    ops = [("signal", r, base + me) for r in range(size) if r != me]
    ops += [("wait", me, base + r) for r in range(size) if r != me]
    ops.append(("reset", me, base))
    return ops


def shared(records: Sequence[dict[str, Any]]) -> bool:
    """Whether two ranks of the agreement (``records``) share a GPU: the schedule then waits by
    stream memory operations, not by spinning kernels (see the module docstring)."""
    return len({r["gpu"] for r in records}) < len(records)


def _capturing(stream: Any) -> bool:
    """Whether ``stream`` is being captured; True where CUDA cannot say (the legacy stream
    while another thread captures), so the launch then enqueues its work directly."""
    try:
        return bool(stream.is_capturing())
    except Exception:  # noqa: BLE001
        return True


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """One rank's launch of one slot as addresses: ``pulls`` and ``gathers`` are copies
    (destination, source, bytes); the reduce combines ``inputs`` (rank order) into ``out``,
    ``count`` elements."""

    pulls: list[tuple[int, int, int]]
    inputs: list[int]
    out: int
    count: int
    gathers: list[tuple[int, int, int]]


def launch_plan(rank: int, count: int, itemsize: int, ptrs: Sequence[int], scratch: int,
                stride: int) -> LaunchPlan:
    """What rank ``rank`` copies and reduces for a buffer of ``count`` elements at ``ptrs[r]``
    on each rank r (as mapped here), with its scratch buffer at ``scratch`` (one ``stride``
    of bytes per peer): pull its share of every peer's buffer, reduce it over its own share,
    then gather every other rank's reduced share from that rank's buffer."""
    size = len(ptrs)
    parts = shares(count, itemsize, size)
    first, mine = parts[rank]
    own = ptrs[rank] + first * itemsize
    peers = [r for r in range(size) if r != rank]
    spare = {r: scratch + k * stride for k, r in enumerate(peers)}
    pulls = [(spare[r], ptrs[r] + first * itemsize, mine * itemsize) for r in peers] \
        if mine else []
    inputs = [own if r == rank else spare[r] for r in range(size)]
    gathers = [(ptrs[rank] + at * itemsize, ptrs[r] + at * itemsize, n * itemsize)
               for r, (at, n) in enumerate(parts) if r != rank and n]
    return LaunchPlan(pulls, inputs, own, mine, gathers)


class IpcScheduleSide:
    """This rank's part, made before the agreement: its flag inbox, its slot counters, its
    abort word, and the IPC handles of its buffers (what :meth:`record` shows the peers)."""

    def __init__(self, cupy: Any, device_id: int, slots: Sequence[Slot],
                 buffers: Sequence[tuple[int, int]], size: int) -> None:
        self.cupy, self.device_id, self.size = cupy, device_id, size
        self.n = len(slots)
        drv = driver()
        rt = cupy.cuda.runtime
        self.inbox = self.counters = self.abort_host = 0
        with cupy.cuda.Device(device_id):
            kernels.prepare_schedule([(_OPS[ReduceOp(s.op)], s.dtype) for s in slots], size)
            self.gpu = str(cupy.cuda.Device(device_id).pci_bus_id)
            handles: dict[int, int] = {}  # allocation base -> index into self.handles
            self.handles: list[str] = []
            self.places: list[tuple[int, int]] = []  # per slot: (handle index, offset)
            for ptr, _count in buffers:
                base = int(checked(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")[0])
                if base not in handles:
                    handles[base] = len(self.handles)
                    self.handles.append(bytes(rt.ipcGetMemHandle(base)).hex())
                self.places.append((handles[base], ptr - base))
            nbytes = 4 * _KINDS * self.n * size
            self.inbox = rt.malloc(nbytes)
            rt.memset(self.inbox, 0, nbytes)
            self.counters = rt.malloc(4 * self.n)
            rt.memset(self.counters, 0, 4 * self.n)
            rt.deviceSynchronize()  # zeroed before any peer can signal into the inbox
            self.inbox_handle = bytes(rt.ipcGetMemHandle(self.inbox)).hex()
            flags = 1 | 2  # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
            self.abort_host = int(checked(drv.cuMemHostAlloc(4, flags), "cuMemHostAlloc"))
            ctypes.c_uint32.from_address(self.abort_host).value = 0
            self.abort_device = int(checked(drv.cuMemHostGetDevicePointer(self.abort_host, 0),
                                           "cuMemHostGetDevicePointer"))
        self.memops = memops_support(cupy, device_id)  # shown: ranks sharing a GPU need them

    def record(self) -> dict[str, Any]:
        """What every peer needs of this rank (JSON-able)."""
        return {"host": socket.gethostname(), "gpu": self.gpu, "inbox": self.inbox_handle,
                "handles": self.handles, "places": self.places, "memops": self.memops}

    def free(self) -> None:
        """Free this rank's inbox, counters and abort word (idempotent)."""
        rt = self.cupy.cuda.runtime
        with self.cupy.cuda.Device(self.device_id):
            inbox, counters, self.inbox, self.counters = self.inbox, self.counters, 0, 0
            for ptr in (inbox, counters):
                if ptr:
                    rt.free(ptr)
            if self.abort_host:
                driver().cuMemFreeHost(self.abort_host)
                self.abort_host = 0


class IpcScheduleTransport(DeviceSlots):
    """Slots as in-place allreduces of fixed device buffers through CUDA IPC (see the module
    docstring); ``records``: every rank's :meth:`IpcScheduleSide.record`, in rank order."""

    kind = "ipc"

    def __init__(self, side: IpcScheduleSide, records: Sequence[dict[str, Any]],
                 slots: Sequence[Slot], buffers: Sequence[tuple[int, int]], rank: int,
                 priority: int) -> None:
        cupy, device_id = side.cupy, side.device_id
        self.cupy, self.device_id, self.side = cupy, device_id, side
        self.rank, self.size, self.n = rank, side.size, side.n
        rt = cupy.cuda.runtime
        self._maps = PeerMappings(
            lambda h: int(rt.ipcOpenMemHandle(h, _LAZY_PEER_ACCESS)), rt.ipcCloseMemHandle,
            1)  # (every mapping pinned: open for the schedule's life)
        self._aborted = False
        # The release thread and what stops it (:meth:`_release`), once aborted.
        self._releasing: tuple[threading.Event, threading.Thread] | None = None
        with cupy.cuda.Device(device_id):
            inboxes = [side.inbox if r == rank else
                       self._maps.get(r, bytes.fromhex(rec["inbox"]), pinned=True)
                       for r, rec in enumerate(records)]
            self._inboxes = cupy.asarray(np.array(inboxes, dtype=np.uint64))
            self._inbox_ptrs = inboxes
            # Ranks that share a GPU wait by stream memory operations (see the docstring).
            self._flags = shared(records)
            if self._flags:
                drv = self._drv = driver()
                self._geq = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
                # Made now, not at the failure: making a stream then could wait on the device.
                self._release_stream = checked(drv.cuStreamCreate(
                    int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")

            def address(r: int, i: int) -> int:
                if r == rank:
                    return buffers[i][0]
                index, offset = records[r]["places"][i]
                return self._maps.get(r, bytes.fromhex(records[r]["handles"][index]), offset,
                                      pinned=True)

            largest = max((n * DTYPES[s.dtype].np_dtype.itemsize
                           for i, s in enumerate(slots)
                           for _, n in shares(buffers[i][1], DTYPES[s.dtype].np_dtype.itemsize,
                                              self.size)), default=0)
            self._stride = -(-largest // _ALIGN) * _ALIGN
            self._scratch = rt.malloc(max(1, (self.size - 1) * self._stride))
            super().__init__(cupy, device_id, self.n, priority)
            self._plans = [self._plan(s, buffers[i][1], [address(r, i) for r in
                                                          range(self.size)])
                           for i, s in enumerate(slots)]
        self._graphs: list[Any] = [None] * self.n  # per slot: its launch as a CUDA graph
        self._graphing = True  # off for good once a slot's capture failed

    def _plan(self, slot: Slot, count: int, ptrs: list[int]) -> tuple[LaunchPlan, str, str]:
        isz = DTYPES[slot.dtype].np_dtype.itemsize
        plan = launch_plan(self.rank, count, isz, ptrs, self._scratch, self._stride)
        return plan, _OPS[ReduceOp(slot.op)], slot.dtype

    @property
    def graphs_built(self) -> int:
        """How many slots launch eagerly as a CUDA graph of their own (see the module
        docstring)."""
        return sum(g is not None for g in self._graphs)

    def launch(self, i: int, stream: Any) -> None:
        if self._aborted:
            raise HvdliteError("the agreed schedule's CUDA IPC transport was aborted (the job "
                               "is ending with an error raised on every rank)")
        self.fork(i, stream)
        if self.size == 1:  # one rank's buffer is already its sum, average, min, max, product
            self.join(i)
            return
        graph = None
        if self._graphing and not _capturing(stream):
            graph = self._graphs[i]
            if graph is None:
                graph = self._capture(i)
        if graph is None:
            self._enqueue(i, True)
        else:
            try:
                graph.launch(stream=self.stream)
            except BaseException:
                self._broken(i, (WRITTEN, REDUCED, GATHERED))
                raise
        self.join(i)

    def _capture(self, i: int) -> Any:
        """Slot ``i``'s launch captured into a CUDA graph (None, and no graph from now on, if
        the capture fails: nothing of it ran, so the direct launch follows)."""
        stream = self.stream
        try:
            stream.begin_capture(mode=self.cupy.cuda.runtime.streamCaptureModeThreadLocal)
            try:
                self._enqueue(i, False)
            finally:
                graph = stream.end_capture()  # ends the capture whatever happened in it
        except Exception:  # noqa: BLE001 (no graph: the direct launch is the same work)
            log.info("hvdlite: the CUDA IPC schedule launches without graphs", exc_info=True)
            self._graphing = False
            return None
        self._graphs[i] = graph
        return graph

    def _enqueue(self, i: int, live: bool) -> None:
        """Slot ``i``'s work on :attr:`stream`: run (``live``) or captured. A live launch
        broken between its signals still gives the peers every later signal of it (their waits
        pass; their sums are void), so this rank's error ends the job instead of its peers
        spinning; the transport then takes no further launch."""
        side, me, size, n = self.side, self.rank, self.size, self.n
        plan, op, wire = self._plans[i]
        memcpy, sptr = self.cupy.cuda.runtime.memcpyAsync, self.sptr
        counters, inboxes, abort_word = side.counters, self._inboxes, side.abort_device
        def meet(kind: int) -> None:  # signal every peer, wait for every peer's signal
            if self._flags:
                self._meet_flags(kind, i)
            else:
                kernels.sched_step(counters, inboxes, abort_word, kind, i, n, me, size,
                                   kind == WRITTEN)

        with self.stream:
            meet(WRITTEN)
            try:
                for dst, src, nbytes in plan.pulls:
                    memcpy(dst, src, nbytes, _D2D, sptr)
                if plan.count:
                    kernels.ipc_reduce(op, wire, plan.inputs, plan.out, plan.count,
                                       _REDUCE_BLOCKS)
                meet(REDUCED)
                for dst, src, nbytes in plan.gathers:
                    memcpy(dst, src, nbytes, _D2D, sptr)
                meet(GATHERED)
            except BaseException:
                if live:
                    self._broken(i, (REDUCED, GATHERED))
                raise

    def _meet_flags(self, kind: int, i: int, signals_only: bool = False) -> None:
        """Ranks sharing a GPU: :func:`meeting`'s operations for ``kind`` of slot ``i`` on
        :attr:`stream` (``signals_only``: its signals alone, for a broken launch)."""
        drv, sptr, inboxes = self._drv, self.sptr, self._inbox_ptrs
        for what, rank, flag in meeting(kind, i, self.n, self.rank, self.size):
            address = inboxes[rank] + 4 * flag
            if what == "signal":
                checked(drv.cuStreamWriteValue32(sptr, address, 1, 0), "cuStreamWriteValue32")
            elif signals_only:
                continue
            elif what == "wait":
                checked(drv.cuStreamWaitValue32(sptr, address, 1, self._geq),
                        "cuStreamWaitValue32")
            else:
                checked(drv.cuMemsetD32Async(address, 0, self.size, sptr), "cuMemsetD32Async")

    def _broken(self, i: int, kinds: tuple[int, ...]) -> None:
        """A launch of slot ``i`` that failed before signalling ``kinds``: signal them (the
        first one starts a new launch), and take no further launch."""
        self._aborted = True
        with contextlib.suppress(Exception), self.stream:
            for kind in kinds:
                if self._flags:
                    self._meet_flags(kind, i, signals_only=True)
                else:
                    kernels.sched_signal(self.side.counters, self._inboxes, kind, i, self.n,
                                         self.rank, self.size, kind == WRITTEN)

    def abort(self) -> None:
        self._aborted = True
        if self._flags:
            if self._releasing is None:
                stop = threading.Event()
                thread = start_quietly(threading.Thread(
                    target=self._release, args=(stop,), name="hvdlite-ipc-release",
                    daemon=True))
                self._releasing = (stop, thread)
        elif self.side.abort_host:
            ctypes.c_uint32.from_address(self.side.abort_host).value = 1

    def _release(self, stop: threading.Event) -> None:
        """Ranks sharing a GPU, a peer gone: let this rank's waits pass, from a thread of its
        own until :meth:`close` (``stop``). Each wait resets its flags to 0 once passed, so
        one write of 1s lets one round of waits through; the launches still queued, on
        :attr:`stream` or in the replays of a captured step on a stream of the caller's
        (which this transport cannot see drain), pass only if the 1s keep coming. So every
        flag of the inbox is set to 1 from a stream of its own, every millisecond."""
        count = _KINDS * self.n * self.size
        try:
            with self.cupy.cuda.Device(self.device_id):
                while not stop.wait(0.001):
                    checked(self._drv.cuMemsetD32Async(self.side.inbox, 1, count,
                                                      self._release_stream), "cuMemsetD32Async")
        except Exception as exc:  # noqa: BLE001 - a thread of its own: say it, do not raise
            # A write that fails once (the context gone) fails again: stop, and say so, since
            # waits still queued on this GPU are then released only by the process's end.
            log.warning("hvdlite: the IPC schedule stopped releasing its waits (%s)", exc)

    def close(self) -> None:
        # Local, as the NCCL transport's: once the stream is idle, or after a bounded wait and
        # the abort word (a launch a peer never matched must not hang the shutdown), the
        # peers' buffers and inboxes are unmapped and this rank's memory freed.
        if self.side.abort_host == 0:
            return
        if not self.idle():
            self.abort()
            self.stream.synchronize()
        if self._releasing is not None:  # the inbox it writes is freed below
            stop, thread = self._releasing
            stop.set()
            thread.join()
        self._graphs = [None] * self.n  # before the mappings their copies name go
        with self.cupy.cuda.Device(self.device_id):
            self._maps.close_all()
            self.cupy.cuda.runtime.free(self._scratch)
            if self._flags:
                self._drv.cuStreamSynchronize(self._release_stream)
                self._drv.cuStreamDestroy(self._release_stream)
        self.side.free()
