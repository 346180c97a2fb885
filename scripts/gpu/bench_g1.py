"""G1: one-tensor allreduce, 4 B .. 256 MiB (powers of 4), sync: hvdlite vs raw CuPy NCCL.

Per size, on the same float32 input and output buffers of each rank: ``hvd.allreduce(x,
op=Sum, out=y)`` (returns once the device finished, async completion off) against a raw NCCL
``allReduce(x -> y)`` (out of place: at 1 rank an in-place call moves nothing) on the caller's
stream followed by a stream synchronise (the same call ->
result-on-the-host-side semantics). Both are timed call to return on the host clock, one repeat
of each in turn after a barrier, slowest rank per repeat, median reported; the raw NCCL device
time (CUDA events) is recorded too. Raw NCCL is also timed before ``hvd.init()`` (hvdlite's
background thread cannot take the GIL or a core from it); the ratio takes the faster raw time.
Targets, ratio hvdlite / raw: at 1 rank (issue 16) <= 1.05 at 256 MiB and <= 1.5 at 16 MiB; at
2 or more ranks <= 1.03 for every size >= 16 MiB.

    mpirun -n 2 python3 scripts/gpu/bench_g1.py --json g1.json
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _gpulib as gl
import numpy as np

import hvdlite as hvd

HVD = "hvdlite allreduce (sync)"
RAW = "raw NCCL + stream sync"
ALL_SIZES = [4 * 4**k for k in range(14)]  # 4 B .. 256 MiB
QUICK_SIZES = [4, 4096, 256 * 1024, 16 * gl.MIB, 256 * gl.MIB]
TARGET_FROM = 16 * gl.MIB
TARGET_RATIO = 1.03
ONE_RANK_TARGETS = {16 * gl.MIB: 1.5, 256 * gl.MIB: 1.05}


def parse_args(argv: list[str] | None = None) -> Any:
    """Command-line options (``--quick``: five sizes, 10 repeats)."""
    p = gl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=100, help="timed repeats per size and variant")
    p.add_argument("--warmup", type=int, default=10, help="untimed repeats per variant")
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        metavar="BYTES",
        help="message sizes in bytes (multiples of 4); default 4 B .. 256 MiB",
    )
    p.add_argument(
        "--async-completion",
        action="store_true",
        help="run hvdlite with async completion (then a stream sync ends each call)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 10, 2
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else ALL_SIZES
    bad = [s for s in args.sizes if s <= 0 or s % 4]
    if bad:
        p.error(f"--sizes must be positive multiples of 4 bytes (float32), got {bad}")
    return args


def bus_bandwidth(nbytes: int, seconds: float, size: int) -> float:
    """NCCL's allreduce bus bandwidth in GB/s: 2 (n-1)/n bytes per rank over the time."""
    return round(2 * (size - 1) / size * nbytes / seconds / 1e9, 2)


class Size:
    """One message size's input, output and reference on this rank."""

    def __init__(self, gpu: gl.Gpu, nbytes: int) -> None:
        cp, n = gpu.cupy, nbytes // 4
        self.nbytes, self.name = nbytes, f"g1.{nbytes}"
        self.x = gl.int_values(cp, n, gpu.args.seed, gpu.rank, salt=nbytes)
        self.ref = gl.reference_sum(cp, n, gpu.args.seed, gpu.size, salt=nbytes)
        self.y = cp.empty(n, dtype=np.float32)
        gpu.sync()


def raw_fn(gpu: gl.Gpu, raw: gl.RawNccl, s: Size) -> Callable[[], None]:
    """Raw NCCL out of place, then a stream synchronise."""

    def run_raw() -> None:
        raw.allreduce(s.x, s.y)
        gpu.sync()

    return run_raw


def raw_alone(gpu: gl.Gpu, raw: gl.RawNccl, s: Size) -> np.ndarray:
    """Raw NCCL + sync at one size, checked and timed before hvdlite starts."""
    fns = {RAW: raw_fn(gpu, raw, s)}
    check(gpu, fns, s.y, s.ref, f"{gl.human_bytes(s.nbytes)}, hvdlite not started")
    return gl.time_round_robin(gpu.comm, fns, gpu.args.repeats, gpu.args.warmup)[RAW]


