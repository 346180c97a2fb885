"""Agreed schedules: sequences of collectives every member of a process set has shown alike
once, then launched by the thread that made each input ready, with no negotiation.

A training step submits the same buckets every step, so once every member has shown the same
slots (names, sizes, dtypes, ops, factors) nothing is left to negotiate: slot ``i`` is the
``i``-th collective of every step on every rank. The scheduler owns the service
(:class:`Schedules`, ``Scheduler.schedules``), which writes each part once:

- the agreement: :meth:`Schedules.agree`, one exchange over the negotiated route (an allgather
  on the set, so a rank that never comes is a stall the inspector names), used for every check
  of every frontend (a ``DistributedOptimizer``'s buckets, a captured step's launches) and for
  opening a schedule (whether every member can, and the transport's id);
- launch, wait and order: :class:`AgreedSchedule` over a transport that keeps the schedule
  contract (``_backends/base.py``: NCCL for device buffers, MPI for host buffers);
- capture control (:meth:`Schedules.capture`), the stall watchdog (:meth:`Schedules.watch`,
  on the background thread), abort and close, and the sticky error: after an abort every
  launch and wait raises the reason;
- a schedule its owner dropped (an optimizer let go, a persistent call collected) has its
  transport closed by the next open, or the shutdown: its communicator, mappings and buffers
  do not pile up in a process that builds optimizers again and again (MPI runs out of
  communicators after about 2,000).

Guarantees: every rank launches slot ``i`` as its ``i``-th launch of a round (a launch out of
turn raises ``MismatchError`` on that rank before anything is enqueued), so a collective never
meets another slot's; a rank that stops launching leaves its peers' launches incomplete,
which the watchdog turns into ``StallError`` on every rank after ``stall_shutdown_time_s``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hvdlite._handles import Handle
from hvdlite._vocab.agreed import Slot, disagreement, slot_rows
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.messages import Kind, Request
from hvdlite.errors import HvdliteError, MismatchError, StallError

if TYPE_CHECKING:
    from hvdlite._backends.base import ScheduleTransport
    from hvdlite._control.channel import Channel

__all__ = ["MAX_WAIT_NAP_S", "AgreedSchedule", "Schedules"]

log = logging.getLogger("hvdlite")

_MAX_WARNED = 64  # stall warnings remembered (each logged once)
# Longest pause of a waiting thread between looks: a host schedule's wait for its launch, and
# a caller's wait for a round (scheduler.py). A host slot past MPI's eager size completes by a
# rendezvous that advances only while both peers are inside MPI, so each of its steps can wait
# out a peer's nap (16 KiB slots on 2 CPU ranks: 20 ms a step with 1 ms naps, 2.5 with these).
MAX_WAIT_NAP_S = 200e-6
_HOT_WAIT_S = 300e-6  # a host wait first looks without sleeping this long (as rounds do)
_MAX_RETIRED = 64  # retired transports kept before those whose graphs are gone are let go


class _Retired:
    """A captured schedule's transport and the graphs that captured its launches (weakly):
    tearing down an NCCL communicator whose kernels a live graph holds waits for that graph
    (ncclCommDestroy and ncclCommAbort both hung two ranks, gpu-validation runs 104-105), so a
    transport is let go only once every such graph is gone."""

    __slots__ = ("transport", "graphs")

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.graphs: list[weakref.ref[Any]] = []

    def held(self) -> bool:
        return any(ref() is not None for ref in self.graphs)


# Transports of captured schedules (closed by a shutdown, or dropped), kept alive: no graph
# may replay kernels of a freed communicator. Past the bound, those whose graphs are all gone
# are let go, oldest first; those some live graph holds stay.
_RETIRED: list[_Retired] = []


def _let_go(transport: Any) -> None:
    # Aborted, which is local (ncclCommAbort; the IPC transport's abort word), not left to the
    # collector, whose ncclCommDestroy waits for the peers.
    try:
        transport.abort()
    except Exception:
        log.exception("hvdlite: letting go of a retired agreed schedule's transport failed")


def _evict() -> None:
    while len(_RETIRED) > _MAX_RETIRED:
        gone = next((r for r in _RETIRED if not r.held()), None)
        if gone is None:
            return  # every one is in a live graph: kept (the graphs are the user's to drop)
        _RETIRED.remove(gone)
        _let_go(gone.transport)


def keep_retired_at_exit() -> None:
    """At interpreter exit: keep every retired transport alive to the process's end, which
    frees it. A graph holding its kernels may still be alive (the user's objects die in the
    interpreter's teardown in no set order), and the collector's ncclCommDestroy, and
    ncclCommAbort too, then waits for it: two ranks hung at exit after their tests passed
    (gpu-validation runs 104 and 105). Local; idempotent."""
    for retired in _RETIRED:
        # A reference no one drops: the interpreter's teardown never collects it.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(retired.transport))
    _RETIRED.clear()


class SchedulerView(Protocol):
    """What the service uses of the scheduler that owns it (a protocol: the scheduler imports
    this module, not the reverse)."""

    engine: Any
    error: HvdliteError | None
    stopped: bool
    capture_thread: int | None

    def submit(self, entry: Entry, wake: bool, channel: Channel) -> None: ...

    def check_usable(self) -> None: ...

    def die(self, exc: BaseException) -> None: ...


class AgreedSchedule:
    """An agreed sequence of in-place allreduces of fixed buffers, launched by the caller.

    Thread-safety: launch from one thread at a time (the one that makes the inputs ready);
    :meth:`wait` from any thread. Every launch and wait raises the schedule's error once it
    was aborted (the engine failed, or shut down while a launch was pending).
    """

    __slots__ = ("name", "slots", "set_id", "transport", "next", "launches", "capturing",
                 "error", "_launched", "_service", "_sched", "_dropped", "_retired",
                 "__weakref__")

    def __init__(self, name: str, slots: Sequence[Slot], set_id: int,
                 transport: ScheduleTransport, service: Schedules) -> None:
        self.name, self.slots, self.set_id = name, tuple(slots), set_id
        self.transport = transport
        self.next = 0  # the slot whose turn it is
        self.launches = 0
        # Set while a CUDA graph captures launches: a captured record is no record and a
        # replay is no launch the watchdog can time.
        self.capturing = False
        self.error: HvdliteError | None = None
        self._launched = [0.0] * len(self.slots)  # host time of a pending launch (0: none)
        self._service = service
        self._sched = service.scheduler
        # Collected unclosed: the transport goes to the service, which closes it at the next
        # open or the shutdown (on a thread that may call MPI and CUDA; a finalizer may run
        # on any thread, inside any call).
        self._dropped = weakref.finalize(self, service.dropped.append, transport)
        self._dropped.atexit = False  # (at exit the engine's shutdown closes what is open)
        self._retired: _Retired | None = None  # once a graph captured its launches

    @property
    def captured(self) -> bool:
        """Whether launches of it live in a CUDA graph (it is retired, never closed)."""
        return self._retired is not None

    @property
    def device_id(self) -> int:
        """The CUDA device of the schedule's buffers (-1: host memory)."""
        return self.transport.device_id

    @property
    def via(self) -> str:
        """How its data travels: "nccl", "ipc" or "mpi"."""
        return self.transport.kind

    def launch(self, i: int, stream: Any = None) -> None:
        """Enqueue slot ``i`` after the work on ``stream`` (device: the producer's CuPy
        stream; host: None), without waiting on the host. Slots go in order, round after
        round: ``MismatchError`` for a slot out of turn (nothing enqueued)."""
        if self.error is not None:
            raise self.error
        sched = self._sched
        if sched.error is not None or sched.stopped:  # a peer may be gone: nothing would come
            sched.check_usable()
        if i != self.next:
            raise MismatchError(f"{self.name}: slot {i} ({self.slots[i].name!r}) launched out "
                                f"of turn, slot {self.next} expected; launch every slot in "
                                "order, every round, the same on every rank")
        self.transport.launch(i, stream)
        self.next = i + 1 if i + 1 < len(self.slots) else 0
        if not self.capturing:
            self._launched[i] = time.monotonic()
        self.launches += 1

    def wait(self, i: int, stream: Any = None) -> None:
        """Order ``stream`` after slot ``i``'s last launch (device; no host wait), or, with
        None, wait for it on the host (a host schedule always does). Raises the schedule's
        error if it was aborted, ``StallError`` past the stall shutdown time."""
        if self.error is not None:
            raise self.error
        if stream is not None and self.transport.device_id >= 0:
            self.transport.order(i, stream)
            return
        self._service.block(self, i)

    def overdue(self, limit_s: float) -> str:
        """'' or a description of the oldest launch not complete after ``limit_s`` seconds
        (non-blocking)."""
        if self.capturing:
            return ""
        now = time.monotonic()
        for i, t in enumerate(self._launched):
            if t and now - t > limit_s:
                if self.transport.done(i):
                    self._launched[i] = 0.0
                    continue
                return (f"{self.name}: slot {i} of {len(self.slots)} ({self.slots[i].name!r}) "
                        f"launched {now - t:.0f} s ago has not completed: a peer died or "
                        "stopped launching it")
        return ""

    def pending(self) -> bool:
        """Whether a launch has not completed (non-blocking); a schedule captured in a CUDA
        graph counts as pending (its replays are not launches to look at)."""
        if self.error is not None:
            return False
        if self.captured:
            return True
        return any(t and not self.transport.done(i) for i, t in enumerate(self._launched))

    def abort(self, reason: HvdliteError) -> None:
        """The job is ending with ``reason``: unblock the transport; every later launch and
        wait raises ``reason``."""
        if self.error is None:
            self.error = reason
            self.transport.abort()

    def close(self) -> None:
        """Free the transport once its launches completed; a schedule whose launches a CUDA
        graph captured is only retired (see :data:`_RETIRED`)."""
        if self.error is None:
            self.error = HvdliteError(f"{self.name}: closed (hvdlite shut down); open it "
                                      "again after hvdlite.init()")
        if self.captured:
            return  # retired when captured (see retire)
        self._dropped.detach()
        self.transport.close()

    def retire(self, graph: object) -> None:
        """Its launches are being captured in ``graph`` (a CUDA graph), which may outlive it
        and the engine: waiting for its stream or aborting it hung a shutdown at two GPUs
        (2026-11-27). So the transport is never closed: kept alive, unused (every launch
        after close raises), until every graph that captured it is gone and the bound asks
        for room, or the process ends."""
        if self._retired is None:
            self._dropped.detach()
            self._retired = _Retired(self.transport)
            _RETIRED.append(self._retired)
        graphs = self._retired.graphs
        graphs[:] = [ref for ref in graphs if ref() is not None]
        graphs.append(weakref.ref(graph))
        _evict()


class Schedules:
    """The agreed schedules of one engine: agreement, opening, capture control, watchdog,
    abort and close (see the module docstring). Owned by the engine's scheduler."""

    def __init__(self, scheduler: SchedulerView) -> None:
        self.scheduler = scheduler
        self._open: weakref.WeakSet[AgreedSchedule] = weakref.WeakSet()
        # Transports of schedules collected unclosed (AgreedSchedule's finalizer appends; a
        # deque's append and popleft are atomic), closed by close_dropped.
        self.dropped: collections.deque[ScheduleTransport] = collections.deque()
        self._opening = threading.Lock()  # opens are collective: one at a time per rank
        self._warned: set[str] = set()
        self.last_watch = 0.0

    def __len__(self) -> int:
        return len(self._open)

    # -- agreement (collective over the set) -------------------------------------------------
    def agree(self, channel: Channel, name: str, mine: Any) -> list[Any]:
        """Every member's ``mine`` (JSON-able), in set order: one allgather over the
        negotiated route (a member that never comes is a stall the inspector names).
        Blocking; collective over ``channel``'s set; raises the engine's errors."""
        payload = np.frombuffer(json.dumps(mine).encode(), dtype=np.uint8)
        sizes = self._gather(channel, f"{name}.agree.sz",
                             np.array([payload.size], dtype=np.int64), "int64")
        raw = self._gather(channel, f"{name}.agree", payload, "uint8").tobytes()
        out, offset = [], 0
        for n in sizes.tolist():
            out.append(json.loads(raw[offset:offset + n]))
            offset += n
        return out

    def _gather(self, channel: Channel, name: str, array: Any, dtype: str) -> Any:
        handle = Handle(name)
        entry = Entry(Request(name, Kind.ALLGATHER, dtype, array.shape, "cpu"), array, None,
                      handle)
        self.scheduler.submit(entry, False, channel)
        return handle.wait()

    def check(self, channel: Channel, what: str, mine: Any, hint: str) -> list[Any]:
        """:meth:`agree`, then ``MismatchError`` on every member (naming each rank that
        differs and its first difference, then ``hint``: the fix) unless all showed alike.
        Returns what every member showed."""
        shown = self.agree(channel, what, mine)
        bad = disagreement(shown, channel.ranks)
        if bad:
            raise MismatchError(f"{what}: the ranks differ ({bad}); {hint}")
        return shown

    # -- opening (collective over the set) ---------------------------------------------------
    def open(self, channel: Channel, name: str, slots: Sequence[Slot],
             buffers: Sequence[tuple[int, int]], device_id: int,
             usable: str = "", via: str = "") -> tuple[AgreedSchedule | None, str]:
        """(the schedule, '') if every member can run ``slots`` on its own transport (device
        buffers over NCCL or CUDA IPC, host buffers over MPI), else (None, why not: the same
        answer on every member). ``buffers[i]``: address and element count of slot ``i``'s
        buffer on ``device_id`` (-1: host), alive as long as the schedule; ``usable``: why
        this rank's caller cannot, '' if it can; ``via``: "nccl" or "ipc" for device
        buffers ('': the ``schedule_transport`` knob's, whose "auto" is NCCL). Collective over
        ``channel``'s set (one exchange, which also checks the slots and the transport alike:
        ``MismatchError`` otherwise); blocking."""
        with self._opening:
            self.close_dropped()
            asked = via or self.scheduler.engine.config.schedule_transport
            kind = "" if device_id < 0 else "ipc" if asked == "ipc" else "nccl"
            why = usable or self._why_not(channel, slots, buffers, device_id, kind)
            uid: list[int] | None = None
            raw = False
            ipc = None  # this rank's side of an IPC schedule, made before the agreement
            if not why and kind == "ipc":
                ipc, why = self._ipc_side(slots, buffers, device_id, channel.size)
            elif not why and device_id >= 0 and channel.rank == 0:
                from cupy.cuda import nccl

                drawn = nccl.get_unique_id()  # bytes (CuPy 13+) or a tuple of ints (older)
                uid, raw = list(drawn), isinstance(drawn, bytes)
            try:
                shown = self.agree(channel, f"{name}.open",
                                   {"why": why, "uid": uid, "bytes": raw,
                                    "slots": slot_rows(slots), "device": device_id >= 0,
                                    "transport": kind,
                                    "ipc": ipc.record() if ipc is not None else None})
                for rank, got in zip(channel.ranks, shown, strict=True):
                    if got["why"]:
                        return None, f"rank {rank}: {got['why']}"
                bad = disagreement([{"slots": g["slots"], "device": g["device"],
                                     "transport": g["transport"]} for g in shown],
                                   channel.ranks)
                if bad:
                    raise MismatchError(f"{name}: the ranks built different schedules "
                                        f"({bad}); every rank must open the same slots, in "
                                        "the same order, with one schedule_transport")
                if ipc is not None:
                    from hvdlite._backends.schedule_ipc import placement_why

                    where = placement_why([g["ipc"] for g in shown])
                    if where:
                        return None, f"schedule_transport=ipc: {where}"
                if ipc is None:
                    transport = self._transport(channel, slots, buffers, device_id, shown, ipc)
                else:
                    transport, why = self._ipc_transport(channel, name, slots, buffers,
                                                         device_id, shown, ipc)
                    if transport is None:
                        return None, why
                ipc = None  # the transport owns it now
            finally:
                if ipc is not None:
                    ipc.free()
            schedule = AgreedSchedule(name, slots, channel.id, transport, self)
            self._open.add(schedule)
            return schedule, ""

    def _ipc_side(self, slots: Sequence[Slot], buffers: Sequence[tuple[int, int]],
                  device_id: int, size: int) -> tuple[Any, str]:
        """(this rank's side of an IPC schedule, '') or (None, why it cannot make one)."""
        from hvdlite._backends.schedule_ipc import IpcScheduleSide

        try:
            return IpcScheduleSide(self.scheduler.engine.gpu_runtime().cupy, device_id, slots,
                                   buffers, size), ""
        except Exception as exc:  # noqa: BLE001 (any failure is this rank's answer: no IPC)
            return None, f"schedule_transport=ipc: {type(exc).__name__}: {exc}"

    def _ipc_transport(self, channel: Channel, name: str, slots: Sequence[Slot],
                       buffers: Sequence[tuple[int, int]], device_id: int,
                       shown: list[dict[str, Any]], ipc: Any) -> tuple[Any, str]:
        """(the IPC transport, '') once every member built its own, else (None, why: the same
        on every member). Its peers' memory is mapped here, after the agreement: a member
        that cannot map it must not leave the others launching into waits it never signals,
        so the members agree once more on whether each built its transport."""
        transport, err = None, ""
        try:
            transport = self._transport(channel, slots, buffers, device_id, shown, ipc)
        except Exception as exc:  # noqa: BLE001 (any failure is this rank's answer: no IPC)
            err = f"{type(exc).__name__}: {exc}"
        built = self.agree(channel, f"{name}.open.built", err)
        failed = [(rank, got) for rank, got in zip(channel.ranks, built, strict=True) if got]
        if not failed:
            return transport, ""
        if transport is not None:
            transport.close()
        rank, got = failed[0]
        return None, f"rank {rank}: schedule_transport=ipc: {got}"

    def _why_not(self, channel: Channel, slots: Sequence[Slot],
                 buffers: Sequence[tuple[int, int]], device_id: int, kind: str) -> str:
        cfg = self.scheduler.engine.config
        if not cfg.optimizer_schedule:
            return "the optimizer_schedule knob is off"
        if not slots or len(slots) != len(buffers):
            return "no slots, or not one buffer per slot"
        if device_id < 0:
            from hvdlite._backends import schedule_mpi

            return schedule_mpi.why_not(slots)
        if kind == "ipc":  # (where the ranks are: checked at the agreement)
            from hvdlite._backends import schedule_ipc

            return schedule_ipc.why_not(slots)
        from hvdlite._backends import schedule_nccl

        transport = getattr(channel.backends.get("cuda"), "transport", None)
        if transport != "nccl":
            return f"its device buffers travel by {transport or 'an undecided transport'}, " \
                   "not NCCL"
        return schedule_nccl.why_not(slots)

    def _transport(self, channel: Channel, slots: Sequence[Slot],
                   buffers: Sequence[tuple[int, int]], device_id: int,
                   shown: list[dict[str, Any]], ipc: Any) -> ScheduleTransport:
        if device_id < 0:
            from hvdlite._backends.schedule_mpi import MpiScheduleTransport

            return MpiScheduleTransport(channel.agreed_comm.Dup(), slots, buffers)
        from hvdlite._gpu.runtime import PRIORITIES

        engine = self.scheduler.engine
        cfg, gpu = engine.config, engine.gpu_runtime()
        if ipc is not None:
            from hvdlite._backends.schedule_ipc import IpcScheduleTransport

            return IpcScheduleTransport(ipc, [g["ipc"] for g in shown], slots, buffers,
                                        channel.rank, PRIORITIES[cfg.stream_priority])
        from hvdlite._backends.schedule_nccl import NcclScheduleTransport

        root = shown[0]
        uid = bytes(root["uid"]) if root["bytes"] else tuple(root["uid"])
        # The knobs as they are when the schedule opens (the optimizer's: at the end of its
        # first step), like the CTA cap, not as they were at init.
        return NcclScheduleTransport(gpu.cupy, device_id, slots, buffers, uid, channel.rank,
                                     channel.size, cfg.optimizer_max_ctas,
                                     PRIORITIES[cfg.stream_priority])

    # -- capture control ---------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, schedules: Sequence[AgreedSchedule], graph: object) -> Iterator[None]:
        """While ``graph`` (a CUDA graph) captures on this thread: other hvdlite calls on it
        are refused (a replay would run them un-negotiated), and ``schedules``' launches are
        captured (their replays then count as pending for the shutdown and abort logic; their
        transports live as long as ``graph`` does, at least)."""
        sched = self.scheduler
        sched.check_usable()
        for s in schedules:
            s.capturing = True
            s.retire(graph)
        sched.capture_thread = threading.get_ident()
        try:
            yield
        finally:
            sched.capture_thread = None
            for s in schedules:
                s.capturing = False

    # -- waiting, watching, ending -----------------------------------------------------------
    def block(self, schedule: AgreedSchedule, i: int) -> None:
        """Wait on the host for slot ``i``'s last launch, looking at the engine's sticky error
        between looks (the watchdog on the background thread turns a launch that never
        completes into one)."""
        transport, sched = schedule.transport, self.scheduler
        hot_until = time.perf_counter() + _HOT_WAIT_S
        nap = 20e-6
        while not transport.done(i):
            if schedule.error is not None:
                raise schedule.error
            if sched.error is not None:
                raise sched.error
            if time.perf_counter() < hot_until:
                # The peers' part usually lands within microseconds; a sleep's timer slack
                # (~50 us) would be most of the wait (a 161-member host schedule: 112 against
                # 31 us for the negotiated call, which polls hot). The yield lets go of the GIL.
                os.sched_yield()
                continue
            time.sleep(nap)
            nap = min(2 * nap, MAX_WAIT_NAP_S)
        if schedule.error is not None:
            # An abort clears the transport's pending launches, so done() turned True without
            # the collective completing: the buffer holds no reduction.
            raise schedule.error

    def watch(self) -> None:
        """At most once a second (background thread): a warning for a launch incomplete past
        ``stall_check_time_s``, ``StallError`` (which stops the engine and tells every peer)
        past ``stall_shutdown_time_s``."""
        now = time.perf_counter()
        if now - self.last_watch < 1.0 or not self._open:
            return
        self.last_watch = now
        sched = self.scheduler
        cfg = sched.engine.config
        if not cfg.stall_check:
            return
        for schedule in list(self._open):
            late = schedule.overdue(cfg.stall_check_time_s)
            if not late:
                continue
            if cfg.stall_shutdown_time_s > 0 and schedule.overdue(cfg.stall_shutdown_time_s):
                sched.die(StallError(f"rank {sched.engine.rank}: {late}; shut down after "
                                     f"stall_shutdown_time_s={cfg.stall_shutdown_time_s}"))
                return
            if late not in self._warned and len(self._warned) < _MAX_WARNED:
                self._warned.add(late)
                log.warning("hvdlite stall: %s", late)

    def abort(self, reason: HvdliteError, pending_only: bool = False) -> None:
        """Abort every schedule (the job is ending with ``reason``), or with ``pending_only``
        those with a launch not yet complete (a peer shut down: they never complete)."""
        for schedule in list(self._open):
            if pending_only and not schedule.pending():
                continue
            try:
                schedule.abort(reason)
            except Exception:
                log.exception("hvdlite: aborting agreed schedule %r failed", schedule.name)

    def close_dropped(self) -> None:
        """Close the transports of schedules collected unclosed (collective in effect: every
        member dropped the same schedules, and each closes its own side: a local close)."""
        while self.dropped:
            transport = self.dropped.popleft()
            try:
                transport.close()
            except Exception:
                log.exception("hvdlite: closing a dropped agreed schedule's transport failed")

    def close(self) -> None:
        """Free every schedule (at shutdown, once the device work drained)."""
        for schedule in list(self._open):
            try:
                schedule.close()
            except Exception:
                log.exception("hvdlite: closing agreed schedule %r failed", schedule.name)
        self._open.clear()
        self.close_dropped()
