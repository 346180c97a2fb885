"""Chrome-trace timeline writer: a bounded queue drained by its own thread.

The engine calls :class:`Timeline` from its hot path, so the calling side only appends a tuple
to a deque (dropping and counting when the deque is full). A daemon writer thread encodes the
events and appends them to the file with one ``pwrite`` per batch that always leaves the file as
a complete JSON array: every batch overwrites the closing ``"\\n]\\n"`` of the previous one. A
process killed at any moment therefore leaves a loadable file holding every batch written so far.
The writer wakes every ``flush_interval_s`` (50 ms) and as soon as ``flush_events`` (1024)
events are waiting, and writes ``_BATCH`` (1024) records per ``pwrite`` (plus the rest of the
item that crossed it), so an event is on disk within about 100 ms of being recorded.

Signals: a writer made on the main thread hooks SIGTERM (and SIGINT) so that every queued
event reaches the file first (``hvdlite/_observe/signals.py``).
The layout, phases and args are specified in ``timeline/FORMAT.md``.

The file is created 0600 and never through a symbolic link: one planted at the path (in a
shared directory, by another user) would have the rank overwrite the file it points at; it is
an OSError instead (docs/security.md).
"""

from __future__ import annotations

import atexit
import collections
import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hvdlite._observe import signals
from hvdlite._threads import start_quietly

__all__ = ["Timeline", "TRACE_VERSION"]

log = logging.getLogger("hvdlite")

TRACE_VERSION = 1
_CLOSE = "\n]\n"  # every write ends with this; the next write starts over it
_END_ROOM = 200  # room kept under max_bytes for the trace_end record
_BATCH = 1024  # records per write at most: bounded work between two writes
FLUSH_INTERVAL_S = 0.05  # the writer wakes this often (and at flush_events queued events)
FLUSH_EVENTS = 1024
_NAME_ROOM = 200  # a track's two metadata records, less twice its name
_PROCESS_TRACK = "hvdlite"  # thread_name of tid 0: cycle marks and tensor-less events
_Item = tuple[str, Any, str, float, Any, float]  # (kind, tensor(s), name, ts, args, dur)
_MEMO_MAX = 4096  # encoded args kept for reuse (cleared when full)


def _json_default(obj: Any) -> Any:
    """Encode numpy scalars/arrays, dtypes, and anything else as its string."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), default=_json_default)


class _Track:
    """Writer-side state of one tensor's track: its tid, open spans and last timestamp."""

    __slots__ = ("tid", "name", "open", "last_ts", "ids")

    def __init__(self, tid: int, name: str, pid: int) -> None:
        self.tid = tid
        self.name = name
        self.ids = f',"pid":{pid},"tid":{tid}'  # the part of every record naming the track
        self.open: list[tuple[str, int]] = []  # (phase, length of its closing record)
        self.last_ts = 0.0


