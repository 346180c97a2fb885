"""timeline/ tools (check, summarize, merge, plot) on traces written by the real writer."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs_util import clean_env, mpiexec, run_group, under_mpi_launcher

from hvdlite._observe.timeline import Timeline
from timeline import Span, check, load, merge, pair, plot, summarize
from timeline import __main__ as cli

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
TENSORS = [f"grad.{i}" for i in range(4)]
NBYTES = [1024 * (i + 1) for i in range(4)]
THRESHOLD = 16384
STEPS = 5


def _comm_us(step: int, i: int) -> float:
    return 20.0 + step + i


def write_rank(path: Path, rank: int, *, offset_us: float | None = None, compute: bool = True,
               max_bytes: int = 0) -> None:
    """STEPS fused allreduces of TENSORS with known timestamps (see the expectations below).

    Per step s at b = 1000 s: NEGOTIATE [b, b+10], on rank 0 with ready ticks of ranks 0 and 1
    at b+2 and b+5 (the even tensors' last rank is 1, the odd ones' 0), QUEUE [b+10, b+12],
    MEMCPY_IN [b+12, b+15], MPI_ALLREDUCE [b+15, b+15+20+s+i], MEMCPY_OUT 2 us after the
    longest allreduce, COMPUTE [b, b+30] on its own track.
    """
    tl = Timeline(str(path), rank, max_bytes=max_bytes, flush_interval_s=30.0)
    if offset_us is not None:
        tl.instant(None, "clock_offset", {"offset_us": offset_us}, ts_us=0.0)
    for s in range(STEPS):
        b = 1000.0 * s
        if compute:
            tl.begin("compute", "COMPUTE", ts_us=b)
        for i, name in enumerate(TENSORS):
            tl.begin(name, "NEGOTIATE_ALLREDUCE", {"bytes": NBYTES[i], "dtype": "float32",
                                                   "shape": [NBYTES[i] // 4]}, ts_us=b)
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for k, r in enumerate(order if rank == 0 else ()):  # the coordinator's ticks
                tl.instant(name, f"RANK_{r}_READY", {"rank": r}, ts_us=b + 2 + 3 * k)
            tl.end(name, "NEGOTIATE_ALLREDUCE", ts_us=b + 10)
        tl.begin_all(TENSORS, "QUEUE", ts_us=b + 10)
        tl.end_all(TENSORS, "QUEUE", ts_us=b + 12)
        tl.begin_all(TENSORS, "MEMCPY_IN_FUSION_BUFFER", {"bucket": s}, ts_us=b + 12)
        tl.end_all(TENSORS, "MEMCPY_IN_FUSION_BUFFER", ts_us=b + 15)
        for i, name in enumerate(TENSORS):
            tl.begin(name, "MPI_ALLREDUCE", {"bytes": NBYTES[i], "bucket": s,
                                             "threshold": THRESHOLD}, ts_us=b + 15)
        if compute:
            tl.end("compute", "COMPUTE", ts_us=b + 30)
        for i, name in enumerate(TENSORS):
            tl.end(name, "MPI_ALLREDUCE", ts_us=b + 15 + _comm_us(s, i))
        out = b + 15 + _comm_us(s, 3)
        tl.begin_all(TENSORS, "MEMCPY_OUT_FUSION_BUFFER", ts_us=out)
        tl.end_all(TENSORS, "MEMCPY_OUT_FUSION_BUFFER", ts_us=out + 2)
        tl.flush()
    tl.close()


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


@pytest.fixture
def two_ranks(tmp_path: Path) -> list[Path]:
    paths = [tmp_path / "r0.json", tmp_path / "r1.json"]
    write_rank(paths[0], 0, offset_us=0.0)
    write_rank(paths[1], 1, offset_us=250.0, compute=False)
    return paths


# ---------------------------------------------------------------- check

def test_check_accepts_writer_traces(two_ranks: list[Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([str(p) for p in two_ranks]) == 0
    out = capsys.readouterr().out
    assert out.count(": OK:") == 2 and "error" not in out
    res = check.check_file(str(two_ranks[0]))
    # 5 steps x 4 tensors x 5 phases + 5 COMPUTE spans; 5 x 4 x 2 ticks + the clock_offset
    assert res.stats["spans"] == STEPS * 4 * 5 + STEPS
    assert res.stats["instants"] == STEPS * 4 * 2 + 1
    assert res.stats["tracks"] == 5


def _write_raw(tmp_path: Path, events: list[dict[str, Any]], name: str = "bad.json") -> str:
    path = tmp_path / name
    head = [{"name": "clock_sync", "ph": "M", "pid": 0, "tid": 0,
             "args": {"wall_time_ns": 0, "perf_counter_us": 0.0}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "t"}},
            {"name": "trace_end", "ph": "M", "pid": 0, "tid": 0, "args": {"dropped": 0}}]
    path.write_text(json.dumps(head + events))
    return str(path)


def _ev(ph: str, name: str, ts: float, **extra: Any) -> dict[str, Any]:
    return {"name": name, "ph": ph, "ts": ts, "pid": 0, "tid": 1, **extra}


@pytest.mark.parametrize("events,message", [
    ([_ev("E", "QUEUE", 1.0)], "E with no open B"),
    ([_ev("B", "A", 1.0), _ev("B", "B", 2.0), _ev("E", "A", 3.0), _ev("E", "B", 4.0)],
     "improper nesting: E 'A' while 'B'"),
    ([_ev("B", "A", 5.0), _ev("E", "A", 4.0)], "negative duration"),
    ([_ev("X", "A", 5.0, dur=-1.0)], "non-negative 'dur'"),
    ([_ev("B", "A", 1.0)], "B never ended"),
    ([_ev("B", "A", 1.0), _ev("E", "A", 5.0), _ev("X", "B", 3.0, dur=4.0)],
     "overlaps 'A' [1.000, 5.000] without nesting"),
    ([{"name": "A", "ph": "B", "pid": 0, "tid": 1}], "needs numeric 'ts'"),
])
def test_check_reports_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                events: list[dict[str, Any]], message: str) -> None:
    path = _write_raw(tmp_path, events)
    assert check.main([path]) == 1
    out = capsys.readouterr().out
    assert message in out and "FAILED" in out


def test_check_lenient_accepts_open_spans_strict_does_not(tmp_path: Path) -> None:
    path = _write_raw(tmp_path, [_ev("B", "A", 1.0)])
    assert not check.check_file(path).ok
    res = check.check_file(path, lenient=True)
    assert res.ok and any("B never ended" in w for w in res.warnings)


def test_check_truncated_tail(two_ranks: list[Path], tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    text = two_ranks[0].read_text()
    cut = tmp_path / "cut.json"
    # Inside a record (a few bytes into one), closing bracket gone: wherever 2/3 falls.
    cut.write_text(text[: text.index("{", len(text) * 2 // 3) + 5])
    assert check.main([str(cut)]) == 1
    assert "not valid JSON" in capsys.readouterr().out
    assert check.main(["--lenient", str(cut)]) == 0
    out = capsys.readouterr().out
    assert "truncated: tail cut at byte" in out and "no trace_end record" in out
    trace = load(str(cut), lenient=True)
    full = json.loads(text)
    assert 0 < len(trace.events) < len(full) and trace.events == full[: len(trace.events)]


def test_check_unreadable_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = tmp_path / "obj.json"
    obj.write_text('{"foo": 1}')
    assert check.main([str(obj), str(tmp_path / "missing.json")]) == 1
    out = capsys.readouterr().out
    assert "expected a JSON array" in out and "cannot read" in out


def test_check_object_form_and_dropped_warning(tmp_path: Path) -> None:
    path = tmp_path / "obj.json"
    path.write_text(json.dumps({"traceEvents": [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "t"}},
        {"name": "trace_end", "ph": "M", "pid": 0, "tid": 0, "args": {"dropped": 12}},
        _ev("B", "A", 1.0), _ev("E", "A", 2.0)]}))
    res = check.check_file(str(path))
    assert res.ok and res.stats["spans"] == 1
    assert any("dropped 12 events" in w for w in res.warnings)
    assert any("no clock_sync" in w for w in res.warnings)


# ---------------------------------------------------------------- summarize

def test_summarize_exact_figures(two_ranks: list[Path]) -> None:
    rep = summarize.summarize([load(str(p)) for p in two_ranks])
    comm = [_comm_us(s, i) for s in range(STEPS) for i in range(4)]
    ar = rep["phases"]["MPI_ALLREDUCE"]
    assert ar["count"] == 2 * STEPS * 4
    assert ar["total_us"] == pytest.approx(2 * sum(comm))
    assert ar["p99_us"] == _nearest_rank(comm * 2, 99) and ar["max_us"] == max(comm)
    assert ar["bytes"] == 2 * STEPS * sum(NBYTES)
    for phase, dur in (("NEGOTIATE_ALLREDUCE", 10.0), ("QUEUE", 2.0),
                       ("MEMCPY_IN_FUSION_BUFFER", 3.0), ("MEMCPY_OUT_FUSION_BUFFER", 2.0)):
        st = rep["phases"][phase]
        assert (st["count"], st["mean_us"], st["p99_us"]) == (2 * STEPS * 4, dur, dur), phase
    assert rep["phases"]["COMPUTE"]["count"] == STEPS  # rank 0 only
    per = rep["tensors"]["grad.2"]["MPI_ALLREDUCE"]
    assert per["count"] == 2 * STEPS and per["bytes"] == 2 * STEPS * NBYTES[2]
    assert per["total_us"] == pytest.approx(2 * sum(_comm_us(s, 2) for s in range(STEPS)))
    assert set(rep["tensors"]) == {*TENSORS, "compute"}
    neg = rep["negotiation"]
    assert set(neg) == set(TENSORS)
    assert neg["grad.0"]["count"] == 2 * STEPS and neg["grad.0"]["mean_us"] == 10.0
    assert neg["grad.0"]["skew_mean_us"] == 3.0  # ticks only on rank 0's trace
    assert neg["grad.0"]["last_ready"] == {"1": STEPS} and neg["grad.0"]["cache_hits"] == 0
    assert neg["grad.1"]["last_ready"] == {"0": STEPS}
    fus = rep["fusion"]
    assert fus["threshold_bytes"] == THRESHOLD
    assert fus["by_phase"] == {"MPI_ALLREDUCE": {
        "buckets": 2 * STEPS,  # bucket ids are per rank
        "tensors_per_bucket_mean": 4.0, "payload_bytes_mean": sum(NBYTES),
        "efficiency_mean": sum(NBYTES) / THRESHOLD}}
    longest = [_comm_us(s, 3) for s in range(STEPS)]
    r0, r1 = rep["communication"]["0"], rep["communication"]["1"]
    assert r0["comm_busy_us"] == pytest.approx(sum(longest))
    assert r0["compute_us"] == pytest.approx(30.0 * STEPS)
    assert r0["overlapped_us"] == pytest.approx(15.0 * STEPS)  # COMPUTE ends at b+30
    assert r0["exposed_us"] == pytest.approx(sum(longest) - 15.0 * STEPS)
    assert r0["wall_us"] == pytest.approx(1000.0 * (STEPS - 1) + 15 + longest[-1] + 2)
    assert r1["comm_busy_us"] == pytest.approx(sum(longest))
    assert r1["compute_us"] is None and r1["overlapped_us"] is None
    assert rep["dropped_events"] == 0 and rep["unpaired_events"] == 0


def test_summarize_cli_text_and_json(two_ranks: list[Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert summarize.main([str(p) for p in two_ranks]) == 0
    text = capsys.readouterr().out
    for needle in ("== per phase", "== per tensor (5 of 5", "== negotiation wait",
                   "== fusion (threshold 16.0KiB)", "62.5%", "== communication", "overlap unknown",
                   "grad.3", "r1:5"):
        assert needle in text, needle
    assert summarize.main(["--json", "--top", "1", str(two_ranks[0])]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["phases"]["QUEUE"]["count"] == STEPS * 4 and rep["files"] == [str(two_ranks[0])]


def test_summarize_joins_rotated_segments(tmp_path: Path) -> None:
    whole = tmp_path / "whole.json"
    rot = tmp_path / "rot.json"
    write_rank(whole, 0)
    write_rank(rot, 0, max_bytes=4000)
    segments = sorted(tmp_path.glob("rot.json*"))
    assert len(segments) >= 3
    a = summarize.summarize([load(str(whole))])
    b = summarize.summarize([load(str(p)) for p in segments])
    assert b["phases"] == a["phases"] and b["tensors"] == a["tensors"]
    assert b["communication"] == a["communication"] and b["fusion"] == a["fusion"]


def test_summarize_dropped_counts_each_process_once(tmp_path: Path) -> None:
    """trace_end carries a running total, repeated in every rotated segment: the report takes
    each process's largest, not their sum."""
    paths = []
    for name, pid, dropped in (("a.json", 0, 5), ("a.json.1", 0, 9), ("b.json", 1, 2)):
        path = tmp_path / name
        path.write_text(json.dumps([{"name": "trace_end", "ph": "M", "pid": pid, "tid": 0,
                                     "args": {"dropped": dropped}}]))
        paths.append(load(str(path)))
    assert summarize.summarize(paths)["dropped_events"] == 9 + 2


