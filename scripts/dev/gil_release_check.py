"""Does a CuPy call release the GIL while it waits for the device? (1 process, 1 GPU)

A Python thread counts loop iterations while the main thread waits ~50 ms for a spinning
kernel through each candidate call; a call that holds the GIL leaves the counter near zero.
The baseline is ``time.sleep`` for the same time (which releases the GIL).

    python3 scripts/dev/gil_release_check.py
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import cupy

SPIN = cupy.RawKernel(r"""
extern "C" __global__ void spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
""", "spin")


def counted(wait: Callable[[], None]) -> tuple[int, float]:
    stop = threading.Event()
    count = [0]

    def spin_python() -> None:
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin_python)
    t.start()
    time.sleep(0.005)
    before = count[0]
    t0 = time.perf_counter()
    wait()
    elapsed = time.perf_counter() - t0
    during = count[0] - before
    stop.set()
    t.join()
    return during, elapsed


def main() -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # RawKernel launches on the current stream (it takes no stream argument)
        SPIN((1,), (1,), (cupy.int64(1_000_000),))  # load the module first
    stream.synchronize()

    def behind_spin() -> cupy.cuda.Event:
        with stream:
            SPIN((1,), (1,), (cupy.int64(50_000_000),))
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        return ev

    cases: dict[str, Callable[[], None]] = {
        "time.sleep(0.05) (baseline, releases the GIL)": lambda: time.sleep(0.05),
        "Event.synchronize()": lambda: behind_spin().synchronize(),
        "Stream.synchronize()": lambda: (behind_spin(), stream.synchronize())[1],
    }
    for name, fn in cases.items():
        during, elapsed = counted(fn)
        print(f"{name:48s} waited {elapsed * 1e3:6.1f} ms; other thread ran {during:>10d} "
              "iterations meanwhile", flush=True)


if __name__ == "__main__":
    main()
