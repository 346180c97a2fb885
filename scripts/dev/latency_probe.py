"""Where does one small collective's time go? A diagnostic, not a benchmark.

Times ``allreduce(x, out=y)`` of 4 bytes one call at a time (barrier before each), and stamps
the stages of each call on this rank through wrappers around the engine's own methods:
queue drained by the loop, negotiation done, data plane entered/left, caller's wait over.
Prints per-stage medians (microseconds after the call began) for a few engine settings, so a
latency change can be pinned on a stage. Runs on host (NumPy) and, when CuPy sees a device,
on device arrays.

    mpirun -n 2 python3 scripts/dev/latency_probe.py [--calls 300]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from hvdlite import _cycle, _engine
from hvdlite._backends import mpi as mpi_backend

MARKS: list[tuple[str, float]] = []


def _stamp(cls: Any, method: str, before: str | None, after: str | None) -> None:
    fn = getattr(cls, method)

    def wrapped(*a: Any, **k: Any) -> Any:
        if before:
            MARKS.append((before, time.perf_counter()))
        out = fn(*a, **k)
        if after:
            MARKS.append((after, time.perf_counter()))
        return out

    setattr(cls, method, wrapped)


def install() -> None:
    _stamp(_engine.Engine, "submit", "submit_start", "submitted")
    _stamp(_engine.Engine, "_drain", None, "drained")
    _stamp(_cycle.Negotiator, "cycle", "cycle_start", "cycle_end")
    _stamp(mpi_backend.MPIBackend, "run", "data_start", "data_end")
    try:
        from hvdlite._backends import nccl

        _stamp(nccl.NcclBackend, "run", "data_start", "data_end")
    except ImportError:
        pass


def probe(label: str, make: Callable[[], tuple[Any, Any]], calls: int, setup: dict[str, Any],
          tweak: Callable[[Any], None] | None = None) -> None:
    comm = MPI.COMM_WORLD
    hvd.shutdown()
    hvd.init(**setup)
    if tweak is not None:
        tweak(_engine.default_engine())
    x, y = make()
    for _ in range(20):
        hvd.allreduce(x, name="probe", op=hvd.Sum, out=y)
    stages: dict[str, list[float]] = {}
    totals = []
    for _ in range(calls):
        comm.Barrier()
        MARKS.clear()
        t0 = time.perf_counter()
        hvd.allreduce(x, name="probe", op=hvd.Sum, out=y)
        t1 = time.perf_counter()
        totals.append(t1 - t0)
        first: dict[str, float] = {}
        for name, t in MARKS:
            first.setdefault(name, t - t0)
        # The cycle that produced the response is the last one to end before the data plane.
        start = first.get("data_start", float("inf"))
        ends = [t - t0 for name, t in MARKS if name == "cycle_end" and t - t0 <= start]
        if ends:
            first["cycle_end"] = ends[-1]
        first["cycles"] = sum(1 for name, _ in MARKS if name == "cycle_end")
        for name, v in first.items():
            stages.setdefault(name, []).append(v)
    us = {k: (1 if k == "cycles" else 1e6) * float(np.median(v)) for k, v in stages.items()}
    total = 1e6 * float(np.median(totals))
    p99 = 1e6 * float(np.percentile(totals, 99))
    rows = comm.gather((label, total, p99, us), root=0)
    if comm.Get_rank() == 0:
        for r, (lab, tot, q99, st) in enumerate(rows):
            order = " ".join(f"{k}={v:.0f}" for k, v in sorted(st.items(), key=lambda kv: kv[1]))
            print(f"rank {r} {lab:28s} p50 {tot:7.1f} us p99 {q99:7.1f} us | {order}",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    install()
    hvd.init()
    rank = hvd.rank()

    def host() -> tuple[Any, Any]:
        return np.ones(1, np.float32), np.empty(1, np.float32)

    configs: list[tuple[str, dict[str, Any], Callable[[Any], None] | None]] = [
        ("default", {}, None),
        ("gil cap off", {"gil_switch_interval_us": 0}, None),
        ("polled waits", {}, lambda e: setattr(e.negotiator, "block_in_mpi", False)),
        ("default again", {}, None),
    ]
    for label, setup, tweak in configs:
        probe(f"host {label}", host, args.calls, setup, tweak)
    try:
        import cupy

        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()

        def dev() -> tuple[Any, Any]:
            return cupy.ones(1, cupy.float32), cupy.empty(1, cupy.float32)

        for label, setup, tweak in configs:
            probe(f"cuda {label}", dev, args.calls, setup, tweak)
        probe("cuda async", dev, args.calls, {"async_completion": True})
    except ImportError:
        pass
    hvd.shutdown()


if __name__ == "__main__":
    main()