class _Marker:
    """A flush request travelling through the queue (never dropped)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class Timeline:
    """Writes one rank's Chrome trace (array form) to ``path``.

    ``path`` may contain ``{rank}``. ``max_bytes`` > 0 caps each file: when the next event would
    push the file past the cap, the file is finished and renamed ``path.1`` (older ones shift to
    ``path.2``, ...; with ``max_files`` > 0 only that many old files are kept) and a fresh
    ``path`` continues the trace. Spans open at a rotation are ended in the old file and re-begun
    in the new one with ``args.continued = true``. ``queue_size`` bounds the events waiting for
    the writer; beyond it events are dropped and counted (``dropped``), never blocking the caller.

    ``clock_offset_us`` (rank 0's clock minus this rank's) is written as a ``clock_offset``
    instant at the start of every file, so each segment can be aligned on its own.

    The writer writes what is queued every ``flush_interval_s`` and as soon as ``flush_events``
    events wait (it sleeps between the two, so a busy producer costs it a wake-up per interval
    or per ``flush_events`` events, not one per event). ``hook_signals`` (on the main thread
    only) hooks SIGTERM/SIGINT as the module docstring says.

    ``close()`` may be called from a signal handler; it is idempotent and also runs at
    interpreter exit.
    """

    def __init__(self, path: str, rank: int, *, mark_cycles: bool = False, max_bytes: int = 0,
                 queue_size: int = 65536, max_files: int = 0,
                 flush_interval_s: float = FLUSH_INTERVAL_S,
                 clock_offset_us: float | None = None,
                 flush_events: int = FLUSH_EVENTS, hook_signals: bool = True,
                 max_tracks: int = 1024) -> None:
        if queue_size < 1:
            raise ValueError(f"timeline queue_size must be >= 1, got {queue_size}")
        if flush_events < 1 or flush_interval_s <= 0:
            raise ValueError(f"timeline flush_events must be >= 1 and flush_interval_s > 0, "
                             f"got {flush_events} and {flush_interval_s}")
        if max_bytes < 0 or max_files < 0:
            raise ValueError(f"timeline max_bytes and max_files must be >= 0, got "
                             f"{max_bytes} and {max_files}")
        self.path = path.replace("{rank}", str(rank))
        self.rank = rank
        self.mark_cycles = mark_cycles
        self.max_bytes = max_bytes
        self.max_files = max_files
        self._cap = queue_size
        self._interval = flush_interval_s
        self._flush_events = flush_events
        self._q: collections.deque[_Item | _Marker] = collections.deque()
        self._dropped = 0
        self._closing = False
        self._closed = False
        self._wake = threading.Event()
        # Writer-thread state from here on.
        self._tracks: dict[str | None, _Track] = {}
        self._segment = 0
        self._fd = -1
        self._size = 0          # bytes of the current file, closing "\n]\n" included
        self._base = 0          # size of the current file before its first event
        self._named: set[int] = set()  # tids whose thread_name is in the current file
        self._reserve = 0       # bytes needed to end every open span at a rotation
        self._written = 0
        self._orphans = 0       # E events with no matching open span, not written
        self._pending: list[str] = []
        self._heads: dict[tuple[str, str], str] = {}  # (name, ph) -> '{"name":..,"ph":..,"ts":'
        self._args_memo: dict[Any, str] = {}
        self._pending_bytes = 0  # counted only under a size cap
        self._offset_us = clock_offset_us
        self._next_tid = 1
        self._max_tracks = max_tracks  # idle tensor tracks kept (cache_capacity), LRU out
        self._failed: OSError | None = None
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        if max_bytes:
            self._remove_stale_segments()
        self._open_file()
        self._thread = threading.Thread(target=self._run, name="hvdlite-timeline", daemon=True)
        start_quietly(self._thread)
        atexit.register(self.close)
        signals.LIVE.add(self)
        if hook_signals:
            signals.hook()

    # ---------------------------------------------------------------- caller side (hot path)

    @staticmethod
    def now_us() -> float:
        """The timeline clock: ``time.perf_counter_ns()`` in microseconds."""
        return time.perf_counter_ns() / 1000.0

    @property
    def dropped(self) -> int:
        """Events dropped because the queue was full (or the writer failed)."""
        return self._dropped

    def _put(self, item: _Item) -> None:
        if self._closing:
            return
        waiting = len(self._q)
        if waiting >= self._cap:
            self._dropped += 1
            return
        self._q.append(item)
        if waiting == self._flush_events:  # the queue only grows by one: this is hit on the way
            self._wake.set()

    def begin(self, tensor: str, phase: str, args: dict[str, Any] | None = None,
              ts_us: float | None = None) -> None:
        """Open span ``phase`` on ``tensor``'s track."""
        self._put(("B", tensor, phase, self.now_us() if ts_us is None else ts_us, args, 0.0))

    def end(self, tensor: str, phase: str, args: dict[str, Any] | None = None,
            ts_us: float | None = None) -> None:
        """Close the innermost open span (named ``phase``) on ``tensor``'s track."""
        self._put(("E", tensor, phase, self.now_us() if ts_us is None else ts_us, args, 0.0))

    def begin_all(self, tensors: Sequence[str], phase: str, args: dict[str, Any] | None = None,
                  ts_us: float | None = None) -> None:
        """``begin`` on every tensor of a bucket at one timestamp (one queue slot)."""
        self._put(("BA", tuple(tensors), phase, self.now_us() if ts_us is None else ts_us,
                   args, 0.0))

    def end_all(self, tensors: Sequence[str], phase: str, args: dict[str, Any] | None = None,
                ts_us: float | None = None) -> None:
        """``end`` on every tensor of a bucket at one timestamp (one queue slot)."""
        self._put(("EA", tuple(tensors), phase, self.now_us() if ts_us is None else ts_us,
                   args, 0.0))

    def instant(self, tensor: str | None, name: str, args: dict[str, Any] | None = None,
                ts_us: float | None = None) -> None:
        """A tick on ``tensor``'s track (``None``: the process track, tid 0)."""
        self._put(("i", tensor, name, self.now_us() if ts_us is None else ts_us, args, 0.0))

    def complete(self, tensor: str, phase: str, start_us: float, dur_us: float,
                 args: dict[str, Any] | None = None) -> None:
        """A whole span known after the fact, e.g. timed by a CUDA event pair."""
        self._put(("X", tensor, phase, start_us, args, dur_us))

    def handoff(self, items: Sequence[tuple[str, str, str | None]],
                ts_us: float | None = None) -> None:
        """A cycle's negotiated tensors in one queue slot: per ``(tensor, negotiate_phase,
        op_phase)`` negotiation ends, the op's span (unless None) and QUEUE in it begin."""
        self._put(("N", items, "", self.now_us() if ts_us is None else ts_us, None, 0.0))

    def mark_cycle(self, ts_us: float | None = None) -> None:
        """A global CYCLE_START mark (Horovod's); no-op unless ``mark_cycles``."""
        if self.mark_cycles:
            self._put(("C", None, "CYCLE_START", self.now_us() if ts_us is None else ts_us,
                       None, 0.0))

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every event queued so far is written to the file (at most ``timeout``
        seconds); False if the writer did not get there in time."""
        if self._closed or not self._thread.is_alive():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        marker = _Marker()
        self._q.append(marker)
        self._wake.set()
        while not marker.done.wait(0.1):
            if not self._thread.is_alive():
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, end open spans, write the trace_end record, close the file
        (waiting at most ``timeout`` seconds for the writer)."""
        if self._closed:
            return
        self._closing = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
        self._closed = True
        atexit.unregister(self.close)
        signals.LIVE.discard(self)
        if not signals.LIVE:
            signals.unhook()

    # ---------------------------------------------------------------- writer thread

    def _run(self) -> None:
        while True:
            # Sleep until the interval passes, flush_events are queued (the producer sets the
            # event at that count), or a flush()/close() asks; an event set while draining
            # makes this wait return at once.
            if len(self._q) < self._flush_events and not self._closing:
                self._wake.wait(self._interval)
            self._wake.clear()
            closing = self._closing
            self._guarded(self._drain)
            if closing and not self._q:
                break
        self._guarded(self._finish)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _guarded(self, step: Callable[[], None]) -> None:
        """Run a writer step; an I/O error stops writing (counted as drops), never raises."""
        try:
            step()
        except OSError as exc:
            self._failed = exc
            self._dropped += len(self._pending)
            self._pending = []
            log.error("hvdlite: timeline writes to %s failed (%s); later events are dropped",
                      self.path, exc)

    def _drain(self) -> None:
        """Write what was queued when the drain began (a busy producer cannot starve the file)."""
        for _ in range(len(self._q)):
            item = self._q.popleft()
            if isinstance(item, _Marker):
                self._write_pending()
                item.done.set()
            elif self._failed is None:
                self._encode(item)
                if len(self._pending) >= _BATCH:
                    self._write_pending()
            else:
                self._dropped += 1
        self._write_pending()

    def _finish(self) -> None:
        while self._q:  # a flush() racing with close(): release it
            item = self._q.popleft()
            if isinstance(item, _Marker):
                item.done.set()
        if self._failed is None:
            self._pending.extend(self._end_open_spans("unfinished"))
            self._pending.append(self._trace_end(rotated=False))
            self._write_pending()

    def _track(self, tensor: str | None) -> _Track:
        track = self._tracks.get(tensor)
        if track is None:
            tid = 0 if tensor is None else self._next_tid
            if tensor is not None:
                self._next_tid += 1
                self._drop_idle_tracks()
            track = _Track(tid, _PROCESS_TRACK if tensor is None else tensor, self.rank)
            self._tracks[tensor] = track
        return track

    def _drop_idle_tracks(self) -> None:
        """Forget the least recently begun tracks with no open span beyond ``max_tracks``
        (names made up per step must not pile up); a name seen again gets a new row."""
        excess = len(self._tracks) - (None in self._tracks) + 1 - self._max_tracks
        if excess <= 0:
            return
        idle: list[str] = []
        for tensor, track in self._tracks.items():
            if tensor is not None and not track.open:
                idle.append(tensor)
                if len(idle) == excess:
                    break
        for tensor in idle:
            self._named.discard(self._tracks.pop(tensor).tid)

    def _name_lines(self, track: _Track) -> list[str]:
        """thread_name/sort metadata for ``track`` unless the current file has them."""
        if track.tid in self._named:
            return []
        self._named.add(track.tid)
        return [self._meta("thread_name", {"name": track.name}, track.tid),
                self._meta("thread_sort_index", {"sort_index": track.tid}, track.tid)]

    def _encode(self, item: _Item) -> None:
        """Queue the record(s) of one item. A bucket's item (``BA``/``EA``) shares its name,
        timestamp and args among its tensors: those parts are encoded once."""
        kind, tensor, name, ts, args, dur = item
        if kind == "N":
            stamp = f"{ts:.3f}"
            queue = self._head("QUEUE", "B") + stamp
            for one, neg, top in tensor:
                self._record("E", one, neg, ts, self._head(neg, "E") + stamp, "}")
                if top is not None:
                    self._record("B", one, top, ts, self._head(top, "B") + stamp, "}")
                self._record("B", one, "QUEUE", ts, queue, "}")
            return
        ph = "i" if kind == "C" else kind[0]
        head = f"{self._head(name, ph)}{ts:.3f}"
        if kind == "X":
            tail = f',"dur":{dur:.3f}'
        elif kind == "i":
            tail = ',"s":"t"'
        elif kind == "C":
            tail = ',"s":"g"'
        else:
            tail = ""
        tail += self._args_json(args) + "}"
        if kind == "BA" or kind == "EA":
            for one in tensor:
                self._record(ph, one, name, ts, head, tail)
        else:
            self._record(kind, tensor, name, ts, head, tail)

    def _head(self, name: str, ph: str) -> str:
        """``{"name":..,"ph":..,"ts":`` for ``name`` and ``ph``, memoised."""
        head = self._heads.get((name, ph))
        if head is None:
            if len(self._heads) >= _MEMO_MAX:
                self._heads.clear()
            head = self._heads[(name, ph)] = f'{{"name":{_dumps(name)},"ph":"{ph}","ts":'
        return head

    def _args_json(self, args: dict[str, Any] | None) -> str:
        """``,"args":{...}`` (empty without args), memoised: the engine sends the same few
        args over and over (a tensor's dtype and shape, a rank, a bucket's id and threshold).
        The key holds the values' types, so ``True`` and ``1`` (equal as keys) stay apart."""
        if not args:
            return ""
        try:
            key = (tuple(args.items()), tuple(map(type, args.values())))
            hit = self._args_memo.get(key)
        except TypeError:  # an unhashable value (a list): encode it every time
            return ',"args":' + _dumps(args)
        if hit is None:
            if len(self._args_memo) >= _MEMO_MAX:
                self._args_memo.clear()
            hit = self._args_memo[key] = ',"args":' + _dumps(args)
        return hit

    def _record(self, kind: str, tensor: str | None, name: str, ts: float, head: str,
                tail: str) -> None:
        track = self._tracks.get(tensor)
        if track is None:
            track = self._track(tensor)
        if kind == "E" and (not track.open or track.open[-1][0] != name):
            # No matching open span here (it began before a start_timeline, or the caller
            # mis-nested): writing it would break the file's pairing, so count it instead.
            self._orphans += 1
            return
        rec = head + track.ids + tail
        if ts > track.last_ts:
            track.last_ts = ts
        close_len = 0
        if self.max_bytes:
            if kind == "B":  # room to end it at a rotation (only under a cap)
                close_len = len(self._span_record("E", track, name, "continued").encode()) + 2
            self._emit(track, rec, close_len)
        else:  # _emit without a cap, inline: this runs for every record
            if track.tid not in self._named:
                self._pending.extend(self._name_lines(track))
            self._pending.append(rec)
        self._written += 1
        if kind == "B":
            if not track.open and tensor is not None:  # most recently used last
                self._tracks[tensor] = self._tracks.pop(tensor)
            track.open.append((name, close_len))
            self._reserve += close_len
        elif kind == "E":
            self._reserve -= track.open.pop()[1]

    def _emit(self, track: _Track, rec: str, extra_reserve: int) -> None:
        """Queue ``rec`` for the file, rotating first when it would pass ``max_bytes``."""
        if self.max_bytes:
            need = len(rec.encode()) + 2 + self._name_room(track)
            used = self._size + self._pending_bytes
            if (used + need + self._reserve + extra_reserve + _END_ROOM > self.max_bytes
                    and used > self._base):
                self._write_pending()
                self._rotate()
                # The new file may need this track's name records again.
                need = len(rec.encode()) + 2 + self._name_room(track)
            self._pending_bytes += need
        self._pending.extend(self._name_lines(track))
        self._pending.append(rec)

    def _name_room(self, track: _Track) -> int:
        """Bytes the track's name records take if the current file does not have them yet."""
        return 0 if track.tid in self._named else _NAME_ROOM + 2 * len(track.name.encode())

    def _span_record(self, ph: str, track: _Track, phase: str, flag: str) -> str:
        """A B or E record at the track's last timestamp, marked ``args.<flag> = true``."""
        return (f'{{"name":{_dumps(phase)},"ph":"{ph}","ts":{track.last_ts:.3f},'
                f'"pid":{self.rank},"tid":{track.tid},"args":{{"{flag}":true}}}}')

    def _end_open_spans(self, flag: str) -> list[str]:
        lines = []
        for track in self._tracks.values():
            for phase, _ in reversed(track.open):
                lines.append(self._span_record("E", track, phase, flag))
        return lines

    def _meta(self, name: str, args: dict[str, Any], tid: int = 0) -> str:
        return _dumps({"name": name, "ph": "M", "pid": self.rank, "tid": tid, "args": args})

    def _trace_end(self, rotated: bool) -> str:
        return self._meta("trace_end", {"dropped": self._dropped, "events": self._written,
                                        "orphan_ends": self._orphans,
                                        "segment": self._segment, "rotated": rotated})

    def _header(self) -> list[str]:
        before = self.now_us()
        wall = time.time_ns()
        after = self.now_us()
        return [
            self._meta("clock_sync", {"wall_time_ns": wall, "perf_counter_us": (before + after) / 2,
                                      "segment": self._segment, "rank": self.rank,
                                      "version": TRACE_VERSION}),
            self._meta("process_name", {"name": f"rank {self.rank}",  # + Horovod's arg:
                                        "start_time_since_epoch_in_micros":  # wall us at ts 0
                                            round(wall / 1000 - (before + after) / 2)}),
            self._meta("process_sort_index", {"sort_index": self.rank}),
        ]

    def _open_file(self) -> None:
        # O_NONBLOCK: a FIFO planted at the path fails at once instead of blocking the open.
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise OSError(errno.ELOOP, f"timeline {self.path}: a symbolic link is there; "
                          "hvdlite does not write through one (another user may have put it "
                          "there, pointing at a file of yours): remove it or choose another "
                          "path") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"timeline {self.path}: not a regular file; choose "
                          "another path")
        self._fd = fd
        self._named = set()
        lines = self._header()
        if self._offset_us is not None:
            track = self._track(None)
            lines += self._name_lines(track)
            lines.append(f'{{"name":"clock_offset","ph":"i","ts":{self.now_us():.3f},'
                         f'"pid":{self.rank},"tid":0,"s":"t",'
                         f'"args":{_dumps({"offset_us": self._offset_us})}}}')
        data = ("[\n" + ",\n".join(lines) + _CLOSE).encode()
        self._pwrite_all(data, 0)
        self._size = self._base = len(data)

    def _remove_stale_segments(self) -> None:
        n = 1
        while os.path.exists(f"{self.path}.{n}"):
            os.remove(f"{self.path}.{n}")
            n += 1

    def _pwrite_all(self, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, offset)
            view = view[n:]
            offset += n

    def _write_pending(self) -> None:
        lines, self._pending, self._pending_bytes = self._pending, [], 0
        self._append(lines)

    def _append(self, lines: list[str]) -> None:
        """One pwrite over the closing bracket: the file is a whole JSON array before and after."""
        if not lines:
            return
        data = ("".join(",\n" + line for line in lines) + _CLOSE).encode()
        self._pwrite_all(data, self._size - len(_CLOSE))
        self._size += len(data) - len(_CLOSE)

    def _rotate(self) -> None:
        """Finish this file (open spans ended, trace_end) and continue in a fresh one."""
        self._append([*self._end_open_spans("continued"), self._trace_end(rotated=True)])
        os.close(self._fd)
        self._fd = -1
        self._shift_old_files()
        self._segment += 1
        self._open_file()
        reopen: list[str] = []
        for track in self._tracks.values():
            if track.open:
                reopen.extend(self._name_lines(track))
                reopen.extend(self._span_record("B", track, phase, "continued")
                              for phase, _ in track.open)
        self._append(reopen)
        self._base = self._size

    def _shift_old_files(self) -> None:
        """path -> path.1 -> path.2 ...; beyond ``max_files`` old files the oldest go."""
        n = 1
        while os.path.exists(f"{self.path}.{n}"):
            n += 1
        for k in range(n - 1, 0, -1):
            if self.max_files and k + 1 > self.max_files:
                os.remove(f"{self.path}.{k}")
            else:
                os.replace(f"{self.path}.{k}", f"{self.path}.{k + 1}")
        os.replace(self.path, f"{self.path}.1")
