"""Retired agreed-schedule transports (captured in a CUDA graph): kept alive with a bound, and
let go by a local abort, never by the collector (whose NCCL ncclCommDestroy waits for peers)."""

from __future__ import annotations

import collections
import gc
import types
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


def test_release_retired_aborts_every_one_once(retired: Any) -> None:
    transports = [RecordingTransport() for _ in range(5)]
    schedules = [_schedule(t) for t in transports]
    for s in schedules:
        s.retire()
        s.close()  # a captured schedule's close leaves its transport to the retirement
    agreed.release_retired()
    agreed.release_retired()
    assert [t.aborts for t in transports] == [1] * 5
    assert [t.closes for t in transports] == [0] * 5
    assert retired == []


def test_a_failing_abort_does_not_keep_the_others(retired: Any, caplog: Any) -> None:
    bad, good = RecordingTransport(), RecordingTransport()

    def boom() -> None:
        raise RuntimeError("driver gone")

    bad.abort = boom  # type: ignore[method-assign]
    _schedule(bad).retire()
    _schedule(good).retire()
    agreed.release_retired()
    assert good.aborts == 1 and retired == []
    assert "letting go of a retired" in caplog.text
