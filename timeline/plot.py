"""Plot a timeline: a Gantt chart of the busiest window and a per-phase duration histogram.

    python -m timeline.plot PATH... --out timeline.png [--window-ms W] [--tracks N] [--start-ms S]

Needs matplotlib (``pip install 'hvdlite[plot]'``). The busiest window is the W-long interval,
starting at some span's start, that holds the most time of working spans (every phase except
NEGOTIATE_*, QUEUE, WAIT_FOR_DATA and the top-level op spans); W defaults to a tenth of the
trace, at least 1 ms. The chart shows every span in that window on the N tracks with the
most time in it.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

import numpy as np

from timeline._trace import OP_SPANS, Span, TraceError, load, merge_continued, pair

__all__ = ["busiest_window", "main", "plot"]

_MAX_CANDIDATES = 2000
_MAX_PHASES_IN_HISTOGRAM = 8


def waiting_phase(name: str) -> bool:
    """Phases that wait rather than work (and an op's top-level span, which holds its
    waiting and its work): they do not make a window busy."""
    return (name.startswith("NEGOTIATE") or name in ("QUEUE", "WAIT_FOR_DATA")
            or name in OP_SPANS)


def busiest_window(spans: list[Span], width_us: float) -> tuple[float, float]:
    """The [start, start + width) interval with the most working-span time (waiting phases
    count only when nothing else is there), starting at a span start."""
    working = [s for s in spans if not waiting_phase(s.name)]
    spans = working or spans
    starts = np.array([s.start for s in spans], dtype=np.float64)
    ends = np.array([s.end for s in spans], dtype=np.float64)
    candidates = np.unique(starts)
    if len(candidates) > _MAX_CANDIDATES:
        candidates = candidates[np.linspace(0, len(candidates) - 1, _MAX_CANDIDATES).astype(int)]
    best, best_t = -1.0, float(candidates[0])
    for t in candidates:
        covered = np.clip(np.minimum(ends, t + width_us) - np.maximum(starts, t), 0.0, None)
        total = float(covered.sum())
        if total > best:
            best, best_t = total, float(t)
    return best_t, best_t + width_us


def _load_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("timeline plot needs matplotlib: pip install 'hvdlite[plot]' "
                           "(or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(paths: list[str], out: str, window_ms: float | None = None, tracks: int = 40,
         start_ms: float | None = None) -> str:
    """Render ``out`` (PNG); returns a one-line description of what was drawn."""
    plt = _load_matplotlib()
    spans: list[Span] = []
    for path in paths:
        spans.extend(pair(load(path, lenient=True)).spans)
    spans = merge_continued(spans)
    if not spans:
        raise ValueError("no spans to plot in " + ", ".join(paths))
    t0 = min(s.start for s in spans)
    extent = max(s.end for s in spans) - t0
    width = window_ms * 1e3 if window_ms else min(extent, max(extent / 10.0, 1000.0)) or 1.0
    if start_ms is None:
        lo, hi = busiest_window(spans, width)
    else:  # a chosen window, e.g. past a warm-up whose long spans dominate "busiest"
        lo = t0 + start_ms * 1e3
        hi = lo + width
    inside = [s for s in spans if s.end >= lo and s.start <= hi]
    busy: dict[tuple[int, str], float] = collections.defaultdict(float)
    for s in inside:
        busy[(s.pid, s.track)] += min(s.end, hi) - max(s.start, lo)
    rows = sorted(sorted(busy, key=lambda k: -busy[k])[:tracks])
    phases = sorted({s.name for s in spans})
    colors = {p: plt.cm.tab20(i % 20) for i, p in enumerate(phases)}
    fig, (gantt, hist) = plt.subplots(2, 1, figsize=(14, 4 + 0.25 * len(rows) + 4),
                                      gridspec_kw={"height_ratios": [max(len(rows), 4), 6]})
    _draw_gantt(gantt, inside, rows, colors, lo, hi)
    if start_ms is not None:
        gantt.set_title(f"window from {start_ms:g} ms")
    _draw_histogram(hist, spans, colors)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return (f"{out}: window {(lo - t0) / 1e3:.3f}-{(hi - t0) / 1e3:.3f} ms of "
            f"{extent / 1e3:.3f} ms, {len(rows)} tracks, {len(phases)} phases")


def _draw_gantt(ax: Any, spans: list[Span], rows: list[tuple[int, str]],
                colors: dict[str, Any], lo: float, hi: float) -> None:
    from matplotlib.patches import Patch

    index = {key: i for i, key in enumerate(rows)}
    bars: dict[tuple[str, int, int], list[tuple[float, float]]] = collections.defaultdict(list)
    for s in spans:
        row = index.get((s.pid, s.track))
        if row is not None:
            start = max(s.start, lo)
            width = max((min(s.end, hi) - start) / 1e3, 1e-4)
            bars[(s.name, s.depth, row)].append(((start - lo) / 1e3, width))
    for (name, depth, row), xranges in sorted(bars.items(), key=lambda kv: kv[0][1]):
        height = 0.8 * 0.7 ** depth
        ax.broken_barh(xranges, (row - height / 2, height), facecolors=colors[name])
    shown = sorted({name for name, _, _ in bars})
    ax.legend(handles=[Patch(color=colors[n], label=n) for n in shown], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"r{pid} {track[:40]}" for pid, track in rows], fontsize=7)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel("ms from the window start")
    ax.set_title("busiest window")


def _draw_histogram(ax: Any, spans: list[Span], colors: dict[str, Any]) -> None:
    durs: dict[str, list[float]] = collections.defaultdict(list)
    for s in spans:
        durs[s.name].append(max(s.dur, 0.01))
    top = sorted(durs, key=lambda n: -len(durs[n]))[:_MAX_PHASES_IN_HISTOGRAM]
    everything = np.concatenate([np.asarray(durs[n]) for n in top])
    lo, hi = float(everything.min()), float(everything.max())
    bins: Any = np.geomspace(lo, hi * 1.0001, 40) if hi > lo else 10
    for name in top:
        ax.hist(durs[name], bins=bins, histtype="step", linewidth=1.5, color=colors[name],
                label=f"{name} ({len(durs[name])})")
    ax.set_xscale("log")
    ax.set_xlabel("span duration (us)")
    ax.set_ylabel("spans")
    ax.set_title("duration per phase")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(prog="hvdlite-timeline plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", metavar="PATH", help="trace files")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--window-ms", type=float, default=None,
                    help="Gantt window width (default: a tenth of the trace, >= 1 ms)")
    ap.add_argument("--tracks", type=int, default=40, help="tracks shown (default 40)")
    ap.add_argument("--start-ms", type=float, default=None,
                    help="draw the window starting this many ms into the trace instead of "
                         "the busiest one")
    args = ap.parse_args(argv)
    try:
        print(plot(args.paths, args.out, args.window_ms, args.tracks, args.start_ms))
    except (RuntimeError, TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
