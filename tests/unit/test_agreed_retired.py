"""Retired agreed-schedule transports (their launches captured in CUDA graphs): kept while a
graph that captured them lives; past the bound, those whose graphs are all gone are let go by
a local abort, oldest first, never by the collector (whose NCCL ncclCommDestroy waits for the
peers, and for a live graph); at interpreter exit kept to the process's end, untouched."""

from __future__ import annotations

import collections
import gc
import types
import weakref
from typing import Any

import pytest

from hvdlite._control import agreed
from hvdlite._vocab.agreed import Slot


class RecordingTransport:
    """Counts its aborts and closes (what the retirement does to a transport is under test)."""

    device_id = 0
    kind = "nccl"

    def __init__(self) -> None:
        self.aborts = 0
        self.closes = 0

    def abort(self) -> None:
        self.aborts += 1

    def close(self) -> None:
        self.closes += 1


class Graph:
    """Stands for the CUDA graph that captured a schedule: only its lifetime matters here."""


@pytest.fixture()
def retired() -> Any:
    saved = list(agreed._RETIRED)
    agreed._RETIRED.clear()
    yield agreed._RETIRED
    agreed._RETIRED[:] = saved


def _schedule(transport: RecordingTransport) -> agreed.AgreedSchedule:
    service = types.SimpleNamespace(scheduler=None, dropped=collections.deque())
    slot = Slot(name="g", count=4, dtype="float32", op=0)
    return agreed.AgreedSchedule("s", [slot], 0, transport, service)  # type: ignore[arg-type]


def _kept(retired: Any) -> list[Any]:
    return [r.transport for r in retired]


def test_past_the_bound_the_oldest_whose_graphs_are_gone_are_aborted(retired: Any) -> None:
    held = Graph()
    first = RecordingTransport()  # the oldest, in a graph still alive: kept
    _schedule(first).retire(held)
    gone = [RecordingTransport() for _ in range(3)]
    for t in gone:
        _schedule(t).retire(Graph())  # the graph dies at once
    rest = [RecordingTransport() for _ in range(agreed._MAX_RETIRED - 2)]
    graphs = [Graph() for _ in rest]
    for t, g in zip(rest, graphs, strict=True):
        _schedule(t).retire(g)
    gc.collect()
    # 1 + 3 + (MAX - 2) = MAX + 2 retired: the two oldest whose graphs are gone went.
    assert [t.aborts for t in gone] == [1, 1, 0]
    assert first.aborts == 0 and all(t.aborts == 0 for t in rest)
    assert _kept(retired) == [first, gone[2], *rest]
    assert all(t.closes == 0 for t in [first, *gone, *rest])  # never closed


def test_every_graph_alive_keeps_every_transport_past_the_bound(retired: Any) -> None:
    transports = [RecordingTransport() for _ in range(agreed._MAX_RETIRED + 2)]
    graphs = [Graph() for _ in transports]
    for t, g in zip(transports, graphs, strict=True):
        _schedule(t).retire(g)
    assert _kept(retired) == transports
    assert all(t.aborts == 0 for t in transports)
    del graphs
    gc.collect()
    _schedule(RecordingTransport()).retire(keep := Graph())
    assert len(retired) == agreed._MAX_RETIRED and keep is not None
    assert [t.aborts for t in transports[:3]] == [1, 1, 1]


def test_a_schedule_captured_twice_is_held_by_either_graph(retired: Any) -> None:
    held = RecordingTransport()
    schedule = _schedule(held)
    first, second = Graph(), Graph()
    schedule.retire(first)
    schedule.retire(second)
    assert _kept(retired) == [held]  # one entry per schedule
    del first
    gc.collect()
    for _ in range(agreed._MAX_RETIRED):
        _schedule(RecordingTransport()).retire(Graph())
    assert held.aborts == 0 and held in _kept(retired)  # the second graph still holds it


def test_at_exit_retired_transports_are_kept_to_the_end_untouched(retired: Any) -> None:
    transports = [RecordingTransport() for _ in range(5)]
    refs = [weakref.ref(t) for t in transports]
    schedules = [_schedule(t) for t in transports]
    for s in schedules:
        s.retire(Graph())
        s.close()  # a captured schedule's close leaves its transport to the retirement
    agreed.keep_retired_at_exit()
    agreed.keep_retired_at_exit()
    assert retired == []
    assert [t.aborts for t in transports] == [0] * 5  # no teardown call at all
    assert [t.closes for t in transports] == [0] * 5
    del transports, schedules, s
    gc.collect()
    assert all(r() is not None for r in refs)  # never collected: no ncclCommDestroy at exit


def test_an_eviction_whose_abort_fails_is_logged_and_the_bound_holds(
        retired: Any, caplog: Any) -> None:
    bad = RecordingTransport()

    def boom() -> None:
        raise RuntimeError("driver gone")

    bad.abort = boom  # type: ignore[method-assign]
    _schedule(bad).retire(Graph())
    for _ in range(agreed._MAX_RETIRED):
        _schedule(RecordingTransport()).retire(Graph())
    assert len(retired) == agreed._MAX_RETIRED and bad not in _kept(retired)
    assert "letting go of a retired" in caplog.text
