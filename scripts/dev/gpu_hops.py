"""Inclusive wall time per hop of a small synchronous device allreduce (1 rank), measured by
wrapping the hops' functions with a clock (each wrapper adds ~0.3 us to what it wraps).

    mpirun -n 1 python scripts/dev/gpu_hops.py [--async-completion] [--steps 5000]

Prints, per hop, calls per step and microseconds per call (median-free: total / calls).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from typing import Any

import cupy as cp

import hvdlite as hvd
from hvdlite import _submit
from hvdlite._backends.nccl import NcclBackend
from hvdlite._control.channel import Channel
from hvdlite._control.negotiator import Negotiator
from hvdlite._engine import Engine
from hvdlite._gpu.runtime import GpuRuntime
from hvdlite._handles import Handle

TOTAL: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTAL[label] += time.perf_counter() - t0
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--async-completion", action="store_true")
    p.add_argument("--steps", type=int, default=5000)
    args = p.parse_args()
    for owner, name, label in [
        (_submit, "_submit", "submit (whole call before wait)"),
        (_submit, "_single_entry", "  lane match + entry"),
        (GpuRuntime, "record_ready", "  record READY"),
        (Engine, "submit_one", "  engine.submit_one"),
        (Handle, "wait", "wait (whole)"),
        (Engine, "progress", "  progress (cycles)"),
        (Engine, "_cycle", "    cycle"),
        (Negotiator, "cycle", "      negotiate"),
        (Negotiator, "_allreduce", "        bit-vector allreduce"),
        (Channel, "execute", "      execute"),
        (NcclBackend, "_run_direct", "        run_direct"),
        (GpuRuntime, "complete", "          complete (DONE record)"),
        (Handle, "_finish", "  finish (DONE sync + completion)"),
    ]:
        timed(owner, name, label)
    hvd.init(async_completion=args.async_completion)
    cp.cuda.Device(hvd.local_rank()).use()
    x, out = cp.ones(1, cp.float32), cp.empty(1, cp.float32)
    stream = cp.cuda.get_current_stream()
    for _ in range(200):
        hvd.allreduce(x, name="s", op=hvd.Sum, out=out)
    stream.synchronize()
    TOTAL.clear()
    CALLS.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        hvd.allreduce(x, name="s", op=hvd.Sum, out=out)
        stream.synchronize()
    step = (time.perf_counter() - t0) / args.steps
    print(f"step {step * 1e6:.1f} us (async completion {args.async_completion})")
    for label in TOTAL:
        print(f"{label:40s} {CALLS[label] / args.steps:5.2f} calls/step "
              f"{TOTAL[label] / CALLS[label] * 1e6:8.1f} us/call")
    hvd.shutdown()


if __name__ == "__main__":
    main()
