"""The Engine: lifecycle, the request queue and the background loop.

All of hvdlite's run-time state lives in one :class:`Engine`; the module-level functions
(``init``, ``rank``, ... in ``_api.py``) are thin wrappers over the process's default engine,
kept here (``default_engine``), so tests can build engines of their own on any communicator.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hvdlite import _exit
from hvdlite._control.channel import Channel
from hvdlite._control.driver import Driver
from hvdlite._control.fusion import FusionBuffers
from hvdlite._control.negotiation import Response
from hvdlite._control.work import Entry
from hvdlite._observe import clocks
from hvdlite._observe.tracer import Tracer, open_timeline
from hvdlite._rankside import watchdog
from hvdlite.config import Config, load_config
from hvdlite.errors import (
    HvdliteError,
    NotInitializedError,
    ShutdownError,
)

__all__ = ["Engine", "default_engine", "is_initialized"]

if TYPE_CHECKING:
    from mpi4py import MPI

    from hvdlite._gpu.runtime import GpuRuntime
    from hvdlite._observe.timeline import Timeline

log = logging.getLogger("hvdlite")

_SHUTDOWN_JOIN_S = 60.0
_ABORT_AFTER_S = 5.0  # from a job-level failure to the abort of the job
_SHUTDOWN_GUARD_S = 10.0  # bound on a shutdown while a peer may be gone


def _in_flight_message(name: str) -> str:
    return (f"tensor {name!r}: a collective with this name is already in flight; wait for it "
            "first or pass a different name=")


class Engine:
    """One hvdlite instance: communicators, process-set channels, the background thread and
    all pending work.

    Thread-safety: ``submit`` may be called from any thread. Everything that talks to MPI or
    NCCL runs inside a cycle, under the cycle lock: on the background thread, or on a thread
    waiting for its own result (:meth:`progress`), one at a time, in the same order on every
    rank.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, config: Config | None = None,
                 process_sets: Sequence[Sequence[int]] = ()) -> None:
        # Imported here, not at module level: importing mpi4py.MPI initialises MPI, and
        # importing hvdlite must have no side effects (the launcher imports it, too).
        from mpi4py import MPI

        from hvdlite._backends.mpi import host_alloc

        base = MPI.COMM_WORLD if comm is None else comm
        self._base = base  # what an abort ends: the whole job hvdlite was started on
        self._guard: _exit.ExitGuard | None = None
        self.config = config if config is not None else load_config()
        _configure_logging(self.config.log_level)
        # hvdlite's traffic runs on its own duplicates so it can never match user messages.
        self._ctrl = base.Dup()
        self._data = base.Dup()
        self.rank = self._ctrl.Get_rank()
        self.size = self._ctrl.Get_size()
        local = base.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        cross = base.Split(color=self.local_rank, key=self.rank)
        self.cross_rank, self.cross_size = cross.Get_rank(), cross.Get_size()
        local.Free()
        cross.Free()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            log.warning("MPI provides thread level %d < THREAD_MULTIPLE: do not call MPI from "
                        "other threads while hvdlite runs", MPI.Query_thread())

        self._lock = threading.Lock()  # the queue, the names in flight, the stop flags
        self.driver = Driver(self)  # runs the cycles (background thread, progress on wait)
        self._queue: list[Entry] = []
        self._counters: dict[tuple[str, int], itertools.count[int]] = {}
        self._error: HvdliteError | None = None  # sticky: raised by every later call
        self._stop_requested = False
        self._stopped = False

        self.fusion = FusionBuffers(self.config.fusion_threshold, host_alloc)
        cfg = self.config
        self.clock_offset_us = clocks.offset_to_root_us(self._ctrl)  # per host, Cristian
        self.tracer = Tracer(self.open_timeline(cfg.timeline, cfg.timeline_mark_cycles)
                             if cfg.timeline else None, cfg.nvtx)
        # Under hvdliterun: ended by the launcher (a host lost) even while blocked in MPI.
        watchdog.start(lambda: self.tracer.timeline)
        # Each rank runs two busy threads at times (training + background): waiting inside MPI
        # (a busy-wait) only pays off with a core for each.
        cores = _cores()
        block = 2 * self.local_size <= cores
        if cores == 1 and (os.cpu_count() or 1) > 1:
            log.warning(_ONE_CORE)
        self._block = block
        self._buckets = itertools.count()
        self._expecting_stall = 0
        self._gpu: GpuRuntime | None = None  # created at the first device tensor
        # One channel per process set this rank belongs to (set 0: every rank), by set id;
        # cycles run their rounds in id order. ``sets`` knows every set's ranks, member or not.
        self.global_channel = self._channel(0, tuple(range(self.size)), self._ctrl, self._data)
        self._channels: dict[int, Channel] = {0: self.global_channel}
        self.sets: dict[int, tuple[int, ...]] = {0: tuple(range(self.size))}
        self.negotiator = self.global_channel.negotiator
        self.mpi = self.global_channel.mpi
        self._next_set = 1
        for ranks in process_sets:
            self._add_set(self.next_set_id(), tuple(ranks))  # collective, same order everywhere
        self._switch_interval = sys.getswitchinterval()
        if self.config.gil_switch_interval_us > 0:
            sys.setswitchinterval(min(self._switch_interval,
                                      self.config.gil_switch_interval_us / 1e6))
        self.driver.thread.start()

    def open_timeline(self, path: str, mark_cycles: bool) -> Timeline | None:
        return open_timeline(path, self.rank, mark_cycles, self.config.timeline_max_bytes,
                             self.clock_offset_us, self.config.cache_capacity)

    # -- submission (any thread) ------------------------------------------------------------
    def gpu_runtime(self) -> GpuRuntime:
        """The device runtime, created on first use (imports CuPy; any thread)."""
        with self._lock:
            if self._gpu is None:
                import cupy

                from hvdlite._gpu.runtime import GpuRuntime

                cfg = self.config
                default = self.local_rank % max(cupy.cuda.runtime.getDeviceCount(), 1)
                self._gpu = GpuRuntime(default, cfg.async_completion,
                                       cfg.timeline_device_events, self.tracer)
                if self._gpu.cpu_sync:
                    log.warning("hvdlite: the timeline is on, so device inputs and completions "
                                "are waited on the CPU (true times in the trace, less overlap); "
                                "set timeline_device_events to keep stream waits and time "
                                "device phases with CUDA events instead")
            return self._gpu

    def reclaim(self) -> None:
        """Drop hvdlite's references to device work that has finished (never waits; any
        thread): its result arrays may then be handed out again."""
        gpu = self._gpu
        if gpu is not None and len(gpu.retirer):
            gpu.retirer.retire()

    def check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._stopped or self._stop_requested:
            raise ShutdownError("hvdlite is shut down; call hvdlite.init() again to use it")

    def auto_name(self, kind: str, set_id: int = 0) -> str:
        """A name that agrees across the set's ranks if they make the same unnamed calls."""
        with self._lock:
            counter = self._counters.setdefault((kind, set_id), itertools.count())
            return f"{kind}.noname.{next(counter)}"

    def submit_one(self, entry: Entry, wake: bool, channel: Channel) -> None:
        """Queue ``entry`` (with its own handle) on ``channel``; any thread.

        ``wake=False``: the caller is about to wait on the handle and so runs the cycle itself
        (progress on wait); the background thread is not woken for it. Otherwise a token per
        submission, even while the loop is awake: cheap then (no waiter to signal), and the
        loop settles a burst of them before negotiating it (Driver._settle)."""
        handle = entry.handle
        handle._driver = self.driver.progress
        name = entry.request.name
        with self._lock:
            if self._error is not None or self._stopped or self._stop_requested:
                self.check_usable()
            if channel.id not in self._channels:
                raise HvdliteError(f"process set {channel.id} was removed; add it again or "
                                   "use another process set")
            in_flight = channel.in_flight
            if name in in_flight:
                raise ValueError(_in_flight_message(name))
            in_flight.add(name)
            entry.enqueued_at = time.perf_counter()
            entry.stats = self.tracer.stats
            entry.channel = channel
            self._queue.append(entry)
        if wake:
            self.driver.wake.put(None)

    def _die(self, exc: BaseException) -> None:
        """The sticky failure: every pending and later call raises it, here and on peers."""
        err = exc if isinstance(exc, HvdliteError) else HvdliteError(
            f"hvdlite background thread failed on rank {self.rank}: {exc!r}")
        if err is not exc:
            err.__cause__ = exc
        log.error("%s", err)  # one line; the traceback only at debug level (not plumbing noise)
        log.debug("hvdlite: where the failure came from", exc_info=exc)
        self._finish(err)
        self._tell_peers(err)

    def _tell_peers(self, err: HvdliteError) -> None:
        """Best effort: one more cycle carrying the failure, so the other ranks raise it too
        instead of waiting for this rank (impossible if it died inside a data collective)."""
        try:
            self.negotiator.failures.announce(str(err))
        except Exception as exc:  # the peers may be gone or stuck; nothing more to do
            log.error("hvdlite: could not tell the other ranks about the failure: %r", exc)

    # -- process sets ----------------------------------------------------------------------
    def _channel(self, set_id: int, ranks: tuple[int, ...], ctrl: Any, data: Any) -> Channel:
        return Channel(set_id, ranks, ctrl, data, self.config, self.tracer, self.fusion,
                       self.gpu_runtime, self._block, self.driver.idle_nap,
                       self._apply_set_change, self._buckets)

    def _add_set(self, set_id: int, ranks: tuple[int, ...]) -> None:
        """Create set ``set_id`` (collective over every rank: both splits run everywhere, at
        the same point of the agreed order); members get its channel."""
        from mpi4py import MPI

        member = self.rank in ranks
        color = 0 if member else MPI.UNDEFINED
        key = ranks.index(self.rank) if member else 0  # set rank = position in ``ranks``
        ctrl = self._ctrl.Split(color, key)
        data = self._data.Split(color, key)
        self.sets[set_id] = ranks
        if member:
            self._channels[set_id] = self._channel(set_id, ranks, ctrl, data)

    def _apply_set_change(self, resp: Response) -> int:
        """Execute an agreed process-set change (under the cycle lock, on every rank)."""
        set_id, ranks = resp.root, tuple(resp.shape)
        if resp.op == 0:
            self._add_set(set_id, ranks)
            return set_id
        self.sets.pop(set_id, None)
        channel = self._channels.pop(set_id, None)
        if channel is not None:
            with self._lock:
                pending = channel.take_pending()
            for e in pending:
                e.fail(HvdliteError(f"tensor {e.request.name!r}: process set {set_id} was "
                                    "removed before this collective ran"))
            channel.close()
        return set_id

    def next_set_id(self) -> int:
        """The id the next added process set gets (the same on every rank: sets are added
        in the same order everywhere)."""
        with self._lock:
            set_id, self._next_set = self._next_set, self._next_set + 1
            return set_id

    def channel_for(self, set_id: int) -> Channel:
        """This rank's channel of process set ``set_id``; ValueError if it is not a member."""
        channel = self._channels.get(set_id)
        if channel is None:
            if set_id in self.sets:
                raise ValueError(f"rank {self.rank} is not in process set {set_id} (ranks "
                                 f"{list(self.sets[set_id])}); call its collectives on its "
                                 "member ranks only")
            raise ValueError(f"process set {set_id} is not registered (known: "
                             f"{sorted(self.sets)}); add it with hvdlite.add_process_set first")
        return channel

    def _finish(self, reason: HvdliteError) -> None:
        """Stop for good: fail everything pending with ``reason``.

        Unless this rank asked for the stop, ``reason`` becomes sticky: every later call raises
        it (a peer shut down, a stall timed out, or this loop failed).
        """
        with self._lock:
            fatal = self._error is None and not self._stop_requested
            if fatal:
                self._error = reason
            self._stopped = True
            pending = [e for c in self._channels.values() for e in c.take_pending()]
            pending += self._queue
            self._queue = []
        def fail(e: Entry) -> None:
            exc = type(reason)(f"tensor {e.request.name!r}: {reason}")
            exc.__cause__ = reason.__cause__ or reason
            e.fail(exc)

        for e in pending:
            fail(e)
        if fatal and self._gpu is not None and not isinstance(reason, ShutdownError):
            # The NCCL watchdog: work on the device may wait for a rank that is gone. Fail
            # it, then abort the communicators so a thread blocked on it wakes and raises.
            self._gpu.retirer.fail_pending(fail)
            for channel in list(self._channels.values()):
                try:
                    channel.abort_device()
                except Exception:
                    log.exception("hvdlite: aborting the NCCL communicators failed")
        self.fusion.release()
        if fatal and not isinstance(reason, ShutdownError):
            self._arm_exit(reason)

    def _arm_exit(self, reason: HvdliteError) -> None:
        """The job is broken (a stall shut down, a rank failed): make sure it ends, even if a
        peer never calls hvdlite again and this rank's exit would hang in MPI finalisation.
        The error still reaches every caller first; _ABORT_AFTER_S later the job is aborted
        with the reason printed once (hvdlite/_exit.py)."""
        if self._guard is None:
            self._guard = _exit.exit_guard(_ABORT_AFTER_S, str(reason), comm=self._base,
                                           timeline=self.tracer.timeline)

    # -- lifecycle -------------------------------------------------------------------------
    def shutdown(self, at_exit: bool = False) -> None:
        """Stop the loop on every rank (it tells the others) and free the communicators.
        ``at_exit``: the interpreter is exiting (the bound below then also covers MPI's
        finalisation after it)."""
        guard = None
        if (self._error is not None or self._queue
                or any(c.entries for c in self._channels.values())):
            # A peer may be gone: the stop round, the joins and MPI's finalisation could all
            # wait for it. Bound them (a clean exit with nothing pending arms nothing, so a
            # rank that merely finishes later than its peers is never cut short).
            what = "a failed job" if self._error else "collectives pending"
            guard = _exit.exit_guard(
                _SHUTDOWN_GUARD_S, f"hvdlite shutdown on rank {self.rank} with {what}: peers "
                "did not respond", comm=self._base, backstop_s=0)
        if not self._stopped:
            self._stop_requested = True
            self.driver.wake.put(None)
            self.driver.thread.join(_SHUTDOWN_JOIN_S)
            if self.driver.thread.is_alive():
                log.error("hvdlite: background thread did not stop within %.0f s; other ranks "
                          "are not responding", _SHUTDOWN_JOIN_S)
                return
        self.driver.thread.join()
        from mpi4py import MPI

        sys.setswitchinterval(self._switch_interval)
        # Device work must drain before its communicators go away, and its retirement (the
        # event-timed spans among it) before the timeline closes.
        if self._gpu is not None:
            self._gpu.synchronize()
            self._gpu.retirer.retire(wait=True)
        for channel in self._channels.values():
            channel.close(free_comms=channel is not self.global_channel)
        if self._gpu is not None:
            self._gpu.shutdown()
        self.tracer.close()
        if guard is not None and not at_exit:
            guard.cancel()  # shut down in time; the process goes on (maybe to init again)
        for comm in (self._ctrl, self._data):
            if comm != MPI.COMM_NULL:
                comm.Free()  # Free() resets the handle to COMM_NULL: a second call is a no-op


_ONE_CORE = ("hvdlite: this rank may run on one CPU core only (its affinity mask), shared by "
             "the training thread and hvdlite's background thread; launch with hvdliterun or "
             "give each rank more cores (Open MPI: mpirun --bind-to none)")


def _cores() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _configure_logging(level: str) -> None:
    names = {"trace": logging.DEBUG, "fatal": logging.CRITICAL}
    logger = logging.getLogger("hvdlite")
    logger.setLevel(names.get(level, getattr(logging, level.upper(), logging.WARNING)))
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hvdlite %(levelname)s] %(message)s"))
        logger.addHandler(handler)


# -- the process's default engine (set by hvdlite._api.init / shutdown) ----------------------
_default: Engine | None = None
_default_lock = threading.Lock()


def default_engine() -> Engine:
    """The running default engine, or :class:`hvdlite.NotInitializedError`."""
    engine = _default
    if engine is None:
        raise NotInitializedError("hvdlite is not initialized; call hvdlite.init() first")
    return engine


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown` (even if a peer has stopped hvdlite)."""
    return _default is not None