def one_size(gpu: gl.Gpu, raw: gl.RawNccl, s: Size, alone: np.ndarray) -> dict[str, Any]:
    """Check, then time, hvdlite and raw NCCL at one message size."""
    args, x, y = gpu.args, s.x, s.y

    def run_hvd() -> None:
        hvd.allreduce(x, name=s.name, op=hvd.Sum, out=y)
        if args.async_completion:
            gpu.sync()

    fns: dict[str, Callable[[], None]] = {HVD: run_hvd, RAW: raw_fn(gpu, raw, s)}
    size = gl.human_bytes(s.nbytes)
    check(gpu, fns, y, s.ref, f"{size}, before timing")
    times = gl.time_round_robin(gpu.comm, fns, args.repeats, args.warmup)
    check(gpu, fns, y, s.ref, f"{size}, after timing")
    dev = gl.device_time(gpu, lambda: raw.allreduce(x, y), args.repeats, args.warmup)
    res = {k: gl.stats(v) for k, v in times.items()}
    res[RAW + gl.ALONE] = gl.stats(alone)
    res["raw NCCL device time (events)"] = gl.stats(dev)
    best = gl.fastest(res, RAW) or RAW
    return {
        "bytes": s.nbytes,
        "times": res,
        "raw_for_ratio": best,
        "ratio_median": gl.ratio(res[HVD]["median_s"], res[best]["median_s"]),
    }


def check(gpu: gl.Gpu, fns: dict[str, Callable[[], None]], out: Any, ref: Any, when: str) -> None:
    """Poison the output, run each variant once, compare with the every-rank reference."""
    for name, fn in fns.items():
        gl.poison(out)
        gpu.sync()
        fn()
        gpu.sync()
        gl.check_equal(gpu, out, ref, f"{name} ({when})")


def target_ratio(nbytes: int, size: int) -> float | None:
    """The largest hvdlite / raw ratio allowed at ``nbytes`` on ``size`` ranks (None: none)."""
    if size == 1:
        return ONE_RANK_TARGETS.get(nbytes)
    return TARGET_RATIO if nbytes >= TARGET_FROM else None


def report(gpu: gl.Gpu, rows: list[dict[str, Any]], steady: dict[str, int]) -> None:
    """Print the table and targets (rank 0) and write the JSON."""
    table_rows, targets = [], []
    for r in rows:
        t = r["times"]
        dev = t["raw NCCL device time (events)"]["median_s"]
        table_rows.append(
            [
                gl.human_bytes(r["bytes"]),
                gl.us(t[HVD]["median_s"]),
                gl.us(t[RAW]["median_s"]),
                gl.us(t[RAW + gl.ALONE]["median_s"]),
                r["ratio_median"],
                gl.us(dev),
                bus_bandwidth(r["bytes"], dev, gpu.size),
            ]
        )
        limit = target_ratio(r["bytes"], gpu.size)
        if limit is not None:
            targets.append(
                gl.target(
                    f"G1 {gl.human_bytes(r['bytes'])} hvdlite/raw", r["ratio_median"], limit, "x"
                )
            )
    table = gl.format_table(
        [
            "size",
            "hvdlite us",
            "raw+sync us",
            "raw+sync, no hvdlite",
            "ratio to faster raw",
            "raw device us",
            "raw busbw GB/s",
        ],
        table_rows,
    )
    mode = "async completion + stream sync" if gpu.args.async_completion else "sync completion"
    notes = [
        f"hvdlite mode: {mode}; op Sum, out= preallocated; medians of "
        f"{gpu.args.repeats} repeats, slowest rank per repeat, host clock",
        f"hvdlite steady state: {steady}",
    ]
    gl.finish(gpu, "G1 one-tensor allreduce", {"sizes": rows}, table, targets, notes)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gpu = gl.Gpu(args)
    raw = gl.RawNccl(gpu)
    sizes = [Size(gpu, nbytes) for nbytes in args.sizes]
    alone = [raw_alone(gpu, raw, s) for s in sizes]
    gl.hvd_start(hvd, gpu, async_completion=bool(args.async_completion))
    rows = [one_size(gpu, raw, s, a) for s, a in zip(sizes, alone, strict=True)]
    steady = hvd.stats()["steady_state"]  # lane hits, immediate calls, result sets made
    raw.close()
    hvd.shutdown()
    report(gpu, rows, steady)


if __name__ == "__main__":
    main()
