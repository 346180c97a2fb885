"""scripts/gpu/graph_overlap.py on DOT text of the shape CUDA's cudaGraphDebugDotPrint writes:
which kernels an NCCL kernel node may overlap, from the graph's dependencies alone."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

import graph_overlap  # noqa: E402


def _node(i: int, kind: str, name: str) -> str:
    return (f'"graph_0_node_{i}"[style="solid" shape="rectangle" label="{i}\n{kind}\n'
            f'ID | {i} | {name}\ngrid | (1,1,1)"];\n')


def _dot(nodes: list[str], edges: list[tuple[int, int]]) -> str:
    body = "".join(nodes) + "".join(f'"graph_0_node_{a}" -> "graph_0_node_{b}";\n'
                                    for a, b in edges)
    return f'digraph dot {{\nsubgraph cluster_0 {{\nlabel="graph_0";\n{body}}}\n}}\n'


def test_a_forked_allreduce_overlaps_the_kernels_after_its_fork() -> None:
    # backward b0 -> b1 -> b2 -> b3 -> step; the bucket's copy forks after b1 (its READY),
    # its NCCL kernel runs beside b2 and b3, and the step joins it.
    nodes = [_node(0, "KERNEL", "b0"), _node(1, "KERNEL", "b1"), _node(2, "KERNEL", "b2"),
             _node(3, "KERNEL", "b3"), _node(4, "EVENT_RECORD", "ready"),
             _node(5, "KERNEL", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
             _node(6, "KERNEL", "sgd_step")]
    edges = [(0, 1), (1, 2), (2, 3), (3, 6), (1, 4), (4, 5), (5, 6)]
    graph = graph_overlap.parse(_dot(nodes, edges))
    assert graph_overlap.overlap(graph) == [("graph_0_node_5", 2, 2, 1)]


def test_an_allreduce_after_backward_overlaps_nothing(tmp_path: Path) -> None:
    nodes = [_node(0, "KERNEL", "b0"), _node(1, "KERNEL", "b1"),
             _node(2, "KERNEL", "ncclDevKernel_AllReduce"), _node(3, "KERNEL", "sgd_step")]
    path = tmp_path / "flat.dot"
    path.write_text(_dot(nodes, [(0, 1), (1, 2), (2, 3)]))
    text, ok = graph_overlap.report(path)
    assert ok and "graph_0_node_2" in text
    assert graph_overlap.overlap(graph_overlap.parse(path.read_text())) == [
        ("graph_0_node_2", 0, 2, 1)]


def test_a_graph_without_nccl_or_a_missing_file_is_said(tmp_path: Path) -> None:
    path = tmp_path / "plain.dot"
    path.write_text(_dot([_node(0, "KERNEL", "b0")], []))
    assert graph_overlap.main([str(path), str(tmp_path / "gone.dot")]) == 1


def test_any_statement_layout_is_read() -> None:
    # No semicolons, brackets and escaped quotes inside record labels, an HTML label, an edge
    # chain, comments, graph attributes: the same graph as the forked case above.
    text = """digraph dot {
    // cudaGraphDebugDotPrint, verbose
    subgraph cluster_1 { label="graph_1" graph[style="dashed"]
    "n0"[shape="record" label="{KERNEL | {ID | 0} | {fn | void k0<float>(a[2], \\"x\\")}}"]
    "n1" [label=<<b>KERNEL</b> b1>]
    "n2"[label="{KERNEL|b2}"] "n3"[label="{KERNEL|b3}"]
    "n4"[label="{EVENT_RECORD|ready}"]
    "n5"[label="{KERNEL|{fn|_Z23ncclDevKernel_AllReduce_Sum_f32_RING_LLP12ncclDevComm}}"]
    "n6"[label="{KERNEL|sgd}"]
    "n0" -> "n1" -> "n2" -> "n3" -> "n6"  /* backward, then the step */
    "n1" -> "n4"; "n4" -> "n5"
    "n5" -> "n6"
    }}
    """
    graph = graph_overlap.parse(text)
    assert graph_overlap.overlap(graph) == [("n5", 2, 2, 1)]
    assert "k0<float>(a[2]" in graph.labels["n0"]


def _record(i: int, fn: str) -> str:
    # The layout cudaGraphDebugDotPrint (CUDA 13, verbose) writes: a record label over several
    # lines, escaped launch brackets, a node handle table; edges carry attributes of their own
    # (the first parser took those for nodes and found no NCCL kernel: gpu-validation run 80).
    return (f'"graph_4_node_{i}"[style="bold" shape="record" label="{{KERNEL\n'
            f'| {{ID | {i} (topoId: {9 - i}) | {fn}\\<\\<\\<24,544,82240\\>\\>\\>}}\n'
            '| {{node handle | func handle} | {0x00000000510E77B8 | 0x000000003565F660}}\n'
            '| {cooperative | 0}\n| {priority | 0}\n}"];\n\n')


def test_cudas_record_layout_is_read() -> None:
    nccl = "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE"
    body = "".join(_record(i, nccl if i == 2 else f"_ZN2at6native6kernel{i}Ev")
                    for i in range(5))
    edges = "".join(f'"graph_4_node_{a}" -> "graph_4_node_{b}" [headlabel=0];\n'
                    for a, b in [(0, 1), (1, 2), (1, 3), (3, 4), (2, 4)])
    text = (f'digraph dot {{\nsubgraph cluster_4 {{\nlabel="graph_4" graph[style="dashed"];\n'
            f"{body}{edges}}}\n}}\n")
    graph = graph_overlap.parse(text)
    assert sum(map(graph_overlap.is_kernel, graph.labels.values())) == 5
    assert graph_overlap.overlap(graph) == [("graph_4_node_2", 1, 2, 1)]
