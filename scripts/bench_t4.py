"""T4 (CPU): the cost of hvdlite.torch's own layer, against hvdlite's NumPy API in the same launch.

Three shapes, each run through ``hvdlite.torch`` on torch CPU tensors and through hvdlite's
NumPy API on NumPy arrays over the *same memory* (``t.numpy()``), op Average, in alternating
blocks so drift on a shared machine hits both alike; ranks meet at a barrier before every
step, each step is timed on every rank and the slowest rank counts; medians are reported:

- tiny: N (1000) one-element float32 tensors, every one ``allreduce_async`` then
  ``synchronize`` each (new outputs), and the in-place form ``allreduce_async_``;
- sync: one 4-byte tensor, ``hvd.allreduce`` (a new tensor) and ``hvd.allreduce_`` (in
  place), one call per step;
- resnet50: the ResNet-50 gradient set (161 float32 tensors, 102 MB), ``allreduce_async``
  of every tensor then ``synchronize`` each;
- grouped: the set's count of one-element tensors (161; the call's host cost without its
  payload), one blocking ``grouped_allreduce`` per step, and the persistent form a repeated
  grouped call opts into (``hvdlite.torch.grouped_allreduce_init``: its agreed schedule).

Every variant's results are checked exactly (values are multiples of 1/2, so the sums and the
averages over a power-of-two rank count are exact; otherwise to 1e-6) against the average of
every rank's inputs before and after timing. Targets (issue 17): tiny and sync <= 1.2x the
NumPy API per tensor.

    mpiexec -n 2 python scripts/bench_t4.py --np 2 --json t4.json

Where a variant's host time goes: ``--profile "tiny (1000 x 4 B): hvdlite.torch allreduce_async"``
(names as the table prints them, comma-separated) runs it again under ``cProfile`` on every
rank after its timing and prints rank 0's functions by own time (also in the JSON).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _benchlib as bl
import numpy as np
import torch
from mpi4py import MPI

import hvdlite
import hvdlite.torch as hvd

TARGET_X = 1.2
Step = Callable[[], list[Any]]


def inputs(seed: int, rank: int, shapes: list[tuple[int, ...]], salt: int) -> list[np.ndarray]:
    """Rank ``rank``'s float32 inputs: halves in [-8, 8] (sums of a few are exact)."""
    rng = bl.rank_rng(seed, rank, salt)
    return [(rng.integers(-16, 17, size=s) / 2).astype(np.float32) for s in shapes]


def averages(seed: int, size: int, shapes: list[tuple[int, ...]], salt: int) -> list[np.ndarray]:
    """The expected Average of every rank's :func:`inputs` (float64, then float32)."""
    acc = [np.zeros(s, np.float64) for s in shapes]
    for r in range(size):
        for a, x in zip(acc, inputs(seed, r, shapes, salt), strict=True):
            a += x
    return [(a / size).astype(np.float32) for a in acc]


class Case:
    """One shape: torch tensors, NumPy views of the same memory, the expected results and
    the variants (name -> one step returning its results)."""

    def __init__(self, label: str, shapes: list[tuple[int, ...]], args: Any, salt: int) -> None:
        comm = MPI.COMM_WORLD
        self.label = label
        self.tensors = [torch.from_numpy(x) for x in inputs(args.seed, comm.Get_rank(), shapes,
                                                             salt)]
        self.arrays = [t.numpy() for t in self.tensors]
        self.expected = averages(args.seed, comm.Get_size(), shapes, salt)
        self.variants: dict[str, Step] = {}

    def check(self, when: str) -> None:
        """Run every variant once and refuse (collectively) unless all results match."""
        for name, step in self.variants.items():
            got = [np.asarray(r) for r in step()]
            bad = [bl.close(g, e, rtol=1e-6, atol=0.0)
                   for g, e in zip(got, self.expected, strict=True)]
            miss = next((b for b in bad if b), "")
            bl.check_all(MPI.COMM_WORLD, not miss, f"{self.label}: {name} ({when})", miss)


