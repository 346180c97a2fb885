"""T3 (CPU): the host cost of DistributedOptimizer's hooks, per parameter.

A model of N (1000) one-element parameters, ``loss = sum_k (p_k * x_k).sum()`` (one small
autograd node per parameter, like a model of many small layers), trained a step at a time:
``zero_grad()``, forward, ``backward()``, ``step()`` (SGD). Variants, each on its own copy of
the model, in alternating blocks, ranks meeting at a barrier before every step, the slowest
rank per step counted, medians reported:

- no communication: the plain optimizer (the baseline);
- ``hvd.DistributedOptimizer`` as Horovod users write it (the defaults: buckets formed
  automatically, the gradients living in each bucket's buffer as views);
- the same with ``gradient_as_bucket_view=False`` (each bucket staged through its buffer);
- one allreduce per parameter, as Horovod does (``bucket_cap_mb`` below one parameter);
- torch DDP (gloo), when ``torch.distributed`` can start.

Before timing, every variant's gradients after one step are checked exactly against the
average over ranks of every rank's ``x_k`` (halves; exact for a power-of-two rank count).
Target (issue 17): (DistributedOptimizer - no communication) / N <= 10 us per parameter.

    mpiexec -n 2 python scripts/bench_t3.py --np 2 --json t3.json
"""

from __future__ import annotations

import os
from typing import Any

import _benchlib as bl
import numpy as np
import torch
from mpi4py import MPI
from torch import nn

import hvdlite.torch as hvd

TARGET_US = 10.0
NO_COMM = "no communication"
HVD = "DistributedOptimizer"
VIEW = "DistributedOptimizer, gradient_as_bucket_view=False"
PER_PARAM = "DistributedOptimizer, one allreduce per parameter"
DDP = "torch DDP (gloo)"


class Tiny(nn.Module):
    """N one-element parameters, each used by one multiply."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(n)])

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([(p * x).sum() for p, x in zip(self.ps, xs, strict=True)]).sum()


def rank_inputs(seed: int, rank: int, n: int) -> list[torch.Tensor]:
    rng = bl.rank_rng(seed, rank)
    return [torch.tensor([v], dtype=torch.float32) for v in rng.integers(-16, 17, n) / 2]


def expected_grads(seed: int, size: int, n: int) -> np.ndarray:
    acc = np.zeros(n)
    for r in range(size):
        acc += np.array([float(x) for x in rank_inputs(seed, r, n)])
    return (acc / size).astype(np.float32)


def ddp_start(comm: MPI.Comm) -> bool:
    """Start torch.distributed (gloo) over TCP on this host; False if it cannot."""
    import torch.distributed as dist

    port = comm.bcast(bl_free_port() if comm.Get_rank() == 0 else None, root=0)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=comm.Get_rank(), world_size=comm.Get_size())
    except (RuntimeError, ValueError) as exc:
        if comm.Get_rank() == 0:
            print(f"torch DDP baseline skipped: {exc}")
        return False
    return True


def bl_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Variant:
    """One model copy, its optimizer and one training step."""

    def __init__(self, name: str, n: int, xs: list[torch.Tensor], ddp: bool = False,
                 **opt_kwargs: Any) -> None:
        self.name = name
        self.model: nn.Module = Tiny(n)
        base: torch.optim.Optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.opt: torch.optim.Optimizer
        if ddp:
            self.model = nn.parallel.DistributedDataParallel(self.model)
            base = torch.optim.SGD(self.model.parameters(), lr=1e-3)
            self.opt = base
        elif opt_kwargs.pop("plain", False):
            self.opt = base
        else:
            self.opt = hvd.DistributedOptimizer(
                base, named_parameters=self.model.named_parameters(), **opt_kwargs)
        self.xs = xs

    def step(self) -> None:
        self.opt.zero_grad()
        self.model(self.xs).backward()
        self.opt.step()

    def grads(self) -> np.ndarray:
        return np.array([float(p.grad) if p.grad is not None else np.nan
                         for p in self.model.parameters()], dtype=np.float32)


def main() -> None:
    bl.install_abort_hook()
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=1000, help="tiny parameters in the model")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--block", type=int, default=3, help="steps per variant before switching")
    p.add_argument("--no-ddp", action="store_true", help="skip the torch DDP baseline")
    args = p.parse_args()
    if args.quick:
        args.params, args.steps = 100, 4
    comm = MPI.COMM_WORLD
    bl.check_size(comm, args.np)
    meta = bl.run_metadata(comm, args)
    torch.set_num_threads(1)
    hvd.init()
    n = args.params
    xs = rank_inputs(args.seed, comm.Get_rank(), n)
    variants = [Variant(NO_COMM, n, xs, plain=True), Variant(HVD, n, xs),
                Variant(VIEW, n, xs, gradient_as_bucket_view=False),
                Variant(PER_PARAM, n, xs, bucket_cap_mb=1 / 2**20)]
    if not args.no_ddp and ddp_start(comm):
        variants.append(Variant(DDP, n, xs, ddp=True))
    check(comm, variants, args.seed, n)
    samples = bl.time_round_robin(
        comm, {v.name: v.step for v in variants}, args.steps, warmup=1, block=args.block
    )
    check(comm, variants, args.seed, n)
    hvd.shutdown()
    report(comm, args, meta, {k: bl.stats(v) for k, v in samples.items()}, n)


def check(comm: MPI.Comm, variants: list[Variant], seed: int, n: int) -> None:
    """One step of each variant; refuse unless its gradients are exact."""
    expected = expected_grads(seed, comm.Get_size(), n)
    own = np.array([float(x) for x in rank_inputs(seed, comm.Get_rank(), n)], np.float32)
    for v in variants:
        v.step()
        miss = bl.close(v.grads(), own if v.name == NO_COMM else expected, rtol=0, atol=0)
        bl.check_all(comm, not miss, f"gradients of {v.name}", miss)


def report(comm: MPI.Comm, args: Any, meta: dict[str, Any], results: dict[str, Any],
           n: int) -> None:
    base = results[NO_COMM]["median_s"]

    def per(k: str) -> float:
        return (results[k]["median_s"] - base) / n * 1e6

    rows = [[k, bl.ms(st["median_s"]), bl.ms(st["p99_s"]),
             "" if k == NO_COMM else round(per(k), 2)] for k, st in results.items()]
    overhead = per(HVD)
    verdict = {"target": f"{HVD}: hook cost <= {TARGET_US} us per parameter",
               "us_per_param": overhead, "met": overhead <= TARGET_US}
    bl.write_json(comm, args.json, {"benchmark": "T3 (CPU)", "run": bl.run_metadata(comm, args),
                                   "params": n, "results": results, "target": verdict,
                                   "started": meta["date_utc"],
                                   "omp_num_threads": os.environ.get("OMP_NUM_THREADS")})
    if comm.Get_rank() == 0:
        print(bl.format_table(["variant", "median ms per step", "p99 ms per step",
                               "us per parameter over no communication"], rows))
        print(f"{'MET   ' if verdict['met'] else 'MISSED'} {verdict['target']}: "
              f"{overhead:.2f} us")


if __name__ == "__main__":
    main()
