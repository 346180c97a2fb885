"""The immediate path of a blocking allreduce: one cached tensor, nothing else pending.

A blocking call that repeats its lane (same name, layout and parameters, ``_vocab/plans.py``)
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
from typing import TYPE_CHECKING, Any, Protocol

from hvdlite._control.held_signals import hold_signals
from hvdlite._control.scheduler import POKE
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.messages import Response
from hvdlite._vocab.plans import Call, Lane

_WAIT_FOR_LOOP_S = 0.005  # longest wait of a blocking call for the background thread's cycle

if TYPE_CHECKING:
    from hvdlite._backends.base import Backend
    from hvdlite._control.channel import Channel
    from hvdlite._control.scheduler import Scheduler
    from hvdlite._gpu.runtime import GpuRuntime
    from hvdlite._observe.tracer import Tracer


class ImmediateEngine(Protocol):
    """What the immediate path uses of the engine: its scheduler and its device runtime."""

    scheduler: Scheduler
    tracer: Tracer

    def gpu_runtime(self) -> GpuRuntime: ...

__all__ = ["DONE", "MISS", "run_now", "prepare"]

MISS = object()  # the call cannot take the immediate path: submit it the general way
DONE = object()  # the call's collective ran on the calling thread: its results are ready

def run_now(engine: ImmediateEngine, channel: Channel, lane: Lane, call: Call, stream: Any) -> Any:
    """Run the blocking allreduce ``call`` of ``lane`` immediately (see the module docstring):
    returns :data:`DONE` once its collective ran, a :class:`~hvdlite.Handle` to wait on if
    the round agreed on more than this call (the call became an ordinary entry), or
    :data:`MISS` if the call must be submitted the general way."""
    sched = engine.scheduler
    if sched.capture_thread is not None:
        return MISS  # the general path refuses it (Scheduler.check_usable)
    lock = sched.cycle_lock
    if not lock.acquire(blocking=False):
        # Only the background thread's cycle (most often the short one after a burst of
        # asynchronous calls) is worth waiting for, and only briefly. Another thread holding
        # the lock may be waiting for a tensor the peers need this very call to submit first
        # (a deadlock if this call blocked): the general path queues it without the lock.
        if not sched.in_background:
            return MISS
        if sched.napping:
            sched.wake.put(POKE)
        if not lock.acquire(timeout=_WAIT_FOR_LOOP_S):
            return MISS
    held = None
    try:
        found = sched.cached_alone(channel, lane.request, 0)
        if found is None:
            return MISS
        slot, resp, backend = found
        step = (_unit_step if lane.shapes else _single_step)(engine, lane, call, resp, backend,
                                                              stream)
        if step is None:
            return MISS
        # A user's signal handler that raised inside the cycle would stop the engine on every
        # rank: it runs after the cycle instead (the interrupted-wait race, held_signals.py).
        held = hold_signals()
        return _cycle(engine, channel, lane, call, slot, step, stream)
    finally:
        lock.release()
        if held is not None:
            held.release()
            held.deliver()


def prepare(engine: ImmediateEngine, entry: Entry, framework: str, stream: Any) -> None:
    """Record READY for a device entry on the caller's stream (``stream``, default current):
    the cycle orders hvdlite's stream after it (cudaStreamWaitEvent) instead of waiting for
    the producer on the CPU."""
    if entry.device_id >= 0:
        runtime = engine.gpu_runtime()
        device_id = entry.device_id
        entry.ready, entry.ready_mark = runtime.record_ready(framework, device_id, stream)
        entry.handle.attach_device(runtime.stream_waiter(framework, device_id),
                                   runtime.async_completion, device_id, entry.ready)


def _target(lane: Lane, stream: Any) -> Any:
    if stream is not None:
        return stream
    from hvdlite._gpu.runtime import current_stream

    return current_stream(lane.framework, lane.device_id)


def _single_step(engine: ImmediateEngine, lane: Lane, call: Call, resp: Response, backend: Backend,
                 stream: Any) -> Callable[[], object] | None:
    """The data step of a single tensor once the round agreed on it alone (None: it cannot
    run here)."""
    spec = backend.direct(resp)
    if spec is None:
        return None
    tensor, output = call.inputs, call.output
    if lane.device_id < 0:
        return lambda: backend.reduce_now(resp, tensor, output, spec)
    sync = not engine.gpu_runtime().async_completion

    def step() -> None:
        target = _target(lane, stream)
        backend.reduce_now(resp, tensor, output, spec, lane.device_id, target)
        if sync:
            target.synchronize()

    return step


def _unit_step(engine: ImmediateEngine, lane: Lane, call: Call, resp: Response, backend: Backend,
               stream: Any) -> Callable[[], object] | None:
    """The data step of a grouped call (one unit) once the round agreed on it alone."""
    if type(resp.dtype) is not str or resp.joined:
        return None
    members, outputs, span = call.inputs, call.output, call.span
    if lane.device_id < 0:
        return lambda: backend.unit_now(resp, members, outputs, span)
    # On the device: a span only (no fusion buffer shared with hvdlite's stream) and sync
    # completion only, so nothing of it is left running on the caller's stream.
    if span is None or engine.gpu_runtime().async_completion:
        return None

    def step() -> None:
        target = _target(lane, stream)
        if stream is None:
            backend.unit_now(resp, members, outputs, span, lane.device_id, target)
        else:
            with target:  # the copy kernels launch on the current stream
                backend.unit_now(resp, members, outputs, span, lane.device_id, target)
        target.synchronize()

    return step


def _cycle(engine: ImmediateEngine, channel: Channel, lane: Lane, call: Call, slot: int,
           step: Callable[[], object], stream: Any) -> Any:
    """The call's cycle alone (``Scheduler.cycle_alone``); DONE, or the handle of the call
    adopted as an entry when its round agreed on more."""
    nbytes = call.nbytes
    t0 = time.perf_counter()

    def as_entry() -> Entry:
        entry = call.entry(lane)
        prepare(engine, entry, lane.framework, stream)
        return entry

    handle = engine.scheduler.cycle_alone(channel, slot, lane.request.name,
                                          lambda _agreed: step(), as_entry, True)
    if handle is not None:
        return handle
    stats = engine.tracer.stats
    stats.record_bucket(1, nbytes, nbytes)
    stats.record_op("allreduce", nbytes, time.perf_counter() - t0)
    return DONE
