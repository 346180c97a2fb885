"""One tally of pytest runs whose ranks wrote ``rank<R>.json`` (tests/conftest.py, with
``HVDLITE_TEST_REPORT_DIR``), as ``scripts/gpu/gpu_tests.sh`` leaves them: one folder per
step with the ranks' tallies and the step's ``meta.json``.

    python3 scripts/gpu/tally.py OUT/gpu-sync OUT/gpu-async ...   # step folders
    python3 scripts/gpu/tally.py OUT [OUT2 ...]                   # every step folder in each

Prints per step the ranks, completion mode, exit status and pytest's counts (rank 0; a rank
that disagrees or wrote no tally is named); the skips by reason; the lines the other-device
test printed; then over all steps the tests that failed anywhere, the tests that ran in no
step (skipped wherever collected) with their reasons, and per completion mode the tests that
ran in neither of its steps. The verdict, last: ``GPU tests: FAILED`` (exit 1) when a step
failed, timed out or lost a rank's tally, or a test failed or errored anywhere; else
``INCOMPLETE`` (exit 3) when some test ran in no step; else ``OK`` (exit 0): every test ran
somewhere and none failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

COUNTS = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")
BAD = ("failed", "error")
OTHER_DEVICE = re.compile(r"rank \d+, other-device result: .*")


def step_dirs(paths: list[Path]) -> list[Path]:
    """The step folders among ``paths``, or inside those that are not one themselves."""
    found: list[Path] = []
    for path in paths:
        if (path / "meta.json").exists() or list(path.glob("rank*.json")):
            found.append(path)
        else:
            found.extend(sorted(p.parent for p in path.glob("*/meta.json")))
    return found


def load_step(path: Path) -> dict[str, Any]:
    """A step's meta data, its ranks' tallies and what went wrong reading them."""
    meta_file = path / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    meta.setdefault("step", path.name)
    ranks = {}
    for f in sorted(path.glob("rank*.json")):
        record = json.loads(f.read_text())
        ranks[int(record["rank"])] = record
    problems = []
    size = int(meta.get("ranks", 0)) or (max(r["size"] for r in ranks.values()) if ranks else 0)
    missing = sorted(set(range(size)) - set(ranks))
    if not ranks:
        problems.append("no tally from any rank (crashed, killed or timed out)")
    elif missing:
        problems.append(f"no tally from rank(s) {missing} (crashed, killed or timed out)")
    outcomes = {r: rec["tests"] for r, rec in ranks.items()}
    if len({json.dumps(o, sort_keys=True) for o in outcomes.values()}) > 1:
        differ = sorted({t for o in outcomes.values() for t in o
                         if len({o2.get(t) for o2 in outcomes.values()}) > 1})
        problems.append(f"ranks disagree on {len(differ)} test(s), e.g. {differ[:3]}")
    rc = meta.get("rc")
    if rc not in (None, "0"):
        problems.append("TIMED OUT" if rc in ("124", "137") else f"exit {rc}")
    log = path.parent / f"{path.name}.log"
    lines = OTHER_DEVICE.findall(log.read_text(errors="replace")) if log.exists() else []
    return {"path": str(path), "meta": meta, "ranks": ranks, "problems": problems,
            "other_device": sorted(set(lines))}


def mode(step: dict[str, Any]) -> str:
    """``sync`` or ``async``: the completion mode the step ran in."""
    return "async" if step["meta"].get("async") == "1" else "sync"


def tally(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Every test's outcome in every step (rank 0's, or the first rank's), and the verdict."""
    outcome: dict[str, dict[str, str]] = defaultdict(dict)
    reasons: dict[str, set[str]] = defaultdict(set)
    for s in steps:
        if not s["ranks"]:
            continue
        first = s["ranks"][min(s["ranks"])]
        for test, result in first["tests"].items():
            outcome[test][s["label"]] = result
        for test, reason in first["skips"].items():
            reasons[test].add(reason)
    failed = {t: o for t, o in outcome.items() if any(v in BAD for v in o.values())}
    ran = {t for t, o in outcome.items() if any(v not in ("skipped", *BAD) for v in o.values())}
    # A module that skipped itself in some steps (a nodeid without "::") ran where its tests did.
    ran |= {t for t in outcome if "::" not in t and any(r.startswith(t + "::") for r in ran)}
    ran_nowhere = {t: sorted(reasons[t]) for t, o in outcome.items()
                   if t not in ran and t not in failed}
    by_mode: dict[str, list[str]] = {}
    for m in ("sync", "async"):
        names = {s["label"] for s in steps if mode(s) == m}
        by_mode[m] = sorted(t for t, o in outcome.items()
                            if any(k in names for k in o)
                            and not any(o.get(k) == "passed" for k in names)
                            and t not in ran_nowhere)
    if failed or any(s["problems"] for s in steps):
        verdict = "FAILED"
    else:
        verdict = "INCOMPLETE" if ran_nowhere else "OK"
    return {"tests": len(outcome), "failed": failed, "ran_nowhere": ran_nowhere,
            "not_run_in_mode": by_mode, "verdict": verdict}


