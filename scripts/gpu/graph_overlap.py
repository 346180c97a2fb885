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
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

# DOT's tokens: a quoted string (escapes kept), an HTML string <...> (nesting), an edge
# operator, a bracket, '=', ';', ',', braces, or a bare identifier or number. Comments dropped.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|->|--|[\[\]=;,{}]|[^\s\[\]=;,{}"<>-]+|-|<|>',
                    re.S)
_COMMENT = re.compile(r"/\*.*?\*/|^\s*(?://|#).*?$", re.S | re.M)


class Graph(NamedTuple):
    labels: dict[str, str]  # node id -> its label text
    children: dict[str, set[str]]
    parents: dict[str, set[str]]


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    text = _COMMENT.sub(" ", text)
    i = 0
    while i < len(text):
        if text[i] == "<":  # an HTML string: up to its matching '>'
            depth, j = 0, i
            while j < len(text):
                depth += {"<": 1, ">": -1}.get(text[j], 0)
                j += 1
                if depth == 0:
                    break
            out.append(text[i:j])
            i = j
            continue
        m = _TOKEN.match(text, i)
        if m is None:
            i += 1  # whitespace
            continue
        out.append(m.group(0))
        i = m.end()
    return out


def _text(token: str) -> str:
    if token.startswith('"') and token.endswith('"'):
        return re.sub(r'\\(.)', lambda m: "\n" if m.group(1) in "nlr" else m.group(1),
                      token[1:-1])
    if token.startswith("<") and token.endswith(">"):
        return token[1:-1]
    return token


def parse(text: str) -> Graph:
    """The nodes (with their labels) and edges of a DOT graph: any statement layout (with or
    without ';', attributes in any order, quoted, HTML or bare, brackets inside labels), as
    CUDA's cudaGraphDebugDotPrint writes it in each of its modes."""
    labels: dict[str, str] = {}
    children: dict[str, set[str]] = defaultdict(set)
    parents: dict[str, set[str]] = defaultdict(set)
    toks = _tokens(text)
    keywords = {"digraph", "graph", "subgraph", "node", "edge", "strict"}
    i = 0
    while i < len(toks):
        tok = toks[i]
        if tok in "{};," or tok.lower() in keywords or tok in ("]", "["):
            if tok == "[":  # attributes of graph/node/edge defaults: skipped
                while i < len(toks) and toks[i] != "]":
                    i += 1
            i += 1
            continue
        if i + 1 < len(toks) and toks[i + 1] == "=":  # a graph attribute (label="...")
            i += 3
            continue
        chain = [_text(tok)]  # a node, or the first of an edge chain a -> b -> c
        i += 1
        while i + 1 < len(toks) and toks[i] in ("->", "--"):
            chain.append(_text(toks[i + 1]))
            i += 2
        attrs: dict[str, str] = {}
        if i < len(toks) and toks[i] == "[":
            i += 1
            while i < len(toks) and toks[i] != "]":
                if i + 2 < len(toks) and toks[i + 1] == "=":
                    attrs[_text(toks[i]).lower()] = _text(toks[i + 2])
                    i += 3
                else:
                    i += 1
            i += 1
        for node in chain:
            labels.setdefault(node, "")
        if len(chain) == 1:
            labels[chain[0]] = attrs.get("label", " ".join(attrs.values()))
        for a, b in pairwise(chain):
            children[a].add(b)
            parents[b].add(a)
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


def report_files(argv: list[str], one: Callable[[Path], tuple[str, bool]], usage: str) -> int:
    """Print ``one(path)``'s text for every file named (``usage`` without any); 0 when each
    file had what it is read for, 1 otherwise, 2 without files (kernel_overlap.py too)."""
    if not argv:
        print(usage)
        return 2
    ok = True
    for p in argv:
        text, good = one(Path(p))
        print(text)
        ok &= good
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    return report_files(argv, report, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
