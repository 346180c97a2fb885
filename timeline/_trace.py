"""Reading hvdlite traces: strict or lenient loading, track names, B/E pairing into spans."""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "OP_SPANS", "Instant", "Pairing", "Span", "Trace", "TraceError", "attribute", "clock_refs",
    "comm_phase", "compute_phase", "intersect_length", "load", "merge_continued",
    "nesting_errors", "pair", "percentile", "track_names", "union_length",
]

_SPAN_PHASES = frozenset("BEX")
_TIMED_PHASES = frozenset("BEXiIn")
_COMM_RE = re.compile(
    r"(?!NEGOTIATE_)[A-Z][A-Z0-9]*_(ALLREDUCE|ALLGATHER|BROADCAST|BCAST|ALLTOALL|"
    r"REDUCESCATTER|REDUCE_SCATTER|BARRIER|JOIN)")
# Horovod's top-level span of an op (the response type), around the op's activities.
OP_SPANS = frozenset(
    {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "ADASUM", "ERROR"})


class TraceError(ValueError):
    """A file that cannot be read as a trace at all."""


@dataclass
class Trace:
    """One loaded file: its events and, when loaded leniently, why the tail was cut."""

    path: str
    events: list[dict[str, Any]]
    truncated: str | None = None


@dataclass
class Span:
    """A B/E pair or an X event on one track."""

    pid: int
    track: str
    name: str
    start: float
    end: float
    depth: int
    args: dict[str, Any] = field(default_factory=dict)
    end_args: dict[str, Any] = field(default_factory=dict)
    payload: int | None = None  # the tensor's bytes, filled in by ``attribute``
    bucket: Any = None          # the bucket it ran in, filled in by ``attribute``

    @property
    def dur(self) -> float:
        return self.end - self.start

    @property
    def continued_in(self) -> bool:
        return bool(self.args.get("continued"))

    @property
    def continued_out(self) -> bool:
        return bool(self.end_args.get("continued"))


@dataclass
class Instant:
    pid: int
    track: str
    name: str
    ts: float
    args: dict[str, Any]


@dataclass
class Pairing:
    """Spans and instants of a trace, plus the problems found while pairing B with E."""

    spans: list[Span]
    instants: list[Instant]
    errors: list[str]
    unclosed: list[str]


def comm_phase(name: str) -> bool:
    """A communication phase: ``<BACKEND>_<OP>`` such as MPI_ALLREDUCE or NCCL_ALLGATHER."""
    return _COMM_RE.fullmatch(name) is not None


def compute_phase(name: str) -> bool:
    """A span the user (or a framework hook) marked as computation."""
    return name.startswith("COMPUTE")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted, non-empty list."""
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _lenient_events(text: str) -> tuple[list[Any], str | None]:
    """Decode an array's elements one by one, stopping at the first damaged one."""
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text[i:i + 1] == "[":
        raise TraceError("not a JSON array (expected '[' at the start)")
    i += 1
    events: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            return events, f"missing closing ']' after {len(events)} events"
        if text[i] == "]":
            return events, None
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            return events, f"tail cut at byte {i} after {len(events)} events ({exc.msg})"
        events.append(obj)


def load(path: str, lenient: bool = False) -> Trace:
    """Load a trace (array form, or an object with ``traceEvents``).

    Lenient mode keeps every complete event before a damaged tail and says where it stopped.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    truncated: str | None = None
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        if not lenient:
            raise TraceError(f"{path}: not valid JSON: {exc} (try --lenient for a truncated "
                             f"trace)") from exc
        try:
            data, truncated = _lenient_events(text)
        except TraceError as exc2:
            raise TraceError(f"{path}: {exc2}") from exc
    if isinstance(data, dict):
        data = data.get("traceEvents")
    if not isinstance(data, list):
        raise TraceError(f"{path}: expected a JSON array of events or an object with "
                         f"'traceEvents'")
    return Trace(path, data, truncated)


def track_names(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], str]:
    """(pid, tid) -> thread_name from the metadata events."""
    names: dict[tuple[Any, Any], str] = {}
    for ev in events:
        if isinstance(ev, dict) and ev.get("ph") == "M" and ev.get("name") == "thread_name":
            names[(ev.get("pid"), ev.get("tid"))] = str((ev.get("args") or {}).get("name"))
    return names


def clock_refs(events: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, float | None]:
    """The first clock_sync metadata args and the first clock_offset instant's offset_us."""
    sync: dict[str, Any] | None = None
    offset: float | None = None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        if sync is None and ev.get("ph") == "M" and ev.get("name") == "clock_sync":
            sync = ev.get("args") or {}
        elif offset is None and ev.get("name") == "clock_offset" and ev.get("ph") in ("i", "I"):
            val = (ev.get("args") or {}).get("offset_us")
            if isinstance(val, (int, float)):
                offset = float(val)
        if sync is not None and offset is not None:
            break  # both sit at the start of an engine's file
    return sync, offset


