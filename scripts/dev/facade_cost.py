"""Probe (issue 38): the torch façade's per-call host cost against the NumPy API, in one launch.

Per rank, median over repeats, both APIs on the same memory, variants interleaved:

- tiny: 1,000 one-element float32 tensors, ``allreduce_async`` each then ``synchronize``
  each, out of place and in place; the submission loop and the waits timed apart (wall and
  this thread's CPU time), ``--no-gc`` with Python's cyclic collector off while timing;
- grouped: ``grouped_allreduce`` of 161 one-element tensors (the ResNet-50 set's count, no
  payload: the host path alone), blocking.

    mpiexec -n 2 python scripts/dev/facade_cost.py [--no-gc]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import hvdlite
import hvdlite.torch as hvd

N_TINY, N_GROUP = 1000, 161


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-gc", action="store_true", help="collector off while timing")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    hvd.init()
    me = hvd.rank()
    ts = [torch.full((1,), float(me + i % 7)) for i in range(N_TINY)]
    arrs = [t.clone().numpy() for t in ts]
    names = {k: [f"fc.{i}.{k}" for i in range(N_TINY)] for k in ("t", "n", "ti", "ni")}
    tiny: dict[str, tuple[Callable[..., Any], Callable[[Any], Any], list[Any], list[str]]] = {
        "torch allreduce_async": (hvd.allreduce_async, hvd.synchronize, ts, names["t"]),
        "NumPy allreduce_async": (hvdlite.allreduce_async, hvdlite.synchronize, arrs,
                                  names["n"]),
        "torch allreduce_async_": (hvd.allreduce_async_, hvd.synchronize, ts, names["ti"]),
        "NumPy allreduce_async_": (hvdlite.allreduce_async_, hvdlite.synchronize, arrs,
                                   names["ni"]),
    }
    gts = [torch.full((1,), float(me + k)) for k in range(N_GROUP)]
    garrs = [t.clone().numpy() for t in gts]
    grouped: dict[str, Callable[[], Any]] = {
        "torch grouped_allreduce (161)": lambda: hvd.grouped_allreduce(gts, name="fc.g.t"),
        "NumPy grouped_allreduce (161)": lambda: hvdlite.grouped_allreduce(garrs, name="fc.g.n"),
    }
    rows: dict[str, list[tuple[float, ...]]] = {}
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for label, (start, sync, xs, ns) in tiny.items():
            for _ in range(5):
                comm.Barrier()
                if args.no_gc:
                    gc.disable()
                w0, c0 = clock(), cpu()
                handles = [start(x, name=n) for x, n in zip(xs, ns, strict=True)]
                w1, c1 = clock(), cpu()
                outs = [sync(h) for h in handles]
                w2 = clock()
                gc.enable()
                del handles, outs
                if rnd:
                    rows.setdefault(label, []).append(
                        ((w1 - w0) / N_TINY, (c1 - c0) / N_TINY, (w2 - w1) / N_TINY,
                         (w2 - w0) / N_TINY))
        for label, fn in grouped.items():
            for _ in range(20):
                comm.Barrier()
                if args.no_gc:
                    gc.disable()
                w0 = clock()
                fn()
                w1 = clock()
                gc.enable()
                if rnd:
                    rows.setdefault(label, []).append((float(w1 - w0),))
    if me == 0:
        print(f"{hvd.size()} ranks, collector {'off' if args.no_gc else 'on'} while timing; "
              "rank 0, medians, us")
        for label, vals in rows.items():
            med = np.median(np.array(vals), axis=0) / 1e3
            if len(med) == 1:
                print(f"{label:32s} per call {med[0]:8.1f}")
            else:
                print(f"{label:32s} per tensor: submit {med[0]:5.2f} (cpu {med[1]:5.2f})  "
                      f"waits {med[2]:5.2f}  total {med[3]:5.2f}")
        for a, b in (("torch allreduce_async", "NumPy allreduce_async"),
                     ("torch allreduce_async_", "NumPy allreduce_async_")):
            ra = np.median(np.array(rows[a]), axis=0)[3] / np.median(np.array(rows[b]), axis=0)[3]
            print(f"{a} / {b}: {ra:.2f}x")
    hvd.shutdown()


if __name__ == "__main__":
    main()
