"""C3: idle cost: CPU time an initialised but unused hvdlite burns, per rank.

The main thread sleeps for ``--seconds`` twice: first before ``hvd.init()`` (the baseline: the
same process, MPI initialised, no hvdlite), then with hvdlite initialised and idle. CPU time of
the whole process (``time.process_time``) and of the main thread (``time.thread_time``) are
read around each interval; what the other threads burn, over the wall interval, is hvdlite's
background cost. Target: <= 2% of one core per rank.

    mpiexec -n 2 python scripts/bench_c3.py --np 2 --json c3.json
"""

from __future__ import annotations

import time

import _benchlib as bl
import numpy as np
from mpi4py import MPI

import hvdlite as hvd


def idle_interval(comm: MPI.Comm, seconds: float) -> dict[str, float]:
    """Sleep ``seconds`` in the main thread; CPU use of the process and its threads over it."""
    comm.Barrier()
    w0, p0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    time.sleep(seconds)
    w1, p1, m1 = time.perf_counter(), time.process_time(), time.thread_time()
    wall = w1 - w0
    return {
        "wall_s": wall,
        "process_cpu_s": p1 - p0,
        "main_thread_cpu_s": m1 - m0,
        "process_core_frac": (p1 - p0) / wall,
        "other_threads_core_frac": ((p1 - p0) - (m1 - m0)) / wall,
    }


def check_engine(comm: MPI.Comm, seed: int) -> None:
    """One allreduce through hvdlite, checked against every rank's inputs, before measuring."""
    x = bl.nonzero_uniform(bl.rank_rng(seed, comm.Get_rank()), 256)
    got = hvd.allreduce(x, name="c3.check", op=hvd.Sum)
    ref = bl.sum_over_ranks(seed, comm.Get_size(), 256)
    problem = bl.close(got, ref.astype(np.float32))
    bl.check_all(comm, not problem, "hvdlite allreduce before the idle interval", problem)


def main() -> None:
    bl.install_abort_hook()
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0, help="length of each idle interval")
    p.add_argument("--settle", type=float, default=1.0, help="pause after init before measuring")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.settle = 1.0, 0.2
    world = MPI.COMM_WORLD
    bl.check_size(world, args.np)
    bl.run_metadata(world, args)
    comm = world.Dup()
    without = idle_interval(comm, args.seconds)
    hvd.init()
    check_engine(comm, args.seed)
    time.sleep(args.settle)
    idle = idle_interval(comm, args.seconds)
    hvd.shutdown()
    per_rank = bl.gather_to_root(comm, {"without_hvdlite": without, "hvdlite_idle": idle})
    if per_rank is None:
        return
    extra = [
        r["hvdlite_idle"]["process_core_frac"] - r["without_hvdlite"]["process_core_frac"]
        for r in per_rank
    ]
    worst = max(extra)
    tl = [
        {
            "target": "hvdlite idle: extra CPU <= 2% of one core per rank (worst rank)",
            "value": f"{worst * 100:.2f}%",
            "met": worst <= 0.02,
        }
    ]
    payload = {
        "benchmark": "C3",
        "meta": bl.run_metadata(comm, args),
        "per_rank": per_rank,
        "extra_core_frac_per_rank": extra,
        "targets": tl,
    }
    bl.write_json(comm, args.json, payload)
    rows = [
        [
            r,
            f"{d['without_hvdlite']['process_core_frac'] * 100:.2f}",
            f"{d['hvdlite_idle']['process_core_frac'] * 100:.2f}",
            f"{d['hvdlite_idle']['other_threads_core_frac'] * 100:.2f}",
            f"{extra[r] * 100:.2f}",
        ]
        for r, d in enumerate(per_rank)
    ]
    heads = ["rank", "without % core", "hvdlite idle % core", "non-main threads %", "extra %"]
    title = f"C3 idle cost: {args.seconds:g} s per interval, {comm.Get_size()} ranks"
    tlines = bl.format_targets(tl)
    print(f"{title}\n{tlines}\n{bl.format_table(heads, rows)}", flush=True)


if __name__ == "__main__":
    main()
