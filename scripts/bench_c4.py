"""C4: GIL interference: a pure-Python loop in the main thread while hvdlite works.

A trial is ``--chunks`` units of pure-Python work (about 1 ms each). In the busy condition the
main thread submits ``--per-chunk`` 4-byte ``allreduce_async`` calls before each unit (1000 in
all by default) and waits for them after the last unit; only the work units are timed, so the
submit calls' own cost is reported apart and what the loop time shows is the background
thread's interference (GIL hand-offs, CPU it takes) while it negotiates and reduces. Each
cycle runs one trial of every condition in turn: without hvdlite, then ``init``, a settle pause,
idle, busy, idle right after busy, ``shutdown``; a slowdown is the median over cycles of the
loop time over the same cycle's time without hvdlite. Targets: busy <= 15%, idle <= 5%.

    mpiexec -n 2 python scripts/bench_c4.py --np 2 --json c4.json
"""

from __future__ import annotations

import time
from typing import Any

import _benchlib as bl
import numpy as np
from mpi4py import MPI

import hvdlite as hvd

WITHOUT = "without hvdlite"
IDLE = "hvdlite idle (settled)"
BUSY = "hvdlite busy"
AFTER_BUSY = "hvdlite idle, right after busy"
CONDITIONS = (WITHOUT, IDLE, BUSY, AFTER_BUSY)


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

    def run_checked(self, what: str = "a timed busy trial") -> dict[str, float]:
        """A busy trial on poisoned outputs, then compared with every rank's inputs."""
        for o in self.outs:
            o.fill(np.nan)
        result = self.run(busy=True)
        problem = bl.close(np.concatenate(self.outs), self.ref)
        bl.check_all(self.comm, not problem, what, problem)
        return result


def main() -> None:
    bl.install_abort_hook()
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=100, help="work units per trial")
    p.add_argument("--per-chunk", type=int, default=10, help="allreduces submitted per unit")
    p.add_argument("--unit-ms", type=float, default=1.0, help="length of one work unit")
    p.add_argument("--reps", type=int, default=20, help="timed cycles (one trial per condition)")
    p.add_argument("--warmup", type=int, default=2, help="untimed cycles")
    p.add_argument("--settle", type=float, default=0.5, help="seconds idle after init")
    args = p.parse_args()
    if args.quick:
        args.chunks, args.per_chunk, args.reps, args.warmup, args.settle = 10, 5, 3, 1, 0.05
    world = MPI.COMM_WORLD
    bl.check_size(world, args.np)
    bl.run_metadata(world, args)
    comm = world.Dup()
    k = calibrate(comm, args.unit_ms / 1e3)
    trials = Trials(comm, args, k)
    hvd.init()
    trials.run_checked("hvdlite allreduces before timing")
    hvd.shutdown()
    for _ in range(args.warmup):
        cycle(trials, args.settle)
    rows = [cycle(trials, args.settle) for _ in range(args.reps)]
    report(comm, args, k, {c: [r[c] for r in rows] for c in CONDITIONS})


def cycle(trials: Trials, settle: float) -> dict[str, dict[str, float]]:
    """One trial of every condition, in order: without, init, idle, busy, idle again, shutdown."""
    out = {WITHOUT: trials.run(busy=False)}
    hvd.init()
    time.sleep(settle)
    out[IDLE] = trials.run(busy=False)
    out[BUSY] = trials.run_checked()
    out[AFTER_BUSY] = trials.run(busy=False)
    hvd.shutdown()
    return out


def med(rows: list[dict[str, float]], key: str) -> float:
    return float(np.median([r[key] for r in rows]))


def paired_slowdown(cond: dict[str, list[dict[str, float]]], name: str) -> float:
    """Median over cycles of (loop time / the same cycle's loop time without hvdlite) - 1."""
    ratios = [c["work_s"] / w["work_s"] for c, w in zip(cond[name], cond[WITHOUT], strict=True)]
    return float(np.median(ratios)) - 1


def report(comm: MPI.Comm, args: Any, k: int, cond: dict[str, list[dict[str, float]]]) -> None:
    """Gather every rank's medians, print the table, write the JSON (rank 0)."""
    mine = {
        name: {
            "work_median_s": med(rows, "work_s"),
            "slowdown": paired_slowdown(cond, name),
            "submit_median_s": med(rows, "submit_s"),
            "done_during_loop_median": med(rows, "done_during_loop"),
            "work_s": [r["work_s"] for r in rows],
        }
        for name, rows in cond.items()
    }
    per_rank = bl.gather_to_root(comm, mine)
    if per_rank is None:
        return
    worst = {c: max(pr[c]["slowdown"] for pr in per_rank) for c in CONDITIONS}
    tl = [
        {
            "target": "busy slowdown <= 15% (worst rank)",
            "value": f"{worst[BUSY]:.1%}",
            "met": worst[BUSY] <= 0.15,
        },
        {
            "target": "idle slowdown <= 5% (worst rank)",
            "value": f"{worst[IDLE]:.1%}",
            "met": worst[IDLE] <= 0.05,
        },
    ]
    n = args.chunks * args.per_chunk
    payload = {
        "benchmark": "C4",
        "meta": bl.run_metadata(comm, args),
        "spin_iterations": k,
        "allreduces_per_trial": n,
        "per_rank": per_rank,
        "worst_slowdown": worst,
        "targets": tl,
    }
    bl.write_json(comm, args.json, payload)
    rows = [
        [
            r,
            c,
            bl.ms(pr[c]["work_median_s"]),
            f"{pr[c]['slowdown']:+.1%}",
            bl.ms(pr[c]["submit_median_s"]),
            f"{pr[c]['done_during_loop_median']:.0f}",
        ]
        for r, pr in enumerate(per_rank)
        for c in CONDITIONS
    ]
    heads = [
        "rank",
        "condition",
        "loop ms (median)",
        "vs without (paired)",
        "submit ms",
        "done in loop",
    ]
    title = (
        f"C4 GIL interference: {args.chunks} x ~{args.unit_ms:g} ms Python units, {n} x 4-byte "
        f"allreduce_async when busy, {args.reps} cycles, {comm.Get_size()} ranks"
    )
    print(f"{title}\n{bl.format_targets(tl)}\n{bl.format_table(heads, rows)}", flush=True)


if __name__ == "__main__":
    main()
