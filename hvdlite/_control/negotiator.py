"""One negotiation cycle over MPI: the cached bit-vector round and the full round.

Every cycle, every rank contributes one uint64 vector to a single BAND allreduce::

    word 0        ~flags          (AND of inverted flags = OR of flags)
    words 1..W    cache hit bits  (AND: a slot is ready when every rank has it pending)
    words W+1..2W ~invalid bits   (OR: a slot any rank saw change is evicted everywhere)

If any rank has a request the cache cannot express (new name, changed parameters, a join, a
stall to report), a full round follows in the same cycle: the ranks' requests are gathered on
the coordinator (rank 0), which decides the ready responses and broadcasts them. Both rounds
produce identical results on every rank, so every rank's cache and execution order agree.
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from hvdlite._backends.failures import FailureChannel
from hvdlite._control.negotiation import CoordinatorTable, ResponseCache
from hvdlite._control.stall import StallInspector
from hvdlite._observe.tracer import Tracer
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.messages import (
    SPECS,
    Kind,
    Request,
    Response,
    pack_request,
    pack_response,
    unpack_request,
    unpack_response,
)
from hvdlite.config import Config
from hvdlite.errors import HvdliteError, ShutdownError, StallError

__all__ = ["Negotiator", "CycleResult"]

UNCACHED, SHUTDOWN, JOINED, PENDING, ROUND, EXPECT_STALL = 1, 2, 4, 8, 16, 32
_HOT_POLL_S = 300e-6  # poll with bare GIL yields this long while work flows
_BUSY_NAP_S = 100e-6  # longest nap between polls while work flows
_UNREADY_POLL_S = 100e-6  # loop pace while a device input's producer still runs
_WORD = (1 << 64) - 1


def _plain_nap(seconds: float) -> bool:
    time.sleep(seconds)
    return False


def _pack(slots: Collection[int]) -> int:
    """Slot numbers -> a bit mask."""
    mask = 0
    for slot in slots:
        mask |= 1 << slot
    return mask


def _bits(mask: int) -> list[int]:
    """A bit mask -> its set slot numbers, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _done_in_stream_order(new: list[Entry]) -> None:
    """Mark READY complete where a later READY of the same thread on the same stream is:
    stream order completes the earlier one first (``Entry.ready_mark``). A burst of calls
    from one stream then costs one event query per stream and round, not one per tensor.
    The newest of each stream is queried; an incomplete one proves nothing of the others."""
    settled: set[tuple[int, int, int]] = set()
    asked: set[tuple[int, int, int]] = set()
    for e in reversed(new):  # a thread's entries are queued in the order it recorded them
        mark = e.ready_mark
        if mark is None or e.ready_done:
            continue
        key = mark[:3]
        if key in settled:
            e.ready_done = True
        elif key not in asked:
            asked.add(key)
            if e.ready.done:
                e.ready_done = True
                settled.add(key)


@dataclass(slots=True)
class CycleResult:
    responses: list[Response]
    stop: HvdliteError | None = None


