"""Scaling on one machine (issue 41): images/s per GPU of each T1/T5 variant at every rank
count, from ``bench_t1.py --json`` files of the same model at 1, 2, 4 (8) GPUs, and each
figure against the same variant at the smallest rank count given (and at 2 GPUs, where the
issue's captured-step target is set: >= 0.97x its 2-GPU figure at 4 GPUs on ResNet-50).

    python3 scripts/gpu/scaling.py OUT/t1_resnet50_np1.json OUT/t1_resnet50_np2.json ...

Files of several models may be given together: one table per model. A file that is missing
or unreadable is named, not fatal. Variants without communication (the model alone) are shown
for reference: their figure per GPU should not move with the rank count.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(paths: list[str]) -> tuple[dict[str, dict[int, dict[str, Any]]], list[str]]:
    """Per model, per rank count, the file's meta and training results; and problems."""
    runs: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    problems = []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
            meta, training = data["meta"], data["results"]["training"]
            model, ranks = meta["args"]["model"], int(meta["ranks"])
        except FileNotFoundError:
            problems.append(f"{p}: MISSING")
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"{p}: UNREADABLE ({exc!r})")
            continue
        if ranks in runs[model]:
            problems.append(f"{p}: a second {model} file at {ranks} ranks (kept the first)")
            continue
        runs[model][ranks] = {"meta": meta, "training": training, "path": p}
    return runs, problems


def table(model: str, by_ranks: dict[int, dict[str, Any]]) -> list[str]:
    counts = sorted(by_ranks)
    base = counts[0]
    variants: list[str] = []
    for n in counts:
        variants += [v for v in by_ranks[n]["training"] if v not in variants]
    head = ["variant"] + [f"{n} GPU{'s' if n > 1 else ''}" for n in counts]
    rows = []
    for v in variants:
        cells = [v]
        for n in counts:
            t = by_ranks[n]["training"].get(v)
            if t is None:
                cells.append("-")
                continue
            ips = float(t["images_per_s_per_gpu"])
            ref = by_ranks[base]["training"].get(v)
            two = by_ranks.get(2, {}).get("training", {}).get(v)
            note = []
            if ref is not None and n != base:
                note.append(f"{ips / float(ref['images_per_s_per_gpu']):.3f}x {base}")
            if two is not None and n not in (2, base):
                note.append(f"{ips / float(two['images_per_s_per_gpu']):.3f}x 2")
            cells.append(f"{ips:.0f}" + (f" ({', '.join(note)})" if note else ""))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    out = [f"== {model}: images/s per GPU (per file: {', '.join(str(n) for n in counts)} "
           f"ranks; commits {sorted({by_ranks[n]['meta'].get('git_commit') for n in counts})})"]
    for r in [head, ["-" * w for w in widths], *rows]:
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    runs, problems = load(argv)
    for model, by_ranks in runs.items():
        print("\n".join(table(model, by_ranks)))
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
