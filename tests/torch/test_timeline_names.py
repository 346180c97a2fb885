"""The timeline of hvdlite.torch calls reads as Horovod's: rows named ``<op>.<name>`` (what
horovod.torch gives its core), Horovod's phase names around each op, CYCLE_START marks; and
the events are in the file shortly after the op, while the job still runs."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from timeline import check, load, pair


def _trace(path: Path) -> tuple[dict[str, list[str]], list[dict[str, Any]]]:
    """Track name -> its span names (start order, outer first), and the raw events."""
    assert check.check_file(str(path)).ok
    spans = sorted(pair(load(str(path))).spans, key=lambda s: (s.start, s.depth))
    tracks: dict[str, list[str]] = defaultdict(list)
    for s in spans:
        tracks[s.track].append(s.name)
    return tracks, json.loads(path.read_text())


def test_rows_and_phases_are_horovods(hvd: Any, tmp_path: Path) -> None:
    path = tmp_path / "names_{rank}.json"
    n, me = hvd.size(), hvd.rank()
    hvd.start_timeline(str(path), mark_cycles=True)
    hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="test_allreduce")
    hvd.allreduce_(torch.ones(4), name="inplace")
    hvd.allreduce_async(torch.ones(4), name="async").wait()
    hvd.grouped_allreduce([torch.ones(3), torch.ones(5)], name="group")
    hvd.allgather(torch.ones(2, 2), name="gather")
    hvd.grouped_allgather([torch.ones(1), torch.ones(2)], name="ggather")
    hvd.broadcast(torch.ones(3), 0, name="bcast")
    hvd.alltoall(torch.ones(2 * n), name="a2a")
    hvd.reducescatter(torch.ones(2 * n), name="rs")
    hvd.grouped_reducescatter([torch.ones(n), torch.ones(2 * n)], name="grs")
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum)  # unnamed: the core numbers it
    assert got.tolist() == [float(n)] * 2
    hvd.stop_timeline()
    tracks, events = _trace(Path(str(path).replace("{rank}", str(me))))
    want = {
        "allreduce.test_allreduce": "ALLREDUCE", "allreduce.inplace": "ALLREDUCE",
        "allreduce.async": "ALLREDUCE", "grouped_allreduce.group": "ALLREDUCE",
        "allgather.gather": "ALLGATHER", "grouped_allgather.ggather_1of2": "ALLGATHER",
        "grouped_allgather.ggather_2of2": "ALLGATHER", "broadcast.bcast": "BROADCAST",
        "alltoall.a2a": "ALLTOALL", "alltoall.a2a.splits": "ALLTOALL",
        "reducescatter.rs": "REDUCESCATTER", "grouped_reducescatter.grs_1of2": "REDUCESCATTER",
        "grouped_reducescatter.grs_2of2": "REDUCESCATTER",
    }
    unnamed = [t for t in tracks if t.startswith("allreduce.noname.")]
    assert len(unnamed) == 1, sorted(tracks)
    assert set(tracks) == set(want) | set(unnamed), sorted(tracks)
    want[unnamed[0]] = "ALLREDUCE"
    wire = {"BROADCAST": "MPI_BCAST"}
    for track, op in want.items():
        seq = tracks[track]
        assert seq[:3] == [f"NEGOTIATE_{op}", op, "QUEUE"], (track, seq)
        assert wire.get(op, f"MPI_{op}") in seq[3:], (track, seq)
    marks = [ev for ev in events if ev.get("name") == "CYCLE_START"]
    assert marks and all(m["ph"] == "i" and m["s"] == "g" for m in marks)


def test_events_reach_the_file_while_running(hvd: Any, tmp_path: Path) -> None:
    """Horovod's test_timeline reads the file 0.1 s after the op, with the timeline still
    on: every phase of the op is there by then (the writer flushes every 50 ms)."""
    path = tmp_path / "live_{rank}.json"
    hvd.start_timeline(str(path), mark_cycles=True)
    try:
        hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="live")
        time.sleep(0.1)
        text = Path(str(path).replace("{rank}", str(hvd.rank()))).read_text()
    finally:
        hvd.stop_timeline()
    events = json.loads(text)  # a complete JSON array while the writer runs
    on_row = {ev["name"] for ev in events if ev.get("ph") in "BE" and ev.get("tid") == 1}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "MPI_ALLREDUCE"} <= on_row, on_row
    assert '"allreduce.live"' in text and "CYCLE_START" in text
    ends = [ev for ev in events if ev.get("ph") == "E" and ev["name"] == "ALLREDUCE"]
    assert len(ends) == 1
