"""Which kernels of a captured step each NCCL kernel may overlap, from the graph's structure.

Reads a CUDA graph written as Graphviz DOT (``hvd.make_graphed_step(..., debug_dump=PATH)``,
or torch's ``CUDAGraph.debug_dump`` after ``enable_debug_mode()``; ``bench_t1.py
--graph-dump DIR`` writes one per captured variant) and prints, for every kernel node whose
label names NCCL, how many other kernel nodes are *concurrent* with it: neither its ancestors
(they must finish first) nor its descendants (they wait for it). A bucket's allreduce that can
overlap backward has the backward kernels launched after its READY event as concurrent nodes;
one that the graph serialises after backward has none, whatever the hardware does. So it
separates "the graph forbids the overlap" from "the GPU does not overlap what the graph
allows" (SMs, stream priorities).

    python3 scripts/gpu/graph_overlap.py step.dot [more.dot ...]

Exit status 0 when every file was read and has at least one NCCL kernel; 1 otherwise.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

_NODE = re.compile(r'"([^"]+)"\s*\[(.*?)\]\s*;', re.S)
_EDGE = re.compile(r'"([^"]+)"\s*->\s*"([^"]+)"')
_LABEL = re.compile(r'label\s*=\s*"((?:[^"\\]|\\.)*)"', re.S)


class Graph(NamedTuple):
    labels: dict[str, str]  # node id -> its label text
    children: dict[str, set[str]]
    parents: dict[str, set[str]]


def parse(text: str) -> Graph:
    """The nodes (with their labels) and edges of a DOT graph as CUDA prints it."""
    labels: dict[str, str] = {}
    for node, attrs in _NODE.findall(text):
        found = _LABEL.search(attrs)
        labels[node] = found.group(1) if found else attrs
    children: dict[str, set[str]] = defaultdict(set)
    parents: dict[str, set[str]] = defaultdict(set)
    for a, b in _EDGE.findall(text):
        children[a].add(b)
        parents[b].add(a)
        labels.setdefault(a, "")
        labels.setdefault(b, "")
    return Graph(labels, children, parents)


def _reach(start: str, links: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    todo = list(links.get(start, ()))
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(links.get(n, ()))
    return seen


def is_kernel(label: str) -> bool:
    return "KERNEL" in label.upper()


def is_nccl(label: str) -> bool:
    return is_kernel(label) and "nccl" in label.lower()


def overlap(graph: Graph) -> list[tuple[str, int, int, int]]:
    """Per NCCL kernel node, in node order: (node, kernels concurrent with it, kernels before
    it, kernels after it); kernels counted are the non-NCCL ones."""
    kernels = {n for n, lab in graph.labels.items() if is_kernel(lab) and not is_nccl(lab)}
    rows = []
    for node in sorted((n for n, lab in graph.labels.items() if is_nccl(lab)),
                       key=_order):
        before = _reach(node, graph.parents) & kernels
        after = _reach(node, graph.children) & kernels
        rows.append((node, len(kernels - before - after), len(before), len(after)))
    return rows


def _order(node: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", node)) or (0,)


def report(path: Path) -> tuple[str, bool]:
    """One file's table, and whether it had an NCCL kernel to look at."""
    try:
        graph = parse(path.read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        return f"== {path}: UNREADABLE ({exc})", False
    rows = overlap(graph)
    kernels = sum(1 for lab in graph.labels.values() if is_kernel(lab))
    head = (f"== {path}: {len(graph.labels)} nodes, {kernels} kernels, {len(rows)} NCCL "
            "kernels")
    if not rows:
        return head + " (none: nothing to look at)", False
    lines = [head, f"{'NCCL node':<24} {'concurrent':>10} {'before':>8} {'after':>8}"]
    lines += [f"{n:<24} {c:>10} {b:>8} {a:>8}" for n, c, b, a in rows]
    return "\n".join(lines), True


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    ok = True
    for p in argv:
        text, good = report(Path(p))
        print(text)
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
