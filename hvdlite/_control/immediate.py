"""The immediate path of a blocking allreduce: one cached tensor, nothing else pending.

A blocking call that repeats its lane (same name, layout and parameters, ``_control/replay.py``)
while nothing else is pending on this rank needs no queue, no entry, no handle and no thread
hand-off. The calling thread takes the cycle lock, runs the cycle's round for that one cached
tensor and, when every rank agreed on it alone, runs the collective at once and returns the
result. The collectives it issues are exactly a general cycle's (the same round, then the same
data call), so peers on the general path pair with it; when the round agrees on anything else,
the cycle goes on the general way, with this call adopted as an ordinary entry.

Device tensors: the NCCL call goes on the caller's stream. Nothing else is pending, so that
orders it exactly as a READY wait on hvdlite's stream would (after everything the caller
enqueued before), and no READY or DONE event is needed::

    caller stream:  ... producer kernels ... -> NCCL allreduce -> (sync completion: the
                                                 caller synchronises this stream)

Sync completion synchronises that stream before returning; async completion returns at once,
the caller's stream already ordered after the collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hvdlite._control.driver import POKE, Owner, cached_alone
from hvdlite._control.negotiation import Request, Response
from hvdlite._control.work import Entry

_WAIT_FOR_LOOP_S = 0.005  # longest wait of a blocking call for the background thread's cycle

if TYPE_CHECKING:
    from hvdlite._control.channel import Channel

__all__ = ["DONE", "MISS", "Work", "run_now"]

MISS = object()  # the call cannot take the immediate path: submit it the general way
DONE = object()  # the call's collective ran on the calling thread: its results are ready

# What a call's data step is, given the agreed response and its backend: the step to run once
# the round agreed on it alone, or None if this call cannot run immediately.
Work = Callable[[Response, Any], Callable[[], object] | None]


def run_now(engine: Owner, channel: Channel, request: Request, nbytes: int, work: Work,
            make_entry: Callable[[], Entry]) -> Any:
    """Run the blocking call of ``request`` immediately (see the module docstring): returns
    :data:`DONE` once its collective ran, a :class:`~hvdlite.Handle` to wait on if the round
    agreed on more than this call (``make_entry`` made it an ordinary entry), or
    :data:`MISS` if the call must be submitted the general way."""
    driver = engine.driver
    lock = driver.cycle_lock
    if not lock.acquire(blocking=False):
        # Only the background thread's cycle (most often the short one after a burst of
        # asynchronous calls) is worth waiting for, and only briefly. Another thread holding
        # the lock may be waiting for a tensor the peers need this very call to submit first
        # (a deadlock if this call blocked): the general path queues it without the lock.
        if not driver.in_background:
            return MISS
        if driver.napping:
            driver.wake.put(POKE)
        if not lock.acquire(timeout=_WAIT_FOR_LOOP_S):
            return MISS
    try:
        found = cached_alone(engine, channel, request, 0)
        if found is None:
            return MISS
        slot, resp, backend = found
        step = work(resp, backend)
        if step is None:
            return MISS
        return _cycle(engine, channel, request.name, slot, nbytes, step, make_entry)
    finally:
        lock.release()


def _cycle(engine: Owner, channel: Channel, name: str, slot: int, nbytes: int,
           step: Callable[[], object], make_entry: Callable[[], Entry]) -> Any:
    neg = channel.negotiator
    neg.in_caller = channel.mpi.in_caller = True
    t0 = time.perf_counter()
    engine.driver.last_cycle = t0
    engine.reclaim()
    try:
        now = time.monotonic()
        hits, invalid = neg.round_one(slot, name, now)
        if neg.agreed_one(slot, hits, invalid) is None:
            # Other work in this round: the general cycle takes it from here.
            entry = make_entry()
            engine.driver.adopt(channel, entry,
                                lambda: neg.conclude(hits, invalid, channel.entries, False,
                                                     now))
            return entry.handle
        step()
        if not channel.entries and not engine._queue:
            neg.settle()
    except BaseException as exc:  # a failure inside the round: sticky, as in any cycle
        engine._die(exc)
        if engine._error is not None and engine._error is not exc:
            raise engine._error from exc
        raise
    stats = engine.tracer.stats
    stats.record_bucket(1, nbytes, nbytes)
    stats.record_op("allreduce", nbytes, time.perf_counter() - t0)
    interrupt = neg.failures.take_deferred()
    if interrupt is not None:
        raise interrupt  # held while the peers were in the round (see Driver._caller_cycle)
    return DONE
