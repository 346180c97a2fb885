"""Print the tables and target lines of GPU benchmark JSON files (from ``--json``), in order.

``run_all.sh`` calls this last so the end of its output (what a remote run hands back) holds
every result in a few dozen lines. Missing or unreadable files are named, not fatal.

    python3 scripts/gpu/summarize.py OUT/g1.json OUT/g2.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summary(path: Path) -> str:
    """The summary text of one result file (or why there is none)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"== {path.name}: MISSING (the benchmark did not finish; see the log above)"
    except (OSError, ValueError) as exc:
        return f"== {path.name}: UNREADABLE ({exc})"
    meta = data.get("meta", {})
    head = (
        f"== {data.get('benchmark', path.stem)} | {meta.get('gpu', '?')} x "
        f"{meta.get('ranks', '?')} | commit {meta.get('git_commit', '?')}"
        f"{_tree_state(meta)} | {meta.get('date_utc', '?')}"
    )
    return f"{head}\n{data.get('table', '(no table)')}"


def _tree_state(meta: dict) -> str:
    """' (dirty)', '' for a clean tree, ' (named by the launcher)' when git was not asked."""
    if meta.get("git_dirty") is None and meta.get("commit_source") == "HVDLITE_BENCH_COMMIT":
        return " (named by the launcher)"
    return " (dirty)" if meta.get("git_dirty") else ""


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n\n".join(summary(Path(a)) for a in argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

