"""C4: GIL interference: a pure-Python loop in the main thread while hvdlite works.

A trial is ``--chunks`` units of pure-Python work (about 1 ms each). In the busy condition the
main thread submits ``--per-chunk`` 4-byte ``allreduce_async`` calls before each unit (1000 in
all by default) and waits for them after the last unit; only the work units are timed, so the
submit calls' own cost is reported apart and what the loop time shows is the background
thread's interference (GIL hand-offs, CPU it takes) while it negotiates and reduces. Conditions:
without hvdlite (before ``init`` and again after ``shutdown``), hvdlite idle, hvdlite busy; idle
and busy trials alternate. Targets: busy slowdown <= 15%, idle <= 5%, versus without.

    mpiexec -n 2 python scripts/bench_c4.py --np 2 --json c4.json
"""

from __future__ import annotations

import time
from typing import Any

import _benchlib as bl
import numpy as np
from mpi4py import MPI

import hvdlite as hvd


def spin(k: int) -> int:
    """Pure-Python work that holds the GIL throughout."""
    acc = 0
    for i in range(k):
        acc = (acc + i * i) % 1000003
    return acc


def calibrate(comm: MPI.Comm, unit_s: float) -> int:
    """Iterations of :func:`spin` for about ``unit_s`` seconds, agreed across ranks (rank 0's)."""
    k = 1000
    while True:
        t0 = time.perf_counter()
        spin(k)
        if time.perf_counter() - t0 >= 0.05:
            break
        k *= 2
    k = max(1, int(k * unit_s / (time.perf_counter() - t0)))
    return int(comm.bcast(k, root=0))


class Trials:
    """Inputs, outputs and the trial loop for every condition."""

    def __init__(self, comm: MPI.Comm, args: Any, k: int) -> None:
        self.comm, self.k = comm, k
        self.chunks, self.per_chunk = args.chunks, args.per_chunk
        n = self.chunks * self.per_chunk
        self.names = [f"c4.{i:05d}" for i in range(n)]
        vals = bl.nonzero_uniform(bl.rank_rng(args.seed, comm.Get_rank()), n)
        self.inputs = [vals[i : i + 1].copy() for i in range(n)]
        self.outs = [np.full(1, np.nan, np.float32) for _ in range(n)]
        self.ref = bl.sum_over_ranks(args.seed, comm.Get_size(), n).astype(np.float32)

    def run(self, busy: bool) -> dict[str, float]:
        """One trial; with ``busy`` the allreduces are submitted chunk by chunk, then waited."""
        handles = []
        work = submit = 0.0
        self.comm.Barrier()
        for c in range(self.chunks):
            if busy:
                t0 = time.perf_counter()
                lo = c * self.per_chunk
                for i in range(lo, lo + self.per_chunk):
                    handles.append(
                        hvd.allreduce_async(
                            self.inputs[i], name=self.names[i], op=hvd.Sum, out=self.outs[i]
                        )
                    )
                submit += time.perf_counter() - t0
            t0 = time.perf_counter()
            spin(self.k)
            work += time.perf_counter() - t0
        done_in_loop = sum(h.poll() for h in handles)
        for h in handles:
            h.wait()
        return {"work_s": work, "submit_s": submit, "done_during_loop": float(done_in_loop)}

    def check(self, what: str) -> None:
        """Poison the outputs, run a busy trial, compare with every rank's inputs."""
        for o in self.outs:
            o.fill(np.nan)
        self.run(busy=True)
        problem = bl.close(np.concatenate(self.outs), self.ref)
        bl.check_all(self.comm, not problem, what, problem)


def collect(trials: Trials, busy: bool | None, reps: int) -> list[dict[str, float]]:
    """``reps`` trials of one condition (``None``: without hvdlite, no submissions)."""
    return [trials.run(busy=bool(busy)) for _ in range(reps)]


