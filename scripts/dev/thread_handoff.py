"""Cost of handing work to another Python thread and back, with no MPI: a two-thread round
trip through threading.Event (as a wake-up flag) and through queue.SimpleQueue (what the
background loop uses since 824f6e3). The floor under hvdlite's submit -> loop -> caller path.

    python scripts/dev/thread_handoff.py
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable

N = 5000


def event_round_trip() -> list[float]:
    go, back = threading.Event(), threading.Event()

    def peer() -> None:
        for _ in range(N):
            go.wait()
            go.clear()
            back.set()

    return _time(peer, go.set, lambda: (back.wait(), back.clear()))


def queue_round_trip() -> list[float]:
    go: queue.SimpleQueue[None] = queue.SimpleQueue()
    back: queue.SimpleQueue[None] = queue.SimpleQueue()

    def peer() -> None:
        for _ in range(N):
            go.get()
            back.put(None)

    return _time(peer, lambda: go.put(None), back.get)


def _time(peer: Callable[[], None], send: Callable[[], object],
          receive: Callable[[], object]) -> list[float]:
    thread = threading.Thread(target=peer)
    thread.start()
    out = []
    for _ in range(N):
        t0 = time.perf_counter()
        send()
        receive()
        out.append(time.perf_counter() - t0)
    thread.join()
    return sorted(out)


def main() -> None:
    for label, fn in (("threading.Event", event_round_trip),
                      ("queue.SimpleQueue", queue_round_trip)):
        ts = fn()
        print(f"{label:18s} round trip p50 {statistics.median(ts) * 1e6:6.1f} us, "
              f"p99 {ts[int(0.99 * len(ts))] * 1e6:6.1f} us ({N} trips)")


if __name__ == "__main__":
    main()
