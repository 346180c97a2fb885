"""The scheduler: the queue, its lock, the sticky error, the stop flags and every kind of
cycle, one implementation each.

A cycle (drain the queue, then per process set: negotiate, execute, complete) runs under one
lock, on whichever thread holds it: the background thread for the work nobody waits for
(:meth:`Scheduler.run`), a thread waiting for its own result (:meth:`Scheduler.progress`,
progress on wait: no thread hand-off there and back), or, for one cached tensor with nothing
else pending, a cycle of its own (:meth:`Scheduler.cycle_alone`: its round, then its data step
on the calling thread; ``_control/immediate.py`` builds the step of a blocking call). The
engine (``_engine.py``) keeps the state a cycle works on (channels, the device runtime, the
tracer); this module decides when a cycle runs, on which thread, and what a failure stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from hvdlite._control.agreed import MAX_WAIT_NAP_S, Schedules
from hvdlite._control.held_signals import HeldSignals
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.messages import Request, Response
from hvdlite.errors import HvdliteError, ShutdownError

if TYPE_CHECKING:
    from hvdlite._backends.base import Backend
    from hvdlite._control.channel import Channel
    from hvdlite._control.negotiator import CycleResult, Negotiator
    from hvdlite._handles import Handle
    from hvdlite._observe.tracer import Tracer

__all__ = ["Scheduler", "EngineState", "POKE"]

log = logging.getLogger("hvdlite")

POKE = object()  # wake-up token of a waiting caller (it cuts an idle nap short)

_LOCK_POLL_S = 200e-6  # how often a caller waiting for the cycle lock looks at its handle
# Nap of the loop while a burst of submissions arrives (see Scheduler._settle): long enough
# that the thread submitting the burst keeps the GIL for a few dozen calls between two looks.
_SETTLE_NAP_S = 200e-6
# A burst whose submissions arrive this densely (a submitting loop: one every 25 us or less)
# is settled for up to this many cycle times, not one: cut at the cycle time, a burst that
# the caller will wait on anyway pays another round, a partial bucket, and the GIL contention
# of a cycle beside the thread that is still submitting. A stream as sparse as gradients
# from backward keeps Horovod's one cycle time, so its first buckets start during backward.
_DENSE_ARRIVALS = 8
_DENSE_CYCLES = 8


class EngineState(Protocol):
    """What the scheduler uses of the engine that owns it: its state, public, as
    ``_engine.Engine`` keeps it (a protocol, so this layer never imports the engine)."""

    rank: int
    tracer: Tracer
    negotiator: Negotiator
    channels: dict[int, Channel]
    config: Any

    @property
    def gpu(self) -> Any: ...  # the device runtime once made, else None

    def gpu_runtime(self) -> Any: ...  # the device runtime, made on first use

    def reclaim(self) -> None: ...

    def stopped(self, reason: HvdliteError, fatal: bool,
                fail: Callable[[Entry], None]) -> None: ...


class Scheduler:
    """Runs an engine's cycles and holds what decides them (see the module docstring).
    Thread-safety: ``submit`` from any thread; ``lock`` guards the queue, the names in flight
    and the stop flags; every cycle runs under ``cycle_lock``, one at a time, in the same
    order on every rank whichever thread runs it."""

    def __init__(self, engine: EngineState) -> None:
        self.engine = engine
        self.lock = threading.Lock()  # the queue, the names in flight, the stop flags
        self.queue: list[Entry] = []
        self.error: HvdliteError | None = None  # sticky: raised by every later call
        self.stop_requested = False
        self.stopped = False
        # The thread capturing a CUDA graph (hvdlite/torch/graphs.py): its calls are refused
        # (and take no immediate path), since a replay would run them un-negotiated.
        self.capture_thread: int | None = None
        self.expecting_stall = 0  # expect_stall() blocks in progress: silence the inspector
        # Serialises cycles: held by the background thread or by a waiting caller running the
        # pending cycle itself (progress). MPI sees one cycle at a time from this process, in
        # the same order on every rank, whichever thread runs it.
        self.cycle_lock = threading.Lock()
        self.napping = False  # the loop is in an idle nap (see idle_nap)
        self.last_cycle = 0.0  # when a waiting caller last started a cycle (see run)
        self.in_background = False  # the background thread holds the cycle lock
        self.nap_s = 20e-6  # first pause between cycles a waiting caller runs without result
        # Wake-ups of the background loop: a C-level queue of tokens is about twice as quick
        # to hand over as threading.Event, whose wait and set run Python-level Condition code.
        self.wake: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.run, name="hvdlite-background", daemon=True)
        # Every submitted handle's driver (progress on wait), bound once: a bound method made
        # per call would be one more object the cyclic collector counts per call.
        self._progress = self.progress
        # The agreed schedules: launched by callers with no cycle, watched by this loop.
        self.schedules = Schedules(self)

    # -- submission and stopping (any thread) -----------------------------------------------
    def check_usable(self) -> None:
        """Raise the sticky error, ``ShutdownError`` once stopped or stopping, or
        ``HvdliteError`` on the thread capturing a CUDA graph."""
        if self.error is not None:
            raise self.error
        if self.stopped or self.stop_requested:
            raise ShutdownError("hvdlite is shut down; call hvdlite.init() again to use it")
        if self.capture_thread is not None and self.capture_thread == threading.get_ident():
            raise HvdliteError("hvdlite collectives cannot be captured in a CUDA graph (they "
                               "are negotiated on the host when they run): inside a captured "
                               "step only DistributedOptimizer's buckets communicate; call "
                               "this one outside the step")

    def submit(self, entry: Entry, wake: bool, channel: Channel) -> None:
        """Queue ``entry`` (with its own handle) on ``channel``; any thread.

        ``wake=False``: the caller is about to wait on the handle and so runs the cycle itself
        (progress on wait); the background thread is not woken for it. Otherwise a token per
        submission, even while the loop is awake: cheap then (no waiter to signal), and the
        loop settles a burst of them before negotiating it (:meth:`_settle`)."""
        entry.handle._driver = self._progress
        name = entry.request.name
        with self.lock:
            if self.error is not None or self.stopped or self.stop_requested \
                    or self.capture_thread is not None:
                self.check_usable()
            if channel.id not in self.engine.channels:
                raise HvdliteError(f"process set {channel.id} was removed; add it again or "
                                   "use another process set")
            in_flight = channel.in_flight
            if name in in_flight:
                raise ValueError(f"tensor {name!r}: a collective with this name is already in "
                                 "flight; wait for it first or pass a different name=")
            in_flight.add(name)
            entry.enqueued_at = time.perf_counter()
            entry.stats = self.engine.tracer.stats
            entry.channel = channel
            self.queue.append(entry)
        if wake:
            self.wake.put(None)

    def stop(self, reason: HvdliteError) -> None:
        """Stop for good: fail everything pending with ``reason``, then let the engine stop
        its own parts (``EngineState.stopped``). Unless this rank asked for the stop, ``reason``
        becomes sticky: every later call raises it (a peer shut down, a stall timed out, or
        a cycle failed)."""
        with self.lock:
            fatal = self.error is None and not self.stop_requested
            if fatal:
                self.error = reason
            self.stopped = True
            pending = [e for c in self.engine.channels.values() for e in c.take_pending()]
            pending += self.queue
            self.queue = []

        def fail(e: Entry) -> None:
            exc = type(reason)(f"tensor {e.request.name!r}: {reason}")
            exc.__cause__ = reason.__cause__ or reason
            e.fail(exc)

        for e in pending:
            fail(e)
        self.engine.stopped(reason, fatal, fail)

    def die(self, exc: BaseException) -> None:
        """A cycle failed: the sticky failure, here and (best effort) on every peer."""
        err = exc if isinstance(exc, HvdliteError) else HvdliteError(
            f"hvdlite background thread failed on rank {self.engine.rank}: {exc!r}")
        if err is not exc:
            err.__cause__ = exc
        log.error("%s", err)  # one line; the traceback only at debug level (not plumbing noise)
        log.debug("hvdlite: where the failure came from", exc_info=exc)
        self.stop(err)
        try:  # one more message carrying the failure, so the peers raise it too
            self.engine.negotiator.failures.announce(str(err))
        except Exception as exc2:  # the peers may be gone or stuck; nothing more to do
            log.error("hvdlite: could not tell the other ranks about the failure: %r", exc2)

    def _failed(self, exc: BaseException) -> None:
        """The epilogue of a cycle a caller ran that raised: the engine's sticky failure; a
        signal's exception (not an ``Exception``) goes on to the caller."""
        self.die(exc)
        if not isinstance(exc, Exception):
            raise exc

    # -- a cycle for one cached tensor alone ------------------------------------------------
    def cached_alone(self, channel: Channel, request: Request,
                     queued: int) -> tuple[int, Response, Backend] | None:
        """(slot, cached response, backend) when a cycle may run for ``request`` alone (under
        the cycle lock): the global set is the only one (a cycle runs every set's round),
        nothing else is queued (but ``queued`` entries, its own) or pending, nothing traced
        or stopping; its response cached, its backend made."""
        if not (len(self.engine.channels) == 1 and len(self.queue) == queued
                and not channel.entries and self.error is None and not self.stopped
                and not self.stop_requested and not self.expecting_stall
                and not self.engine.tracer.on):
            return None
        found = channel.negotiator.cached(request)
        if found is None:
            return None
        backend = channel.backends.get(found[1].device)
        return None if backend is None else (found[0], found[1], backend)

    def cycle_alone(self, channel: Channel, slot: int, name: str,
                    step: Callable[[Response], object], entry: Callable[[], Entry],
                    raise_sticky: bool) -> Handle | None:
        """The cycle of one cached tensor alone, on the calling thread (under the cycle
        lock): its round (the general cycle's, so peers on the general path pair with it),
        then ``step`` with its agreed response, and None. A round that agreed on more than
        this tensor ends the general way, with ``entry()`` (the call as an entry) adopted as
        pending work, and returns its handle. A failure is the sticky one (``raise_sticky``:
        raised here too, for a caller with no handle to fail)."""
        neg = channel.negotiator
        neg.in_caller = channel.mpi.in_caller = True
        self.last_cycle = time.perf_counter()
        self.engine.reclaim()
        try:
            now = time.monotonic()
            agreed, hits, invalid = neg.round_alone(slot, name, now)
            if agreed is None:
                adopted = entry()
                self._adopt(channel, adopted,
                            lambda: neg.conclude(hits, invalid, channel.entries, False, now))
                return adopted.handle
            step(agreed)
        except BaseException as exc:
            if not raise_sticky:
                self._failed(exc)
                return None
            self.die(exc)
            if self.error is not None and self.error is not exc:
                raise self.error from exc
            raise
        interrupt = neg.failures.take_deferred()
        if interrupt is not None:
            raise interrupt  # held while the peers were in the round (see _caller_cycle)
        return None

    def _adopt(self, channel: Channel, entry: Entry,
               conclude: Callable[[], CycleResult]) -> None:
        """``entry`` joins the pending work as if it had been queued before the round, then
        ``conclude`` ends the cycle and its responses run (under the cycle lock)."""
        entry.handle._driver = self._progress
        entry.enqueued_at = time.perf_counter()
        entry.stats = self.engine.tracer.stats
        entry.channel = channel
        name = entry.request.name
        with self.lock:
            channel.in_flight.add(name)
            channel.entries[name] = entry
        cycle = conclude()
        if cycle.responses:
            channel.execute(cycle.responses, self.lock)
        if cycle.stop is not None:
            self.stop(cycle.stop)

    def _run_queued(self, entry: Entry) -> bool:
        """Run ``entry`` (a waiting caller's own, queued, and the only work of this rank) in
        :meth:`cycle_alone`: its bucket on the backend as the general cycle would run it (its
        READY and DONE events kept). False if it cannot (the general cycle runs it)."""
        channel = entry.channel
        if len(self.queue) != 1 or self.queue[0] is not entry:
            return False
        found = self.cached_alone(channel, entry.request, 1)
        if found is None or found[2].direct(found[1]) is None:
            return False
        slot, backend = found[0], found[2]
        with self.lock:
            if self.queue != [entry]:
                return False
            self.queue = []

        nbytes = entry.array.nbytes  # one tensor: direct() refuses grouped calls

        def step(agreed: Response) -> None:
            with self.lock:
                channel.in_flight.discard(entry.request.name)
            self.engine.tracer.stats.record_bucket(1, nbytes, nbytes)
            backend.run([agreed], [entry])

        self.cycle_alone(channel, slot, entry.request.name, step, lambda: entry, False)
        return True

    # -- cycles: run by the background thread, or by a thread waiting for its result --------
    def progress(self, handle: Handle) -> None:
        """Run cycles on this (waiting) thread until ``handle`` is resolved (progress on wait).

        A thread that would block for its result runs the pending cycle itself, under the
        cycle lock, instead of waking the background thread and then being woken by it: two
        thread hand-offs saved per blocking call. If the background thread is inside a cycle,
        this waits for the lock (after cutting an idle nap of that cycle short) and goes on
        from there. Errors become the engine's sticky failure, as in the background loop.
        """
        lock = self.cycle_lock
        if not lock.acquire(blocking=False):
            if self.napping:  # the loop naps inside an idle round: cut it short
                self.wake.put(POKE)
            # Not a plain acquire: the holder's cycles may resolve this handle while the holder
            # goes on waiting for its own tensor, which a peer may hold back until this thread
            # submits its next one (a deadlock across ranks, seen with two threads per rank).
            while not lock.acquire(timeout=_LOCK_POLL_S):
                if handle._resolved or self.stopped:
                    return
        held = HeldSignals()  # a raising handler waits for the end of the cycle
        try:
            held.hold()
            # Alone and cached: a cycle of its own (_control/immediate.py).
            queued = self.queue
            if queued and queued[0].handle is handle:
                ran = self._run_queued(queued[0])
                held.deliver()
                if ran and (handle._resolved or self.stopped):
                    return
            misses = 0
            ready = handle._ready
            if ready is not None and self._alone(handle) and not ready.done:
                self._announce_now(handle)  # see below
            while not handle._resolved and not self.stopped:
                self._caller_cycle(held)
                if handle._resolved:
                    return
                ready = handle._ready
                if ready is not None and not ready.done:
                    if self._alone(handle):
                        # Nothing else pending here, so nothing can queue behind it: announce
                        # it now and let hvdlite's stream wait for the producer (no CPU wait).
                        self._announce_now(handle)
                        continue
                    # Our own input is still being produced and other work is pending: wait
                    # for it here (this thread waits anyway; the GIL and the cycle lock are
                    # free meanwhile, so the other tensors keep moving), then announce it.
                    lock.release()
                    try:
                        ready.synchronize()
                    finally:
                        lock.acquire()
                    continue
                # A round that did not resolve us: a peer had not submitted yet. Go again at
                # once (it is usually there by the next round), then pace the rounds.
                misses += 1
                if misses > 2:
                    time.sleep(min(self.nap_s * (1 << min(misses - 3, 10)), MAX_WAIT_NAP_S,
                                   self.engine.negotiator.cycle_s))
        finally:
            if self.engine.negotiator.announce_now is not None:
                self._announce_now(None)
            lock.release()
            held.release()  # last: a handler put back may run (and raise) at once
        held.deliver()  # a signal noted after the last cycle

    def _caller_cycle(self, held: HeldSignals) -> None:
        """One cycle on a waiting caller's thread. A failure inside it is the engine's sticky
        failure; an exception a signal handler raised while the caller waited inside a round
        (Ctrl-C, an alarm) is held until the round is complete and then raised to the caller
        alone, as an abandoned wait: the engine and the peers go on, the collective stays
        pending (its handle completes later). On the main thread user handlers do not run
        inside the cycle at all (``held``, :class:`HeldSignals`), wherever the signal comes:
        they run after it."""
        try:
            self.cycle(caller=True)
        except BaseException as exc:
            try:
                self._failed(exc)  # a signal's exception outside any wait goes on: it stopped all
            finally:
                held.deliver()
            return
        held.deliver()
        for channel in self.engine.channels.values():
            interrupt = channel.negotiator.failures.take_deferred()
            if interrupt is not None:
                raise interrupt

    def _announce_now(self, handle: Handle | None) -> None:
        for channel in self.engine.channels.values():
            channel.negotiator.announce_now = handle

    def _alone(self, handle: Handle) -> bool:
        """Whether ``handle``'s tensors are all the work pending on this rank."""
        queued, channels = self.queue, list(self.engine.channels.values())
        return (len(queued) + sum(len(c.entries) for c in channels) <= 1
                and all(e.handle is handle for e in queued)
                and all(e.handle is handle for c in channels for e in c.entries.values()))

    def run(self) -> None:
        isolated = False
        while True:
            woken = self._wait_for_work()
            try:
                if not isolated and self.engine.gpu is not None:
                    # As soon as there is a device: another thread's graph capture must not
                    # fail this thread's event queries (nor they the capture).
                    self.engine.gpu.own_thread()
                    isolated = True
                if self.schedules:
                    self.schedules.watch()  # at most once a second
            except BaseException as exc:  # noqa: BLE001 - must reach every caller
                self.die(exc)
                return
            if (woken or self.queue) and not self.stop_requested:
                # (A timer's round that finds a burst starting settles it as well: cut at its
                # first submission, the burst would cost a round of its own.)
                self._settle()
            elif (time.perf_counter() - self.last_cycle < self.engine.negotiator.cycle_s
                  and not self.stop_requested):
                # A caller ran a round within the cycle time: the peers' rounds are being
                # served by it, and a timer round now would only contend for the cycle lock.
                continue
            settled = time.perf_counter()
            with self.cycle_lock:
                self.in_background = True  # see immediate.run_now: worth waiting for
                try:
                    eng = self.engine
                    if self.stopped:
                        return
                    if woken and not self.stop_requested and self._only_newer(settled) \
                            and not any(c.entries for c in eng.channels.values()):
                        # Woken for work a waiting caller has already run (allreduce_async,
                        # then wait() at once): nothing to do; what was queued since starts
                        # the next burst, whose tokens wake the loop to settle it. (A wake-up
                        # by the timer always runs its round: peers with pending work may be
                        # waiting in it.)
                        continue
                    try:
                        self.cycle(caller=False)
                    except BaseException as exc:  # noqa: BLE001 - must reach every caller
                        self.die(exc)
                        return
                finally:
                    self.in_background = False
            if self.stopped:
                return

    def cycle(self, caller: bool) -> None:
        """One cycle: drain the queue, then per process set (in set-id order, the same on
        every member): negotiate, execute in the agreed order, complete. Runs under the
        cycle lock, on whichever thread holds it."""
        eng = self.engine
        if caller:
            self.last_cycle = time.perf_counter()
        eng.reclaim()
        new = self._drain()
        stopping, expecting = self.stop_requested, self.expecting_stall > 0
        channels = eng.channels
        tracer = eng.tracer
        if tracer.timeline is not None:
            tracer.cycle()  # Horovod's CYCLE_START: one per cycle, at its start
        for channel in list(channels.values()):  # a set added now runs from the next cycle
            if channel.id not in channels:
                continue  # removed earlier in this cycle (the same on every member)
            mine = [e for e in new if e.channel is channel] if len(channels) > 1 else new
            working = bool(channel.entries) or bool(mine)
            t0 = time.perf_counter()
            cycle = channel.negotiate(mine, stopping, expecting, caller)
            if working:  # idle rounds (mostly naps waiting for peers) are not negotiation
                tracer.stats.record_negotiation(time.perf_counter() - t0)
            if tracer.timeline is not None:
                tracer.negotiated(cycle.responses, channel.entries)
            if cycle.responses:
                channel.execute(cycle.responses, self.lock)
            if cycle.stop is not None:
                self.stop(cycle.stop)
                return
            if not channel.entries and not self.queue:
                channel.negotiator.settle()

    def _only_newer(self, since: float) -> bool:
        """Whether everything queued was submitted after ``since`` (or nothing is)."""
        with self.lock:
            return all(e.enqueued_at > since for e in self.queue)

    def _wait_for_work(self) -> bool:
        """Sleep until work is submitted or the pace says so; False if the timer ran out."""
        wake = self.wake
        woken = True
        if not self.queue and not self.stop_requested:
            try:
                wake.get(timeout=min(c.negotiator.next_wait_s(bool(c.entries))
                                     for c in self.engine.channels.values()))
            except queue.Empty:
                woken = False
        try:
            while True:  # the tokens of submissions this cycle drains anyway
                wake.get_nowait()
        except queue.Empty:
            pass
        return woken

    def _settle(self) -> None:
        """Woken by a submission: let the burst it starts (a step's gradients) finish first,
        napping while submissions keep arriving, for up to one cycle time (a dense burst: up
        to _DENSE_CYCLES of them, see _DENSE_ARRIVALS). A cycle per submission of a burst
        would cost a round each, cut the burst into partial buckets (no plan to replay) and
        take the GIL from the thread that submits. A caller that waits on a handle meanwhile
        runs the cycle itself, so a burst followed by its waits is negotiated once, whole."""
        wake = self.wake
        cycle_s = self.engine.negotiator.cycle_s
        nap = min(_SETTLE_NAP_S, cycle_s / 4)
        start = time.perf_counter()
        deadline, dense_deadline = start + cycle_s, start + _DENSE_CYCLES * cycle_s
        seen = len(self.queue)
        while True:
            time.sleep(nap)
            if wake.empty():
                return
            try:
                while True:
                    wake.get_nowait()
            except queue.Empty:
                pass
            queued = len(self.queue)  # read without the lock: a hint for the pace only
            dense = queued - seen >= _DENSE_ARRIVALS
            seen = queued
            if time.perf_counter() >= (dense_deadline if dense else deadline):
                return

    def idle_nap(self, seconds: float) -> bool:
        """A nap of the negotiation's idle wait that ends early when work is submitted here
        (the token goes back, so the next _wait_for_work does not sleep either) or when a
        waiting caller wants the cycle lock (a poke, consumed: it runs the next cycle)."""
        self.napping = True
        try:
            token = self.wake.get(timeout=seconds)
        except queue.Empty:
            return False
        finally:
            self.napping = False
        if token is not POKE:
            self.wake.put(None)
        return True

    def _drain(self) -> list[Entry]:
        with self.lock:
            new, self.queue = self.queue, []
            # Pending in their channels from here on, so that a stop found in an earlier
            # channel's round of this cycle still fails them (they are in no queue any more).
            for e in new:
                e.channel.entries[e.request.name] = e
        if self.engine.tracer.timeline is not None:
            self.engine.tracer.negotiating(new)
        return new
