"""The call template's steady state: a call that repeats its name's lane.

Everything the template (``_submit.py``) would compute for such a call is known from the lane
(``_control/replay.py``): the request, the layout, where the results go. What is left is a few
comparisons, the output (the caller's, or a recycled result set), and either the immediate
path (``_control/immediate.py``: a blocking allreduce with nothing else pending) or an entry
for the engine's queue.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hvdlite._control.immediate import DONE, MISS, run_now
from hvdlite._control.negotiation import Kind, Response
from hvdlite._control.replay import Lane
from hvdlite._control.work import Entry
from hvdlite._handles import Handle

if TYPE_CHECKING:
    from hvdlite._control.channel import Channel
    from hvdlite._engine import Engine

__all__ = ["MISS", "repeat", "prepare", "unit_entry"]


def repeat(engine: Engine, channel: Channel, lane: Lane, kind: Kind, tensors: Sequence[Any],
           out: Any, inplace: bool, group: bool, params: tuple[Any, ...], stream: Any,
           block: bool) -> Any:
    """The handle (or, ``block``, the result) of a call that repeats ``lane``; :data:`MISS`
    if it does not repeat it (the template takes the call)."""
    steady = engine.tracer.stats.steady
    made = lane.allocated
    value = _repeat(engine, channel, lane, kind, tensors, out, inplace, group, params, stream,
                    block, steady)
    steady["lane_misses" if value is MISS else "lane_hits"] += 1
    steady["results_allocated"] += lane.allocated - made
    return value


def _repeat(engine: Engine, channel: Channel, lane: Lane, kind: Kind, tensors: Sequence[Any],
            out: Any, inplace: bool, group: bool, params: tuple[Any, ...], stream: Any,
            block: bool, steady: dict[str, int]) -> Any:
    if group:
        unit = _unit_parts(lane, tensors, params, engine.reclaim)
        if unit is None:
            return MISS
        members, outputs, span, user = unit

        def make() -> Entry:
            entry = unit_entry(lane, members, outputs, span, user)
            prepare(engine, entry, lane.framework, stream)
            return entry

        work = _unit_work(engine, lane, members, outputs, span, stream)
        nbytes = lane.request_bytes
    else:
        single = _single_parts(lane, tensors[0], out, inplace, params, engine.reclaim)
        if single is None:
            return MISS
        tensor, (output, user) = tensors[0], single

        def make() -> Entry:
            entry = Entry(lane.request, tensor, output, Handle(lane.request.name), user,
                          lane.device_id, lane.to_user)
            prepare(engine, entry, lane.framework, stream)
            return entry

        work = _single_work(engine, lane, tensor, output, stream)
        nbytes = tensor.nbytes
    if block and kind is Kind.ALLREDUCE:
        done = run_now(engine, channel, lane.request, nbytes, work, make)
        if done is DONE:
            steady["immediate"] += 1
            return _value(lane, outputs if group else output, user, group)
        if done is not MISS:
            return done.wait()
    entry = make()
    engine.submit_one(entry, not block, channel)
    return entry.handle.wait() if block else entry.handle


def prepare(engine: Engine, entry: Entry, framework: str, stream: Any) -> None:
    """Record READY for a device entry on the caller's stream (``stream``, default current):
    the cycle orders hvdlite's stream after it (cudaStreamWaitEvent) instead of waiting for
    the producer on the CPU."""
    if entry.device_id >= 0:
        runtime = engine._gpu or engine.gpu_runtime()
        device_id = entry.device_id
        entry.ready = runtime.record_ready(framework, device_id, stream)
        entry.handle.attach_device(runtime.stream_waiter(framework, device_id),
                                   runtime.async_completion, device_id, entry.ready)


def _value(lane: Lane, result: Any, user: Any, group: bool) -> Any:
    """What a blocking call returns when its collective ran on the calling thread."""
    if group:
        if user is not None:
            return list(user)
        return list(result) if lane.to_user is None else [lane.to_user(r) for r in result]
    if user is not None:
        return user
    return result if lane.to_user is None else lane.to_user(result)


def _single_parts(lane: Lane, tensor: Any, out: Any, inplace: bool, params: tuple[Any, ...],
                  reclaim: Callable[[], None]) -> tuple[Any, Any] | None:
    """(output, user object to hand back) of a single-tensor call that repeats ``lane``."""
    if lane.shapes or not lane.matches(tensor, params):
        return None
    user = None
    if inplace:
        if lane.device_id < 0 and not tensor.flags.writeable:
            return None  # the template raises the error
        output = user = tensor
    elif out is not None:
        if not (type(out) is lane.ttype and out.shape == lane.shape
                and out.dtype is lane.dtype and out.strides == lane.strides
                and (out.data.device_id == lane.device_id if lane.device_id >= 0
                     else out.flags.writeable)):
            return None
        output = user = out
    else:
        res = lane.result(reclaim)
        output = res.views[0] if res is not None else None
    return output, user


def _unit_parts(lane: Lane, tensors: Sequence[Any], params: tuple[Any, ...],
                reclaim: Callable[[], None]) -> tuple[Any, Any, Any, Any] | None:
    """(members, outputs, span, user objects) of a grouped call that repeats ``lane``."""
    if not lane.shapes or not lane.matches_group(tensors, params):
        return None
    members = lane.inputs
    if lane.inplace:
        return members, members, lane.span, members
    res = lane.result(reclaim)
    assert res is not None  # an allreduce always has results
    return members, res.views, res.flat, None


def unit_entry(lane: Lane, members: Any, outputs: Any, span: Any, user: Any) -> Entry:
    """The entry of a grouped call of ``lane`` (one entry, one handle for all its members)."""
    entry = Entry(lane.request, members[0], None, Handle(lane.request.name), user,
                  lane.device_id, lane.to_user)
    entry.members, entry.outputs, entry.span = members, outputs, span
    entry.size = lane.request_bytes
    return entry


def _target(engine: Engine, lane: Lane, stream: Any) -> Any:
    if stream is not None:
        return stream
    from hvdlite._gpu.runtime import current_stream

    return current_stream(lane.framework, lane.device_id)


def _single_work(engine: Engine, lane: Lane, tensor: Any, output: Any,
                 stream: Any) -> Callable[[Response, Any], Callable[[], object] | None]:
    def work(resp: Response, backend: Any) -> Callable[[], object] | None:
        spec = backend.direct(resp)
        if spec is None:
            return None
        if lane.device_id < 0:
            return lambda: backend.reduce_one(resp, tensor, output, spec)
        sync = not engine.gpu_runtime().async_completion

        def step() -> None:
            target = _target(engine, lane, stream)
            backend.reduce_now(tensor, output, lane.device_id, target, spec)
            if sync:
                target.synchronize()

        return step

    return work


def _unit_work(engine: Engine, lane: Lane, members: Any, outputs: Any, span: Any,
               stream: Any) -> Callable[[Response, Any], Callable[[], object] | None]:
    def work(resp: Response, backend: Any) -> Callable[[], object] | None:
        if type(resp.dtype) is not str or resp.joined:
            return None
        if lane.device_id < 0:
            return lambda: backend.unit_now(resp, members, outputs, span)
        # On the device: a span only (no fusion buffer shared with hvdlite's stream) and sync
        # completion only, so nothing of it is left running on the caller's stream.
        if span is None or engine.gpu_runtime().async_completion:
            return None

        def step() -> None:
            target = _target(engine, lane, stream)
            if stream is None:
                backend.unit_now(resp, members, outputs, span, lane.device_id, target)
            else:
                with target:  # the copy kernels launch on the current stream
                    backend.unit_now(resp, members, outputs, span, lane.device_id, target)
            target.synchronize()

        return step

    return work
