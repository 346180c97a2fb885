"""The engine's timeline: exact event accounting for known collectives, runtime start/stop,
and the statistics counters. Every rank writes its own file (``{rank}`` in the path)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from timeline import Span, check, load, pair


def _spans(path: Path) -> dict[str, list[Span]]:
    """tensor name -> its spans in begin order, paired by the timeline tools after ``check``
    passed on the file (valid JSON, proper nesting, every span ended)."""
    result = check.check_file(str(path))
    assert result.ok, result.errors
    spans: dict[str, list[Span]] = defaultdict(list)
    for span in pair(load(str(path))).spans:
        spans[span.track].append(span)
    for phases in spans.values():
        phases.sort(key=lambda s: (s.start, s.depth))
    return spans


def test_every_tensor_has_each_phase_once_in_order(hvd: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace_{rank}.json"
    hvd.start_timeline(str(path), mark_cycles=True)
    parts = [np.full(5, i, np.float32) for i in range(4)]
    hvd.grouped_allreduce(parts, name="tl.group", op=hvd.Sum)  # fused: copy phases
    hvd.allreduce(np.ones(3), name="tl.single", op=hvd.Sum)
    hvd.allgather(np.ones((2, 2)), name="tl.gather")
    hvd.broadcast(np.ones(2), 0, name="tl.bcast")
    hvd.barrier_async(name="tl.barrier").wait()
    hvd.stop_timeline()
    mine = Path(str(path).replace("{rank}", str(hvd.rank())))
    spans = _spans(mine)
    # Horovod's cycle marks: global instants on the process track.
    marks = [ev for ev in json.loads(mine.read_text()) if ev.get("name") == "CYCLE_START"]
    assert marks and all(m["ph"] == "i" and m["s"] == "g" for m in marks), marks
    # Horovod's layout: NEGOTIATE_<OP>, then a top-level <OP> span (the response type) holding
    # the activities; none for a barrier (as Horovod).
    fused = ["MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"]
    # A grouped call is one unit, reduced in its own result buffer: no copy out.
    want = {"tl.group": ("ALLREDUCE", fused[:-1]),
            "tl.single": ("ALLREDUCE", ["MPI_ALLREDUCE"]),
            "tl.gather": ("ALLGATHER", ["MPI_ALLGATHER"]),
            "tl.bcast": ("BROADCAST", ["MPI_BCAST"]),
            "tl.barrier": ("BARRIER", [])}
    assert set(spans) == set(want)
    for name, (op, activities) in want.items():
        got = spans[name]
        neg, rest = got[0], got[1:]
        assert neg.name == f"NEGOTIATE_{op}" and neg.depth == 0, (name, got)
        if op == "BARRIER":
            assert [s.name for s in rest] == ["QUEUE"] and rest[0].depth == 0, (name, got)
            continue
        top, inner = rest[0], rest[1:]
        assert top.name == op and top.depth == 0, (name, got)
        assert [s.name for s in inner] == ["QUEUE", *activities], (name, got)
        assert all(s.depth == 1 for s in inner), (name, got)
        assert abs(neg.end - top.start) < 1e-3 and abs(inner[0].start - top.start) < 1e-3
        assert abs(top.end - inner[-1].end) < 1e-3, (name, got)  # ends with its last activity
        for s0, s1 in zip(inner, inner[1:], strict=False):
            assert s0.end <= s1.start + 1e-3, (name, got)  # each phase ends before the next
        assert all(s.end >= s.start for s in got), (name, got)
    # The buffer each bucket could fill (QUEUE's end): the threshold when fused, else its size
    # (a grouped call's own: its payload).
    room = {name: got[2].end_args["threshold"] for name, got in spans.items()
            if name != "tl.barrier"}
    assert room["tl.group"] == 4 * 5 * 4 and room["tl.single"] == 3 * 8, room


def test_repeated_calls_nest_properly(hvd: Any, tmp_path: Path) -> None:
    """A name called again as soon as its handle completes: its next negotiation begins
    after its top-level span ended (check passes, every span once per call)."""
    path = tmp_path / "again_{rank}.json"
    hvd.start_timeline(str(path))
    for _ in range(30):
        hvd.allreduce(np.ones(4), name="tl.again")
        hvd.allreduce_async(np.ones(4), name="tl.again.async").wait()
    hvd.stop_timeline()
    spans = _spans(Path(str(path).replace("{rank}", str(hvd.rank()))))
    for name in ("tl.again", "tl.again.async"):
        names = [s.name for s in spans[name]]
        assert names.count("ALLREDUCE") == names.count("NEGOTIATE_ALLREDUCE") == 30, names


def test_runtime_start_stop(hvd: Any, tmp_path: Path) -> None:
    first, second = tmp_path / "a_{rank}.json", tmp_path / "b_{rank}.json"
    hvd.start_timeline(str(first))
    hvd.allreduce(np.ones(2), name="tl.before")
    hvd.stop_timeline()
    hvd.allreduce(np.ones(2), name="tl.between")  # not traced
    hvd.start_timeline(str(second))
    hvd.allreduce(np.ones(2), name="tl.after")
    hvd.stop_timeline()
    me = str(hvd.rank())
    a = _spans(Path(str(first).replace("{rank}", me)))
    b = _spans(Path(str(second).replace("{rank}", me)))
    assert set(a) == {"tl.before"} and set(b) == {"tl.after"}


def test_stats_count_operations(hvd: Any) -> None:
    before = hvd.stats()["ops"].get("allreduce", {}).get("count", 0)
    for _ in range(5):
        hvd.allreduce(np.ones(8, np.float32), name="stats.x")
    snap = hvd.stats()
    ops = snap["ops"]["allreduce"]
    assert ops["count"] == before + 5
    assert ops["latency_p50_s"] > 0 and ops["latency_p99_s"] >= ops["latency_p50_s"]
    assert 0.0 <= snap["cache"]["hit_rate"] <= 1.0
    neg = snap["negotiation"]
    assert neg["count"] >= 1 and neg["max_s"] > 0
    time.sleep(0.1)  # the loops keep cycling while idle; those rounds carry no work
    assert hvd.stats()["negotiation"]["count"] == neg["count"]


def test_rotated_files_are_bounded_by_timeline_max_files(restart: Any, tmp_path: Path) -> None:
    """A long job's capped timeline stays bounded on disk: past ``timeline_max_files`` rotated
    files the oldest go, and every file kept is a whole trace."""
    hvd = restart(timeline_max_bytes=4096, timeline_max_files=2)
    path = tmp_path / "rot_{rank}.json"
    hvd.start_timeline(str(path))
    for i in range(300):
        hvd.allreduce(np.ones(2), name=f"rot.{i % 7}", op=hvd.Sum)
    hvd.stop_timeline()
    mine = Path(str(path).replace("{rank}", str(hvd.rank())))
    kept = sorted(p.name for p in tmp_path.glob(mine.name + "*"))
    assert kept == [mine.name, f"{mine.name}.1", f"{mine.name}.2"], kept
    for p in tmp_path.glob(mine.name + "*"):
        result = check.check_file(str(p))
        assert result.ok, (p, result.errors)
        assert p.stat().st_size <= 4096
