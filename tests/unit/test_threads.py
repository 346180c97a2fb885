"""hvdlite's threads block the asynchronous signals (``hvdlite/_threads.py``), so that a signal
sent to the process is taken by a thread that runs its handler at once, never by one of
hvdlite's while the main thread sleeps on. Read from the kernel's own view of each thread's
mask (``/proc/self/task/<tid>/status``, ``SigBlk``)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from hvdlite._observe.timeline import Timeline
from hvdlite._threads import ASYNC_SIGNALS, start_quietly

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir()
                                or not hasattr(signal, "pthread_sigmask"),
                                reason="needs Linux's /proc and pthread_sigmask")


def _blocked(native_id: int) -> set[int]:
    """The signals the kernel says thread ``native_id`` of this process blocks."""
    for line in Path(f"/proc/self/task/{native_id}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            mask = int(line.split()[1], 16)
            return {s for s in range(1, 65) if mask >> (s - 1) & 1}
    raise AssertionError("no SigBlk line")


def test_a_thread_started_quietly_blocks_the_async_signals_and_its_starter_does_not() -> None:
    before = _blocked(threading.get_native_id())
    seen: dict[str, set[int]] = {}
    go = threading.Event()

    def body() -> None:
        seen["mask"] = _blocked(threading.get_native_id())
        go.wait(10)

    t = start_quietly(threading.Thread(target=body, daemon=True))
    try:
        for _ in range(1000):
            if "mask" in seen:
                break
            go.wait(0.01)
        assert set(ASYNC_SIGNALS) <= seen["mask"]
        assert {signal.SIGSEGV, signal.SIGPIPE, signal.SIGABRT}.isdisjoint(seen["mask"])
        assert _blocked(threading.get_native_id()) == before  # the caller's mask as it was
    finally:
        go.set()
        t.join(10)


def test_the_timeline_writer_blocks_them(tmp_path: Path) -> None:
    """The writer thread whose taking a SIGTERM kept a 60 s sleep's handler waiting."""
    tl = Timeline(str(tmp_path / "t.json"), 0, hook_signals=False)
    try:
        writer = tl._thread.native_id
        assert writer is not None
        assert {signal.SIGINT, signal.SIGTERM} <= _blocked(writer)
    finally:
        tl.close(10)
