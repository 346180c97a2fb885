"""Summarize hvdlite timelines: where the time went, per phase and per tensor.

    python -m timeline.summarize [--json] [--top N] PATH...

Reports, over all given files (ranks, rotated segments): counts, total/mean/p99 duration and
bytes per phase and per tensor x phase; negotiation wait with the rank that was ready last;
fusion efficiency of the buckets; and per rank the communication time that computation hid
(overlapped) or did not (exposed). timeline/FORMAT.md defines each figure.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import re
import sys
from typing import Any

from timeline._trace import (
    Instant,
    Span,
    Trace,
    TraceError,
    attribute,
    comm_phase,
    compute_phase,
    intersect_length,
    load,
    merge_continued,
    pair,
    percentile,
    union_length,
)

__all__ = ["format_text", "main", "parse_size", "summarize"]

_CACHE_HIT = "CACHE_HIT"


def _stats(durs: list[float], nbytes: int) -> dict[str, Any]:
    durs = sorted(durs)
    total = sum(durs)
    return {"count": len(durs), "total_us": total, "mean_us": total / len(durs),
            "p99_us": percentile(durs, 99), "max_us": durs[-1], "bytes": nbytes}


# The engine's size units (hvdlite.config.parse_size; copied, the tools import no hvdlite):
# bare letters and *iB are powers of 1024, *B powers of 1000.
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """'65536', '64MiB', '1.5 MB' -> bytes."""
    m = _SIZE.fullmatch(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 65536, 64MiB, 1.5MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _nbytes(span: Span) -> int:
    return span.payload or 0


def _by_phase(spans: list[Span]) -> dict[str, dict[str, Any]]:
    durs: dict[str, list[float]] = collections.defaultdict(list)
    nbytes: collections.Counter[str] = collections.Counter()
    for s in spans:
        durs[s.name].append(s.dur)
        nbytes[s.name] += _nbytes(s)
    return {name: _stats(durs[name], nbytes[name]) for name in sorted(durs)}


def _tick_rank(tick: Instant) -> int | None:
    rank = tick.args.get("rank", tick.name)
    try:
        return int(rank)
    except (TypeError, ValueError):
        return None


def _negotiation(spans: list[Span], instants: list[Instant]) -> dict[str, dict[str, Any]]:
    ticks: dict[tuple[int, str], list[Instant]] = collections.defaultdict(list)
    for t in instants:
        ticks[(t.pid, t.track)].append(t)
    times: dict[tuple[int, str], list[float]] = {}
    for key, group in ticks.items():
        group.sort(key=lambda t: t.ts)
        times[key] = [t.ts for t in group]
    out: dict[str, dict[str, Any]] = {}
    per_tensor: dict[str, list[Span]] = collections.defaultdict(list)
    for s in spans:
        if s.name.startswith("NEGOTIATE"):
            per_tensor[s.track].append(s)
    for tensor, negs in sorted(per_tensor.items()):
        entry = _stats([s.dur for s in negs], 0)
        del entry["bytes"]
        skews: list[float] = []
        last: collections.Counter[int] = collections.Counter()
        hits = 0
        for s in negs:
            group = ticks.get((s.pid, s.track), [])
            ts = times.get((s.pid, s.track), [])
            inside = group[bisect.bisect_left(ts, s.start):bisect.bisect_right(ts, s.end)]
            hits += any(t.name == _CACHE_HIT for t in inside)
            ranked = [(t.ts, r) for t in inside
                      if t.name != _CACHE_HIT and (r := _tick_rank(t)) is not None]
            if len(ranked) >= 2:
                skews.append(ranked[-1][0] - ranked[0][0])
            if ranked:
                last[ranked[-1][1]] += 1
        entry["cache_hits"] = hits
        entry["skew_mean_us"] = sum(skews) / len(skews) if skews else None
        entry["last_ready"] = {str(r): n for r, n in sorted(last.items())}
        out[tensor] = entry
    return out


def _fusion(spans: list[Span], threshold: int | None) -> dict[str, Any]:
    """Per communication phase: buckets, tensors and payload per bucket, fill of the threshold."""
    members: dict[tuple[str, int, Any], dict[str, int]] = {}
    given: dict[tuple[int, Any], int] = {}
    for s in spans:
        if s.bucket is None:
            continue
        for args in (s.args, s.end_args):
            thr = args.get("threshold")
            if isinstance(thr, (int, float)) and thr > 0:
                given[(s.pid, s.bucket)] = int(thr)
        if comm_phase(s.name):
            members.setdefault((s.name, s.pid, s.bucket), {})[s.track] = _nbytes(s)
    by_phase: dict[str, dict[str, Any]] = {}
    for phase in sorted({k[0] for k in members}):
        keys = [k for k in members if k[0] == phase]
        payloads = [sum(members[k].values()) for k in keys]
        fills = [p / t for k, p in zip(keys, payloads, strict=True)
                 if (t := given.get(k[1:], threshold or 0)) > 0]
        by_phase[phase] = {
            "buckets": len(keys),
            "tensors_per_bucket_mean": sum(len(members[k]) for k in keys) / len(keys),
            "payload_bytes_mean": sum(payloads) / len(keys),
            "efficiency_mean": sum(fills) / len(fills) if fills else None,
        }
    # An unfused bucket's threshold arg is its own size (fill 100%), not the fusion threshold.
    fused = {k[1:] for k, tensors in members.items() if len(tensors) > 1}
    thresholds = ({t for key, t in given.items() if key in fused}
                  or ({threshold} if threshold else set()))
    return {"threshold_bytes": max(thresholds) if thresholds else None, "by_phase": by_phase}


def _communication(spans: list[Span]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for pid in sorted({s.pid for s in spans}):
        mine = [s for s in spans if s.pid == pid]
        comm = [(s.start, s.end) for s in mine if comm_phase(s.name)]
        compute = [(s.start, s.end) for s in mine if compute_phase(s.name)]
        busy = union_length(comm)
        entry: dict[str, Any] = {
            "wall_us": max(s.end for s in mine) - min(s.start for s in mine),
            "comm_busy_us": busy, "compute_us": None, "overlapped_us": None,
            "exposed_us": None,
        }
        if compute:
            overlapped = intersect_length(comm, compute)
            entry.update(compute_us=union_length(compute), overlapped_us=overlapped,
                         exposed_us=busy - overlapped)
        out[str(pid)] = entry
    return out


def summarize(traces: list[Trace], threshold: int | None = None) -> dict[str, Any]:
    """Every figure of the report, as a JSON-ready dict (``threshold``: the fusion threshold
    in bytes, for traces whose spans do not carry one)."""
    spans: list[Span] = []
    instants: list[Instant] = []
    unpaired = 0
    dropped: dict[Any, int] = {}  # per process: trace_end carries a running total
    for trace in traces:
        p = pair(trace)
        spans.extend(p.spans)
        instants.extend(p.instants)
        unpaired += len(p.errors) + len(p.unclosed)
        for ev in trace.events:
            if isinstance(ev, dict) and ev.get("name") == "trace_end" and ev.get("ph") == "M":
                count = int((ev.get("args") or {}).get("dropped", 0))
                dropped[ev.get("pid")] = max(dropped.get(ev.get("pid"), 0), count)
    spans = merge_continued(spans)
    attribute(spans)
    tensors: dict[str, list[Span]] = collections.defaultdict(list)
    for s in spans:
        tensors[s.track].append(s)
    return {
        "files": [t.path for t in traces],
        "truncated": {t.path: t.truncated for t in traces if t.truncated},
        "dropped_events": sum(dropped.values()),
        "unpaired_events": unpaired,
        "phases": _by_phase(spans),
        "tensors": {name: _by_phase(group) for name, group in sorted(tensors.items())},
        "negotiation": _negotiation(spans, instants),
        "fusion": _fusion(spans, threshold),
        "communication": _communication(spans),
    }


def _t(us: float | None) -> str:
    if us is None:
        return "-"
    if us >= 1e6:
        return f"{us / 1e6:.3f}s"
    if us >= 1e3:
        return f"{us / 1e3:.3f}ms"
    return f"{us:.1f}us"


def _b(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


def _phase_rows(phases: dict[str, dict[str, Any]], prefix: str = "") -> list[str]:
    return [f"{prefix}{name:<28} {st['count']:>7} {_t(st['total_us']):>11} "
            f"{_t(st['mean_us']):>11} {_t(st['p99_us']):>11} {_b(st['bytes']):>10}"
            for name, st in sorted(phases.items(), key=lambda kv: -kv[1]["total_us"])]


def format_text(rep: dict[str, Any], top: int = 20) -> str:
    """The report as aligned text tables."""
    head = f"{'phase':<28} {'count':>7} {'total':>11} {'mean':>11} {'p99':>11} {'bytes':>10}"
    out = [f"files: {', '.join(rep['files'])}"]
    for path, why in rep["truncated"].items():
        out.append(f"warning: {path} truncated: {why}")
    if rep["dropped_events"]:
        out.append(f"warning: the writer dropped {rep['dropped_events']} events")
    if rep["unpaired_events"]:
        out.append(f"warning: {rep['unpaired_events']} B/E events did not pair (run check)")
    out += ["", "== per phase", head, *_phase_rows(rep["phases"])]
    ranked = sorted(rep["tensors"].items(),
                    key=lambda kv: -sum(st["total_us"] for st in kv[1].values()))
    shown = ranked if top <= 0 else ranked[:top]
    out += ["", f"== per tensor ({len(shown)} of {len(ranked)}, by total time)", head]
    for name, phases in shown:
        out.append(name)
        out += _phase_rows(phases, prefix="  ")
    out += ["", "== negotiation wait",
            f"{'tensor':<28} {'count':>7} {'cached':>7} {'mean':>11} {'p99':>11} "
            f"{'rank skew':>11}  last ready"]
    for name, st in rep["negotiation"].items():
        last = " ".join(f"r{r}:{n}" for r, n in st["last_ready"].items()) or "-"
        out.append(f"{name[:28]:<28} {st['count']:>7} {st['cache_hits']:>7} "
                   f"{_t(st['mean_us']):>11} {_t(st['p99_us']):>11} "
                   f"{_t(st['skew_mean_us']):>11}  {last}")
    fus = rep["fusion"]
    out += ["", f"== fusion (threshold {_b(fus['threshold_bytes'])})",
            f"{'phase':<28} {'buckets':>7} {'tensors/b':>10} {'payload/b':>10} {'fill':>7}"]
    for phase, st in fus["by_phase"].items():
        eff = st["efficiency_mean"]
        out.append(f"{phase:<28} {st['buckets']:>7} {st['tensors_per_bucket_mean']:>10.2f} "
                   f"{_b(st['payload_bytes_mean']):>10} {'-' if eff is None else f'{eff:.1%}':>7}")
    if not fus["by_phase"]:
        out.append("(no bucket ids in the trace)")
    out += ["", "== communication (per rank)",
            f"{'rank':<6} {'wall':>11} {'comm busy':>11} {'compute':>11} {'overlapped':>11} "
            f"{'exposed':>11}"]
    for pid, st in rep["communication"].items():
        out.append(f"{pid:<6} {_t(st['wall_us']):>11} {_t(st['comm_busy_us']):>11} "
                   f"{_t(st['compute_us']):>11} {_t(st['overlapped_us']):>11} "
                   f"{_t(st['exposed_us']):>11}")
    if any(st["compute_us"] is None for st in rep["communication"].values()):
        out.append("(no COMPUTE spans on some ranks: overlap unknown there; comm busy is the "
                   "union of communication spans)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(prog="hvdlite-timeline summarize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", metavar="PATH", help="trace files (any ranks/segments)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--top", type=int, default=20,
                    help="tensors shown in the per-tensor table (0 = all; default 20)")
    ap.add_argument("--threshold", type=parse_size, default=None,
                    help="fusion threshold (e.g. 64MiB) for traces whose spans carry none")
    args = ap.parse_args(argv)
    try:
        traces = [load(p, lenient=True) for p in args.paths]
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rep = summarize(traces, args.threshold)
    print(json.dumps(rep, indent=2) if args.json else format_text(rep, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
