"""The Engine: hvdlite's run-time state and its lifecycle.

All of hvdlite's run-time state lives in one :class:`Engine` (its cycles, queue and stop
flags in its :class:`~hvdlite._control.scheduler.Scheduler`); the module-level functions
(``init``, ``rank``, ... in ``_api.py``) are thin wrappers over the process's default engine,
kept here (``default_engine``), so tests can build engines of their own on any communicator.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hvdlite import _exit
from hvdlite._control.agreed import keep_retired_at_exit
from hvdlite._control.channel import Channel
from hvdlite._control.scheduler import Scheduler
from hvdlite._observe import clocks
from hvdlite._observe.tracer import Tracer, open_timeline
from hvdlite._rankside import watchdog
from hvdlite._threads import start_quietly
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.fusion import FusionBuffers
from hvdlite._vocab.messages import Response
from hvdlite.config import Config, load_config
from hvdlite.errors import (
    HvdliteError,
    NotInitializedError,
    ShutdownError,
)

__all__ = ["Engine", "default_engine", "is_initialized", "keep_retired_at_exit"]

if TYPE_CHECKING:
    from mpi4py import MPI

    from hvdlite._gpu.runtime import GpuRuntime
    from hvdlite._observe.timeline import Timeline

log = logging.getLogger("hvdlite")

_SHUTDOWN_JOIN_S = 60.0
_ABORT_AFTER_S = 5.0  # from a job-level failure to the abort of the job
_SHUTDOWN_GUARD_S = 10.0  # bound on a shutdown while a peer may be gone


class Engine:
    """One hvdlite instance: communicators, process-set channels, the device runtime, the
    tracer, and its scheduler (the queue, the background thread, every cycle).

    Thread-safety: ``scheduler.submit`` may be called from any thread. Everything that talks
    to MPI or NCCL runs inside a cycle, under the scheduler's cycle lock: on the background
    thread, or on a thread waiting for its own result (``Scheduler.progress``), one at a
    time, in the same order on every rank.
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
        # Every rank's local size, for is_homogeneous (a buffer Allgather, as every exchange of
        # the runtime: docs/architecture.md, "The GIL").
        counts = np.empty(self.size, np.int64)
        self._ctrl.Allgather([np.array([self.local_size], np.int64), MPI.INT64_T],
                             [counts, MPI.INT64_T])
        self.homogeneous = bool((counts == self.local_size).all())
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            log.warning("MPI provides thread level %d < THREAD_MULTIPLE: do not call MPI from "
                        "other threads while hvdlite runs", MPI.Query_thread())

        self._lock = threading.Lock()  # the engine's own state: device runtime, names, set ids
        # The queue, the sticky error, the stop flags and every kind of cycle.
        self.scheduler = Scheduler(self)
        self._counters: dict[tuple[str, int], itertools.count[int]] = {}

        self.fusion = FusionBuffers(self.config.fusion_threshold, host_alloc)
        cfg = self.config
        self.clock_offset_us = clocks.offset_to_root_us(self._ctrl)  # per host, Cristian
        self.tracer = Tracer(self.open_timeline(cfg.timeline, cfg.timeline_mark_cycles)
                             if cfg.timeline else None, cfg.nvtx)
        # Under hvdliterun: ended by the launcher (a host lost) even while blocked in MPI.
        watchdog.start()
        # Each rank runs two busy threads at times (training + background): waiting inside MPI
        # (a busy-wait) only pays off with a core for each.
        cores = _cores()
        block = 2 * self.local_size <= cores
        if cores == 1 and (os.cpu_count() or 1) > 1:
            log.warning(_ONE_CORE)
        self._block = block
        self._buckets = itertools.count()
        self._gpu: GpuRuntime | None = None  # created at the first device tensor
        # One channel per process set this rank belongs to (set 0: every rank), by set id;
        # cycles run their rounds in id order. ``sets`` knows every set's ranks, member or not.
        self.global_channel = self._channel(0, tuple(range(self.size)), self._ctrl, self._data)
        self.channels: dict[int, Channel] = {0: self.global_channel}
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
        start_quietly(self.scheduler.thread)

    def open_timeline(self, path: str, mark_cycles: bool) -> Timeline | None:
        cfg = self.config
        return open_timeline(path, self.rank, mark_cycles, cfg.timeline_max_bytes,
                             self.clock_offset_us, cfg.cache_capacity, cfg.timeline_max_files)

    # -- submission (any thread) ------------------------------------------------------------
    def gpu_runtime(self) -> GpuRuntime:
        """The device runtime, created on first use (imports CuPy; any thread)."""
        gpu = self._gpu
        if gpu is not None:
            return gpu
        with self._lock:
            if self._gpu is None:
                import cupy

                from hvdlite._gpu.runtime import GpuRuntime

                cfg = self.config
                default = self.local_rank % max(cupy.cuda.runtime.getDeviceCount(), 1)
                self._gpu = GpuRuntime(default, cfg.async_completion,
                                       cfg.timeline_device_events, self.tracer,
                                       cfg.stream_priority)
                if self._gpu.cpu_sync:
                    log.warning("hvdlite: the timeline is on, so device inputs and completions "
                                "are waited on the CPU (true times in the trace, less overlap); "
                                "set timeline_device_events to keep stream waits and time "
                                "device phases with CUDA events instead")
            return self._gpu

    @property
    def gpu(self) -> GpuRuntime | None:
        """The device runtime once made (else None: no device tensor seen yet)."""
        return self._gpu

    def reclaim(self) -> None:
        """Drop hvdlite's references to device work that has finished (never waits; any
        thread): its result arrays may then be handed out again."""
        gpu = self._gpu
        if gpu is not None and len(gpu.retirer):
            gpu.retirer.retire()

    def auto_name(self, kind: str, set_id: int = 0) -> str:
        """A name that agrees across the set's ranks if they make the same unnamed calls."""
        with self._lock:
            counter = self._counters.setdefault((kind, set_id), itertools.count())
            return f"{kind}.noname.{next(counter)}"

    # -- process sets ----------------------------------------------------------------------
    def _channel(self, set_id: int, ranks: tuple[int, ...], ctrl: Any, data: Any) -> Channel:
        return Channel(set_id, ranks, ctrl, data, self.config, self.tracer, self.fusion,
                       self.gpu_runtime, self._block, self.scheduler.idle_nap,
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
            self.channels[set_id] = self._channel(set_id, ranks, ctrl, data)

    def _apply_set_change(self, resp: Response) -> int:
        """Execute an agreed process-set change (under the cycle lock, on every rank)."""
        set_id, ranks = resp.root, tuple(resp.shape)
        if resp.op == 0:
            self._add_set(set_id, ranks)
            return set_id
        self.sets.pop(set_id, None)
        channel = self.channels.pop(set_id, None)
        if channel is not None:
            with self.scheduler.lock:
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

    def device_transport(self, set_id: int) -> str | None:
        """How process set ``set_id``'s device buckets travel on this rank ("nccl", "ipc" or
        "mixed"), once its first device collective decided it; else None."""
        backend = self.channel_for(set_id).backends.get("cuda")
        return getattr(backend, "transport", None)

    def channel_for(self, set_id: int) -> Channel:
        """This rank's channel of process set ``set_id``; ValueError if it is not a member."""
        channel = self.channels.get(set_id)
        if channel is None:
            if set_id in self.sets:
                raise ValueError(f"rank {self.rank} is not in process set {set_id} (ranks "
                                 f"{list(self.sets[set_id])}); call its collectives on its "
                                 "member ranks only")
            raise ValueError(f"process set {set_id} is not registered (known: "
                             f"{sorted(self.sets)}); add it with hvdlite.add_process_set first")
        return channel

    def stopped(self, reason: HvdliteError, fatal: bool, fail: Callable[[Entry], None]) -> None:
        """The scheduler stopped for ``reason`` (every pending entry failed): stop the
        engine's parts. ``fatal`` (a failure, not this rank's shutdown): device work may wait
        for a rank that is gone (the NCCL watchdog): fail it, abort the communicators so a
        thread blocked on it wakes and raises, and make sure the job ends."""
        if fatal:
            # A peer shut down (its script ended, or raised): launches of the agreed schedules
            # still waiting for it never complete; a failure ends every schedule.
            self.scheduler.schedules.abort(reason, pending_only=isinstance(reason,
                                                                          ShutdownError))
        if fatal and self._gpu is not None and not isinstance(reason, ShutdownError):
            self._gpu.retirer.fail_pending(fail)
            for channel in list(self.channels.values()):
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
            self._guard = _exit.exit_guard(_ABORT_AFTER_S, str(reason), comm=self._base)

    # -- lifecycle -------------------------------------------------------------------------
    def shutdown(self, at_exit: bool = False) -> None:
        """Stop the loop on every rank (it tells the others) and free the communicators.
        ``at_exit``: the interpreter is exiting (the bound below then also covers MPI's
        finalisation after it)."""
        guard = None
        sched = self.scheduler
        if (sched.error is not None or sched.queue
                or any(c.entries for c in self.channels.values())):
            # A peer may be gone: the stop round, the joins and MPI's finalisation could all
            # wait for it. Bound them (a clean exit with nothing pending arms nothing, so a
            # rank that merely finishes later than its peers is never cut short).
            what = "a failed job" if sched.error else "collectives pending"
            guard = _exit.exit_guard(
                _SHUTDOWN_GUARD_S, f"hvdlite shutdown on rank {self.rank} with {what}: peers "
                "did not respond", comm=self._base, backstop_s=0)
        if not sched.stopped:
            sched.stop_requested = True
            sched.wake.put(None)
            sched.thread.join(_SHUTDOWN_JOIN_S)
            if sched.thread.is_alive():
                log.error("hvdlite: background thread did not stop within %.0f s; other ranks "
                          "are not responding", _SHUTDOWN_JOIN_S)
                return
        sched.thread.join()
        from mpi4py import MPI

        sys.setswitchinterval(self._switch_interval)
        # Device work must drain before its communicators go away, and its retirement (the
        # event-timed spans among it) before the timeline closes.
        if self._gpu is not None:
            self._gpu.synchronize()
            self._gpu.retirer.retire(wait=True)
        sched.schedules.close()  # their launches finished (device: streams synchronised)
        for channel in self.channels.values():
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


def start_default(make: Callable[[], Engine]) -> bool:
    """Install ``make()`` as the process's default engine unless a healthy one runs (neither
    stopped nor failed); True if it made one. ``make`` runs under the lock, so concurrent
    ``init()`` calls make one engine."""
    global _default
    with _default_lock:
        current = _default
        if (current is not None and not current.scheduler.stopped
                and current.scheduler.error is None):
            return False
        _default = make()
        return True


def take_default() -> Engine | None:
    """Detach the default engine and return it (None if there is none): the first half of a
    shutdown, after which ``default_engine()`` raises ``NotInitializedError``."""
    global _default
    with _default_lock:
        engine, _default = _default, None
    return engine


def default_engine() -> Engine:
    """The running default engine, or :class:`hvdlite.NotInitializedError`."""
    engine = _default
    if engine is None:
        raise NotInitializedError("hvdlite is not initialized; call hvdlite.init() first")
    return engine


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown` (even if a peer has stopped hvdlite)."""
    return _default is not None
