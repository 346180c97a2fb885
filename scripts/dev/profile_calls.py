"""Per-function CPU profile (all threads, via yappi) of hvdlite's per-call Python work.

A diagnostic for the per-tensor cost: profiles ``allreduce`` of 4 bytes one call at a time
and a grouped allreduce of the 161 ResNet-50 gradient shapes, on host arrays and, when CuPy
sees a device, on device arrays. Prints the top functions by own time per call. yappi slows
everything down several times; compare functions with each other, not with benchmarks.

    pip install yappi; mpirun -n 2 python3 scripts/dev/profile_calls.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yappi

import hvdlite as hvd

DATA = Path(__file__).resolve().parents[1] / "data" / "resnet50_grads.json"


def resnet_shapes() -> list[tuple[int, ...]]:
    return [tuple(t["shape"]) for t in json.loads(DATA.read_text())["tensors"]]


def profile(label: str, fn: Any, calls: int, top: int) -> None:
    for _ in range(max(calls // 10, 5)):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    plain = (time.perf_counter() - t0) / calls
    yappi.clear_stats()
    yappi.set_clock_type("cpu")
    yappi.start()
    for _ in range(calls):
        fn()
    yappi.stop()
    if hvd.rank() != 0:
        return
    print(f"== {label}: {plain * 1e6:.1f} us per call unprofiled; own CPU time per call:")
    stats = yappi.get_func_stats()
    stats.sort("tsub")
    for f in list(stats)[:top]:
        print(f"  {f.tsub / calls * 1e6:8.1f} us own {f.ttot / calls * 1e6:8.1f} us total "
              f"{f.ncall / calls:7.1f}x  {Path(f.module).name}:{f.lineno} {f.name}", flush=True)


def run(xp: Any, where: str, top: int) -> None:
    x, y = xp.ones(1, np.float32), xp.empty(1, np.float32)
    profile(f"{where} allreduce 4 B", lambda: hvd.allreduce(x, name="p1", op=hvd.Sum, out=y),
            1000, top)
    xs = [xp.ones(s, np.float32) for s in resnet_shapes()]
    profile(f"{where} grouped_allreduce x{len(xs)}",
            lambda: hvd.grouped_allreduce(xs, name="pg", op=hvd.Average), 30, top)


def main() -> None:
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    hvd.init()
    run(np, "host", top)
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None and cupy.cuda.runtime.getDeviceCount():
        cupy.cuda.Device(hvd.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
        run(cupy, "cuda", top)
    hvd.shutdown()


if __name__ == "__main__":
    main()
