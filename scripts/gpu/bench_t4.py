"""T4 (GPU): the cost of hvdlite.torch's own layer on torch CUDA tensors, in the same launch as
hvdlite's CuPy API on CuPy arrays over the *same memory* and torch.distributed.

Variants, op Average (torch.distributed: SUM in place on copies, its fastest form), one repeat
of each in turn after a barrier, host clock until the results are usable (a stream synchronise
ends every variant), slowest rank per repeat, median reported. torch's current stream and
CuPy's are the same non-blocking stream:

- ResNet-50 set (161 float32 tensors, 102 MB): every tensor ``hvdlite.torch.allreduce_async``
  then ``synchronize`` each; the same through ``hvdlite.allreduce_async`` on CuPy arrays; and
  ``torch.distributed.all_reduce`` per tensor (``async_op=True`` then wait all, and a plain
  loop then one synchronise: the faster counts);
- the ResNet-50 set as one ``hvdlite.torch.grouped_allreduce`` against one
  ``torch.distributed.all_reduce`` of a flat buffer of all of it (one fused call, the limit),
  and the same grouped call through the CuPy API (what the core costs without the torch layer)
  and as ``hvdlite.torch.grouped_allreduce_init`` (the persistent form a repeated grouped call
  opts into: its agreed schedule, no negotiation; and with ``inplace=True``, the tensors moved
  into its buffer, no copy a call; the same 1.5x target is shown for both);
- 4 B sync call: ``hvdlite.torch.allreduce`` against ``hvdlite.allreduce`` on CuPy and
  ``torch.distributed.all_reduce`` then a stream synchronise (its plain form). After timing,
  20 more calls of each hvdlite form say how many took the immediate path (the calling
  thread, no queue: ``hvdlite/_control/immediate.py``).

Per variant: median and p99 of the whole variant, and for the set variants the median per
tensor (the 161 asynchronous calls' target is per tensor).

Results are checked exactly (integer-valued floats) before and after timing. Targets: issue 17,
at any rank count: ResNet-50 set <= 1.2x the CuPy API; 4 B sync <= 1.2x the CuPy API. Issue 32,
at 2 GPUs: 4 B sync <= 1.0x torch.distributed's plain form; the grouped call <= 1.5x one fused
torch.distributed call; the 161 asynchronous calls <= 0.5x torch.distributed per tensor.

    mpirun -n 1 python3 scripts/gpu/bench_t4.py --np 1 --json t4g.json

Issue 38's figures, a GPU per rank (one launch prints every target it judges; run_all.sh's
launch):

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    mpirun --allow-run-as-root --oversubscribe --bind-to none -n 2 -x PATH -x LD_LIBRARY_PATH \
        -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
        -x NVSHMEM_DISABLE_NVLS python3 scripts/gpu/bench_t4.py --np 2 --json t4g.json

Where a variant's host time goes (issue 38's open GPU targets): ``--profile "hvdlite.torch
grouped_allreduce of the set,CuPy API grouped_allreduce of the set"`` runs those variants again
under ``cProfile`` on every rank after timing and prints rank 0's functions by own time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import _gpulib as gl
import numpy as np

X_CUPY, X_TORCH, X_SYNC_TORCH, X_GROUPED = 1.2, 0.5, 1.0, 1.5
TORCH_T = "hvdlite.torch allreduce_async"
CUPY_A = "CuPy API allreduce_async"
DIST_ASYNC = "torch.distributed all_reduce (async_op, wait all)"
DIST_LOOP = "torch.distributed all_reduce (loop, one synchronize)"
SYNC_T = "hvdlite.torch allreduce (4 B)"
SYNC_C = "CuPy API allreduce (4 B)"
SYNC_D = "torch.distributed all_reduce (4 B), then synchronize"
GROUPED_T = "hvdlite.torch grouped_allreduce of the set"
GROUPED_C = "CuPy API grouped_allreduce of the set"
# The opt-in form of a repeated grouped call (issue 38): its agreed schedule, no negotiation.
PERSIST_T = "hvdlite.torch grouped_allreduce_init of the set (persistent)"
# The same with the tensors moved into the schedule's buffer (inplace=True): no copy per call.
PERSIST_I = "hvdlite.torch grouped_allreduce_init of the set (persistent, in place)"
FUSED_D = "torch.distributed all_reduce of one flat buffer of the set"


def main() -> None:
    p = gl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30, help="timed repeats of the set per variant")
    p.add_argument("--sync-reps", type=int, default=2000, help="timed 4 B calls per variant")
    p.add_argument("--profile", default="",
                   help="comma-separated variant names (as the table prints them) to profile "
                        "after timing: cProfile on every rank, rank 0's table printed and in "
                        "the JSON")
    args = p.parse_args()
    if args.quick:
        args.reps, args.sync_reps = 3, 50
    gpu = gl.Gpu(args)
    import torch

    import hvdlite
    import hvdlite.torch as hvd

    torch.cuda.set_device(gpu.device_id)
    torch.cuda.set_stream(torch.cuda.ExternalStream(gpu.stream.ptr, device=gpu.device_id))
    dist, why = gl.torch_dist(gpu)
    gl.hvd_start(hvdlite, gpu)
    cp = gpu.cupy
    shapes = [s for _, s in gl.load_shapes("resnet50", 20 if args.quick else None)]
    dev = torch.device("cuda", gpu.device_id)
    ts = [torch.full(s, float(((k % 7) + 2 * gpu.rank) * 2), device=dev)
          for k, s in enumerate(shapes)]
    want = [float(sum(((k % 7) + 2 * r) * 2 for r in range(gpu.size))) / gpu.size
            for k in range(len(shapes))]
    arrays = [cp.asarray(t) for t in ts]  # the same memory, CuPy's view
    copies = [t.clone() for t in ts]
    names = [f"t4g.{k}" for k in range(len(shapes))]
    fns: dict[str, Callable[[], list[Any]]] = {
        TORCH_T: lambda: _async_all(hvd.allreduce_async, hvd.synchronize, ts, names, "t", gpu),
        CUPY_A: lambda: _async_all(hvdlite.allreduce_async, hvdlite.synchronize, arrays, names,
                                   "c", gpu),
    }
    grouped_in = [t.clone() for t in ts]
    fns[GROUPED_T] = lambda: _grouped(hvd, grouped_in, gpu)
    grouped_cp = [cp.asarray(t.clone()) for t in ts]
    fns[GROUPED_C] = lambda: _grouped(hvdlite, grouped_cp, gpu, "t4g.grouped.c")
    persist = hvd.grouped_allreduce_init([t.clone() for t in ts], name="t4g.persist")
    fns[PERSIST_T] = lambda: _persistent(persist, gpu)
    # In place, each call reduces the last call's results again: the average of equal values,
    # so every call after the first returns the same exact values.
    persist_i = hvd.grouped_allreduce_init([t.clone() for t in ts], name="t4g.persist.inplace",
                                           inplace=True)
    fns[PERSIST_I] = lambda: _persistent(persist_i, gpu)
    flat = torch.cat([t.reshape(-1) for t in copies])
    if dist is not None:
        fns[DIST_ASYNC] = lambda: _dist_async(dist, copies, gpu)
        fns[DIST_LOOP] = lambda: _dist_loop(dist, copies, gpu)
        fns[FUSED_D] = lambda: _dist_loop(dist, [flat], gpu)
    checked = (TORCH_T, CUPY_A, GROUPED_T, GROUPED_C, PERSIST_T, PERSIST_I)
    _check(gpu, {k: fns[k] for k in checked}, want, "before timing")
    times = gl.time_round_robin(gpu.comm, fns, args.reps, warmup=3)
    _check(gpu, {k: fns[k] for k in checked}, want, "after timing")
    t4 = torch.full((1,), float(gpu.rank + 1), device=dev)
    c4 = cp.asarray(t4.clone())
    sync_fns = {SYNC_T: lambda: hvd.allreduce(t4, name="t4g.sync.t"),
                SYNC_C: lambda: hvdlite.allreduce(c4, name="t4g.sync.c")}
    want4 = float(sum(r + 1 for r in range(gpu.size))) / gpu.size
    for name, fn in sync_fns.items():
        got = float(np.asarray(fn().tolist() if name == SYNC_T else cp.asnumpy(fn()))[0])
        gl.check_all(gpu.comm, got == want4, name, f"got {got}, expected {want4}")
    if dist is not None:
        d4 = torch.full((1,), float(gpu.rank + 1), device=dev)
        dist.distributed.all_reduce(d4)
        gpu.sync()
        gl.check_all(gpu.comm, float(d4[0]) == want4 * gpu.size, SYNC_D, f"got {float(d4[0])}")
        sync_fns[SYNC_D] = lambda: _dist_loop(dist, [d4], gpu)  # the call, then synchronise
    times.update(gl.time_round_robin(gpu.comm, sync_fns, args.sync_reps, warmup=50, after=gpu.sync))
    immediate = {k: _immediate(hvdlite, sync_fns[k], gpu) for k in (SYNC_T, SYNC_C)}
    wanted = gl.split_names(args.profile, [*fns, *sync_fns])
    profiles = gl.profile_variants(gpu.comm, {**fns, **sync_fns}, wanted,
                                   max(args.reps // 2, 2)) if wanted else {}
    gl.torch_close(dist)
    hvdlite.shutdown()
    _report(gpu, args, {k: gl.stats(v) for k, v in times.items()}, len(shapes), why,
            immediate, profiles)


def _immediate(hvdlite: Any, fn: Callable[[], Any], gpu: gl.Gpu, calls: int = 20) -> int:
    """How many of ``calls`` more calls of ``fn`` took the immediate path."""
    before = hvdlite.stats()["steady_state"]["immediate"]
    for _ in range(calls):
        fn()
        gpu.sync()
    return int(hvdlite.stats()["steady_state"]["immediate"] - before)


def _async_all(start: Any, sync: Any, xs: list[Any], names: list[str], tag: str,
               gpu: gl.Gpu) -> list[Any]:
    handles = [start(x, name=f"{n}.{tag}") for x, n in zip(xs, names, strict=True)]
    outs = [sync(h) for h in handles]
    gpu.sync()
    return outs


def _persistent(persist: Any, gpu: gl.Gpu) -> list[Any]:
    outs = persist()  # the first call negotiated (settles the transport), later ones scheduled
    gpu.sync()
    return list(outs)


def _grouped(hvd: Any, xs: list[Any], gpu: gl.Gpu, name: str = "t4g.grouped") -> list[Any]:
    outs = hvd.grouped_allreduce(xs, name=name)
    gpu.sync()
    return list(outs)


def _dist_async(torch: Any, xs: list[Any], gpu: gl.Gpu) -> list[Any]:
    works = [torch.distributed.all_reduce(x, async_op=True) for x in xs]
    for w in works:
        w.wait()
    gpu.sync()
    return xs


def _dist_loop(torch: Any, xs: list[Any], gpu: gl.Gpu) -> list[Any]:
    for x in xs:
        torch.distributed.all_reduce(x)
    gpu.sync()
    return xs


def _check(gpu: gl.Gpu, fns: dict[str, Callable[[], list[Any]]], want: list[float],
           when: str) -> None:
    cp = gpu.cupy
    for name, fn in fns.items():
        outs = fn()
        bad = ""
        for k, (o, w) in enumerate(zip(outs, want, strict=True)):
            arr = cp.asarray(o)
            if not bool((arr == w).all()):
                bad = f"tensor {k}: expected every element {w}, got e.g. {float(arr.ravel()[0])}"
                break
        gl.check_all(gpu.comm, not bad, f"{name} ({when})", bad)


def _report(gpu: gl.Gpu, args: Any, st: dict[str, dict[str, float]], n: int, why: str,
            immediate: dict[str, int], profiles: dict[str, Any]) -> None:
    med = {k: v["median_s"] for k, v in st.items()}
    rows: list[tuple[str, float, float, str]] = []
    verdicts: list[dict[str, Any]] = []
    torch_best = min((k for k in (DIST_ASYNC, DIST_LOOP) if k in med), key=med.__getitem__,
                     default=None)
    per_tensor = (TORCH_T, CUPY_A, DIST_ASYNC, DIST_LOOP)
    for k, v in st.items():
        each = f"{v['median_s'] / n * 1e6:.1f}" if k in per_tensor else ""
        rows.append((k, gl.ms(v["median_s"]), gl.ms(v["p99_s"]), each))
    checks = [(f"ResNet-50 set: {TORCH_T} <= {X_CUPY}x {CUPY_A}", med[TORCH_T] / med[CUPY_A],
               X_CUPY),
              (f"4 B sync: {SYNC_T} <= {X_CUPY}x {SYNC_C}", med[SYNC_T] / med[SYNC_C], X_CUPY)]
    if torch_best is not None:
        checks.append((f"ResNet-50 set: {TORCH_T} <= {X_TORCH}x {torch_best}",
                       med[TORCH_T] / med[torch_best], X_TORCH))
    if SYNC_D in med:
        checks.append((f"4 B sync: {SYNC_T} <= {X_SYNC_TORCH}x {SYNC_D}",
                       med[SYNC_T] / med[SYNC_D], X_SYNC_TORCH))
    if FUSED_D in med:
        checks.append((f"ResNet-50 set: {GROUPED_T} <= {X_GROUPED}x {FUSED_D}",
                       med[GROUPED_T] / med[FUSED_D], X_GROUPED))
        for opt_in in (PERSIST_T, PERSIST_I):  # the same target for the opt-in forms
            if opt_in in med:
                checks.append((f"ResNet-50 set: {opt_in} <= {X_GROUPED}x {FUSED_D}",
                               med[opt_in] / med[FUSED_D], X_GROUPED))
    for target, ratio, limit in checks:
        verdicts.append({"target": target, "ratio": ratio, "met": ratio <= limit})
    payload = {"benchmark": "T4 (GPU)", "device": gpu.device_name(), "ranks": gpu.size,
               "tensors": n, "results": st, "targets": verdicts, "torch_dropped": why,
               "immediate_of_20": immediate, "note": gl.shortcut_note(gpu.size),
               "args": vars(args), "profiles": profiles}
    if gpu.rank == 0:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=2)
        print(f"T4 on {gpu.device_name()}, {gpu.size} rank(s), {n} tensors")
        width = max(len(r[0]) for r in rows)
        print(f"| {'variant'.ljust(width)} | median ms | p99 ms | median us per tensor |")
        for r in rows:
            print(f"| {r[0].ljust(width)} | {r[1]:9.3f} | {r[2]:6.3f} | {r[3]:>20s} |")
        if profiles:
            print(gl.format_profile(profiles))
        if GROUPED_C in med:
            print(f"grouped call, the torch layer's share: {GROUPED_T} / {GROUPED_C} = "
                  f"{med[GROUPED_T] / med[GROUPED_C]:.3f}x")
        for k, count in immediate.items():
            print(f"immediate path: {k}: {count} of 20 calls")
        for v in verdicts:
            print(f"{'MET   ' if v['met'] else 'MISSED'} {v['target']}: {v['ratio']:.3f}x")


if __name__ == "__main__":
    main()