def write_engine_shaped(path: Path) -> None:
    """The engine's layout: bucket id on QUEUE's E, the bucket's wire bytes on the collective
    (the same args for every tensor), cache-hit ticks instead of ready ticks on a cached round."""
    sizes = {"a": 400, "b": 600}
    names = list(sizes)
    tl = Timeline(str(path), 0)
    for step in range(2):
        b = 100.0 * step
        for n, nbytes in sizes.items():
            tl.begin(n, "NEGOTIATE_ALLREDUCE", {"dtype": "float32", "shape": [nbytes // 4],
                                                "bytes": nbytes}, ts_us=b)
            if step == 0:
                tl.instant(n, "RANK_0_READY", {"rank": 0}, ts_us=b + 1)
                tl.instant(n, "RANK_1_READY", {"rank": 1}, ts_us=b + 4)
            else:
                tl.instant(n, "CACHE_HIT", {"rank": 0}, ts_us=b + 1)
            tl.end(n, "NEGOTIATE_ALLREDUCE", ts_us=b + 5)
            tl.begin(n, "QUEUE", ts_us=b + 5)
        tl.end_all(names, "QUEUE", {"bucket": step}, ts_us=b + 6)
        for phase, t0, t1, args in (("MEMCPY_IN_FUSION_BUFFER", 6, 7, None),
                                    ("MPI_ALLREDUCE", 7, 17, {"bytes": 1000}),
                                    ("MEMCPY_OUT_FUSION_BUFFER", 17, 18, None)):
            tl.begin_all(names, phase, args, ts_us=b + t0)
            tl.end_all(names, phase, ts_us=b + t1)
    tl.close()


def test_summarize_engine_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "engine.json"
    write_engine_shaped(path)
    assert check.check_file(str(path)).ok
    assert summarize.main(["--json", "--threshold", "4000", str(path)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["phases"]["MPI_ALLREDUCE"]["bytes"] == 2000  # payload, not 2 x the wire bytes
    assert rep["phases"]["QUEUE"]["bytes"] == 2000
    assert rep["tensors"]["a"]["MPI_ALLREDUCE"]["bytes"] == 800
    assert rep["tensors"]["b"]["MEMCPY_OUT_FUSION_BUFFER"]["bytes"] == 1200
    assert rep["fusion"] == {"threshold_bytes": 4000, "by_phase": {"MPI_ALLREDUCE": {
        "buckets": 2, "tensors_per_bucket_mean": 2.0, "payload_bytes_mean": 1000.0,
        "efficiency_mean": 0.25}}}
    neg = rep["negotiation"]["a"]
    assert (neg["count"], neg["cache_hits"], neg["last_ready"], neg["skew_mean_us"]) == (
        2, 1, {"1": 1}, 3.0)


def test_summarize_attributes_device_tracks(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Event-timed device spans (track "X [device]", complete events written after DONE, even
    after X's next negotiation began) take X's payload and bucket of the submission they ran
    for, not those of whatever X negotiates next."""
    path = tmp_path / "dev.json"
    tl = Timeline(str(path), 0)
    for step, nbytes in enumerate((400, 800)):
        b = 100.0 * step
        tl.begin("x", "NEGOTIATE_ALLREDUCE", {"bytes": nbytes}, ts_us=b)
        tl.end("x", "NEGOTIATE_ALLREDUCE", ts_us=b + 5)
        tl.begin("x", "QUEUE", ts_us=b + 5)
        tl.end("x", "QUEUE", {"bucket": 10 + step}, ts_us=b + 6)
    for step in range(2):  # written late, as the finalizer does
        tl.complete("x [device]", "NCCL_ALLREDUCE", 100.0 * step + 7, 20.0)
    tl.close()
    assert check.check_file(str(path)).ok
    assert summarize.main(["--json", str(path)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["tensors"]["x [device]"]["NCCL_ALLREDUCE"]["bytes"] == 1200
    assert rep["phases"]["NCCL_ALLREDUCE"] == rep["tensors"]["x [device]"]["NCCL_ALLREDUCE"]
    spans = pair(load(str(path))).spans
    summarize.attribute(spans)
    buckets = sorted(s.bucket for s in spans if s.track == "x [device]")
    assert buckets == [10, 11]


@pytest.mark.parametrize("text,value", [("65536", 65536), ("64MiB", 64 << 20),
                                        ("1.5 KB", 1500), ("2gib", 2 << 30)])
def test_parse_size(text: str, value: int) -> None:
    assert summarize.parse_size(text) == value


@pytest.mark.parametrize("text", ["64M", "64MiB", "64MB", "4k", "1G", "1.5 KB", "512"])
def test_parse_size_agrees_with_the_engine(text: str) -> None:
    """--threshold means what fusion_threshold means (the tools copy the engine's units)."""
    from hvdlite.config import parse_size as engine_parse_size

    assert summarize.parse_size(text) == engine_parse_size(text)


def test_parse_size_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        summarize.parse_size("64 parsecs")


# ---------------------------------------------------------------- merge

def _timed_by_track(events: list[dict[str, Any]]) -> dict[tuple[int, str], list[tuple[str, str,
                                                                                    float]]]:
    names = {(ev["pid"], ev["tid"]): ev["args"]["name"] for ev in events
             if ev["ph"] == "M" and ev["name"] == "thread_name"}
    out: dict[tuple[int, str], list[tuple[str, str, float]]] = {}
    for ev in events:
        if ev["ph"] != "M":
            out.setdefault((ev["pid"], names[(ev["pid"], ev["tid"])]), []).append(
                (ev["ph"], ev["name"], ev["ts"]))
    return out


def test_merge_aligns_by_clock_offset(two_ranks: list[Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "merged.json"
    assert merge.main([str(out), str(two_ranks[1]), str(two_ranks[0])]) == 0
    assert "aligned by offset" in capsys.readouterr().out
    merged = json.loads(out.read_text())
    info = merged[0]
    assert info["name"] == "merged" and info["args"]["aligned_by"] == "offset"
    assert info["args"]["base_us"] == 0.0  # rank 0's clock_offset instant at ts 0
    orig = {**_timed_by_track(json.loads(two_ranks[0].read_text())),
            **{k: [(ph, n, ts + 250.0) for ph, n, ts in v]
               for k, v in _timed_by_track(json.loads(two_ranks[1].read_text())).items()}}
    assert _timed_by_track(merged) == orig
    assert check.check_file(str(out)).ok
    assert {ev["pid"] for ev in merged if ev["ph"] != "M"} == {0, 1}
    a = summarize.summarize([load(str(p)) for p in two_ranks])
    b = summarize.summarize([load(str(out))])
    assert b["phases"] == a["phases"] and b["negotiation"] == a["negotiation"]


def _set_clock(path: Path, wall_ns: int, perf_us: float) -> None:
    events = json.loads(path.read_text())
    for ev in events:
        if ev["name"] == "clock_sync":
            ev["args"].update(wall_time_ns=wall_ns, perf_counter_us=perf_us)
    path.write_text(json.dumps(events))


def test_merge_aligns_by_wall_clock(tmp_path: Path) -> None:
    paths = [tmp_path / "r0.json", tmp_path / "r1.json"]
    write_rank(paths[0], 0)
    write_rank(paths[1], 1)
    _set_clock(paths[0], 2_000_000_000, 1000.0)   # perf 0 = wall 1_999_000 us
    _set_clock(paths[1], 2_000_500_000, 3000.0)   # perf 0 = wall 1_997_500 us
    out = tmp_path / "m.json"
    assert merge.main([str(out), *map(str, paths)]) == 0
    merged = json.loads(out.read_text())
    assert merged[0]["args"]["aligned_by"] == "wall"
    base = 1_997_500.0  # rank 1's first event (ts 0) is the earliest
    expect = {**{k: [(ph, n, ts + 1_999_000 - base) for ph, n, ts in v]
                 for k, v in _timed_by_track(json.loads(paths[0].read_text())).items()},
              **{k: [(ph, n, ts + 1_997_500 - base) for ph, n, ts in v]
                 for k, v in _timed_by_track(json.loads(paths[1].read_text())).items()}}
    assert _timed_by_track(merged) == expect
    syncs = [ev["args"] for ev in merged if ev["name"] == "clock_sync"]
    assert [s["wall_time_ns"] / 1000 - s["perf_counter_us"] for s in syncs] == [base, base]


def test_merge_alignment_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_rank(a, 0, offset_us=0.0)
    write_rank(b, 1)
    assert merge.main([str(tmp_path / "m.json"), "--align", "offset", str(a), str(b)]) == 1
    assert "no clock_offset event for rank(s) [1]" in capsys.readouterr().err
    assert merge.main([str(tmp_path / "m.json"), str(a), str(b)]) == 0
    assert "aligned by wall" in capsys.readouterr().out
    events = json.loads(b.read_text())
    b.write_text(json.dumps([ev for ev in events if ev["name"] != "clock_sync"]))
    assert merge.main([str(tmp_path / "m.json"), str(a), str(b)]) == 1
    assert "no clock_sync metadata" in capsys.readouterr().err
    assert merge.main([str(tmp_path / "m.json"), "--align", "none", str(a), str(b)]) == 0


def test_merge_rotated_segments_share_tracks(tmp_path: Path) -> None:
    write_rank(tmp_path / "r0.json", 0, offset_us=0.0, max_bytes=4000)
    segments = sorted(tmp_path.glob("r0.json*"))
    assert len(segments) >= 3
    out = tmp_path / "m.json"
    assert merge.main([str(out), *map(str, segments)]) == 0
    merged = json.loads(out.read_text())
    names = [ev["args"]["name"] for ev in merged if ev["name"] == "thread_name"]
    assert sorted(names) == sorted({*TENSORS, "compute", "hvdlite"})
    spans = summarize.summarize([load(str(out))])["phases"]
    assert spans["MPI_ALLREDUCE"]["count"] == STEPS * 4 and spans["COMPUTE"]["count"] == STEPS


# ---------------------------------------------------------------- plot

def test_busiest_window_is_exact() -> None:
    spans = [Span(0, "a", "X", s, e, 0) for s, e in
             [(0, 10), (100, 150), (120, 160), (400, 405), (1000, 1001)]]
    assert plot.busiest_window(spans, 50.0) == (100.0, 150.0)  # 50 + 30 us covered
    assert plot.busiest_window(spans, 5.0) == (120.0, 125.0)  # two spans overlap there
    waits = [Span(0, "a", "NEGOTIATE_ALLREDUCE", 0, 900, 0), Span(0, "a", "QUEUE", 900, 990, 0)]
    assert plot.busiest_window(spans + waits, 50.0) == (100.0, 150.0)  # waiting is not work
    assert plot.busiest_window(waits, 50.0) == (0.0, 50.0)


def test_plot_writes_png(two_ranks: list[Path], tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    assert plot.main([*map(str, two_ranks), "--out", str(out), "--window-ms", "1.5"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "window" in capsys.readouterr().out


def test_plot_without_matplotlib(two_ranks: list[Path], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot.main([str(two_ranks[0]), "--out", str(tmp_path / "x.png")]) == 1
    assert "needs matplotlib: pip install 'hvdlite[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------- a real hvdlite trace

_JOB = """
import sys
import numpy as np
import hvdlite as hvd
hvd.init(timeline=sys.argv[1], fusion_threshold=4096)
r = hvd.rank()
for step in range({steps}):
    hs = [hvd.allreduce_async(np.full(64 * (i + 1), r + i, dtype=np.float32), name=f"grad.{{i}}",
                              op=hvd.Sum) for i in range(4)]
    for h in hs:
        h.wait()
    hvd.allgather(np.arange(3, dtype=np.int64) + r, name="ag")
    hvd.broadcast(np.zeros(5), 0, name="bc")
hvd.shutdown()
"""
def _run_two_ranks(script: Path, *argv: str) -> str:
    code, out = run_group([mpiexec(), "-n", "2", sys.executable, str(script), *argv],
                          clean_env(), 120)
    assert code is not None, f"2-rank hvdlite job did not finish in 120 s:\n{out[-4000:]}"
    assert code == 0, out[-4000:]
    return out


def _sequence_ok(names: list[str], op: str) -> int:
    """Count submissions in a track's span names (in start order, outer first); fail on any
    other order. Each is Horovod's: NEGOTIATE_<OP>, then <OP> around QUEUE and the rest."""
    n, i = 0, 0
    wire = "MPI_BCAST" if op == "BROADCAST" else f"MPI_{op}"
    while i < len(names):
        assert names[i:i + 3] == [f"NEGOTIATE_{op}", op, "QUEUE"], names[i:i + 6]
        i += 3
        fused = names[i] == "MEMCPY_IN_FUSION_BUFFER"
        want = ["MEMCPY_IN_FUSION_BUFFER", wire, "MEMCPY_OUT_FUSION_BUFFER"] if fused \
            else [wire]
        assert names[i:i + len(want)] == want, names[i - 2:i + 3]
        i += len(want)
        n += 1
    return n


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.skipif(under_mpi_launcher(),
                    reason="starts its own mpiexec job; not run from inside one")
def test_tools_on_a_real_two_rank_trace(tmp_path: Path) -> None:
    steps = 3
    script = tmp_path / "job.py"
    script.write_text(_JOB.format(steps=steps))
    _run_two_ranks(script, str(tmp_path / "t{rank}.json"))
    paths = [tmp_path / "t0.json", tmp_path / "t1.json"]
    for rank, path in enumerate(paths):
        res = check.check_file(str(path))
        assert res.ok, res.errors
        p = load(str(path))
        spans = sorted(pair(p).spans, key=lambda s: (s.start, -s.end))
        tracks: dict[str, list[str]] = {}
        for s in spans:
            assert s.pid == rank and s.dur >= 0
            tracks.setdefault(s.track, []).append(s.name)
        assert set(tracks) == {"grad.0", "grad.1", "grad.2", "grad.3", "ag", "bc"}
        for name, seq in tracks.items():
            op = "ALLGATHER" if name == "ag" else "BROADCAST" if name == "bc" else "ALLREDUCE"
            assert _sequence_ok(seq, op) == steps, (name, seq)
    rep = summarize.summarize([load(str(p)) for p in paths])
    ph = rep["phases"]
    assert ph["NEGOTIATE_ALLREDUCE"]["count"] == ph["MPI_ALLREDUCE"]["count"] == 2 * 4 * steps
    assert ph["MPI_ALLGATHER"]["count"] == ph["MPI_BCAST"]["count"] == 2 * steps
    assert ph["ALLREDUCE"]["count"] == 2 * 4 * steps and ph["BROADCAST"]["count"] == 2 * steps
    assert ph["MPI_ALLREDUCE"]["bytes"] == 2 * steps * sum(64 * (i + 1) * 4 for i in range(4))
    assert ph["MPI_ALLGATHER"]["bytes"] == 2 * steps * 3 * 8
    assert ph["QUEUE"]["count"] == 2 * 6 * steps
    assert rep["unpaired_events"] == 0 and rep["dropped_events"] == 0
    assert sum(n["count"] for n in rep["negotiation"].values()) == 2 * 6 * steps
    merged = tmp_path / "merged.json"
    assert merge.main([str(merged), *map(str, paths)]) == 0
    assert check.check_file(str(merged)).ok
    again = summarize.summarize([load(str(merged))])["phases"]
    assert again.keys() == ph.keys()
    for name, st in ph.items():  # merged timestamps are rounded to the nanosecond
        assert (again[name]["count"], again[name]["bytes"]) == (st["count"], st["bytes"])
        assert again[name]["total_us"] == pytest.approx(st["total_us"], abs=1e-3 * st["count"])


# ---------------------------------------------------------------- entry points

def test_dispatcher(two_ranks: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert "unknown tool 'frobnicate'" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "summarize" in capsys.readouterr().out
    assert cli.main(["check", str(two_ranks[0])]) == 0


@pytest.mark.parametrize("argv", [["-m", "timeline", "check"], ["-m", "timeline.check"]])
def test_module_entry_points(two_ranks: list[Path], argv: list[str]) -> None:
    ok = subprocess.run([sys.executable, *argv, str(two_ranks[0])], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ": OK:" in ok.stdout
    bad = two_ranks[0].with_name("bad.json")
    bad.write_text("[{")
    fail = subprocess.run([sys.executable, *argv, str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert fail.returncode == 1 and "not valid JSON" in fail.stdout