def report(steps: list[dict[str, Any]], result: dict[str, Any]) -> str:
    """The tally as text."""
    runs = sorted({(s["meta"].get("tree", "?"), s["meta"].get("device", "?")) for s in steps})
    dates = sorted(s["meta"]["date_utc"] for s in steps if "date_utc" in s["meta"])
    out = [f"runs: {'; '.join(f'tree {t} on {d}' for t, d in runs)}"
           + (f"; {dates[0]} to {dates[-1]}" if dates else ""), ""]
    out.append(f"{'step':<14}{'ranks':>6}  {'mode':<6}{'exit':>5}{'s':>6}  "
               + "  ".join(f"{c:>7}" for c in COUNTS) + "  problems")
    totals: Counter[str] = Counter()
    for s in steps:
        meta = s["meta"]
        first = s["ranks"][min(s["ranks"])] if s["ranks"] else {}
        counts = [int(first.get(c, 0)) for c in COUNTS]
        totals.update(dict(zip(COUNTS, counts, strict=True)))
        out.append(f"{s['label']:<14}{meta.get('ranks', '?'):>6}  {mode(s):<6}"
                   f"{meta.get('rc', '?'):>5}{meta.get('seconds', '?'):>6}  "
                   + "  ".join(f"{c:>7}" for c in counts) + "  " + "; ".join(s["problems"]))
    out.append(f"{'all steps':<33}  " + "  ".join(f"{totals[c]:>7}" for c in COUNTS)
               + "  (rank 0's counts, summed)")
    out.append("")
    out.append("skips by reason (rank 0):")
    for s in steps:
        first = s["ranks"][min(s["ranks"])] if s["ranks"] else {"skips": {}}
        for reason, n in sorted(Counter(first["skips"].values()).items()):
            out.append(f"  {s['label']}: {n} x {reason}")
    lines = [line for s in steps for line in s["other_device"]]
    if lines:
        out.append("")
        out.append("the other-device test's reads (tests/gpu/test_gpu_bad_input.py):")
        out.extend(f"  {line}" for line in lines)
    out.append("")
    out.append(f"distinct tests: {result['tests']}; failed or errored in some step: "
               f"{len(result['failed'])}; ran in no step: {len(result['ran_nowhere'])}")
    for test, per_step in sorted(result["failed"].items()):
        bad = ", ".join(f"{k}: {v}" for k, v in per_step.items() if v in BAD)
        out.append(f"  FAILED {test} ({bad})")
    for test, why in sorted(result["ran_nowhere"].items()):
        out.append(f"  not run: {test}: {' / '.join(why)}")
    for m, tests in result["not_run_in_mode"].items():
        if tests:
            out.append(f"passed in no {m}-completion step (run elsewhere): {len(tests)}")
            out.extend(f"  {t}" for t in tests)
    out.append("")
    out.append(f"GPU tests: {result['verdict']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Print the tally of the step folders given; 0 if every test ran and passed, 1 if
    anything failed, 3 if some test ran nowhere."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="step folders, or folders of them")
    parser.add_argument("--json", type=Path, help="also write the tally here as JSON")
    args = parser.parse_args(argv)
    dirs = step_dirs(args.paths)
    if not dirs:
        print(f"no step folders (with meta.json or rank*.json) in {args.paths}", file=sys.stderr)
        return 2
    steps = [load_step(d) for d in dirs]
    names = Counter(s["meta"]["step"] for s in steps)
    for s in steps:  # a step name twice (several runs tallied together): name its folder too
        name = s["meta"]["step"]
        s["label"] = name if names[name] == 1 else f"{name} ({s['path']})"
    result = tally(steps)
    print(report(steps, result))
    if args.json:
        args.json.write_text(json.dumps({"steps": [
            {"meta": s["meta"], "problems": s["problems"], "other_device": s["other_device"],
             "counts": {r: {c: rec.get(c, 0) for c in COUNTS} for r, rec in s["ranks"].items()}}
            for s in steps], **result}, indent=1))
    return {"OK": 0, "FAILED": 1, "INCOMPLETE": 3}[result["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