def async_step(fn: Callable[..., Any], sync: Callable[[Any], Any], xs: list[Any],
               names: list[str]) -> Step:
    def step() -> list[Any]:
        handles = [fn(x, name=n) for x, n in zip(xs, names, strict=True)]
        return [sync(h) for h in handles]
    return step


def tiny_case(args: Any) -> Case:
    n = 100 if args.quick else args.tensors
    case = Case(f"tiny ({n} x 4 B)", [(1,)] * n, args, 1)
    ts, arrs = case.tensors, case.arrays
    names = [f"t4.tiny.{i}" for i in range(n)]
    case.variants = {
        "hvdlite.torch allreduce_async": async_step(
            hvd.allreduce_async, hvd.synchronize, ts, [f"{k}.ta" for k in names]),
        "NumPy API allreduce_async": async_step(
            hvdlite.allreduce_async, hvdlite.synchronize, arrs, [f"{k}.na" for k in names]),
        "hvdlite.torch allreduce_async_": async_step(
            hvd.allreduce_async_, hvd.synchronize, ts, [f"{k}.ti" for k in names]),
        "NumPy API allreduce_async_": async_step(
            hvdlite.allreduce_async_, hvdlite.synchronize, arrs, [f"{k}.ni" for k in names]),
    }
    return case


def sync_case(args: Any) -> Case:
    case = Case("sync (1 x 4 B)", [(1,)], args, 2)
    t, a = case.tensors[0], case.arrays[0]
    case.variants = {
        "hvdlite.torch allreduce": lambda: [hvd.allreduce(t, name="t4.sync.t")],
        "NumPy API allreduce": lambda: [hvdlite.allreduce(a, name="t4.sync.n")],
        "hvdlite.torch allreduce_": lambda: [hvd.allreduce_(t, name="t4.sync.ti")],
        "NumPy API allreduce_": lambda: [hvdlite.allreduce_(a, name="t4.sync.ni")],
    }
    return case


def resnet_case(args: Any) -> Case:
    shapes = [s for _, s in bl.load_shapes("resnet50", 16 if args.quick else None)]
    case = Case(f"resnet50 ({len(shapes)} tensors)", shapes, args, 3)
    names = [f"t4.r50.{i}" for i in range(len(shapes))]
    case.variants = {
        "hvdlite.torch allreduce_async": async_step(
            hvd.allreduce_async, hvd.synchronize, case.tensors, [f"{k}.t" for k in names]),
        "NumPy API allreduce_async": async_step(
            hvdlite.allreduce_async, hvdlite.synchronize, case.arrays, [f"{k}.n" for k in names]),
    }
    return case


def grouped_case(args: Any) -> Case:
    n = len(bl.load_shapes("resnet50", 16 if args.quick else None))
    case = Case(f"grouped ({n} x 4 B)", [(1,)] * n, args, 4)
    ts, arrs = case.tensors, case.arrays
    # Collective: every rank builds it at the same point (its check exchange).
    persist = hvd.grouped_allreduce_init(ts, name="t4.grouped.p")
    case.variants = {
        "hvdlite.torch grouped_allreduce": lambda: hvd.grouped_allreduce(
            ts, name="t4.grouped.t"),
        "NumPy API grouped_allreduce": lambda: hvdlite.grouped_allreduce(
            arrs, name="t4.grouped.n"),
        "hvdlite.torch grouped_allreduce_init (persistent)": persist,
    }
    return case


