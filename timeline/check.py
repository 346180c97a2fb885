"""Validate hvdlite (or any Chrome-trace) timelines.

    python -m timeline.check [--lenient] PATH...

Checks that the file is JSON (``--lenient`` accepts a truncated tail, as a crash leaves it),
that every B has a matching E on the same track in order, that spans nest on each track and
that no duration is negative. A file without a ``trace_end`` record (its writer was killed, at
a write boundary) may end with spans still open: that is a warning, not an error. Exit status
0 when every file passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

from timeline._trace import Trace, TraceError, load, nesting_errors, pair

__all__ = ["CheckResult", "check_file", "check_trace", "main"]

_MAX_SHOWN = 20


@dataclass
class CheckResult:
    """Problems (fail the check) and warnings (reported, do not fail) for one file."""

    path: str
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors


def _metadata(events: list[Any], name: str) -> list[dict[str, Any]]:
    return [ev for ev in events if isinstance(ev, dict) and ev.get("ph") == "M"
            and ev.get("name") == name]


def check_trace(trace: Trace, lenient: bool) -> CheckResult:
    """Run every check on a loaded trace."""
    res = CheckResult(trace.path)
    if trace.truncated:
        res.warnings.append(f"truncated: {trace.truncated} (loaded leniently)")
    pairing = pair(trace)
    res.errors.extend(pairing.errors)
    res.errors.extend(nesting_errors(pairing.spans))
    if lenient or not _metadata(trace.events, "trace_end"):
        res.warnings.extend(pairing.unclosed)
    else:
        res.errors.extend(pairing.unclosed)
    _check_metadata(trace, res)
    tracks = {(s.pid, s.track) for s in pairing.spans}
    res.stats = {"events": len(trace.events), "spans": len(pairing.spans),
                 "instants": len(pairing.instants), "tracks": len(tracks)}
    return res


def _check_metadata(trace: Trace, res: CheckResult) -> None:
    used = {(ev.get("pid"), ev.get("tid")) for ev in trace.events
            if isinstance(ev, dict) and ev.get("ph") in ("B", "E", "X", "i")}
    named = {(ev.get("pid"), ev.get("tid")) for ev in _metadata(trace.events, "thread_name")}
    for pid, tid in sorted(used - named, key=repr):
        res.warnings.append(f"pid {pid} tid {tid} has events but no thread_name metadata")
    if not _metadata(trace.events, "clock_sync"):
        res.warnings.append("no clock_sync metadata: merge cannot align this file by wall clock")
    ends = _metadata(trace.events, "trace_end")
    if not ends:
        res.warnings.append("no trace_end record: the writer did not close this file "
                            "(crash, kill, or still running)")
    for ev in ends:
        args = ev.get("args") or {}
        if args.get("dropped"):
            res.warnings.append(f"pid {ev.get('pid')}: the writer dropped {args['dropped']} "
                                f"events (queue full); the trace is incomplete")
        if args.get("orphan_ends"):
            res.warnings.append(f"pid {ev.get('pid')}: the writer skipped "
                                f"{args['orphan_ends']} E events that matched no open span")


def check_file(path: str, lenient: bool = False) -> CheckResult:
    """Load and check one file; an unreadable file is a single error."""
    try:
        trace = load(path, lenient=lenient)
    except TraceError as exc:
        return CheckResult(path, errors=[str(exc)])
    return check_trace(trace, lenient)


def _report(res: CheckResult) -> None:
    for msg in res.errors[:_MAX_SHOWN]:
        print(f"{res.path}: error: {msg}")
    if len(res.errors) > _MAX_SHOWN:
        print(f"{res.path}: ... and {len(res.errors) - _MAX_SHOWN} more errors")
    for msg in res.warnings[:_MAX_SHOWN]:
        print(f"{res.path}: warning: {msg}")
    if len(res.warnings) > _MAX_SHOWN:
        print(f"{res.path}: ... and {len(res.warnings) - _MAX_SHOWN} more warnings")
    counts = ", ".join(f"{v} {k}" for k, v in res.stats.items())
    verdict = "OK" if res.ok else f"FAILED ({len(res.errors)} errors)"
    print(f"{res.path}: {verdict}" + (f": {counts}" if counts else ""))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(prog="hvdlite-timeline check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", metavar="PATH", help="trace files to validate")
    ap.add_argument("--lenient", action="store_true",
                    help="accept a truncated tail and spans left open by a crash")
    ap.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    args = ap.parse_args(argv)
    status = 0
    for path in args.paths:
        res = check_file(path, lenient=args.lenient)
        if args.quiet:
            res.warnings = []
        if not args.quiet or not res.ok:
            _report(res)
        status = status or (0 if res.ok else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
