"""Who runs cycles, and when: the background thread's loop and a waiting caller's progress.

A cycle (drain the queue, then per process set: negotiate, execute, complete) runs under one
lock, on whichever thread holds it: the background thread for the work nobody waits for, or
a thread waiting for its own result (progress on wait, so no thread hand-off there and back).
The engine (``_engine.py``) holds the state a cycle works on; this module decides when a
cycle runs and on which thread.
"""

from __future__ import annotations

import _signal
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from hvdlite._control.negotiation import Request, Response
from hvdlite._control.work import Entry

if TYPE_CHECKING:
    from hvdlite._control.channel import Channel
    from hvdlite._control.negotiator import CycleResult, Negotiator
    from hvdlite._handles import Handle
    from hvdlite._observe.tracer import Tracer
    from hvdlite.errors import HvdliteError

__all__ = ["Driver", "Owner", "POKE", "cached_alone"]

POKE = object()  # wake-up token of a waiting caller (it cuts an idle nap short)

_MAX_NAP_S = 200e-6  # longest pause of a waiting caller between rounds without its result
_LOCK_POLL_S = 200e-6  # how often a caller waiting for the cycle lock looks at its handle
# Nap of the loop while a burst of submissions arrives (see Driver._settle): long enough that
# the thread submitting the burst keeps the GIL for a few dozen calls between two looks.
_SETTLE_NAP_S = 200e-6


class Owner(Protocol):
    """What the driver (and the immediate path) use of the engine that owns them: its state,
    as ``_engine.Engine`` keeps it. A protocol, so this layer never imports the engine."""

    driver: Driver
    tracer: Tracer
    negotiator: Negotiator
    _channels: dict[int, Channel]
    _queue: list[Entry]
    _lock: threading.Lock
    _error: HvdliteError | None
    _stopped: bool
    _stop_requested: bool
    _expecting_stall: int
    _gpu: Any  # the device runtime once made (else None)

    def gpu_runtime(self) -> Any: ...

    def reclaim(self) -> None: ...

    def _die(self, exc: BaseException) -> None: ...

    def _finish(self, reason: HvdliteError) -> None: ...


