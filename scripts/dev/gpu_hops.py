"""Inclusive wall time per hop of a synchronous device allreduce (1 rank): a 4-byte tensor,
or ``--grouped`` the ResNet-50 set as one grouped call; measured by wrapping the hops'
functions with a clock (each wrapper adds ~0.3 us to what it wraps).

    mpirun -n 1 python scripts/dev/gpu_hops.py [--async-completion] [--grouped] [--steps N]

Prints, per hop, calls per step and microseconds per call (median-free: total / calls).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import cupy as cp

import hvdlite as hvd
from hvdlite import _collectives, _steady
from hvdlite._backends.nccl import NcclBackend
from hvdlite._control import replay
from hvdlite._control.channel import Channel
from hvdlite._control.driver import Driver
from hvdlite._control.negotiator import Negotiator
from hvdlite._engine import Engine
from hvdlite._gpu.fused import FusedAllreduce
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
    p.add_argument("--grouped", action="store_true")
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    for owner, name, label in [
        (_collectives, "_submit", "call (whole)"),
        (_steady, "_single_parts", "  lane match + output"),
        (_steady, "run_now", "  immediate path"),
        (Negotiator, "_allreduce", "    bit-vector allreduce"),
        (NcclBackend, "reduce_now", "    NCCL call on the caller's stream"),
        (replay.Lane, "matches_group", "  group lane match"),
        (replay.Lane, "result", "  results (recycled)"),
        (GpuRuntime, "record_ready", "  record READY"),
        (Engine, "submit_one", "  engine.submit_one"),
        (Handle, "wait", "  wait"),
        (Driver, "progress", "    progress (cycles)"),
        (Driver, "cycle", "      cycle"),
        (Negotiator, "cycle", "        negotiate"),
        (Channel, "execute", "        execute"),
        (NcclBackend, "run", "          backend run"),
        (FusedAllreduce, "run", "            fused run"),
        (GpuRuntime, "complete", "            complete (DONE record)"),
        (Handle, "_finish", "    finish (DONE sync + completion)"),
    ]:
        timed(owner, name, label)
    hvd.init(async_completion=args.async_completion)
    cp.cuda.Device(hvd.local_rank()).use()
    x, out = cp.ones(1, cp.float32), cp.empty(1, cp.float32)
    spec = json.loads((Path(__file__).parents[1] / "data" / "resnet50_grads.json").read_text())
    xs = [cp.ones(math.prod(t["shape"]), cp.float32).reshape(t["shape"])
          for t in spec["tensors"]]
    stream = cp.cuda.get_current_stream()
    held: Any = None

    def step() -> None:
        nonlocal held
        if args.grouped:
            held = hvd.grouped_allreduce(xs, name="g", op=hvd.Sum)
        else:
            hvd.allreduce(x, name="s", op=hvd.Sum, out=out)
        stream.synchronize()

    for _ in range(200):
        step()
    TOTAL.clear()
    CALLS.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    per_step = (time.perf_counter() - t0) / args.steps
    print(f"step {per_step * 1e6:.1f} us (async completion {args.async_completion}, grouped "
          f"{args.grouped})")
    for label in TOTAL:
        print(f"{label:40s} {CALLS[label] / args.steps:5.2f} calls/step "
              f"{TOTAL[label] / CALLS[label] * 1e6:8.1f} us/call")
    hvd.shutdown()


if __name__ == "__main__":
    main()
