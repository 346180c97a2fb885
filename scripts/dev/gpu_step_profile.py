"""Where the host time of a steady-state step goes on the GPU machine (1 rank).

Runs one shape of work in a loop (``--what grouped|async|sync|sync_ac``) on the ResNet-50
gradient set or a 4-byte tensor, prints the time per step, then profiles ``--steps`` more steps
with cProfile (the caller's thread; run it under py-spy for the background thread) and prints
the functions with the most own time. A probe for the cost budget, not a benchmark.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import time
from pathlib import Path

import cupy as cp

import hvdlite as hvd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", default="grouped", choices=["grouped", "async", "sync", "sync_ac"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    hvd.init(async_completion=args.what == "sync_ac")
    cp.cuda.Device(hvd.local_rank()).use()
    spec = json.loads((Path(__file__).parents[1] / "data" / "resnet50_grads.json").read_text())
    shapes = [tuple(t["shape"]) for t in spec["tensors"]]
    xs = [cp.full(math.prod(s), 1.0, cp.float32).reshape(s) for s in shapes]
    outs = [cp.empty_like(x) for x in xs]
    names = [f"p{i}" for i in range(len(xs))]
    small, small_out = cp.ones(1, cp.float32), cp.empty(1, cp.float32)
    stream = cp.cuda.get_current_stream()

    def step() -> None:
        if args.what == "grouped":
            res = hvd.grouped_allreduce(xs, name="g", op=hvd.Sum)
            assert len(res) == len(xs)
        elif args.what == "async":
            hs = [hvd.allreduce_async(x, name=n, op=hvd.Sum, out=o)
                  for x, n, o in zip(xs, names, outs, strict=True)]
            for h in hs:
                h.wait()
        else:
            hvd.allreduce(small, name="s", op=hvd.Sum, out=small_out)
        stream.synchronize()

    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    print(f"{args.what}: {(time.perf_counter() - t0) / args.steps * 1e6:.1f} us per step")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    hvd.shutdown()


if __name__ == "__main__":
    main()