class Driver:
    """Runs an engine's cycles: its background thread (:meth:`run`) and progress on wait
    (:meth:`progress`). Thread-safety: every cycle runs under ``cycle_lock``, one at a time,
    in the same order on every rank whichever thread runs it."""

    def __init__(self, engine: Owner) -> None:
        self.engine = engine
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

    def quiet(self, channel: Channel, queued: int = 0) -> bool:
        """Whether a cycle may run for one cached tensor of ``channel`` alone (the immediate
        path, ``_control/immediate.py``; under the cycle lock): the global set is the only
        one (a cycle runs every set's round), nothing (but ``queued`` entries, that tensor's)
        is queued or pending, nothing traced, nothing stopping."""
        e = self.engine
        return (len(e._channels) == 1 and len(e._queue) == queued and not channel.entries
                and e._error is None and not e._stopped and not e._stop_requested
                and not e._expecting_stall and not e.tracer.on)

    def adopt(self, channel: Channel, entry: Entry, conclude: Callable[[], CycleResult]) -> None:
        """Finish, the general way, an immediate cycle whose round agreed on more than its
        own tensor: ``entry`` (that call) joins the pending work as if it had been queued
        before the round, then ``conclude`` ends the cycle and its responses run (under the
        cycle lock)."""
        entry.handle._driver = self.progress
        entry.enqueued_at = time.perf_counter()
        entry.stats = self.engine.tracer.stats
        entry.channel = channel
        name = entry.request.name
        with self.engine._lock:
            channel.in_flight.add(name)
            channel.entries[name] = entry
        cycle = conclude()
        if cycle.responses:
            channel.execute(cycle.responses, self.engine._lock)
        if cycle.stop is not None:
            self.engine._finish(cycle.stop)

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
                if handle._resolved or self.engine._stopped:
                    return
        held = _HeldSignals()  # a raising handler waits for the end of the cycle
        try:
            held.hold()
            # Alone and cached: a cycle of its own (_control/immediate.py).
            queued = self.engine._queue
            if queued and queued[0].handle is handle:
                ran = _run_queued(self.engine, queued[0])
                held.deliver()
                if ran and (handle._resolved or self.engine._stopped):
                    return
            misses = 0
            ready = handle._ready
            if ready is not None and self._alone(handle) and not ready.done:
                self._announce_now(handle)  # see below
            while not handle._resolved and not self.engine._stopped:
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
                    time.sleep(min(self.nap_s * (1 << min(misses - 3, 10)), _MAX_NAP_S,
                                   self.engine.negotiator.cycle_s))
        finally:
            if self.engine.negotiator.announce_now is not None:
                self._announce_now(None)
            lock.release()
            held.release()  # last: a handler put back may run (and raise) at once
        held.deliver()  # a signal noted after the last cycle

    def _caller_cycle(self, held: _HeldSignals) -> None:
        """One cycle on a waiting caller's thread. A failure inside it is the engine's sticky
        failure; an exception a signal handler raised while the caller waited inside a round
        (Ctrl-C, an alarm) is held until the round is complete and then raised to the caller
        alone, as an abandoned wait: the engine and the peers go on, the collective stays
        pending (its handle completes later). On the main thread user handlers do not run
        inside the cycle at all (``held``, :class:`_HeldSignals`), wherever the signal comes:
        they run after it."""
        try:
            self.cycle(caller=True)
        except BaseException as exc:
            self.engine._die(exc)
            held.deliver()
            if not isinstance(exc, Exception):
                raise  # a signal's exception outside any wait: the engine had to stop
            return
        held.deliver()
        for channel in self.engine._channels.values():
            interrupt = channel.negotiator.failures.take_deferred()
            if interrupt is not None:
                raise interrupt

    def _announce_now(self, handle: Handle | None) -> None:
        for channel in self.engine._channels.values():
            channel.negotiator.announce_now = handle

    def _alone(self, handle: Handle) -> bool:
        """Whether ``handle``'s tensors are all the work pending on this rank."""
        queued, channels = self.engine._queue, list(self.engine._channels.values())
        return (len(queued) + sum(len(c.entries) for c in channels) <= 1
                and all(e.handle is handle for e in queued)
                and all(e.handle is handle for c in channels for e in c.entries.values()))

    def run(self) -> None:
        while True:
            woken = self._wait_for_work()
            if woken and not self.engine._stop_requested:
                self._settle()
            elif (time.perf_counter() - self.last_cycle < self.engine.negotiator.cycle_s
                  and not self.engine._stop_requested):
                # A caller ran a round within the cycle time: the peers' rounds are being
                # served by it, and a timer round now would only contend for the cycle lock.
                continue
            with self.cycle_lock:
                self.in_background = True  # see immediate.run_now: worth waiting for
                try:
                    eng = self.engine
                    if eng._stopped:
                        return
                    if woken and not eng._queue and not eng._stop_requested and not any(
                            c.entries for c in eng._channels.values()):
                        # Woken for work a waiting caller has already run (allreduce_async,
                        # then wait() at once): nothing to do. (A wake-up by the timer always
                        # runs its round: peers with pending work may be waiting in it.)
                        continue
                    try:
                        self.cycle(caller=False)
                    except BaseException as exc:  # noqa: BLE001 - must reach every caller
                        eng._die(exc)
                        return
                finally:
                    self.in_background = False
            if self.engine._stopped:
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
        stopping, expecting = eng._stop_requested, eng._expecting_stall > 0
        channels = eng._channels
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
                channel.execute(cycle.responses, eng._lock)
            if cycle.stop is not None:
                eng._finish(cycle.stop)
                return
            if not channel.entries and not eng._queue:
                channel.negotiator.settle()

    def _wait_for_work(self) -> bool:
        """Sleep until work is submitted or the pace says so; False if the timer ran out."""
        wake = self.wake
        woken = True
        if not self.engine._queue and not self.engine._stop_requested:
            try:
                wake.get(timeout=min(c.negotiator.next_wait_s(bool(c.entries))
                                     for c in self.engine._channels.values()))
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
        napping while submissions keep arriving, for up to one cycle time. A cycle per
        submission of a burst would cost a round each, cut the burst into partial buckets
        (no plan to replay) and take the GIL from the thread that submits."""
        wake = self.wake
        cycle_s = self.engine.negotiator.cycle_s
        deadline = time.perf_counter() + cycle_s
        while time.perf_counter() < deadline:
            time.sleep(min(_SETTLE_NAP_S, cycle_s / 4))
            if wake.empty():
                return
            try:
                while True:
                    wake.get_nowait()
            except queue.Empty:
                pass

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
        with self.engine._lock:
            new, self.engine._queue = self.engine._queue, []
            # Pending in their channels from here on, so that a stop found in an earlier
            # channel's round of this cycle still fails them (they are in no queue any more).
            for e in new:
                e.channel.entries[e.request.name] = e
        if self.engine.tracer.timeline is not None:
            self.engine.tracer.negotiating(new)
        return new


def cached_alone(engine: Owner, channel: Channel, request: Request,
            queued: int) -> tuple[int, Response, Any] | None:
    """(slot, cached response, backend) when a cycle may run for ``request`` alone: nothing
    else pending (but ``queued`` entries, its own), its response cached, its backend made."""
    if not engine.driver.quiet(channel, queued):
        return None
    neg = channel.negotiator
    slot, same = neg.cache.lookup(request)
    if not same or not neg.idle():
        return None
    resp = neg.cache.response(slot)
    backend = channel.backends.get(resp.device)
    return None if backend is None else (slot, resp, backend)


_MAIN_THREAD = threading.main_thread().ident
# Signals whose user handlers wait while the main thread runs cycles as a waiting caller.
_HELD_SIGNALS = (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2,
                 signal.SIGHUP)


class _HeldSignals:
    """While a waiting caller on the main thread (where Python runs signal handlers) runs its
    cycles (:meth:`hold` to :meth:`release`), the user's Python handlers of
    ``_HELD_SIGNALS`` only note their signal, and :meth:`deliver` (after each cycle) runs them
    for the noted signals, on this thread. An exception a handler raises (an alarm, a user's
    SIGINT handler) then reaches the caller between cycles, never halfway through one, where
    it would leave the cycle half done and stop the engine on every rank. Python's own
    ``default_int_handler`` (Ctrl-C) is left alone: inside an MPI wait its KeyboardInterrupt
    is deferred to the end of the round (``FailureChannel.defer``); elsewhere it stops the
    engine, as a Ctrl-C may. Off the main thread (no handler runs there) it does nothing."""

    __slots__ = ("noted", "saved")

    def __init__(self) -> None:
        self.saved: list[tuple[int, Any]] = []
        self.noted: list[tuple[int, Any]] = []

    def hold(self) -> None:
        """Replace the user handlers by the note-taker (main thread only)."""
        if threading.get_ident() != _MAIN_THREAD:
            return
        for sig in _HELD_SIGNALS:
            handler = _signal.getsignal(sig)  # the C function: no enum for SIG_DFL (cheap)
            if callable(handler) and handler is not signal.default_int_handler:
                self.saved.append((sig, handler))
                _signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.noted.append((signum, frame))

    def deliver(self) -> None:
        """Run the handlers of the signals noted so far (each may raise)."""
        if self.noted:
            handlers = dict(self.saved)
            noted, self.noted = self.noted, []
            for signum, frame in noted:
                handlers[signum](signum, frame)

    def release(self) -> None:
        """Put the user handlers back (a signal that comes meanwhile was noted for
        :meth:`deliver`, or runs its own handler once that is back)."""
        done = 0
        try:
            for sig, handler in self.saved:
                _signal.signal(sig, handler)
                done += 1
        finally:
            for sig, handler in self.saved[done:]:  # a handler raised while putting them back
                _signal.signal(sig, handler)


def _run_queued(engine: Owner, entry: Entry) -> bool:
    """Run ``entry`` (a waiting caller's own, queued, and the only work of this rank) in a
    cycle of its own, as :func:`run_now` runs a blocking call: its round, then its bucket on
    the backend as the general cycle would (its READY and DONE events kept). False if it
    cannot (the general cycle runs it). Under the cycle lock. (The blocking call's twin,
    which needs no entry at all, is ``_control/immediate.py``.)"""
    channel = entry.channel
    if len(engine._queue) != 1 or engine._queue[0] is not entry:
        return False
    found = cached_alone(engine, channel, entry.request, 1)
    if found is None or found[2].direct(found[1]) is None:
        return False
    slot, backend, neg = found[0], found[2], channel.negotiator
    with engine._lock:
        if engine._queue != [entry]:
            return False
        engine._queue = []
    neg.in_caller = channel.mpi.in_caller = True
    engine.driver.last_cycle = time.perf_counter()
    engine.reclaim()
    now = time.monotonic()
    try:
        hits, invalid = neg.round_one(slot, entry.request.name, now)
        agreed = neg.agreed_one(slot, hits, invalid)
        if agreed is None:
            engine.driver.adopt(channel, entry,
                         lambda: neg.conclude(hits, invalid, channel.entries, False, now))
            return True
        with engine._lock:
            channel.in_flight.discard(entry.request.name)
        engine.tracer.stats.record_bucket(1, entry.nbytes(), entry.nbytes())
        backend.run([agreed], [entry])
    except BaseException as exc:  # as in Driver._caller_cycle
        engine._die(exc)
        if not isinstance(exc, Exception):
            raise
        return True
    interrupt = neg.failures.take_deferred()
    if interrupt is not None:
        raise interrupt
    return True
