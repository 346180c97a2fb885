"""C1: the ResNet-50 gradient set on numpy, every tensor ``allreduce_async`` then wait all.

Baselines in the same launch, on the same data: raw mpi4py ``Allreduce`` on one pre-fused
buffer (the limit: no negotiation, no fusion copies) and raw ``Allreduce`` per tensor.
Targets (2 ranks): hvdlite <= 1.3x the limit and <= 0.5x raw per tensor.

    mpiexec -n 2 python scripts/bench_c1.py --np 2 --json c1.json
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import _benchlib as bl
import numpy as np
from mpi4py import MPI

import hvdlite as hvd

LIMIT = "MPI Allreduce, pre-fused (limit)"
PER_TENSOR = "MPI Allreduce per tensor"
ASYNC_NEW = "hvdlite allreduce_async (new outputs)"
ASYNC_OUT = "hvdlite allreduce_async(out=)"
GROUPED = "hvdlite grouped_allreduce"


def rank_input(seed: int, rank: int, total: int) -> np.ndarray:
    """One rank's gradients, all tensors back to back (float32, never zero)."""
    return bl.nonzero_uniform(bl.rank_rng(seed, rank), total)


def reference(seed: int, size: int, total: int, average: bool) -> np.ndarray:
    """The expected reduction, rebuilt from every rank's inputs in float64."""
    acc = bl.sum_over_ranks(seed, size, total)
    if average:
        acc /= size
    return acc.astype(np.float32)


class Case:
    """The buffers of one run and one step function per variant."""

    def __init__(self, args: Any, comm: MPI.Comm) -> None:
        self.comm = comm
        self.average = args.op == "average"
        self.op = hvd.Average if self.average else hvd.Sum
        self.shapes = bl.load_shapes(args.set, args.tensors)
        self.names = [f"c1.{n}" for n, _ in self.shapes]
        total = sum(math.prod(s) for _, s in self.shapes)
        self.fused_in = rank_input(args.seed, comm.Get_rank(), total)
        self.fused_out = np.full_like(self.fused_in, np.nan)
        self.inputs = bl.split(self.fused_in, self.shapes)
        self.outs = [np.full_like(t, np.nan) for t in self.inputs]
        self.new_outs: list[np.ndarray] = []
        self.grouped_outs: list[np.ndarray] = []
        self.inv_size = np.float32(1.0 / comm.Get_size())

    def limit(self) -> None:
        self.comm.Allreduce(self.fused_in, self.fused_out, op=MPI.SUM)
        if self.average:
            np.multiply(self.fused_out, self.inv_size, out=self.fused_out)

    def per_tensor(self) -> None:
        for t, o in zip(self.inputs, self.outs, strict=True):
            self.comm.Allreduce(t, o, op=MPI.SUM)
            if self.average:
                np.multiply(o, self.inv_size, out=o)

    def async_out(self) -> None:
        handles = [
            hvd.allreduce_async(t, name=n, op=self.op, out=o)
            for t, n, o in zip(self.inputs, self.names, self.outs, strict=True)
        ]
        for h in handles:
            h.wait()

    def async_new(self) -> None:
        handles = [
            hvd.allreduce_async(t, name=n, op=self.op)
            for t, n in zip(self.inputs, self.names, strict=True)
        ]
        self.new_outs = [h.wait() for h in handles]

    def grouped(self) -> None:
        self.grouped_outs = hvd.grouped_allreduce(self.inputs, name="c1.grouped", op=self.op)

    def variants(self) -> dict[str, tuple[Callable[[], None], Callable[[], list[np.ndarray]]]]:
        """name -> (step, the outputs that step produced)."""
        return {
            LIMIT: (self.limit, lambda: [self.fused_out]),
            PER_TENSOR: (self.per_tensor, lambda: self.outs),
            ASYNC_NEW: (self.async_new, lambda: self.new_outs),
            ASYNC_OUT: (self.async_out, lambda: self.outs),
            GROUPED: (self.grouped, lambda: self.grouped_outs),
        }

    def clear(self) -> None:
        """Poison every output so a variant that writes nothing cannot pass the check."""
        self.fused_out.fill(np.nan)
        for o in self.outs:
            o.fill(np.nan)
        self.new_outs, self.grouped_outs = [], []


