"""``python -m timeline <tool> ...`` / ``hvdlite-timeline <tool> ...``: one entry for every tool."""

from __future__ import annotations

import importlib
import sys

__all__ = ["main"]

TOOLS = {
    "summarize": "per phase / per tensor timings, negotiation wait, fusion, exposed comm",
    "check": "validate a trace (JSON, B/E pairing, nesting, durations)",
    "merge": "merge per-rank traces into one file on one clock",
    "plot": "PNG Gantt of the busiest window and per-phase histogram (needs matplotlib)",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to ``timeline.<tool>.main``; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or args[0] not in TOOLS:
        lines = ["usage: hvdlite-timeline {" + ",".join(TOOLS) + "} ...", ""]
        lines += [f"  {name:<10} {text}" for name, text in TOOLS.items()]
        bad = bool(args) and args[0] not in ("-h", "--help")
        if bad:
            lines.insert(0, f"hvdlite-timeline: unknown tool {args[0]!r}")
        print("\n".join(lines), file=sys.stderr if bad or not args else sys.stdout)
        return 2 if bad or not args else 0
    module = importlib.import_module(f"timeline.{args[0]}")
    status: int = module.main(args[1:])
    return status


if __name__ == "__main__":
    sys.exit(main())
