"""C6: small allreduce latency: one 4-byte float32 tensor, sync, call to result, p50 and p99.

hvdlite ``allreduce(x, out=o)`` against raw mpi4py ``Allreduce(x, o)`` on the same buffers, in
alternating blocks so that drift on a shared machine hits both alike. Every call is timed on
its own; percentiles are per rank, and the worst rank is reported. Targets: hvdlite p50 <= 50
us, p99 <= 200 us.

    mpiexec -n 2 python scripts/bench_c6.py --np 2 --json c6.json
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import _benchlib as bl
import numpy as np
from mpi4py import MPI

import hvdlite as hvd

HVD = "hvdlite allreduce (sync)"
RAW = "mpi4py Allreduce"


def timed_calls(fn: Callable[[], object], count: int, into: list[float]) -> None:
    """Append the duration of each of ``count`` calls of ``fn`` to ``into``."""
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        into.append(time.perf_counter() - t0)


def check(
    comm: MPI.Comm,
    fns: dict[str, Callable[[], object]],
    out: np.ndarray,
    ref: np.ndarray,
    when: str,
) -> None:
    """Poison the output, call each variant once, compare with every rank's inputs."""
    for name, fn in fns.items():
        out.fill(np.nan)
        fn()
        problem = bl.close(out, ref)
        bl.check_all(comm, not problem, f"{name} ({when})", problem)


def main() -> None:
    bl.install_abort_hook()
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5000, help="timed calls per variant")
    p.add_argument("--block", type=int, default=250, help="calls per variant before switching")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls per variant")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.block, args.warmup = 100, 50, 10
    world = MPI.COMM_WORLD
    bl.check_size(world, args.np)
    bl.run_metadata(world, args)
    comm = world.Dup()
    hvd.init()
    x = bl.nonzero_uniform(bl.rank_rng(args.seed, comm.Get_rank()), 1)
    ref = bl.sum_over_ranks(args.seed, comm.Get_size(), 1).astype(np.float32)
    out = np.full(1, np.nan, np.float32)
    fns: dict[str, Callable[[], object]] = {
        HVD: lambda: hvd.allreduce(x, name="c6.x", op=hvd.Sum, out=out),
        RAW: lambda: comm.Allreduce(x, out, op=MPI.SUM),
    }
    check(comm, fns, out, ref, "before timing")
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        timed_calls(fn, args.warmup, [])
    while len(samples[HVD]) < args.repeats:
        for name, fn in fns.items():
            comm.Barrier()
            timed_calls(fn, min(args.block, args.repeats - len(samples[name])), samples[name])
    check(comm, fns, out, ref, "after timing")
    hvd.shutdown()
    report(comm, args, {k: np.asarray(v) for k, v in samples.items()})


def report(comm: MPI.Comm, args: Any, samples: dict[str, np.ndarray]) -> None:
    """Per-rank stats gathered to rank 0; worst-rank p50/p99 decide the targets."""
    mine = {k: bl.stats(v) for k, v in samples.items()}
    per_rank = bl.gather_to_root(comm, mine)
    if per_rank is None:
        return
    worst = {
        k: {q: max(pr[k][q] for pr in per_rank) for q in ("median_s", "p99_s")} for k in samples
    }
    h = worst[HVD]
    tl = [
        {
            "target": "hvdlite p50 <= 50 us (worst rank)",
            "value": bl.us(h["median_s"]),
            "met": h["median_s"] <= 50e-6,
        },
        {
            "target": "hvdlite p99 <= 200 us (worst rank)",
            "value": bl.us(h["p99_s"]),
            "met": h["p99_s"] <= 200e-6,
        },
    ]
    payload = {
        "benchmark": "C6",
        "meta": bl.run_metadata(comm, args),
        "per_rank": per_rank,
        "worst_rank": worst,
        "targets": tl,
    }
    bl.write_json(comm, args.json, payload)
    raw = worst[RAW]
    rows = [
        [
            k,
            bl.us(w["median_s"]),
            bl.us(w["p99_s"]),
            w["median_s"] / raw["median_s"],
            w["p99_s"] / raw["p99_s"],
        ]
        for k, w in worst.items()
    ]
    heads = ["variant", "p50 us", "p99 us", "p50 x raw", "p99 x raw"]
    title = (
        f"C6 4-byte allreduce latency: {args.repeats} calls per variant, "
        f"{comm.Get_size()} ranks (worst rank's percentiles)"
    )
    tlines = bl.format_targets(tl)
    print(f"{title}\n{tlines}\n{bl.format_table(heads, rows)}", flush=True)


if __name__ == "__main__":
    main()