def _where(i: int, ev: dict[str, Any], track: str) -> str:
    return f"event #{i} ({ev.get('ph')} {ev.get('name')!r}, pid {ev.get('pid')}, " \
           f"track {track!r}, ts {ev.get('ts')})"


def pair(trace: Trace) -> Pairing:
    """Pair B with E per track in file order; X events become spans directly.

    Errors: an E with no open B, an E whose name differs from the innermost open B, an E
    before its B, a negative X duration, a timed event without numeric ts/pid/tid.
    """
    names = track_names(trace.events)
    stacks: dict[tuple[Any, Any], list[tuple[int, dict[str, Any], int]]] = {}
    out = Pairing([], [], [], [])
    for i, ev in enumerate(trace.events):
        if not isinstance(ev, dict) or not isinstance(ev.get("ph"), str):
            out.errors.append(f"event #{i}: not an object with a string 'ph': {ev!r:.80}")
            continue
        ph = ev["ph"]
        if ph not in _TIMED_PHASES:
            continue
        key = (ev.get("pid"), ev.get("tid"))
        track = names.get(key, f"tid {key[1]}")
        if not isinstance(ev.get("ts"), (int, float)) or None in key:
            out.errors.append(f"{_where(i, ev, track)}: needs numeric 'ts', 'pid' and 'tid'")
            continue
        _pair_one(out, stacks.setdefault(key, []), i, ev, track)
    for key, stack in stacks.items():
        track = names.get(key, f"tid {key[1]}")
        out.unclosed.extend(f"{_where(i, ev, track)}: B never ended" for i, ev, _ in stack)
    return out


def _pair_one(out: Pairing, stack: list[tuple[int, dict[str, Any], int]], i: int,
              ev: dict[str, Any], track: str) -> None:
    ph, pid, ts = ev["ph"], ev["pid"], float(ev["ts"])
    args = ev.get("args") or {}
    if ph == "B":
        stack.append((i, ev, len(stack)))
    elif ph == "E":
        if not stack:
            out.errors.append(f"{_where(i, ev, track)}: E with no open B on this track")
            return
        bi, bev, depth = stack.pop()
        if "name" in ev and ev["name"] != bev.get("name"):
            out.errors.append(f"{_where(i, ev, track)}: improper nesting: E {ev['name']!r} "
                              f"while {bev.get('name')!r} (event #{bi}) is the innermost open "
                              f"span")
        if ts < float(bev["ts"]):
            out.errors.append(f"{_where(i, ev, track)}: negative duration "
                              f"({ts - float(bev['ts']):.3f} us) for B at event #{bi}")
        out.spans.append(Span(pid, track, str(bev.get("name")), float(bev["ts"]), ts, depth,
                              bev.get("args") or {}, args))
    elif ph == "X":
        dur = ev.get("dur")
        if not isinstance(dur, (int, float)) or dur < 0:
            out.errors.append(f"{_where(i, ev, track)}: X needs a non-negative 'dur', got "
                              f"{dur!r}")
            return
        out.spans.append(Span(pid, track, str(ev.get("name")), ts, ts + dur, len(stack), args))
    else:
        out.instants.append(Instant(pid, track, str(ev.get("name")), ts, args))


