"""Device runtime: hvdlite's streams, the event pool, metadata uploads and retirement.

How the streams meet (one device; time flows down)::

    caller stream        hvdlite stream (stream_priority, non-blocking)   the waiting thread
    -------------        --------------------------------------------     ------------------
    producer kernel
    record READY ----+   (negotiated once READY has completed on every
                     |    rank: a running producer holds only its own
                     |    tensor back, never the ones behind it)
                     +--> wait READY   (cudaStreamWaitEvent: no CPU wait)
                          copy-in kernel (one launch per bucket)
                          NCCL collective
                          copy-out kernel (Average / postscale fused in)
                          record DONE -------------------------------+--> async off: wait()
    async on:                                                        |    syncs DONE itself,
    wait DONE <------------------------------------------------------+    then completes
    consumer kernel
                          (every cycle retires finished buckets by a non-blocking query of
                           their DONE: inputs and outputs are released only after it)

With the timeline on, READY and DONE are waited on the CPU instead, so host timestamps
bracket the device work; with ``timeline_device_events`` the streams stay as drawn and each
device phase is timed by a CUDA event pair, turned into timeline spans once DONE completed.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvdlite._lru import Bounded
from hvdlite._observe.tracer import Tracer
from hvdlite._vocab.entry import finish_all
from hvdlite.errors import BackendUnavailableError

__all__ = ["GpuRuntime", "current_stream", "import_cupy", "isolate_from_captures",
           "latest_per_stream", "torch_streams"]

log = logging.getLogger("hvdlite")

# CUDA stream priority per config.stream_priority (CUDA clamps -1000 to the device's greatest).
PRIORITIES = {"high": -1000, "normal": 0}
_META_SLOTS = 64  # pinned staging slots for bucket metadata, reused round robin
_META_SLOT_BYTES = 64 * 1024  # room for 4095 tensors per bucket
# READY events' sequence (see Entry.ready_mark): next() on it is one C call, atomic under the GIL.
_RECORDS = itertools.count()
_get_ident = threading.get_ident
_MAX_IN_FLIGHT = 4096  # buckets enqueued and not yet retired before retiring waits


def latest_per_stream(entries: Sequence[Any]) -> list[Any]:
    """Of ``entries`` whose READY negotiation has not seen complete, the one with the latest
    READY of each stream, device and recording thread (``Entry.ready_mark``): waiting for it
    waits for the others."""
    latest: dict[tuple[int, int, int], Any] = {}
    for e in entries:
        if not e.ready_done:
            mark = e.ready_mark
            key = mark[:3]
            seen = latest.get(key)
            if seen is None or seen.ready_mark[3] < mark[3]:
                latest[key] = e
    return list(latest.values())


def import_cupy() -> Any:
    """CuPy, or :class:`BackendUnavailableError` saying why device tensors cannot work."""
    try:
        import cupy
        import cupy.cuda.nccl  # noqa: F401 - fails here if CuPy was built without NCCL
    except Exception as exc:  # ImportError, or a CUDA/NCCL load failure inside it
        raise BackendUnavailableError(
            f"device tensors need CuPy with NCCL (pip install 'hvdlite[gpu]'); import failed: "
            f"{exc}") from exc
    return cupy


# torch streams as CuPy objects, by (device, raw handle); bounded: a program may make a new
# stream every step (a reused handle names the same CUDA stream, so a kept entry stays right).
torch_streams: Bounded[tuple[int, int], Any] = Bounded(256)


def isolate_from_captures() -> str:
    """Make the calling thread's CUDA calls ignore stream captures that other threads run:
    its capture interaction mode becomes THREAD_LOCAL (PyTorch's NCCL watchdog does the
    same). In the default (GLOBAL) mode, while any thread captures a CUDA graph in global
    mode (``torch.cuda.graph``'s default), this thread's event queries and allocations fail,
    and the capture with them. Returns '' once done, else why not (cuda-python missing, or
    the driver's error); the mode is then left as it was."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return "cuda-python is not installed (pip install cuda-bindings, or hvdlite[gpu])"
    try:
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        err, _ = driver.cuThreadExchangeStreamCaptureMode(mode)
    except Exception as exc:  # a cuda-python too old or too new for this driver
        return f"cuThreadExchangeStreamCaptureMode failed: {exc}"
    return "" if int(err) == 0 else f"cuThreadExchangeStreamCaptureMode failed: {err!r}"


def current_stream(framework: str, device_id: int) -> Any:
    """The caller's current stream on ``device_id`` as a CuPy stream object (torch's: made
    once per torch stream; ``torch.cuda.current_stream`` builds a new object every call)."""
    import cupy

    if framework == "torch":
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        handle = (raw(device_id) if raw is not None
                  else torch.cuda.current_stream(device_id).cuda_stream)
        key = (device_id, handle)
        stream = torch_streams.get(key)
        if stream is None:
            stream = cupy.cuda.ExternalStream(handle, device_id)
            torch_streams.keep(key, stream)
        return stream
    return cupy.cuda.get_current_stream(device_id)


class DeviceContext:
    """Per-device state: the hvdlite stream, READY events, metadata staging."""

    def __init__(self, cupy: Any, device_id: int, priority: int) -> None:
        self.cupy = cupy
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True, priority=priority)
            self._pinned = cupy.cuda.alloc_pinned_memory(_META_SLOTS * _META_SLOT_BYTES)
            self._meta_dev = cupy.empty(_META_SLOTS * _META_SLOT_BYTES // 8, dtype=np.int64)
        self._host = np.frombuffer(self._pinned, dtype=np.int64)
        self._slot_events: list[Any] = [None] * _META_SLOTS
        self._slot = 0
        self._events: collections.deque[Any] = collections.deque()

    def event(self) -> Any:
        """A READY event from the pool (no timing: cheaper to record and wait on)."""
        try:
            return self._events.pop()
        except IndexError:
            with self.cupy.cuda.Device(self.device_id):
                return self.cupy.cuda.Event(block=False, disable_timing=True)

    def done_event(self) -> Any:
        """A new DONE event (handles keep it, so it is not pooled), made on this device."""
        cuda = self.cupy.cuda
        if cuda.runtime.getDevice() == self.device_id:
            return cuda.Event(block=False, disable_timing=True)
        with cuda.Device(self.device_id):
            return cuda.Event(block=False, disable_timing=True)

    def release(self, event: Any) -> None:
        # Back to the pool once its entry has been waited on: a stream wait captures the work
        # recorded so far, so re-recording the event later is harmless. (A grouped call is
        # one entry, so every READY event has exactly one user.)
        self._events.append(event)

    def upload_meta(self, values: np.ndarray) -> Any:
        """Copy int64 ``values`` to device memory in stream order; returns the device view.

        Staged through pinned memory so the copy is truly asynchronous (a pageable copy may
        synchronise with the stream). A slot is reused only after its last copy finished.
        """
        n = values.size
        if n * 8 > _META_SLOT_BYTES:
            raise ValueError(f"bucket metadata of {n} words exceeds {_META_SLOT_BYTES // 8}")
        slot, self._slot = self._slot, (self._slot + 1) % _META_SLOTS
        pending = self._slot_events[slot]
        if pending is not None:
            pending.synchronize()
        words = _META_SLOT_BYTES // 8
        self._host[slot * words:slot * words + n] = values
        dev = self._meta_dev[slot * words:slot * words + n]
        self.cupy.cuda.runtime.memcpyAsync(
            dev.data.ptr, self._pinned.ptr + slot * _META_SLOT_BYTES, n * 8,
            self.cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        ev = self._slot_events[slot] or self.cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(self.stream)
        self._slot_events[slot] = ev
        return dev


class _Once:
    """Runs a completion callback exactly once, whichever thread gets there first."""

    __slots__ = ("_fn", "_lock")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class Retirer:
    """Work enqueued on the device but not yet known to be finished: (DONE event, callback,
    objects to keep alive). Retired in order, without waiting, by a non-blocking event query
    at the start of every cycle (on whichever thread runs it), so no extra thread hands the
    GIL back and forth per bucket. CuPy has no ``record_stream``: the kept inputs, outputs
    and buffers must outlive the device's use of them, which this guarantees. A backlog past
    ``limit`` is retired by waiting for its oldest DONE (the device is far behind anyway).
    """

    def __init__(self, limit: int = _MAX_IN_FLIGHT) -> None:
        self._pending: collections.deque[tuple[Any, Callable[[], None] | None, Any]] = (
            collections.deque())
        self._limit = limit
        # Cycles retire under the cycle lock, and a caller may retire too before it reuses
        # result arrays (see _vocab/plans.py): whoever gets this lock retires, the other
        # skips (the work is the same).
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pending)

    def track(self, event: Any, on_done: Callable[[], None] | None, keep: Any) -> None:
        self._pending.append((event, on_done, keep))
        if len(self._pending) > self._limit:
            self._pending[0][0].synchronize()
            self.retire()

    def fail_pending(self, fail: Callable[[Any], None]) -> None:
        """Call ``fail(entry)`` for every live entry of the work not yet retired (the job is
        ending: their results will never be right)."""
        for _, _, keep in list(self._pending):
            entries = keep[0] if isinstance(keep, tuple) and keep else ()
            for e in entries if isinstance(entries, list) else ():
                if e is not None:
                    fail(e)

    def retire(self, wait: bool = False) -> None:
        """Run the callbacks and drop the references of everything finished (in order); with
        ``wait``, of everything (at shutdown, after the streams were synchronised)."""
        if not self._lock.acquire(blocking=wait):
            return
        try:
            pending = self._pending
            while pending and (wait or pending[0][0].done):
                _, on_done, _ = pending.popleft()
                if on_done is not None:
                    try:
                        on_done()
                    except Exception:  # a failed callback must not stop later retirements
                        log.exception("hvdlite: device completion callback failed")
        finally:
            self._lock.release()


class GpuRuntime:
    """All device state of one engine: contexts per device and the retirement queue."""

    def __init__(self, default_device: int, async_completion: bool, device_events: bool,
                 tracer: Tracer, stream_priority: str = "high") -> None:
        self.cupy = import_cupy()
        self.default_device = default_device
        #: The CUDA priority of the per-device streams (``config.stream_priority`` at init;
        #: an agreed schedule's stream takes the knob's value when the schedule opens).
        self.priority = PRIORITIES[stream_priority]
        self.tracer = tracer
        self._async = async_completion
        self._device_events = device_events
        self._contexts: dict[int, DeviceContext] = {}
        self._waiters: dict[tuple[str, int], Callable[[Any, Any], None]] = {}
        self._lock = threading.Lock()
        self._warned_isolation = False
        self.retirer = Retirer()

    # The timeline can start and stop at run time, so these follow it.
    @property
    def cpu_sync(self) -> bool:
        """Timeline on without event timing: wait on the CPU so host times bracket device work."""
        return self.tracer.timeline is not None and not self._device_events

    @property
    def event_timed(self) -> bool:
        """Timeline on with event timing: device phases timed by CUDA event pairs."""
        return self.tracer.timeline is not None and self._device_events

    @property
    def async_completion(self) -> bool:
        return self._async and not self.cpu_sync

    def timing_event(self, ctx: DeviceContext) -> Any:
        with self.cupy.cuda.Device(ctx.device_id):
            event = self.cupy.cuda.Event(block=False, disable_timing=False)
            event.record(ctx.stream)
        return event

    def context(self, device_id: int) -> DeviceContext:
        ctx = self._contexts.get(device_id)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(device_id)
                if ctx is None:
                    ctx = self._contexts[device_id] = DeviceContext(self.cupy, device_id,
                                                                        self.priority)
        return ctx

    def record_ready(self, framework: str, device_id: int,
                     stream: Any) -> tuple[Any, tuple[int, int, int, int]]:
        """Record a READY event on the caller's stream (caller thread, at enqueue); returns
        it and its mark (see ``Entry.ready_mark``)."""
        ctx = self.context(device_id)
        if stream is None:
            stream = current_stream(framework, device_id)
        event = ctx.event()
        ptr = stream.ptr
        if ptr == 0 and self.cupy.cuda.runtime.getDevice() != device_id:
            # The null stream means the current device's: record on the tensor's device's
            # (a tensor on another GPU than the rank's, with no stream given).
            with self.cupy.cuda.Device(device_id):
                event.record(stream)
        else:
            event.record(stream)
        # The number is taken after the record: one thread's numbers follow its records.
        return event, (ptr, device_id, _get_ident(), next(_RECORDS))

    def wait_ready(self, ctx: DeviceContext, entries: Sequence[Any]) -> None:
        """Order hvdlite's stream after every entry's producer (its READY event), except
        where negotiation already saw READY complete; the events go back to the pool. Of
        the events one thread recorded on one stream only the latest is waited for: it
        completes after the others (stream order), and a bucket of a burst of calls costs
        one stream wait per producer stream, not one per tensor."""
        for e in latest_per_stream(entries):
            if self.cpu_sync:
                e.ready.synchronize()
            else:
                ctx.stream.wait_event(e.ready)
        for e in entries:
            ctx.release(e.ready)

    def complete(self, ctx: DeviceContext, entries: list[Any], outputs: list[Any],
                 timed: Sequence[Any] = ()) -> None:
        """Record DONE after a bucket's enqueued work; complete its entries now (async) or
        once DONE has completed (sync: by the waiting thread, a poll, or retirement, whichever
        comes first). Either way the handles get the DONE event at once, so ``wait_stream``
        never waits for the device, and the retirer keeps the entries (inputs, outputs)
        alive until DONE has completed: CuPy has no ``record_stream``."""
        done = ctx.done_event()
        done.record(ctx.stream)
        spans = (lambda: self.tracer.device_spans(timed)) if timed else None
        keep = (entries, outputs)
        if self.async_completion:
            finish_all(entries, outputs, (done,))
            self.retirer.track(done, spans, keep)
            return
        once = _Once(lambda: finish_all(entries, outputs))
        for e in entries:  # every entry has a handle of its own
            if e is not None:
                e.handle.enqueued((done,), once)
        if spans is None:
            self.retirer.track(done, once, keep)
            return

        def spans_then_complete() -> None:
            spans()
            once()

        self.retirer.track(done, spans_then_complete, keep)

    def stream_waiter(self, framework: str, device_id: int) -> Callable[[Any, Any], None]:
        """For Handle.wait: make the caller's stream (default: current) wait on the events.
        One function per (framework, device), made once."""
        key = (framework, device_id)
        waiter = self._waiters.get(key)
        if waiter is None:

            def waiter(handle: Any, stream: Any) -> None:
                target = stream if stream is not None else current_stream(framework, device_id)
                for event in handle._events:
                    target.wait_event(event)

            self._waiters[key] = waiter
        return waiter

    def own_thread(self) -> None:
        """Called once by each thread hvdlite owns that makes CUDA calls (its background
        thread): isolates it from other threads' graph captures (:func:`isolate_from_captures`),
        or warns once that it cannot."""
        why = isolate_from_captures()
        if why and not self._warned_isolation:
            self._warned_isolation = True
            log.warning("hvdlite: its background thread keeps CUDA's global capture mode (%s): "
                        "a CUDA graph captured on another thread with capture_error_mode="
                        "'global' (torch.cuda.graph's default) while hvdlite has device work in "
                        "flight can fail; capture with capture_error_mode='thread_local'", why)

    def synchronize(self) -> None:
        """Wait for everything hvdlite enqueued on its streams (used at shutdown)."""
        for ctx in self._contexts.values():
            ctx.stream.synchronize()

    def shutdown(self) -> None:
        self.synchronize()
        self.retirer.retire(wait=True)
        self._contexts.clear()