def main() -> None:
    bl.install_abort_hook()
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=100, help="work units per trial")
    p.add_argument("--per-chunk", type=int, default=10, help="allreduces submitted per unit")
    p.add_argument("--unit-ms", type=float, default=1.0, help="length of one work unit")
    p.add_argument("--reps", type=int, default=20, help="trials per condition")
    p.add_argument("--warmup", type=int, default=2, help="untimed trials per condition")
    args = p.parse_args()
    if args.quick:
        args.chunks, args.per_chunk, args.reps, args.warmup = 10, 5, 3, 1
    world = MPI.COMM_WORLD
    bl.check_size(world, args.np)
    comm = world.Dup()
    k = calibrate(comm, args.unit_ms / 1e3)
    trials = Trials(comm, args, k)
    collect(trials, None, args.warmup)
    before = collect(trials, None, args.reps)
    hvd.init()
    trials.check("hvdlite allreduces before timing")
    for _ in range(args.warmup):
        trials.run(busy=False)
        trials.run(busy=True)
    idle, busy = [], []
    for _ in range(args.reps):
        idle.append(trials.run(busy=False))
        busy.append(trials.run(busy=True))
    trials.check("hvdlite allreduces after timing")
    hvd.shutdown()
    after = collect(trials, None, args.reps)
    report(
        comm,
        args,
        k,
        {
            "without (before init)": before,
            "without (after shutdown)": after,
            "hvdlite idle": idle,
            "hvdlite busy": busy,
        },
    )


def med(rows: list[dict[str, float]], key: str) -> float:
    return float(np.median([r[key] for r in rows]))


def report(comm: MPI.Comm, args: Any, k: int, cond: dict[str, list[dict[str, float]]]) -> None:
    """Gather every rank's medians, print the table, write the JSON (rank 0)."""
    mine = {
        name: {
            "work_median_s": med(rows, "work_s"),
            "submit_median_s": med(rows, "submit_s"),
            "done_during_loop_median": med(rows, "done_during_loop"),
            "work_s": [r["work_s"] for r in rows],
        }
        for name, rows in cond.items()
    }
    base = float(
        np.median(
            [
                r["work_s"]
                for n in ("without (before init)", "without (after shutdown)")
                for r in cond[n]
            ]
        )
    )
    per_rank = bl.gather_to_root(comm, {"conditions": mine, "baseline_work_median_s": base})
    if per_rank is None:
        return
    slow = {
        c: [
            pr["conditions"][c]["work_median_s"] / pr["baseline_work_median_s"] - 1
            for pr in per_rank
        ]
        for c in ("hvdlite idle", "hvdlite busy")
    }
    tl = [
        {
            "target": "busy slowdown <= 15% (worst rank)",
            "value": f"{max(slow['hvdlite busy']):.1%}",
            "met": max(slow["hvdlite busy"]) <= 0.15,
        },
        {
            "target": "idle slowdown <= 5% (worst rank)",
            "value": f"{max(slow['hvdlite idle']):.1%}",
            "met": max(slow["hvdlite idle"]) <= 0.05,
        },
    ]
    n = args.chunks * args.per_chunk
    payload = {
        "benchmark": "C4",
        "meta": bl.run_metadata(comm, args),
        "spin_iterations": k,
        "allreduces_per_trial": n,
        "per_rank": per_rank,
        "slowdown": slow,
        "targets": tl,
    }
    bl.write_json(comm, args.json, payload)
    rows = []
    for r, pr in enumerate(per_rank):
        for c in (
            "without (before init)",
            "without (after shutdown)",
            "hvdlite idle",
            "hvdlite busy",
        ):
            d = pr["conditions"][c]
            rows.append(
                [
                    r,
                    c,
                    bl.ms(d["work_median_s"]),
                    f"{d['work_median_s'] / pr['baseline_work_median_s'] - 1:+.1%}",
                    bl.ms(d["submit_median_s"]),
                    f"{d['done_during_loop_median']:.0f}",
                ]
            )
    heads = ["rank", "condition", "loop ms (median)", "vs without", "submit ms", "done in loop"]
    title = (
        f"C4 GIL interference: {args.chunks} x ~{args.unit_ms:g} ms Python units, {n} x 4-byte "
        f"allreduce_async when busy, {args.reps} trials, {comm.Get_size()} ranks"
    )
    tlines = bl.format_targets(tl)
    print(f"{title}\n{tlines}\n{bl.format_table(heads, rows)}", flush=True)


if __name__ == "__main__":
    main()
