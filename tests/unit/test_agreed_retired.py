"""Retired agreed-schedule transports (captured in a CUDA graph): kept alive with a bound, the
evicted let go by a local abort, never by the collector (whose NCCL ncclCommDestroy waits for
peers), and at interpreter exit kept to the process's end with no teardown call."""

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

    def __init__(self) -> None:
        self.aborts = 0
        self.closes = 0

    def abort(self) -> None:
        self.aborts += 1

    def close(self) -> None:
        self.closes += 1


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


def test_retired_transports_are_kept_bounded_and_the_oldest_aborted(retired: Any) -> None:
    transports = [RecordingTransport() for _ in range(agreed._MAX_RETIRED + 3)]
    for t in transports:
        _schedule(t).retire()
    gc.collect()
    assert len(retired) == agreed._MAX_RETIRED
    assert [t.aborts for t in transports[:3]] == [1, 1, 1]
    assert all(t.aborts == 0 for t in transports[3:])
    assert retired == transports[3:]
    assert all(t.closes == 0 for t in transports)  # a graph may still replay: never closed


def test_at_exit_retired_transports_are_kept_to_the_end_untouched(retired: Any) -> None:
    transports = [RecordingTransport() for _ in range(5)]
    refs = [weakref.ref(t) for t in transports]
    schedules = [_schedule(t) for t in transports]
    for s in schedules:
        s.retire()
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
    _schedule(bad).retire()
    for _ in range(agreed._MAX_RETIRED):
        _schedule(RecordingTransport()).retire()
    assert len(retired) == agreed._MAX_RETIRED and bad not in retired
    assert "letting go of a retired" in caplog.text
