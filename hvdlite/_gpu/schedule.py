"""An agreed bucket schedule: a fixed sequence of in-place device allreduces that every rank of
a set checked once and that the caller's thread then launches itself, with no negotiation.

A training step submits the same buckets every step (``DistributedOptimizer``'s), so once every
rank has shown it builds the same buckets (names, sizes, dtypes, ops, factors: one exchange at
the step that agrees them) nothing is left to negotiate: bucket ``i`` of a step is the ``i``-th
collective of that step on every rank. The autograd thread then launches a bucket the moment it
is ready and every earlier one has been launched (DDP's rule), straight onto NCCL:

    caller stream          schedule stream (own NCCL communicator)
    -------------          ---------------------------------------
    gradients of bucket i
    record READY[i] ---->  wait READY[i]; ncclAllReduce in place; scale; record DONE[i]
    ... backward goes on
    step(): wait DONE[*]   (stream order: no host wait)

No background-thread wake-up, MPI round or queue per bucket: a launch is two event calls and one
NCCL call (docs/architecture.md, "The training step's budget"). The communicator is the
schedule's own, so the order of its collectives is the schedule's alone (the engine's other
device collectives, ordered by negotiation, run on other communicators and another stream).

Failure: a launch that does not complete within ``stall_shutdown_time_s`` (a peer died, or
stopped launching) is found by the engine's background thread (:meth:`Schedule.overdue`), which
fails the engine; failing the engine aborts the schedule's communicator (:meth:`Schedule.abort`),
so kernels waiting for a rank that will never come return.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hvdlite._ops import DTYPES, ReduceOp, nccl_wire
from hvdlite.errors import MismatchError

__all__ = ["Spec", "Schedule", "agree", "check"]


@dataclass(frozen=True)
class Spec:
    """One collective of a schedule, as every rank must agree on it."""

    name: str
    count: int  # elements
    dtype: str  # a DTYPES key
    op: int  # ReduceOp
    pre: float
    post: float


def _first_difference(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    if len(mine) != len(theirs):
        return f"{len(theirs)} buckets, expected {len(mine)}"
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a != b:
            field = next(k for k in a if a[k] != b.get(k))
            return (f"bucket {i} {b['name']!r}: {field} {b.get(field)!r}, expected "
                    f"{a[field]!r} (as rank 0 has it)")
    return ""


def check(specs: Sequence[Spec], exchange: Callable[[bytes], list[bytes]],
          ranks: Sequence[int], what: str) -> None:
    """Check that every rank of the set (``ranks``, global ranks in set order) built the same
    ``specs``; collective over the set (``exchange``: an allgather of bytes).
    :class:`MismatchError` on every rank, naming the ranks and the first differing entry."""
    got = [json.loads(b) for b in exchange(json.dumps([asdict(s) for s in specs]).encode())]
    bad = []
    for rank, theirs in zip(ranks, got, strict=True):
        diff = _first_difference(got[0], theirs)
        if diff:
            bad.append(f"rank {rank}: {diff}")
    if bad:
        raise MismatchError(f"{what}: the ranks built different gradient buckets ("
                            f"{'; '.join(bad)}); every rank must wrap the same model's "
                            "parameters, in the same order, with the same settings")


def agree(usable: str, root: bool, exchange: Callable[[bytes], list[bytes]],
          ranks: Sequence[int]) -> tuple[Any, str]:
    """Whether every rank of the set can launch a checked schedule itself (``usable``: why
    this rank cannot, '' when it can; ``root``: this rank is the set's first, which draws the
    NCCL unique id); collective over the set. Returns (the unique id, '') where every rank
    can, else (None, why the first rank that cannot cannot): the same answer on every rank."""
    uid: list[int] | None = None
    raw = False
    if root and not usable:
        from cupy.cuda import nccl

        drawn = nccl.get_unique_id()  # bytes (CuPy 13+) or a tuple of ints (older)
        uid, raw = list(drawn), isinstance(drawn, bytes)
    got = [json.loads(b) for b in exchange(
        json.dumps({"why": usable, "uid": uid, "bytes": raw}).encode())]
    for rank, g in zip(ranks, got, strict=True):
        if g["why"]:
            return None, f"rank {rank}: {g['why']}"
    if got[0]["uid"] is None:
        return None, f"rank {ranks[0]} drew no NCCL id"
    return (bytes(got[0]["uid"]) if got[0]["bytes"] else tuple(got[0]["uid"])), ""


@contextlib.contextmanager
def _max_ctas(n: int) -> Iterator[None]:
    """NCCL_MAX_CTAS for the communicators made within (NCCL reads it at each communicator's
    init: CuPy's binding has no ncclConfig_t); the environment as it was afterwards."""
    if n <= 0:
        yield
        return
    old = os.environ.get("NCCL_MAX_CTAS")
    os.environ["NCCL_MAX_CTAS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            del os.environ["NCCL_MAX_CTAS"]
        else:
            os.environ["NCCL_MAX_CTAS"] = old


class Schedule:
    """Launches an agreed sequence of in-place allreduces of persistent device buffers.

    ``buffers[i]``: (device pointer, element count) of collective ``i``'s buffer, alive as long
    as the schedule. Launch from one thread at a time, in order (``launch(0)``, ``launch(1)``,
    ... each step); :meth:`wait` orders a consumer stream after a launch.
    """

    def __init__(self, cupy: Any, device_id: int, specs: Sequence[Spec],
                 buffers: Sequence[tuple[int, int]], uid: Any, rank: int, size: int,
                 max_ctas: int = 0) -> None:
        from cupy.cuda import nccl

        self.cupy, self.device_id, self.specs = cupy, device_id, tuple(specs)
        self.size = size
        cuda = cupy.cuda
        with cuda.Device(device_id), _max_ctas(max_ctas):
            self.comm = nccl.NcclCommunicator(size, uid, rank)
            self.stream = cuda.Stream(non_blocking=True, priority=-1000)
            n = len(specs)
            self._ready = [cuda.Event(block=False, disable_timing=True) for _ in range(n)]
            self._done = [cuda.Event(block=False, disable_timing=True) for _ in range(n)]
        self._sptr = self.stream.ptr
        self._calls = [self._call(nccl, s, b) for s, b in zip(specs, buffers, strict=True)]
        self._launched = [0.0] * len(specs)  # host time of the last launch (0: none pending)
        self.launches = 0
        # Set while a CUDA graph captures launches: the watchdog then leaves the events alone
        # (a captured record is no record; the graph's replays are not launches it can time).
        self.capturing = False
        self.captured = False  # launches of it live in a CUDA graph

    def _call(self, nccl: Any, spec: Spec, buf: tuple[int, int]) -> tuple[Any, ...]:
        if spec.dtype == "bfloat16":  # no NumPy type (unscaled only: see the optimizer)
            dtype, per, kind, np_dtype = getattr(nccl, "NCCL_BFLOAT16", 9), 1, "float", None
        else:
            row = DTYPES[spec.dtype]
            name, per = nccl_wire(row)
            dtype, kind, np_dtype = getattr(nccl, f"NCCL_{name.upper()}"), row.kind, row.np_dtype
        op, pre, post = ReduceOp(spec.op), spec.pre, spec.post
        avg = getattr(nccl, "NCCL_AVG", None)
        if op is ReduceOp.AVERAGE and avg is not None and kind == "float" \
                and pre == 1.0 and post == 1.0:
            nccl_op = avg  # a premultiplied sum inside NCCL: DDP's divide-then-sum
        elif op is ReduceOp.AVERAGE:
            nccl_op, post = nccl.NCCL_SUM, post / self.size
        else:
            nccl_op = {ReduceOp.SUM: nccl.NCCL_SUM, ReduceOp.MIN: nccl.NCCL_MIN,
                       ReduceOp.MAX: nccl.NCCL_MAX, ReduceOp.PRODUCT: nccl.NCCL_PROD}[op]
        view = None
        if pre != 1.0 or post != 1.0:
            assert np_dtype is not None
            mem = self.cupy.cuda.UnownedMemory(buf[0], buf[1] * np_dtype.itemsize, self)
            view = self.cupy.ndarray(buf[1], np_dtype, self.cupy.cuda.MemoryPointer(mem, 0))
        return buf[0], buf[1] * per, dtype, nccl_op, view, pre, post

    def launch(self, i: int, stream: Any) -> None:
        """Enqueue collective ``i`` after the work on ``stream`` (a CuPy stream object: the
        producer's), without waiting on the host."""
        ready = self._ready[i]
        ready.record(stream)
        self.stream.wait_event(ready)
        ptr, count, dtype, op, view, pre, post = self._calls[i]
        if view is not None and pre != 1.0:
            with self.stream:
                view *= pre
        self.comm.allReduce(ptr, ptr, count, dtype, op, self._sptr)
        if view is not None and post != 1.0:
            with self.stream:
                view *= post
        self._done[i].record(self.stream)
        if not self.capturing:
            self._launched[i] = time.monotonic()
        self.launches += 1

    def wait(self, i: int, stream: Any | None) -> None:
        """Order ``stream`` after collective ``i`` (a stream wait), or, with None, wait for it
        on the host."""
        if stream is None:
            self._done[i].synchronize()
        else:
            stream.wait_event(self._done[i])

    def overdue(self, limit_s: float) -> str:
        """'' or a description of the oldest launch not complete after ``limit_s`` seconds
        (checked by the engine's background thread; non-blocking event queries)."""
        if self.capturing:
            return ""
        now = time.monotonic()
        for i, t in enumerate(self._launched):
            if t and now - t > limit_s:
                if self._done[i].done:
                    self._launched[i] = 0.0
                    continue
                return (f"bucket {self.specs[i].name!r} (collective {i} of "
                        f"{len(self.specs)} of the schedule) launched {now - t:.0f} s ago has "
                        "not completed on the device: a peer died or stopped launching it")
        return ""

    def pending(self) -> bool:
        """Whether a launch has not completed on the device (non-blocking queries); a step
        captured in a CUDA graph counts as pending: its replays are not launches to query."""
        if self.comm is None:
            return False
        if self.captured:
            return True
        return any(t and not done.done for t, done in zip(self._launched, self._done,
                                                         strict=True))

    def abort(self) -> None:
        """The job is ending with an error: abort the communicator so NCCL kernels waiting for
        a rank that will never come return."""
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        """Free the communicator once the device finished with it: by ``ncclCommAbort``,
        which is local, since ranks may close their schedules in different orders (the
        registry is a weak set, and an optimizer may be collected on one rank and not on
        another), where ``ncclCommDestroy``'s finalisation may wait for the peers."""
        comm, self.comm = self.comm, None
        if comm is not None:
            self.stream.synchronize()
            comm.abort()