def nesting_errors(spans: list[Span]) -> list[str]:
    """Spans on one track must nest (no partial overlap); X events are checked against all."""
    by_track: dict[tuple[int, str], list[Span]] = {}
    for s in spans:
        by_track.setdefault((s.pid, s.track), []).append(s)
    errors = []
    for (pid, track), group in by_track.items():
        group.sort(key=lambda s: (s.start, -s.end))
        stack: list[Span] = []
        for s in group:
            while stack and stack[-1].end <= s.start:
                stack.pop()
            if stack and s.end > stack[-1].end:
                top = stack[-1]
                errors.append(f"pid {pid} track {track!r}: {s.name!r} [{s.start:.3f}, "
                              f"{s.end:.3f}] overlaps {top.name!r} [{top.start:.3f}, "
                              f"{top.end:.3f}] without nesting in it")
                continue
            stack.append(s)
    return errors


def merge_continued(spans: list[Span]) -> list[Span]:
    """Join spans split by file rotation (E continued + B continued, same track and name)."""
    # A zero-length piece precedes the longer span that resumes it, and a piece that is not a
    # continuation precedes the continuations that start at the same time.
    spans = sorted(spans, key=lambda s: (s.pid, s.track, s.start, s.end, s.continued_in))
    out: list[Span] = []
    open_out: dict[tuple[int, str, str], Span] = {}
    for s in spans:
        key = (s.pid, s.track, s.name)
        prev = open_out.pop(key, None) if s.continued_in else None
        if prev is not None and abs(prev.end - s.start) <= 1e-3:
            prev.end = s.end
            prev.end_args = s.end_args
            s = prev
        else:
            out.append(s)
        if s.continued_out:
            open_out[key] = s
    return out


def _arg(span: Span, key: str) -> Any:
    return span.end_args.get(key, span.args.get(key))


DEVICE_SUFFIX = " [device]"  # event-timed device spans of tensor X live on track "X [device]"


def attribute(spans: list[Span]) -> None:
    """Give each span its tensor's payload bytes and its bucket id.

    Per track in time order: a NEGOTIATE_* span starts a new submission, whose ``bytes`` arg is
    the tensor's payload; a ``bucket`` arg (B or E) on any later span names the bucket until the
    next negotiation. Without a negotiation in the file, a span's own ``bytes`` arg is used.
    A device track ("X [device]") takes both from the submission of host track X that was the
    latest to begin negotiating before the device span started.
    """
    by_track: dict[tuple[int, str], list[Span]] = {}
    for s in spans:
        by_track.setdefault((s.pid, s.track), []).append(s)
    submissions: dict[tuple[int, str], list[tuple[float, int | None, Any]]] = {}
    for key, group in by_track.items():
        if not key[1].endswith(DEVICE_SUFFIX):
            submissions[key] = _attribute_host(group)
    for (pid, track), group in by_track.items():
        if track.endswith(DEVICE_SUFFIX):
            _attribute_device(group, submissions.get((pid, track[:-len(DEVICE_SUFFIX)]), []))


def _attribute_host(group: list[Span]) -> list[tuple[float, int | None, Any]]:
    """Attribute one host track; returns its submissions as (start, payload, bucket)."""
    group.sort(key=lambda s: (s.start, s.end))
    subs: list[list[Any]] = []
    payload: int | None = None
    bucket: Any = None
    for s in group:
        if s.name.startswith("NEGOTIATE"):
            val = s.args.get("bytes")
            payload = int(val) if isinstance(val, (int, float)) else None
            bucket = None
            subs.append([s.start, payload, None])
        elif _arg(s, "bucket") is not None:
            bucket = _arg(s, "bucket")
            if subs:
                subs[-1][2] = bucket
        own = s.args.get("bytes")
        fallback = int(own) if isinstance(own, (int, float)) else None
        s.payload = payload if payload is not None else fallback
        s.bucket = bucket
    return [(start, pay, buck) for start, pay, buck in subs]


def _attribute_device(group: list[Span], subs: list[tuple[float, int | None, Any]]) -> None:
    starts = [start for start, _, _ in subs]
    for s in group:
        i = bisect.bisect_right(starts, s.start) - 1
        own = s.args.get("bytes")
        fallback = int(own) if isinstance(own, (int, float)) else None
        if i >= 0:
            _, payload, bucket = subs[i]
            s.payload = payload if payload is not None else fallback
            s.bucket = bucket
        else:
            s.payload = fallback


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of intervals."""
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total


def intersect_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length covered by both the union of ``a`` and the union of ``b``."""
    return union_length(a) + union_length(b) - union_length(a + b)
