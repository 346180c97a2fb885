"""The timeline on the device: the CPU-sync fallback (host times bracket device phases) and
the opt-in event-timed mode (CUDA event pairs; stream waits and async completion unchanged)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from gpu_util import allreduce_phase, one_ipc_step, reinit, warm_up  # noqa: E402

N = 1 << 16


def _events(path: str, rank: int) -> list[dict[str, Any]]:
    return json.loads(Path(path.replace("{rank}", str(rank))).read_text())


def _tracks(events: list[dict[str, Any]]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


@pytest.fixture
def traced(hvd: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    path = str(tmp_path / "gpu_{rank}.json")
    with reinit(hvd, timeline=path, **request.param):
        yield path


@pytest.mark.parametrize("traced", [{}], indirect=True)
def test_cpu_sync_fallback_brackets_device_phases(hvd: Any, traced: str) -> None:
    r = hvd.rank()
    want = sum(k + 1 for k in range(hvd.size()))
    parts = [cupy.full(1000 + i, r + 1.0, dtype=cupy.float32) for i in range(3)]
    out = hvd.grouped_allreduce(parts, name="tlg", op=hvd.Sum)  # reduced in its results
    assert float(out[0][0]) == want
    # In place on separate tensors: through the fusion buffer, so copied out too.
    apart = [cupy.full(1000 + i, r + 1.0, dtype=cupy.float32) for i in range(3)]
    hvd.grouped_allreduce_(apart, name="tlp", op=hvd.Sum)
    assert all(float(a[-1]) == want for a in apart)
    phase = allreduce_phase(hvd)
    hvd.shutdown()  # closes the trace
    events = _events(traced, r)
    names = _tracks(events)
    phases = {(names[e["tid"]], e["name"]) for e in events if e.get("ph") == "B"}
    common = ("NEGOTIATE_ALLREDUCE", "QUEUE", "WAIT_FOR_DATA", "MEMCPY_IN_FUSION_BUFFER",
              phase)
    for track, expected in (("tlg", common), ("tlp", (*common, "MEMCPY_OUT_FUSION_BUFFER"))):
        for phase in expected:
            assert (track, phase) in phases, (track, phase)
    assert ("tlg", "MEMCPY_OUT_FUSION_BUFFER") not in phases
    hvd.init(timeline=traced)  # the fixture's teardown shuts down again


@pytest.mark.parametrize("traced", [{"timeline_device_events": True,
                                     "async_completion": True}], indirect=True)
def test_event_timed_mode_keeps_async_and_times_the_wait(hvd: Any, traced: str) -> None:
    r = hvd.rank()
    warm_up(hvd, N)
    phase = allreduce_phase(hvd)
    one_ipc_step(hvd, 512 << 20, timeline=traced, timeline_device_events=True,
                 async_completion=True)
    # A long collective (512 MiB, ~2 ms on the device) on a ready input: a producer still
    # running would hold the tensor back from negotiation (head-of-line rule), so it is the
    # collective that must still be running when wait() returns.
    n = 1 << 26
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.full(n, r + 1.0, dtype=cupy.float64)
        out = cupy.empty_like(x)
        stream.synchronize()
        h = hvd.allreduce_async(x, name="evt", op=hvd.Sum, out=out)
        got = h.wait()
        (done,) = h._events
        still_running = not done.done  # async completion is unchanged by the timeline
    stream.synchronize()
    assert still_running, "with event timing on, wait() should not wait for the device"
    assert float(got.min()) == sum(k + 1 for k in range(hvd.size()))
    time.sleep(0.5)  # retirement turns the event pairs into spans after DONE (or shutdown)
    hvd.shutdown()
    events = _events(traced, r)
    names = _tracks(events)
    spans = {e["name"]: e for e in events
             if e.get("ph") == "X" and names[e["tid"]] == "evt [device]"}
    assert {"WAIT_FOR_DATA", phase} <= set(spans), spans
    # The event pair around the collective shows the device time of 512 MiB.
    assert spans[phase]["dur"] > 100, spans[phase]
    print(f"[rank {r}] event-timed: WAIT_FOR_DATA {spans['WAIT_FOR_DATA']['dur']:.0f} us, "
          f"{phase} {spans[phase]['dur']:.0f} us")
    hvd.init(timeline=traced)