def check(case: Case, ref: np.ndarray, when: str) -> None:
    """Run each variant once on poisoned outputs, compare with the reference; refuse on a miss."""
    for name, (step, outputs) in case.variants().items():
        case.clear()
        step()
        got = outputs()
        flat = np.concatenate([g.ravel() for g in got]) if got else np.empty(0, np.float32)
        problem = bl.close(flat, ref)
        bl.check_all(case.comm, not problem, f"{name} ({when})", problem)


def summarise(times: dict[str, np.ndarray], nbytes: int) -> dict[str, Any]:
    """Per-variant stats plus ratios to the limit and to raw per-tensor."""
    med = {k: float(np.median(v)) for k, v in times.items()}
    out: dict[str, Any] = {}
    for name, t in times.items():
        out[name] = {
            **bl.stats(t),
            "x_limit": med[name] / med[LIMIT],
            "x_per_tensor": med[name] / med[PER_TENSOR],
            "algbw_GBps": nbytes / med[name] / 1e9,
        }
    return out


def targets(res: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """C1 target lines for both hvdlite async variants (the limit ratio is set for 2 ranks)."""
    lines = []
    for name in (ASYNC_NEW, ASYNC_OUT):
        r = res[name]
        lines.append(
            {
                "target": f"{name}: <= 1.3x the limit"
                + ("" if size == 2 else " (set for 2 ranks)"),
                "value": round(r["x_limit"], 3),
                "met": r["x_limit"] <= 1.3,
            }
        )
        lines.append(
            {
                "target": f"{name}: <= 0.5x raw per tensor",
                "value": round(r["x_per_tensor"], 3),
                "met": r["x_per_tensor"] <= 0.5,
            }
        )
    return lines


def parse_args(doc: str) -> Any:
    """The C1 workload's arguments (shared with bench_c5, which times the same step)."""
    p = bl.base_parser(doc.splitlines()[0])
    p.add_argument("--set", choices=["resnet50", "bert_large"], default="resnet50")
    p.add_argument("--op", choices=["sum", "average"], default="sum")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tensors", type=int, default=None, help="use only the first N tensors")
    args = p.parse_args()
    if args.quick:
        args.reps, args.warmup, args.tensors = 3, 1, args.tensors or 30
    return args


def main() -> None:
    bl.install_abort_hook()
    args = parse_args(__doc__)
    world = MPI.COMM_WORLD
    bl.check_size(world, args.np)
    bl.run_metadata(world, args)
    comm = world.Dup()
    hvd.init()
    case = Case(args, comm)
    nbytes = case.fused_in.nbytes
    ref = reference(args.seed, comm.Get_size(), case.fused_in.size, case.average)
    check(case, ref, "before timing")
    steps = {name: step for name, (step, _) in case.variants().items()}
    times = bl.time_round_robin(comm, steps, args.reps, args.warmup)
    check(case, ref, "after timing")
    res = summarise(times, nbytes)
    tl = targets(res, comm.Get_size())
    note = bl.torch_note()
    payload = {
        "benchmark": "C1",
        "meta": bl.run_metadata(comm, args),
        "set": args.set,
        "tensors": len(case.shapes),
        "bytes": nbytes,
        "op": args.op,
        "results": res,
        "targets": tl,
        "notes": [note],
    }
    bl.write_json(comm, args.json, payload)
    rows = [
        [
            n,
            bl.ms(r["median_s"]),
            bl.ms(r["p99_s"]),
            r["x_limit"],
            r["x_per_tensor"],
            r["algbw_GBps"],
        ]
        for n, r in res.items()
    ]
    heads = ["variant", "median ms", "p99 ms", "x limit", "x per-tensor", "GB/s"]
    title = (
        f"C1 {args.set}: {len(case.shapes)} float32 tensors, {nbytes / 1e6:.1f} MB, "
        f"op={args.op}, {comm.Get_size()} ranks, {args.reps} reps (max over ranks)"
    )
    tlines = bl.format_targets(tl)
    bl.print0(comm, f"{title}\n{note}\n{tlines}\n{bl.format_table(heads, rows)}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
