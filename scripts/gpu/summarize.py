"""Print the tables and target lines of benchmark JSON files (from ``--json``), in order, then
every target of every file in one list with a tally.

``run_all.sh`` calls this last so the end of its output (what a remote run hands back) holds
every result in a few dozen lines, and its last lines every target, met or missed, with the
numbers. Missing or unreadable files are named, not fatal. The CPU benchmarks' JSON (no
``limit``/``unit`` in their targets) is read too.

    python3 scripts/gpu/summarize.py OUT/g1.json OUT/g2.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[str, Any] | str:
    """The parsed result file, or why there is none."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"== {path.name}: MISSING (the benchmark did not finish; see the log above)"
    except (OSError, ValueError) as exc:
        return f"== {path.name}: UNREADABLE ({exc})"
    if not isinstance(data, dict):
        return f"== {path.name}: UNREADABLE (not a JSON object)"
    return data


def summary(path: Path, data: dict[str, Any] | str) -> str:
    """The summary text of one result file (or why there is none)."""
    if isinstance(data, str):
        return data
    meta = data.get("meta", {})
    head = (
        f"== {data.get('benchmark', path.stem)} | {meta.get('gpu', meta.get('host', '?'))} x "
        f"{meta.get('ranks', '?')} | commit {meta.get('git_commit', '?')}"
        f"{_tree_state(meta)} | {meta.get('date_utc', '?')}"
    )
    bench = str(data.get("benchmark", ""))
    body = data.get("table") or "\n".join(target_line(bench, t) for t in data.get("targets", []))
    return f"{head}\n{body}"


def _tree_state(meta: dict[str, Any]) -> str:
    """' (dirty)', '' for a clean tree, ' (named by the launcher)' when git was not asked."""
    if meta.get("git_dirty") is None and meta.get("commit_source") == "HVDLITE_BENCH_COMMIT":
        return " (named by the launcher)"
    dirty = meta.get("git_dirty", meta.get("uncommitted_code_changes"))
    return " (dirty)" if dirty else ""


def target_line(bench: str, t: dict[str, Any]) -> str:
    """``met    G2 name: value (limit L)`` for one target record of benchmark ``bench``."""
    unit = t.get("unit", "")
    limit = f" (limit {t['limit']}{unit})" if "limit" in t else ""
    word = "met   " if t.get("met") else "MISSED"
    name = str(t.get("target", "?"))
    tag = bench.split()[0] if bench else "?"
    if not name.startswith(tag):
        name = f"{tag} {name}"
    return f"{word} {name}: {t.get('value', '?')}{unit}{limit}"


def every_target(results: list[dict[str, Any] | str]) -> str:
    """Every target of every file, one line each, and a tally (missing files count)."""
    lines, met, missed, absent = [], 0, 0, 0
    for data in results:
        if isinstance(data, str):
            absent += 1
            lines.append(f"MISSED {data.removeprefix('== ')}")
            continue
        for t in data.get("targets", []):
            lines.append(target_line(str(data.get("benchmark", "")), t))
            met, missed = met + bool(t.get("met")), missed + (not t.get("met"))
    tally = f"targets: {met} met, {missed} missed; result files missing or unreadable: {absent}"
    return "\n".join(["== every target", *lines, tally])


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    paths = [Path(a) for a in argv]
    results = [load(p) for p in paths]
    print("\n\n".join(summary(p, d) for p, d in zip(paths, results, strict=True)))
    print()
    print(every_target(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
