"""C5: the timeline's cost on the CPU path: the C1 workload with the timeline on vs off.

Same launch, same buffers: blocks of C1's ``allreduce_async(out=)`` step with the timeline off
and on alternate (``start_timeline`` before an "on" block and ``stop_timeline`` after it, both
outside the timed steps; every rank writes its own file, and the writer thread runs during
the timed steps). Correctness is checked with the timeline on before timing. Target: <= 5%
slower with the timeline on.

    mpiexec -n 2 python scripts/bench_c5.py --np 2 --json c5.json
"""

from __future__ import annotations

import os
import tempfile
import time

import _benchlib as bl
import numpy as np
from bench_c1 import Case, parse_args, reference
from mpi4py import MPI

import hvdlite as hvd


def main() -> None:
    bl.install_abort_hook()
    args = parse_args(__doc__)
    world = MPI.COMM_WORLD
    bl.check_size(world, args.np)
    bl.run_metadata(world, args)  # records the start: date, commit, load
    comm = world.Dup()
    hvd.init()
    case = Case(args, comm)
    ref = reference(args.seed, comm.Get_size(), case.fused_in.size, case.average)
    tmp = tempfile.mkdtemp(prefix="hvdlite-c5-")
    path = os.path.join(tmp, "c5_{rank}.json")

    hvd.start_timeline(path)
    case.clear()
    case.async_out()
    hvd.stop_timeline()
    got = np.concatenate([o.ravel() for o in case.outs])
    problem = bl.close(got, ref)
    bl.check_all(comm, not problem, "allreduce_async(out=) with the timeline on", problem)

    for _ in range(args.warmup):
        case.async_out()
    per_block = max(args.reps // 4, 1)
    samples: dict[str, list[float]] = {"timeline off": [], "timeline on": []}
    for _ in range(max(args.reps // per_block, 1)):
        for label in samples:
            if label == "timeline on":
                hvd.start_timeline(path)
            for _ in range(per_block):
                comm.Barrier()
                t0 = time.perf_counter()
                case.async_out()
                samples[label].append(time.perf_counter() - t0)
            if label == "timeline on":
                hvd.stop_timeline()
    times = {k: bl.max_over_ranks(comm, np.array(v)) for k, v in samples.items()}
    med = {k: float(np.median(v)) for k, v in times.items()}
    ratio = med["timeline on"] / med["timeline off"]
    size = os.path.getsize(path.replace("{rank}", str(comm.Get_rank())))
    tl = [{"target": "timeline on / off <= 1.05", "value": round(ratio, 3), "met": ratio <= 1.05}]
    res = {k: bl.stats(v) for k, v in times.items()}
    bl.write_json(comm, args.json, {"benchmark": "C5", "meta": bl.run_metadata(comm, args),
                                    "results": res, "ratio": ratio, "targets": tl,
                                    "last_trace_bytes": size})
    rows = [[k, bl.ms(r["median_s"]), bl.ms(r["p99_s"])] for k, r in res.items()]
    title = (f"C5 timeline cost on C1 ({len(case.shapes)} tensors, {comm.Get_size()} ranks, "
             f"{len(samples['timeline on'])} steps each; last trace block: {size} bytes)")
    bl.print0(comm, f"{title}\n{bl.format_targets(tl)}\n"
                         f"{bl.format_table(['variant', 'median ms', 'p99 ms'], rows)}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
