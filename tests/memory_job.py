"""Memory soak job (run by tests/test_memory_job.py under ``mpiexec -n 2``; runs at any size).

Every step submits ``--tensors`` float32 allreduces (``--elements`` each) asynchronously and
waits for them all (``--blocking``: one blocking allreduce after the other, each result
dropped once checked). ``--names named`` (default) gives each tensor a fixed name (the cached
steady state of a training loop); ``unnamed`` leaves names out, so every call gets a new
automatic name; ``mixed`` alternates; ``unique`` names every call ``u.<step>.<i>`` (a name
never seen again: per-step names of a training or evaluation loop). ``--order random``: each
rank submits and waits in its own order, drawn per step. Resident memory is read from
``/proc/self/statm`` after ``--baseline`` steps (0: before the first) and every ``--every``
steps after it; each rank prints one line

    MEM rank=R names=N steps=S baseline_step=B rss_baseline_kib=X rss_end_kib=Y
        growth_kib=Y-X max_growth_kib=M wall_s=T us_per_allreduce=U samples=[step:kib ...]

and the job exits 1 if any rank grew by more than ``--limit-kib`` from the baseline to the end
(or if a result was wrong), 0 otherwise. Every result is checked exactly.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import numpy as np

import hvdlite as hvd

PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def rss_kib() -> int:
    """Resident set size of this process in KiB (second field of /proc/self/statm)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * PAGE_KIB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--tensors", type=int, default=20)
    parser.add_argument("--elements", type=int, default=16)
    parser.add_argument("--baseline", type=int, default=500)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--limit-kib", type=int, default=4096)
    parser.add_argument("--names", choices=["named", "unnamed", "mixed", "unique"],
                        default="named", help="fixed names per tensor, automatic names, every "
                        "other one, or a new name every call")
    parser.add_argument("--order", choices=["fixed", "random"], default="fixed")
    parser.add_argument("--blocking", action="store_true")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    inputs = [np.full(args.elements, rank + i, np.float32) for i in range(args.tensors)]
    # Sum over ranks of (rank + i): exact in float32 for these sizes.
    wants = [np.full(args.elements, sum(r + i for r in range(size)), np.float32)
             for i in range(args.tensors)]  # fmt: skip
    names: list[str | None] = [
        f"mem.{i}" if args.names == "named" or (args.names == "mixed" and i % 2 == 0)
        else None for i in range(args.tensors)]  # fmt: skip
    samples: list[tuple[int, int]] = []
    baseline = -1
    bad = ""
    order = list(range(args.tensors))
    shuffle = random.Random(rank).shuffle
    if args.baseline == 0:
        gc.collect()
        baseline = rss_kib()
        samples.append((0, baseline))
    start = time.monotonic()
    for step in range(1, args.steps + 1):
        if args.names == "unique":
            names = [f"u.{step}.{i}" for i in range(args.tensors)]
        if args.order == "random":
            shuffle(order)
        if args.blocking:
            for i in order:
                got = hvd.allreduce(inputs[i], name=names[i], op=hvd.Sum)
                if not np.array_equal(got, wants[i]):
                    bad = bad or f"step {step} tensor {i}: got {got[:4]}, expected {wants[i][:4]}"
            del got
        else:
            handles = {i: hvd.allreduce_async(inputs[i], name=names[i], op=hvd.Sum)
                       for i in order}  # fmt: skip
            if args.order == "random":
                shuffle(order)
            for i in order:
                got = handles[i].wait()
                if not np.array_equal(got, wants[i]):
                    bad = bad or f"step {step} tensor {i}: got {got[:4]}, expected {wants[i][:4]}"
            del handles, got
        if step % args.every == 0 or step == args.baseline:
            gc.collect()
            rss = rss_kib()
            samples.append((step, rss))
            if step == args.baseline:
                baseline = rss
    wall = time.monotonic() - start
    hvd.shutdown()
    end = samples[-1][1]
    after = [rss for step, rss in samples if step >= args.baseline]
    growth, max_growth = end - baseline, max(after) - baseline
    shown = " ".join(f"{step}:{rss}" for step, rss in samples)
    per_call_us = 1e6 * wall / (args.steps * args.tensors)
    line = (f"MEM rank={rank} names={args.names} steps={args.steps} "
            f"baseline_step={args.baseline} rss_baseline_kib={baseline} rss_end_kib={end} "
            f"growth_kib={growth} max_growth_kib={max_growth} wall_s={wall:.1f} "
            f"us_per_allreduce={per_call_us:.1f} samples=[{shown}]")  # fmt: skip
    # One write per line: ranks share the launcher's stdout, and print() writes the newline
    # separately, so unbuffered lines of two ranks could run together.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if bad:
        print(f"MEM rank={rank} WRONG RESULT: {bad}", file=sys.stderr, flush=True)
        return 1
    if growth > args.limit_kib:
        print(f"MEM rank={rank} GREW {growth} KiB from step {args.baseline} to {args.steps} "
              f"(limit {args.limit_kib} KiB)", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