class Negotiator:
    """This rank's side of negotiation: cache state, pending hits and (on rank 0) the table."""

    def __init__(self, comm: MPI.Intracomm, config: Config, tracer: Tracer,
                 block_in_mpi: bool = False,
                 nap: Callable[[float], bool] | None = None,
                 forget: Callable[[str, Request | None], None] | None = None) -> None:
        self.comm = comm
        self.tracer = tracer
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        # ``forget``: told each name the cache lets go (the channel drops its per-name state)
        self.cache = ResponseCache(config.cache_capacity, forget)
        self.words = math.ceil(config.cache_capacity / 64)
        self._all = (1 << (64 * self.words)) - 1  # every slot bit of one section
        self._vec_buf = bytearray(8 * (1 + 2 * self.words))
        self._vectors: dict[tuple[int, int], bytes] = {}  # (flags, hit slot) -> vector
        self._seen = 0  # flags any rank raised in the last cycle
        self.table = CoordinatorTable(self.size) if self.rank == 0 else None
        self.stall = StallInspector(config)
        self.cycle_s = config.cycle_time_ms / 1e3
        self.idle_max_s = max(config.idle_backoff_max_ms / 1e3, self.cycle_s)
        # A cached request pending this long is sent in full so the stall inspector sees it.
        self.patience_s = min(max(config.stall_check_time_s / 2, 0.5), 10.0)
        self._wait_s = self.cycle_s
        self._busy = True
        self._uncached: list[Request] = []
        self._invalid: set[int] = set()
        self._hits: dict[int, tuple[str, float]] = {}  # slot -> (name, since)
        self.cache_hits = 0
        # The failure notices' generation, rank 0's clock, by a buffer broadcast as every
        # exchange of the runtime (docs/architecture.md, "The GIL").
        stamp = np.array([time.time_ns() if self.rank == 0 else 0], np.int64)
        comm.Bcast([stamp, MPI.INT64_T], root=0)
        self.failures = FailureChannel(comm, int(stamp[0]))
        # While work flows, wait inside MPI (GIL released) rather than poll from Python, unless
        # ranks outnumber this host's cores: MPI's busy-wait would then starve the other ranks.
        self.block_in_mpi = block_in_mpi
        # Sleeps up to the given seconds; True if local work arrived meanwhile (the engine
        # passes a wait on its wake-up queue; alone, a plain sleep that never cuts short).
        self._nap = nap if nap is not None else _plain_nap
        # Set by the engine per cycle: a waiting caller runs it (poll MPI, so signals reach
        # the main thread and a Ctrl-C ends the wait) or the background thread does.
        self.in_caller = False
        # Device entries whose producer has not finished (READY not complete): held back from
        # negotiation, so a tensor ready everywhere never queues behind one still produced.
        self._unready: list[Entry] = []
        # The one handle whose entries are announced even with their producer running: set
        # by a waiting caller when nothing else is pending on this rank (nothing can queue
        # behind it then), so its collective waits on the device, not on the CPU.
        self.announce_now: object = None
        self._join: str | None = None  # this rank's pending join, if any
        self._next_demote = 0.0

    # -- pacing ------------------------------------------------------------------------
    def next_wait_s(self, has_pending: bool) -> float:
        """How long the loop may sleep before the next cycle if nothing is enqueued."""
        if self._unready:  # a producer may finish any moment: look again soon
            return min(self.cycle_s, _UNREADY_POLL_S)
        if has_pending or self._busy:
            self._wait_s = self.cycle_s
        else:
            self._wait_s = min(self.idle_max_s, self._wait_s * 2)
        return self._wait_s

    # -- one cycle -----------------------------------------------------------------------
    def cycle(self, new: list[Entry], entries: dict[str, Entry], stopping: bool,
              expecting_stall: bool = False) -> CycleResult:
        now = time.monotonic()
        if self._unready:
            self._unready = [e for e in self._unready if not self._released(e, entries, now)]
        if new and new[-1].ready is not None:
            _done_in_stream_order(new)
        for e in new:
            ready = e.ready
            if ready is not None:
                # A completed READY needs no stream wait at execution (see Entry.ready_done).
                if e.ready_done or ready.done:
                    e.ready_done = True
                elif e.handle is not self.announce_now:
                    self._unready.append(e)
                    continue
            self._classify(e.request, now)
        self._demote_stale(entries, now)
        flags = self._local_flags(entries, stopping, now)
        if expecting_stall:
            flags |= EXPECT_STALL
        sent = len(self._uncached)
        if entries:
            self._busy = True  # local work waits on this round: poll it hot
        hits, invalid = self._allreduce(flags)
        return self.conclude(hits, invalid, entries, stopping, now, sent)

    def settle(self) -> None:
        """Nothing is left pending on this rank after a cycle: its next rounds may back off.
        A peer with work pending needs this rank's own submission of it anyway, and that
        submission starts a round at once; stalls are still seen by the backed-off rounds."""
        self._busy = False

    # -- one cached tensor alone (Scheduler.cycle_alone) -----------------------------------
    def cached(self, request: Request) -> tuple[int, Response] | None:
        """(slot, cached response) when a cycle may run for ``request`` alone: its response
        is cached under the same request, and nothing of this rank's is held back, waiting
        for peers or due to be sent."""
        if (self._unready or self._uncached or self._invalid or self._hits
                or self._join is not None or self.announce_now is not None):
            return None
        return self.cache.cached(request)

    def round_alone(self, slot: int, name: str,
                    now: float) -> tuple[Response | None, list[int], list[int]]:
        """The round of a cycle whose only local work is the cached tensor ``name`` (its
        slot): what :meth:`cycle` would send for it, without an entry behind it. Returns
        (its response, if the round agreed on it and nothing else: the cycle is over and
        nothing of this rank's is left, so the next rounds may back off; else None: finish
        the cycle with :meth:`conclude`), and the round's hits and invalid slots."""
        self._hits[slot] = (name, now)
        self._busy = True
        hits, invalid = self._allreduce(PENDING | self._local_flags({}, False, now))
        if invalid or hits != [slot] or self._seen & (SHUTDOWN | JOINED | UNCACHED | ROUND):
            return None, hits, invalid
        (resp,) = self._take_hits(hits)
        self.tracer.stats.record_cache(1, 0)
        self._busy = False
        return resp, hits, invalid

    def conclude(self, hits: list[int], invalid: list[int], entries: dict[str, Entry],
                 stopping: bool, now: float, sent: int = 0) -> CycleResult:
        """The rest of a cycle once its round has run: evictions, cached responses, and the
        full round if any rank needs one."""
        if self._seen & SHUTDOWN:
            return CycleResult([], self._shutdown_reason(stopping))
        self._evict(invalid, entries)
        responses: list[Response] = []
        if self._seen & JOINED:
            # Who contributes depends on who has joined: cached responses do not apply.
            self._uncached.extend(entries[n].request for n, _ in self._hits.values())
            self._hits.clear()
        else:
            responses = self._take_hits(hits)
        stop = None
        self.tracer.stats.record_cache(len(responses), sent)
        if self._seen & (UNCACHED | JOINED | ROUND) or invalid:
            # Any rank expecting a stall (seen & EXPECT_STALL) silences the inspector.
            full, fatal = self._full_round(entries, now, bool(self._seen & EXPECT_STALL))
            responses.extend(full)
            stop = StallError(fatal) if fatal else None
        self._busy = bool(self._seen & PENDING) or bool(responses)
        return CycleResult(responses, stop)

    def _released(self, e: Entry, entries: dict[str, Entry], now: float) -> bool:
        """True once ``e`` leaves the unready list: its producer finished (READY complete: a
        non-blocking query, never a CPU wait), and it is classified now; or it is gone."""
        if entries.get(e.request.name) is not e:
            return True  # failed meanwhile (shutdown, a peer's failure)
        if e.ready.done:
            e.ready_done = True
        elif e.handle is not self.announce_now:
            return False
        self._classify(e.request, now)
        return True

    def _classify(self, req: Request, now: float) -> None:
        if req.kind is Kind.JOIN:
            self._join = req.name
        if self.cache.capacity and SPECS[req.kind].cacheable:
            slot, same = self.cache.lookup(req)
            if same:
                self._hits[slot] = (req.name, now)
                return
            if slot >= 0:
                self._invalid.add(slot)
        self._uncached.append(req)

    def _demote_stale(self, entries: dict[str, Entry], now: float) -> None:
        if now < self._next_demote or not self._hits:
            return
        self._next_demote = now + self.patience_s / 4
        for slot, (name, since) in list(self._hits.items()):
            if now - since > self.patience_s:
                del self._hits[slot]
                self._invalid.add(slot)
                self._uncached.append(entries[name].request)

    def _local_flags(self, entries: dict[str, Entry], stopping: bool, now: float) -> int:
        flags = UNCACHED if self._uncached else 0
        if stopping:
            flags |= SHUTDOWN
        if entries:
            flags |= PENDING
        if self._join is not None:
            if self._join in entries:
                flags |= JOINED
            else:
                self._join = None
        # A stall check needs a full round, but only while the coordinator's table holds a
        # tensor some rank is waiting on: an idle job's rounds stay one small allreduce (a
        # full round's blocking gather spins until the napping peers arrive: ~2% of a core).
        if self.table is not None and self.stall.due(now) and self.table.has_pending():
            flags |= ROUND
        return flags

    def _allreduce(self, flags: int) -> tuple[list[int], list[int]]:
        """The cycle's one BAND allreduce; returns (slots ready everywhere, slots evicted).

        The vector is built and read as one Python integer (bit 64*w + b is bit b of word
        w): a few big-int operations instead of a dozen NumPy calls per cycle.
        """
        upper = 64 + 64 * self.words  # where the ~invalid section starts
        buf = self._vec_buf
        sent = None
        if not self._invalid and len(self._hits) <= 1:
            # The steady state of a training step's small calls: one cached tensor (or
            # none). Its vector is the same bytes every time; when every rank sent exactly
            # those, the result is those bytes too and needs no decoding.
            key = (flags, next(iter(self._hits), -1))
            sent = self._vectors.get(key)
            if sent is None:
                if len(self._vectors) > 4 * self.cache.capacity:
                    self._vectors.clear()
                hits = (1 << key[1]) if key[1] >= 0 else 0
                vec = (~flags & _WORD) | (hits << 64) | (self._all << upper)
                sent = self._vectors[key] = vec.to_bytes(len(buf), "little")
            buf[:] = sent
        else:
            keep = ~_pack(self._invalid) & self._all if self._invalid else self._all
            vec = (~flags & _WORD) | (_pack(self._hits) << 64) | (keep << upper)
            self._invalid = set()
            buf[:] = vec.to_bytes(len(buf), "little")
        # See _wait: inside MPI while work flows (if this host has the cores), else polled.
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.UINT64_T], op=MPI.BAND))
        if sent is not None and buf == sent:  # every rank sent the same: nothing to decode
            self._seen = flags
            return list(self._hits), []
        out = int.from_bytes(buf, "little")
        self._seen = ~out & _WORD
        ready = (out >> 64) & self._all
        invalid = ~(out >> upper) & self._all
        return _bits(ready), (_bits(invalid) if invalid else [])

    def _wait(self, req: MPI.Request) -> None:
        # While work flows, wait inside MPI with the GIL released (one hand-off) when every
        # busy thread has a core; otherwise poll: hot for a short while (a late Test() delays
        # every rank's next collective), then back off. Idle, the naps grow to the idle backoff
        # so an idle engine costs next to nothing, but local work cuts a nap short: a round
        # entered idle must not sleep through this rank's next submission. Either way a peer's
        # failure notice ends the wait.
        if req.Test():
            return
        busy = self._busy or self.in_caller  # a waiting caller never naps through its round
        while True:
            try:
                if busy and self.block_in_mpi and not self.in_caller:
                    self.failures.wait(req)
                    return
                if self._poll(req, busy):
                    return
                busy = True  # work arrived during an idle nap: wait for this round as busy
            except HvdliteError:
                raise
            except BaseException as exc:  # a signal handler's, in a waiting caller
                if not self.in_caller or exc is self.failures.last_raised:
                    raise  # (or the grace ran out: FailureChannel.check)
                self.failures.defer(exc)  # the peers are in this round too: finish it

    def _poll(self, req: MPI.Request, busy: bool) -> bool:
        """Poll ``req`` until done (True), or until local work cuts an idle nap short (False)."""
        hot_until = time.perf_counter() + (_HOT_POLL_S if busy else 0.0)
        # Idle, peers arrive within one idle wait of each other: start the naps long so an
        # idle cycle costs a few wake-ups, not a dozen (each one a GIL hand-off as well).
        nap, cap = (10e-6, _BUSY_NAP_S) if busy else (self.idle_max_s / 8, self.idle_max_s)
        while not req.Test():
            self.failures.check()
            if time.perf_counter() < hot_until:
                os.sched_yield()  # yields GIL and CPU; sleep(0) costs ~50 us of timer slack
            elif busy:
                time.sleep(nap)
            elif self._nap(nap):
                return False
            nap = min(nap * 2, cap)
        return True

    def _evict(self, slots: list[int], entries: dict[str, Entry]) -> None:
        for slot in slots:
            hit = self._hits.pop(slot, None)
            if hit is not None:
                self._uncached.append(entries[hit[0]].request)
            self.cache.evict(slot)

    def _take_hits(self, slots: list[int]) -> list[Response]:
        out = []
        for slot in slots:
            self._hits.pop(slot, None)
            out.append(self.cache.take(slot))
        self.cache_hits += len(out)
        if out and self.tracer.timeline is not None:
            self.tracer.ready_tick(self.rank, [r.name for r in out], cached=True)
        return out

    def _full_round(self, entries: dict[str, Entry], now: float,
                    quiet: bool) -> tuple[list[Response], str]:
        payload = [pack_request(r) for r in self._uncached]
        self._uncached = []
        # Polled (see _wait): a blocking gather would busy-wait inside MPI until napping ranks
        # arrive, and a waiting caller's interrupt could not be held until the round is done.
        gathered = self._gather(payload)
        decided = None
        if self.table is not None:
            assert gathered is not None  # rank 0 is the gather root
            for rank, reqs in enumerate(gathered):
                requests = [unpack_request(t) for t in reqs]
                self.table.add(rank, requests, now)
                if requests and self.tracer.timeline is not None:
                    self.tracer.ready_tick(rank, [r.name for r in requests])
            fatal = self.stall.check(self.table, now, quiet) if self.stall.due(now) else ""
            decided = ([pack_response(r) for r in self.table.pop_ready()], fatal)
        packed, fatal = self._bcast(decided)
        responses = [unpack_response(t) for t in packed]
        for resp in responses:
            entry = entries.get(resp.name)
            # Every rank must put, in the same order, so slots agree; a rank without the
            # request stores None, which never matches and so forces renegotiation.
            victim = self.cache.put(resp, entry.request if entry is not None else None)
            # A hit still waiting on the evicted slot would now point at another tensor:
            # send it in full instead (every rank evicted the same slot, so all do the same).
            hit = self._hits.pop(victim, None) if victim >= 0 else None
            if hit is not None:
                self._uncached.append(entries[hit[0]].request)
        return responses, fatal

    def _gather(self, obj: Any) -> list[Any] | None:
        """``comm.gather(obj, root=0)`` through nonblocking byte collectives, polled."""
        data = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.zeros(self.size, np.int64) if self.rank == 0 else None
        mine = np.array([data.size], np.int64)
        self._wait(self.comm.Igather([mine, MPI.INT64_T], [sizes, MPI.INT64_T], root=0))
        if sizes is None:
            self._wait(self.comm.Igatherv([data, MPI.BYTE], None, root=0))
            return None
        counts = sizes.tolist()
        offsets = [0, *itertools.accumulate(counts[:-1])]  # linear in ranks, not quadratic
        buf = np.empty(sum(counts), np.uint8)
        self._wait(self.comm.Igatherv([data, MPI.BYTE], [buf, (counts, offsets), MPI.BYTE],
                                      root=0))
        view = buf.data  # each rank's bytes unpickled in place, not copied first
        return [pickle.loads(view[o:o + n]) for o, n in zip(offsets, counts, strict=True)]

    def _bcast(self, obj: Any) -> Any:
        """``comm.bcast(obj, root=0)`` through nonblocking byte collectives, polled."""
        data = (np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), np.uint8)
                if self.rank == 0 else None)
        size = np.array([data.size if data is not None else 0], np.int64)
        self._wait(self.comm.Ibcast([size, MPI.INT64_T], root=0))
        buf = data.copy() if data is not None else np.empty(int(size[0]), np.uint8)
        self._wait(self.comm.Ibcast([buf, MPI.BYTE], root=0))
        return obj if self.rank == 0 else pickle.loads(buf.tobytes())

    def _shutdown_reason(self, stopping: bool) -> ShutdownError:
        # A byte collective, polled, as every other round: mpi4py's pickle-based allreduce
        # holds the GIL while it waits, so a peer that died here froze the whole process (no
        # timeline writes, no signal handler, no watchdog) until the rank wrapper's SIGKILL.
        first_of = np.array([self.rank if stopping else self.size], np.int64)
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, [first_of, MPI.INT64_T], op=MPI.MIN))
        first = int(first_of[0])
        if stopping and first == self.rank:
            return ShutdownError("hvdlite.shutdown() was called before it completed")
        return ShutdownError(
            f"hvdlite was shut down by rank {first} (it called hvdlite.shutdown() or exited) "
            "before this collective completed; make every rank run the same collectives "
            "before shutting down"
        )
