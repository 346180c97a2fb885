"""READY events in stream order (``hvdlite/_control/negotiator.py``, ``_gpu/runtime.py``): of
the READY events one thread recorded on one stream of one device, the latest stands for the
earlier ones. The inference itself, on stand-in events whose completion the test sets (what
CUDA does with real ones is checked on the GPU: tests/gpu/test_gpu_streams.py)."""

from __future__ import annotations

from hvdlite._control.negotiator import _done_in_stream_order
from hvdlite._gpu.runtime import latest_per_stream
from hvdlite._handles import Handle
from hvdlite._ops import ReduceOp
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.messages import Kind, Request


class _Event:
    """A READY stand-in: ``done`` as the test sets it, and how often it was asked."""

    def __init__(self, done: bool) -> None:
        self._done, self.asked = done, 0

    @property
    def done(self) -> bool:
        self.asked += 1
        return self._done


def _entry(name: str, mark: tuple[int, int, int, int], done: bool) -> Entry:
    req = Request(name=name, kind=Kind.ALLREDUCE, dtype="float32", shape=(4,),
                  op=int(ReduceOp.SUM))
    e = Entry(req, None, None, Handle(name), device_id=mark[1])
    e.ready, e.ready_mark = _Event(done), mark
    return e


def test_the_latest_complete_event_of_a_stream_settles_the_earlier_ones_unasked() -> None:
    # Stream 7 of device 0, thread 1: three records, the last complete.
    burst = [_entry(f"a{k}", (7, 0, 1, k), done=(k == 2)) for k in range(3)]
    _done_in_stream_order(burst)
    assert [e.ready_done for e in burst] == [True, True, True]
    assert [e.ready.asked for e in burst] == [0, 0, 1]


def test_an_incomplete_latest_event_proves_nothing() -> None:
    burst = [_entry(f"a{k}", (7, 0, 1, k), done=True) for k in range(2)]
    burst.append(_entry("a2", (7, 0, 1, 2), done=False))
    _done_in_stream_order(burst)
    assert [e.ready_done for e in burst] == [False, False, False]
    assert [e.ready.asked for e in burst] == [0, 0, 1]  # the others are asked by the cycle


def test_other_streams_devices_and_threads_are_not_settled() -> None:
    late = _entry("late", (7, 0, 1, 9), done=True)
    others = [_entry("stream", (8, 0, 1, 1), done=False),
              _entry("device", (7, 1, 1, 2), done=False),  # the same handle on another GPU
              _entry("thread", (7, 0, 2, 3), done=False)]
    _done_in_stream_order([*others, late])
    assert late.ready_done and not any(e.ready_done for e in others)


def test_a_bucket_waits_for_the_latest_event_of_each_stream_only() -> None:
    entries = [_entry("x0", (7, 0, 1, 4), False), _entry("y0", (8, 0, 1, 5), False),
               _entry("x1", (7, 0, 1, 6), False), _entry("x2", (7, 0, 1, 3), False),
               _entry("z0", (7, 0, 2, 1), False), _entry("done", (9, 0, 1, 8), False)]
    entries[-1].ready_done = True  # negotiation saw it complete: no wait at all
    got = sorted(e.request.name for e in latest_per_stream(entries))
    assert got == ["x1", "y0", "z0"]
