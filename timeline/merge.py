"""Merge per-rank timelines into one file, on one clock.

    python -m timeline.merge [--align auto|offset|wall|none] OUT PATH...

Each file's timestamps are on its own process's ``perf_counter`` clock. ``offset`` alignment
adds the ``clock_offset`` instant the engine recorded (this rank's offset to the coordinator's
clock, measured at init); ``wall`` alignment maps each file through its ``clock_sync`` pair
(wall_time_ns, perf_counter_us); ``auto`` uses offsets when every rank has one, else wall
clocks. The merged trace starts at ts 0; pids (ranks) are kept and tids are renumbered per rank
by tensor name, so rotated segments of one rank share tracks.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from timeline._trace import _TIMED_PHASES, Trace, TraceError, clock_refs, load, track_names

__all__ = ["main", "merge"]


class MergeError(ValueError):
    """The inputs cannot be aligned as asked."""


def _rank_of(trace: Trace) -> int:
    sync, _ = clock_refs(trace.events)
    if sync is not None and isinstance(sync.get("rank"), int):
        return int(sync["rank"])
    for ev in trace.events:
        if isinstance(ev, dict) and isinstance(ev.get("pid"), int):
            return int(ev["pid"])
    raise MergeError(f"{trace.path}: no event names a pid")


def _segment(trace: Trace) -> int:
    sync, _ = clock_refs(trace.events)
    seg = (sync or {}).get("segment", 0)
    return int(seg) if isinstance(seg, int) else 0


def _shifts(traces: list[Trace], align: str) -> tuple[list[float], str]:
    """Per-file shift (us) onto the common clock, and the alignment actually used."""
    refs = [clock_refs(t.events) for t in traces]
    ranks = [_rank_of(t) for t in traces]
    offsets: dict[int, float] = {}
    for rank, (_, off) in zip(ranks, refs, strict=True):
        if off is not None:
            offsets.setdefault(rank, off)
    if align == "auto":
        align = "offset" if all(r in offsets for r in ranks) else "wall"
    if align == "none":
        return [0.0] * len(traces), align
    if align == "offset":
        missing = sorted({r for r in ranks if r not in offsets})
        if missing:
            raise MergeError(f"--align offset: no clock_offset event for rank(s) {missing}")
        return [offsets[r] for r in ranks], align
    syncs = []
    for trace, (sync, _) in zip(traces, refs, strict=True):
        if sync is None or not {"wall_time_ns", "perf_counter_us"} <= sync.keys():
            raise MergeError(f"{trace.path}: no clock_sync metadata to align by wall clock "
                             f"(use --align none to merge unaligned)")
        syncs.append((int(sync["wall_time_ns"]), float(sync["perf_counter_us"])))
    # Relative to the first file: absolute wall-clock microseconds (~1e15) would leave doubles
    # only a quarter-microsecond of resolution.
    wall0, perf0 = syncs[0]
    return [(wall - wall0) / 1000.0 - (perf - perf0) for wall, perf in syncs], align


def merge(traces: list[Trace], align: str = "auto") -> list[dict[str, Any]]:
    """The merged event list (metadata first, then each rank's segments in order)."""
    order = sorted(range(len(traces)), key=lambda i: (_rank_of(traces[i]), _segment(traces[i])))
    traces = [traces[i] for i in order]
    shifts, used = _shifts(traces, align)
    base = min((ev["ts"] + shift for t, shift in zip(traces, shifts, strict=True)
                for ev in t.events if isinstance(ev, dict) and ev.get("ph") in _TIMED_PHASES
                and isinstance(ev.get("ts"), (int, float))), default=0.0)
    tids: dict[int, dict[str, int]] = {}
    meta: dict[tuple[Any, ...], dict[str, Any]] = {}
    body: list[dict[str, Any]] = []
    for trace, shift in zip(traces, shifts, strict=True):
        names = track_names(trace.events)
        for ev in trace.events:
            if not isinstance(ev, dict):
                continue
            ev = dict(ev)
            pid = ev.get("pid")
            if "tid" in ev and isinstance(pid, int):
                name = names.get((pid, ev["tid"]), f"tid {ev['tid']}")
                per = tids.setdefault(pid, {"hvdlite": 0})
                tid = per.get(name)
                if tid is None:  # tids of a rank are 0..n-1: the next one is the count
                    tid = per[name] = len(per)
                ev["tid"] = tid
            if ev.get("ph") == "M":
                _merge_meta(meta, ev, shift - base, used)
            else:
                if isinstance(ev.get("ts"), (int, float)):
                    ev["ts"] = round(ev["ts"] + shift - base, 3)
                body.append(ev)
    info = {"name": "merged", "ph": "M", "pid": 0, "tid": 0,
            "args": {"aligned_by": used, "base_us": base, "inputs": [t.path for t in traces]}}
    return [info, *meta.values(), *body]


def _merge_meta(meta: dict[tuple[Any, ...], dict[str, Any]], ev: dict[str, Any], shift: float,
                used: str) -> None:
    name = ev.get("name")
    if name == "thread_sort_index":
        ev["args"] = {"sort_index": ev["tid"]}
    if name == "clock_sync":
        args = dict(ev.get("args") or {})
        if isinstance(args.get("perf_counter_us"), (int, float)):
            args["perf_counter_us"] = round(args["perf_counter_us"] + shift, 3)
        args["merged_shift_us"] = shift
        args["aligned_by"] = used
        ev["args"] = args
    key: tuple[Any, ...] = (name, ev.get("pid"), ev.get("tid"))
    if name == "trace_end":
        key += (json.dumps(ev.get("args"), sort_keys=True),)
    meta.setdefault(key, ev)


def write(path: str, events: list[dict[str, Any]]) -> None:
    """Write events as a JSON array, one event per line."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(ev, separators=(",", ":")) for ev in events))
        f.write("\n]\n")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(prog="hvdlite-timeline merge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="OUT", help="merged trace to write")
    ap.add_argument("paths", nargs="+", metavar="PATH", help="per-rank traces (and segments)")
    ap.add_argument("--align", choices=("auto", "offset", "wall", "none"), default="auto",
                    help="clock alignment (default auto: offsets if every rank has one)")
    args = ap.parse_args(argv)
    try:
        traces = [load(p, lenient=True) for p in args.paths]
        events = merge(traces, args.align)
    except (TraceError, MergeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for t in traces:
        if t.truncated:
            print(f"warning: {t.path} truncated: {t.truncated}", file=sys.stderr)
    write(args.out, events)
    aligned = events[0]["args"]["aligned_by"]
    print(f"merged {len(traces)} files ({len(events)} events, aligned by {aligned}) "
          f"into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
