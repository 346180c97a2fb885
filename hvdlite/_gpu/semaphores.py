"""Device semaphores: flags in IPC-shared device memory, written and awaited on CUDA streams.

Each rank owns one small device array of 32-bit flags, its *inbox*, allocated once with
``cudaMalloc`` when a communicator is made; its IPC handle is exchanged once, and every peer
opens it once. A rank tells a peer something by a stream write of a value into the peer's
inbox (``cuStreamWriteValue32``, ordered after the stream's earlier work, with the memory
fence the default flag gives: what the stream wrote before is visible to whoever sees the
value); it waits by a stream wait on its *own* inbox (``cuStreamWaitValue32`` with
``CU_STREAM_WAIT_VALUE_GEQ``), so a wait polls local memory and every write crosses the link
once. Neither takes an SM or a host thread. CuPy has no binding for these stream memory
operations: they come from NVIDIA's ``cuda-python`` (``cuda.bindings.driver``, the ``gpu``
extra), imported only here and only when a communicator is made.

Epochs. A flag carries the epoch of the latest use of a staging slot that its writer has
finished with; step ``k`` of a communicator of ``slots`` slots uses slot ``k % slots`` in its
epoch ``k // slots + 1`` (so the first use of a slot is epoch 1 and the flags start at 0,
which counts as "epoch 0 done"). Values are 32 bits and wrap: the driver's GEQ is cyclic,
``(int32)(*flag - value) >= 0``, so a wait is right as long as the flag is never more than
2**31 - 1 epochs away from the awaited value. The protocol keeps every writer within one epoch
of every waiter of a slot (a slot's next use waits for every peer to have read it), so that
holds with room to spare; :func:`cyclic_geq` is the rule, :func:`step_epoch` the arithmetic.

Release. A rank whose peer died may have a stream parked on a wait that no one will satisfy;
:meth:`Semaphores.release` writes :func:`release_value` (far ahead, cyclically, of every epoch
this rank has awaited) into all of its own flags from a private stream, so the waits pass and
the streams drain (the results are garbage, and the engine has failed their entries already).
A peer still alive may overwrite a released flag with an older epoch it had queued, so the
release is repeated until the streams that waited are idle, within a bound.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["MOD", "RELEASE_AHEAD", "Semaphores", "checked", "cyclic_geq", "driver",
           "memops_support", "release_value", "step_epoch", "flag_index", "choose_protocol",
           "SUPPORTED", "NO_BINDINGS", "NO_MEMOPS", "PROBE_FAILED", "FORCED_EVENTS"]

log = logging.getLogger("hvdlite")

MOD = 1 << 32  # flags are 32-bit: every memop-capable device supports them
RELEASE_AHEAD = 1 << 30  # how far a release jumps ahead (< 2**31, the cyclic horizon)
_MAX_MARKS = 64  # streams whose drain a release watches (hvdlite's own, callers' immediate)

# Why a rank can (0) or cannot use stream memory operations: one code per rank is exchanged at
# setup, so every rank picks the same protocol.
SUPPORTED, NO_BINDINGS, NO_MEMOPS, PROBE_FAILED, FORCED_EVENTS = range(5)
_WHY = {
    NO_BINDINGS: "cuda-python is not installed (pip install cuda-bindings, or hvdlite[gpu])",
    NO_MEMOPS: "the driver or device has no stream memory operations "
               "(cuStreamWaitValue32; CUDA < 12 needs them enabled: NVreg_EnableStreamMemOPs=1)",
    PROBE_FAILED: "a stream write/wait probe on the device failed",
    FORCED_EVENTS: "the event-and-barrier protocol was asked for",
}

# Inbox layout: [kind][slot][peer], kind 0 = WRITTEN (the peer filled its slot), 1 = READ (the
# peer finished reading this rank's slot).
WRITTEN, READ = 0, 1
_KINDS = 2


def step_epoch(step: int, slots: int) -> tuple[int, int]:
    """(slot, epoch) of a communicator's ``step`` (0-based) over ``slots`` slots; the epoch is
    1 at a slot's first use and wraps at 2**32."""
    if slots < 1 or step < 0:
        raise ValueError(f"step_epoch needs step >= 0 and slots >= 1, got {step}, {slots}")
    return step % slots, (step // slots + 1) % MOD


def cyclic_geq(flag: int, value: int) -> bool:
    """The driver's ``CU_STREAM_WAIT_VALUE_GEQ`` on 32-bit values: ``(int32)(flag - value) >=
    0``; what a stream wait for ``value`` on a flag holding ``flag`` lets through."""
    d = (flag - value) % MOD
    return d < (1 << 31)


def release_value(epoch: int) -> int:
    """The value a release writes: cyclically at or past every epoch up to ``epoch`` and the
    few before it (the highest this rank can have awaited), far from the wrap horizon."""
    return (epoch + RELEASE_AHEAD) % MOD


def flag_index(kind: int, slot: int, peer: int, slots: int, size: int) -> int:
    """Index in an inbox of ``size`` ranks' flags of ``kind`` (WRITTEN, READ) for ``slot``."""
    if not (0 <= kind < _KINDS and 0 <= slot < slots and 0 <= peer < size):
        raise ValueError(f"no flag ({kind}, {slot}, {peer}) among {_KINDS} kinds, {slots} "
                         f"slots, {size} ranks")
    return (kind * slots + slot) * size + peer


def choose_protocol(codes: list[int]) -> tuple[str, str]:
    """("flags" | "events", why) from every rank's :func:`memops_support` code: flags only
    if every rank can use them (the protocol must be the same on all)."""
    bad = [(r, c) for r, c in enumerate(codes) if c != SUPPORTED]
    if not bad:
        return "flags", "device semaphores (cuStreamWriteValue32 / cuStreamWaitValue32)"
    rank, code = bad[0]
    why = _WHY.get(code, f"unknown reason code {code}")
    more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
    return "events", f"IPC events and an MPI barrier per step: rank {rank}{more}: {why}"


def driver() -> Any:
    from cuda.bindings import driver

    return driver


def checked(result: Any, what: str) -> Any:
    """The value(s) of a cuda-python call, or RuntimeError naming the call and the error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


def memops_support(cupy: Any, device_id: int) -> int:
    """SUPPORTED, or why this rank's device cannot take stream memory operations: no
    cuda-python, a driver without them, or a probe (a write then a wait on a scratch flag, on
    a stream of its own, synchronised) that fails."""
    try:
        drv = driver()
    except ImportError:
        return NO_BINDINGS
    rt = cupy.cuda.runtime
    try:
        with cupy.cuda.Device(device_id):
            version = int(checked(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
            if version < 12000:  # before CUDA 12 memops were opt-in, per device
                attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1
                if not int(checked(drv.cuDeviceGetAttribute(attr, device_id), "attribute")):
                    return NO_MEMOPS
            scratch = rt.malloc(4)
            stream = rt.streamCreateWithFlags(1)  # cudaStreamNonBlocking
            try:
                rt.memsetAsync(scratch, 0, 4, stream)
                checked(drv.cuStreamWriteValue32(stream, scratch, 7, 0), "cuStreamWriteValue32")
                checked(drv.cuStreamWaitValue32(
                    stream, scratch, 7, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
                    "cuStreamWaitValue32")
                rt.streamSynchronize(stream)
            finally:
                rt.streamDestroy(stream)
                rt.free(scratch)
    except Exception as exc:  # noqa: BLE001 (any failure means: not here)
        log.info("hvdlite: stream memory operations unusable on GPU %d: %s", device_id, exc)
        return PROBE_FAILED
    return SUPPORTED


class Semaphores:
    """One rank's inbox of flags and its peers' inboxes, mapped (see the module docstring).

    Made on every rank of a communicator; :meth:`handle` goes to every peer (once), then
    :meth:`attach` takes the peers' inboxes, opened through ``open_peer(rank, handle)``
    (the communicator's handle cache, which also closes them).
    """

    def __init__(self, cupy: Any, device_id: int, rank: int, size: int, slots: int) -> None:
        self.cupy, self.device_id = cupy, device_id
        self.rank, self.size, self.slots = rank, size, slots
        drv = self._drv = driver()
        self._geq = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self._not_ready = int(drv.CUresult.CUDA_ERROR_NOT_READY)
        self.count = _KINDS * slots * size
        rt = cupy.cuda.runtime
        with cupy.cuda.Device(device_id):
            self.base = rt.malloc(self.count * 4)
            rt.memset(self.base, 0, self.count * 4)
            rt.deviceSynchronize()  # zeroed before any peer can signal into it
            # Made now, not at the failure: making a stream then could wait on the device.
            # Non-blocking (the legacy default stream does not order it), highest priority.
            _, high = checked(drv.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
            self._release_stream = checked(drv.cuStreamCreateWithPriority(
                int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), high), "cuStreamCreate")
        self.inboxes: list[int] = []  # [rank] -> that rank's inbox in this context
        self.epoch = 0  # the highest epoch this rank has enqueued a wait for (cyclically)
        self._marks: dict[int, Any] = {}  # stream -> event after its latest waits

    def handle(self) -> bytes:
        """This rank's inbox IPC handle (64 bytes)."""
        return bytes(self.cupy.cuda.runtime.ipcGetMemHandle(self.base))

    def attach(self, handles: list[bytes], open_peer: Any) -> None:
        """Map every peer's inbox from ``handles`` (by rank; this rank's own is its base)."""
        self.inboxes = [self.base if r == self.rank else open_peer(r, handles[r])
                        for r in range(self.size)]

    def _flag(self, owner: int, kind: int, slot: int, peer: int) -> int:
        return self.inboxes[owner] + 4 * flag_index(kind, slot, peer, self.slots, self.size)

    def signal(self, stream: int, to: int, kind: int, slot: int, epoch: int) -> None:
        """On ``stream``, after its earlier work: tell rank ``to`` that this rank is done with
        ``slot``'s ``epoch`` (``kind``: WRITTEN its slot, or READ ``to``'s)."""
        checked(self._drv.cuStreamWriteValue32(stream, self._flag(to, kind, slot, self.rank),
                                              epoch, 0), "cuStreamWriteValue32")

    def awaits(self, epoch: int) -> None:
        """Note that this rank's streams may wait for ``epoch`` (what :meth:`release` must pass):
        :meth:`wait` notes its own; a one-shot kernel's waits are noted by its caller."""
        if cyclic_geq(epoch, self.epoch):
            self.epoch = epoch

    def wait(self, stream: int, kind: int, slot: int, peer: int, epoch: int) -> None:
        """On ``stream``, before its later work: wait until ``peer`` signalled ``kind`` for
        ``slot`` at ``epoch`` or later (cyclically)."""
        self.awaits(epoch)
        checked(self._drv.cuStreamWaitValue32(stream, self._flag(self.rank, kind, slot, peer),
                                             epoch, self._geq), "cuStreamWaitValue32")

    def mark(self, stream: int) -> None:
        """Record, on ``stream``, that its waits so far are behind it (one event per stream,
        re-recorded: what :meth:`release` watches drain; an event outlives its stream)."""
        event = self._marks.pop(stream, None)
        if event is None:
            if len(self._marks) >= _MAX_MARKS:  # the oldest stream's mark goes (destroying a
                old = self._marks.pop(next(iter(self._marks)))  # pending event is allowed)
                self._drv.cuEventDestroy(old)
            event = checked(self._drv.cuEventCreate(
                int(self._drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
        self._marks[stream] = event  # (re-inserted: the newest)
        checked(self._drv.cuEventRecord(event, stream), "cuEventRecord")

    def release(self, bound_s: float = 2.0) -> bool:
        """Let every wait this rank enqueued pass (a peer is gone: see the module docstring):
        set all of its own flags far ahead, from its private stream, until the streams that
        waited are idle or ``bound_s`` passed. True if they drained."""
        value = release_value(self.epoch)
        deadline = time.monotonic() + bound_s
        with self.cupy.cuda.Device(self.device_id):
            while True:
                checked(self._drv.cuMemsetD32Async(self.base, value, self.count,
                                                  self._release_stream), "cuMemsetD32Async")
                idle = all(self._idle(e) for e in list(self._marks.values()))
                if idle or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        if not idle:
            log.warning("hvdlite: a released CUDA IPC wait did not drain within %.1f s; the "
                        "job ends without it (the driver frees the device at exit)", bound_s)
        return idle

    def _idle(self, event: Any) -> bool:
        err = self._drv.cuEventQuery(event)[0]
        return int(err) != self._not_ready

    def free(self) -> None:
        """Free the inbox, the release stream and the marks (after every peer closed its
        mapping of the inbox)."""
        with self.cupy.cuda.Device(self.device_id):
            for event in self._marks.values():
                self._drv.cuEventDestroy(event)
            self._marks.clear()
            self._drv.cuStreamDestroy(self._release_stream)
            self.cupy.cuda.runtime.free(self.base)