def main() -> None:
    bl.install_abort_hook()
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=1000, help="tiny tensors per step")
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant (tiny)")
    p.add_argument("--sync-calls", type=int, default=3000, help="timed sync calls per variant")
    p.add_argument("--resnet-steps", type=int, default=6, help="timed steps per variant")
    p.add_argument("--grouped-calls", type=int, default=300,
                   help="timed grouped calls per variant (the ResNet-50 set's count of tiny "
                        "tensors)")
    p.add_argument("--cache-capacity", type=int, default=None,
                   help="hvdlite's cache_capacity (default: its own). The tiny case's four "
                        "variants use 4,000 names in turn: past the default 1,024, every call "
                        "is a cache miss; 8192 keeps each variant's step cached, as a training "
                        "step's names are")
    p.add_argument("--profile", default="",
                   help="comma-separated variant names to profile after timing (cProfile, "
                        "every rank, rank 0's table printed and in the JSON)")
    args = p.parse_args()
    if args.quick:
        args.steps, args.sync_calls, args.resnet_steps, args.grouped_calls = 6, 200, 2, 20
    comm = MPI.COMM_WORLD
    bl.check_size(comm, args.np)
    meta = bl.run_metadata(comm, args)
    torch.set_num_threads(1)
    hvd.init(**({} if args.cache_capacity is None else {"cache_capacity": args.cache_capacity}))
    plan = [(tiny_case(args), args.steps, 5), (sync_case(args), args.sync_calls, 100),
            (resnet_case(args), args.resnet_steps, 1),
            (grouped_case(args), args.grouped_calls, 20)]
    results: dict[str, Any] = {}
    counts: dict[str, int] = {}
    wanted = bl.split_names(args.profile, [f"{c.label}: {k}" for c, _, _ in plan
                                           for k in c.variants])
    missing = sorted(set(wanted) - {f"{c.label}: {k}" for c, _, _ in plan for k in c.variants})
    bl.check_all(comm, not missing, "--profile", f"no such variant: {missing} (names are "
                 "'<case>: <variant>' as the table prints them)")
    profiles: dict[str, Any] = {}
    for case, steps, block in plan:
        case.check("before timing")
        samples = bl.time_round_robin(comm, case.variants, steps, warmup=2, block=block)
        case.check("after timing")
        results[case.label] = {k: bl.stats(v) for k, v in samples.items()}
        counts[case.label] = len(case.tensors)
        mine = [w for w in wanted if w.startswith(f"{case.label}: ")]
        if mine:
            variants = {f"{case.label}: {k}": fn for k, fn in case.variants.items()}
            profiles.update(bl.profile_variants(comm, variants, mine, max(steps // 4, 2)))
    hvd.shutdown()
    if profiles and comm.Get_rank() == 0:
        print(bl.format_profile(profiles), flush=True)
        meta["profiles"] = profiles
    report(comm, args, meta, results, counts, (plan[0][0].label, plan[1][0].label))


def report(comm: MPI.Comm, args: Any, meta: dict[str, Any], results: dict[str, Any],
           counts: dict[str, int], targeted: tuple[str, ...]) -> None:
    """Rank 0: the JSON, the table (per step and per tensor) and the target verdicts."""
    rows, verdicts = [], []
    for label, variants in results.items():
        for name, st in variants.items():
            base = name.replace("hvdlite.torch", "NumPy API")
            ratio = (st["median_s"] / variants[base]["median_s"]
                     if base != name and base in variants else None)
            rows.append([label, name, bl.us(st["median_s"]), bl.us(st["p99_s"]),
                         bl.us(st["median_s"] / counts[label]),
                         "" if ratio is None else f"{ratio:.2f}x"])
            if label in targeted and ratio is not None and not name.endswith("_"):
                verdicts.append({"target": f"{label}: {name} <= {TARGET_X}x the NumPy API",
                                 "ratio": ratio, "met": ratio <= TARGET_X})
    payload = {"benchmark": "T4 (CPU)", "run": bl.run_metadata(comm, args),
               "tensors_per_step": counts, "results": results, "targets": verdicts,
               "started": meta["date_utc"], "profiles": meta.get("profiles", {})}
    bl.write_json(comm, args.json, payload)
    if comm.Get_rank() == 0:
        print(bl.format_table(["shape", "variant", "median us per step", "p99 us per step",
                               "median us per tensor", "vs NumPy API"], rows))
        for v in verdicts:
            print(f"{'MET   ' if v['met'] else 'MISSED'} {v['target']}: {v['ratio']:.2f}x")


if __name__ == "__main__":
    main()
