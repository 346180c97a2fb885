"""What the engine reports about itself: timeline phases, NVTX ranges and statistics.

One :class:`Tracer` per engine. The timeline and NVTX are optional and cost one attribute test
per call when off; the statistics are always on (a lock and a few list operations per tensor).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from hvdlite._observe import nvtx as _nvtx
from hvdlite._observe.stats import Stats
from hvdlite._ops import ReduceOp
from hvdlite._vocab.messages import Kind, Response

if TYPE_CHECKING:
    from hvdlite._observe.timeline import Timeline
    from hvdlite._vocab.entry import Entry

__all__ = ["Tracer", "open_timeline"]

log = logging.getLogger("hvdlite")
_NOTHING = contextlib.nullcontext()


def open_timeline(path: str, rank: int, mark_cycles: bool, max_bytes: int = 0,
                  clock_offset_us: float = 0.0, max_tracks: int = 1024,
                  max_files: int = 0) -> Timeline | None:
    """A writer for this rank: rank 0 only, unless ``path`` contains ``{rank}``.

    ``clock_offset_us`` (rank 0's clock minus this rank's, measured at init) goes into the
    trace so ``timeline merge`` can line the ranks up; ``max_tracks`` (``cache_capacity``)
    bounds the idle tensor rows the writer remembers; ``max_files`` the rotated files kept.
    """
    if rank != 0 and "{rank}" not in path:
        return None
    from hvdlite._observe.timeline import Timeline

    return Timeline(path, rank, mark_cycles=mark_cycles, max_bytes=max_bytes,
                    max_files=max_files, clock_offset_us=clock_offset_us,
                    max_tracks=max_tracks)


# Horovod's timeline names (horovod/common/timeline.cc, common.h). A negotiation is
# NEGOTIATE_<REQUEST TYPE>; once negotiated, a tensor's data-moving op gets a top-level span
# named after the response type (ALLREDUCE, ..., or ERROR) around its activities. Horovod
# writes none for a barrier or a join (nor has hvdlite's process-set changes).
_NEGOTIATE = {kind: f"NEGOTIATE_{kind.name}" for kind in Kind}
_TOP: dict[Kind, str | None] = {kind: None if kind in (Kind.BARRIER, Kind.JOIN, Kind.PROCESS_SET)
                                else kind.name for kind in Kind}
# Activities hvdlite names <TRANSPORT>_<OP> that Horovod spells differently.
_ACTIVITY = {f"{t}_BROADCAST": f"{t}_BCAST" for t in ("MPI", "NCCL", "IPC")}


def _negotiate(req: Any) -> str:
    # Horovod's request type for an allreduce with op Adasum is ADASUM.
    if req.kind is Kind.ALLREDUCE and req.op == ReduceOp.ADASUM:
        return "NEGOTIATE_ADASUM"
    return _NEGOTIATE[req.kind]


def _top_phase(resp: Response) -> str | None:
    if resp.error:
        return "ERROR"
    if resp.kind is Kind.ALLREDUCE and resp.op == ReduceOp.ADASUM:
        return "ADASUM"
    return _TOP[resp.kind]


class Tracer:
    """Timeline + NVTX + stats, behind the few calls the engine and backends make."""

    def __init__(self, timeline: Timeline | None, nvtx: bool) -> None:
        self.timeline = timeline
        self.nvtx = nvtx
        self.stats = Stats()
        self._done_us = 0.0  # when the last activity of the running bucket ended

    @property
    def on(self) -> bool:
        return self.timeline is not None or self.nvtx

    def swap_timeline(self, timeline: Timeline | None) -> Timeline | None:
        old, self.timeline = self.timeline, timeline
        return old

    # -- per tensor ----------------------------------------------------------------------
    def negotiating(self, entries: Sequence[Entry]) -> None:
        tl = self.timeline
        if tl is None:
            return
        for e in entries:
            req = e.request
            args = {"dtype": req.dtype, "shape": req.shape, "bytes": e.nbytes()}
            tl.begin(req.name, _negotiate(req), args, ts_us=e.enqueued_at * 1e6)

    def ready_tick(self, rank: int, names: Sequence[str], cached: bool = False) -> None:
        tl = self.timeline
        if tl is not None:
            label = "CACHE_HIT" if cached else f"RANK_{rank}_READY"
            for name in names:
                tl.instant(name, label, {"rank": rank})

    def negotiated(self, responses: Sequence[Response], entries: dict[str, Entry]) -> None:
        tl = self.timeline
        if tl is None:
            return
        items = []
        for resp in responses:
            e = entries.get(resp.name)
            if e is not None:
                items.append((resp.name, _negotiate(e.request), _top_phase(resp)))
        if items:  # one queue slot for the cycle
            tl.handoff(items)

    def dequeued(self, names: Sequence[str], bucket_id: int, threshold: int) -> None:
        tl = self.timeline
        if tl is not None:
            self._done_us = ts = tl.now_us()
            tl.end_all(names, "QUEUE", {"bucket": bucket_id, "threshold": threshold}, ts)

    def executed(self, names: Sequence[str], head: Response) -> None:
        """The bucket's op is done (or failed): its top-level span ends, at the end of its
        last activity. Backends complete the handles after that activity ends, so a caller
        that submits the name again at once begins its next negotiation no earlier."""
        top = _top_phase(head)
        if self.timeline is not None and top is not None:
            self.timeline.end_all(names, top, ts_us=self._done_us)

    def phase(self, names: Sequence[str], phase: str, args: dict[str, Any] | None = None,
              sync: Callable[[], None] | None = None) -> contextlib.AbstractContextManager[None]:
        """Span ``phase`` on every tensor of a bucket; ``sync`` runs before the span ends (the
        device CPU-sync fallback, so host timestamps bracket device work)."""
        if not self.on:
            return _NOTHING  # the hot path: no generator built per phase
        return self._phase(names, phase, args, sync)

    @contextlib.contextmanager
    def _phase(self, names: Sequence[str], phase: str, args: dict[str, Any] | None,
               sync: Callable[[], None] | None) -> Iterator[None]:
        tl = self.timeline
        phase = _ACTIVITY.get(phase, phase)
        if tl is not None:
            tl.begin_all(names, phase, args)
        label = (f"{phase} {names[0]}" + (f" +{len(names) - 1}" if len(names) > 1 else "")
                 if self.nvtx else "")
        with _nvtx.range(label, self.nvtx):
            yield
            if sync is not None and tl is not None:
                sync()
        if tl is not None:
            self._done_us = ts = tl.now_us()
            tl.end_all(names, phase, ts_us=ts)

    def device_spans(self, timed: Sequence[Any]) -> None:
        """Event-timed device phases, once their DONE event completed (at retirement).

        ``timed`` holds ``(names, phase, start_event, end_event, args)``; each tensor's device
        spans go on a track "<name> [device]". Device times are
        placed on the host clock by taking "now" as the end of the last phase: retirement
        runs at the next cycle after DONE completes, so spans sit at most that late.
        """
        tl = self.timeline
        if tl is None or not timed:
            return
        import cupy

        elapsed = cupy.cuda.get_elapsed_time
        first = timed[0][2]
        origin = tl.now_us() - elapsed(first, timed[-1][3]) * 1e3
        for names, phase, start, end, args in timed:
            phase = _ACTIVITY.get(phase, phase)
            begin_us = origin + elapsed(first, start) * 1e3
            dur_us = elapsed(start, end) * 1e3
            for name in names:
                # A track of its own: these spans arrive after DONE, when the same name may
                # already be negotiating its next step on the host track.
                tl.complete(f"{name} [device]", phase, begin_us, dur_us, args)

    def cycle(self) -> None:
        if self.timeline is not None:
            self.timeline.mark_cycle()

    def close(self) -> None:
        tl = self.swap_timeline(None)
        if tl is not None:
            tl.close()
