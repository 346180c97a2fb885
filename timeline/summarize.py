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
import sys
from typing import Any

from timeline._trace import (
    Instant,
    Span,
    Trace,
    TraceError,
    comm_phase,
    compute_phase,
    intersect_length,
    load,
    merge_continued,
    pair,
    percentile,
    union_length,
)

__all__ = ["main", "summarize", "format_text"]


def _stats(durs: list[float], nbytes: int) -> dict[str, Any]:
    durs = sorted(durs)
    total = sum(durs)
    return {"count": len(durs), "total_us": total, "mean_us": total / len(durs),
            "p99_us": percentile(durs, 99), "max_us": durs[-1], "bytes": nbytes}


def _nbytes(span: Span) -> int:
    val = span.args.get("bytes", 0)
    return int(val) if isinstance(val, (int, float)) else 0


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
    for group in ticks.values():
        group.sort(key=lambda t: t.ts)
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
        for s in negs:
            group = ticks.get((s.pid, s.track), [])
            times = [t.ts for t in group]
            inside = group[bisect.bisect_left(times, s.start):bisect.bisect_right(times, s.end)]
            ranked = [t for t in inside if _tick_rank(t) is not None]
            if len(ranked) >= 2:
                skews.append(ranked[-1].ts - ranked[0].ts)
            if ranked:
                last[_tick_rank(ranked[-1]) or 0] += 1
        entry["skew_mean_us"] = sum(skews) / len(skews) if skews else None
        entry["last_ready"] = {str(r): n for r, n in sorted(last.items())}
        out[tensor] = entry
    return out


def _fusion(spans: list[Span]) -> dict[str, Any]:
    buckets: dict[tuple[int, Any], dict[str, int]] = {}
    thresholds: dict[tuple[int, Any], int] = {}
    for s in spans:
        if not comm_phase(s.name) or "bucket" not in s.args:
            continue
        key = (s.pid, s.args["bucket"])
        buckets.setdefault(key, {})[s.track] = _nbytes(s)
        thr = s.args.get("threshold")
        if isinstance(thr, (int, float)) and thr > 0:
            thresholds[key] = int(thr)
    if not buckets:
        return {"buckets": 0, "note": "no communication span carries a 'bucket' arg"}
    payloads = {k: sum(v.values()) for k, v in buckets.items()}
    fills = [payloads[k] / thresholds[k] for k in buckets if k in thresholds]
    return {
        "buckets": len(buckets),
        "tensors_per_bucket_mean": sum(len(v) for v in buckets.values()) / len(buckets),
        "payload_bytes_mean": sum(payloads.values()) / len(buckets),
        "threshold_bytes": max(thresholds.values()) if thresholds else None,
        "efficiency_mean": sum(fills) / len(fills) if fills else None,
    }


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


def summarize(traces: list[Trace]) -> dict[str, Any]:
    """Every figure of the report, as a JSON-ready dict."""
    spans: list[Span] = []
    instants: list[Instant] = []
    unpaired = 0
    dropped = 0
    for trace in traces:
        p = pair(trace)
        spans.extend(p.spans)
        instants.extend(p.instants)
        unpaired += len(p.errors) + len(p.unclosed)
        dropped += sum(int((ev.get("args") or {}).get("dropped", 0)) for ev in trace.events
                       if isinstance(ev, dict) and ev.get("name") == "trace_end"
                       and ev.get("ph") == "M")
    spans = merge_continued(spans)
    tensors: dict[str, list[Span]] = collections.defaultdict(list)
    for s in spans:
        tensors[s.track].append(s)
    return {
        "files": [t.path for t in traces],
        "truncated": {t.path: t.truncated for t in traces if t.truncated},
        "dropped_events": dropped,
        "unpaired_events": unpaired,
        "phases": _by_phase(spans),
        "tensors": {name: _by_phase(group) for name, group in sorted(tensors.items())},
        "negotiation": _negotiation(spans, instants),
        "fusion": _fusion(spans),
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
            f"{'tensor':<28} {'count':>7} {'mean':>11} {'p99':>11} {'rank skew':>11}  last ready"]
    for name, st in rep["negotiation"].items():
        last = " ".join(f"r{r}:{n}" for r, n in st["last_ready"].items()) or "-"
        out.append(f"{name[:28]:<28} {st['count']:>7} {_t(st['mean_us']):>11} "
                   f"{_t(st['p99_us']):>11} {_t(st['skew_mean_us']):>11}  {last}")
    out += ["", "== fusion"]
    fus = rep["fusion"]
    if fus["buckets"]:
        eff = fus["efficiency_mean"]
        out.append(f"buckets {fus['buckets']}, {fus['tensors_per_bucket_mean']:.2f} tensors and "
                   f"{_b(fus['payload_bytes_mean'])} per bucket, threshold "
                   f"{_b(fus['threshold_bytes'])}, efficiency "
                   f"{'-' if eff is None else f'{eff:.1%}'}")
    else:
        out.append(fus["note"])
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
    args = ap.parse_args(argv)
    try:
        traces = [load(p, lenient=True) for p in args.paths]
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rep = summarize(traces)
    print(json.dumps(rep, indent=2) if args.json else format_text(rep, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
