"""Every collective, exact, on a job that spans hosts: the global set, a set on one host and
a set that spans hosts. Inputs are a function of (rank, case), so every rank computes every
expected result with NumPy. Writes ``<out>/rank-<r>.json`` (placement and the cases run);
any wrong result raises (the rank fails, and with it the job).

    hvdliterun -np 4 -H a:2,b:2 --tcp -- python mh_collectives.py OUT
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np

import hvdlite as hvd

DTYPES = ("int32", "int64", "float32", "float64")


def data(rank: int, case: int, rows: int, dtype: str) -> np.ndarray:
    base = np.arange(rows * 3, dtype=np.int64).reshape(rows, 3)
    return ((base * (rank + 2) + case) % 97 + 1).astype(dtype)  # small ints: exact sums


def check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        raise AssertionError(f"rank {hvd.rank()}: {what}: got {got!r}, want {want!r}")


def run_set(tag: str, ranks: list[int], pset: object) -> int:
    me, n, cases = hvd.rank(), len(ranks), 0
    for k, dtype in enumerate(DTYPES):
        c = 10 * k
        x = {r: data(r, c, 2 * n, dtype) for r in ranks}
        stack = np.stack([x[r] for r in ranks])
        for label, op, ref in (("sum", hvd.Sum, stack.sum(0)), ("min", hvd.Min, stack.min(0)),
                               ("max", hvd.Max, stack.max(0))):
            got = hvd.allreduce(x[me], name=f"{tag}.ar.{label}.{dtype}", op=op,
                                process_set=pset)
            check(got, ref.astype(dtype), f"{tag} allreduce {label} {dtype}")
        small = {r: (x[r] % 3 + 1) for r in ranks}
        prod = np.prod(np.stack([small[r] for r in ranks]), 0).astype(dtype)
        check(hvd.allreduce(small[me], name=f"{tag}.prod.{dtype}", op=hvd.Product,
                            process_set=pset), prod, f"{tag} allreduce product {dtype}")
        grouped = hvd.grouped_allreduce([x[me], x[me][:1]], name=f"{tag}.grp.{dtype}",
                                        op=hvd.Sum, process_set=pset)
        check(grouped[0], stack.sum(0).astype(dtype), f"{tag} grouped 0 {dtype}")
        check(grouped[1], stack.sum(0)[:1].astype(dtype), f"{tag} grouped 1 {dtype}")
        # allgather: rank r (position i) gives i + 1 rows
        parts = {r: data(r, c + 1, i + 1, dtype) for i, r in enumerate(ranks)}
        check(hvd.allgather(parts[me], name=f"{tag}.ag.{dtype}", process_set=pset),
              np.concatenate([parts[r] for r in ranks]), f"{tag} allgather {dtype}")
        for root in ranks:
            check(hvd.broadcast(x[me], root_rank=root, name=f"{tag}.bc{root}.{dtype}",
                                process_set=pset), x[root], f"{tag} broadcast {root} {dtype}")
        # alltoall, equal splits: position j gets rows 2j..2j+1 of everyone's
        pos = ranks.index(me)
        want = np.concatenate([x[r][2 * pos: 2 * pos + 2] for r in ranks])
        check(hvd.alltoall(x[me], name=f"{tag}.a2a.{dtype}", process_set=pset), want,
              f"{tag} alltoall {dtype}")
        check(hvd.reducescatter(x[me], name=f"{tag}.rs.{dtype}", op=hvd.Sum, process_set=pset),
              stack.sum(0)[2 * pos: 2 * pos + 2].astype(dtype), f"{tag} reducescatter {dtype}")
        cases += 9 + len(ranks)
    hvd.barrier(process_set=pset)
    return cases + 1


def main() -> None:
    out = Path(sys.argv[1])
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    one_host = hvd.add_process_set([0, 1])  # both on the first host
    spanning = hvd.add_process_set([1, 2])  # one rank on each host
    cases = run_set("global", list(range(size)), hvd.global_process_set)
    if one_host.included():
        cases += run_set("onehost", [0, 1], one_host)
    if spanning.included():
        cases += run_set("spanning", [1, 2], spanning)
    # 4 MiB: the large-message path between hosts, exact
    big = np.arange(1 << 20, dtype=np.int32) % 1000 + me
    want = (np.arange(1 << 20, dtype=np.int32) % 1000) * size + sum(range(size))
    check(hvd.allreduce(big, name="big", op=hvd.Sum), want.astype(np.int32), "4 MiB allreduce")
    cases += 1
    placement = {"rank": me, "size": size, "host": socket.gethostname(),
                 "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                 "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                 "homogeneous": hvd.is_homogeneous(), "cases": cases,
                 "env": {k: os.environ.get(k) for k in ("MH_NAMED", "MH_SET",
                                                        "HOROVOD_MH_PREFIXED")}
                 | {"python": sys.executable}}
    hvd.shutdown()
    (out / f"rank-{me}.json").write_text(json.dumps(placement))


if __name__ == "__main__":
    main()
