"""Memory soak job (run by tests/test_memory_job.py under ``mpiexec -n 2``; runs at any size).

Every step submits ``--tensors`` tiny float32 allreduces asynchronously and waits for them all.
``--names named`` (default) gives each tensor a fixed name (the cached steady state of a
training loop); ``unnamed`` leaves names out, so every call gets a new automatic name;
``mixed`` alternates. Resident memory is read from ``/proc/self/statm`` after
``--baseline`` steps and every ``--every`` steps after it; each rank prints one line

    MEM rank=R names=N steps=S baseline_step=B rss_baseline_kib=X rss_end_kib=Y
        growth_kib=Y-X max_growth_kib=M wall_s=T us_per_allreduce=U samples=[step:kib ...]

and the job exits 1 if any rank grew by more than ``--limit-kib`` from the baseline to the end
(or if a result was wrong), 0 otherwise. Results are checked exactly every ``--every`` steps.
"""

from __future__ import annotations

import argparse
import gc
import os
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
    parser.add_argument("--names", choices=["named", "unnamed", "mixed"], default="named",
                        help="fixed names per tensor, automatic names, or every other one")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    inputs = [np.full(args.elements, rank + i, np.float32) for i in range(args.tensors)]
    # Sum over ranks of (rank + i): exact in float32 for these sizes.
    wants = [np.full(args.elements, sum(r + i for r in range(size)), np.float32)
             for i in range(args.tensors)]  # fmt: skip
    names = [f"mem.{i}" if args.names == "named" or (args.names == "mixed" and i % 2 == 0)
             else None for i in range(args.tensors)]  # fmt: skip
    samples: list[tuple[int, int]] = []
    baseline = -1
    bad = ""
    start = time.monotonic()
    for step in range(1, args.steps + 1):
        handles = [hvd.allreduce_async(x, name=n, op=hvd.Sum)
                   for x, n in zip(inputs, names, strict=True)]  # fmt: skip
        results = [h.wait() for h in handles]
        if step % args.every == 0 or step == args.baseline:
            for i, (got, want) in enumerate(zip(results, wants, strict=True)):
                if not np.array_equal(got, want):
                    bad = bad or f"step {step} tensor {i}: got {got[:4]}, expected {want[:4]}"
            del results, handles
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
