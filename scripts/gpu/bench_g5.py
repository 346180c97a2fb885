"""G5: completion chain: allreduce(4 KiB) -> dependent kernel on the caller's stream -> repeat.

Each of ``--iterations`` (200) iterations is ``hvd.allreduce(x, op=Sum, out=y)`` followed by a
kernel on the caller's stream that computes ``x = y / size + 1`` from its result, and the next
allreduce reduces that ``x``. With ``x0`` of rank r the chain's closed form is
``x_K = mean_r(x0_r) + K`` (exact: integer-valued float32 data), checked before and after
timing. Variants: hvdlite with async completion off (``allreduce`` returns once the device
finished) and on (it returns once the caller's stream is ordered after the collective); a raw
NCCL chain with everything on one stream and no host sync (the floor). A chain is timed from
its first call to a stream synchronise after its last kernel (host clock, slowest rank);
reported: median per-iteration time over ``--repeats`` chains. Target: on <= 0.7x off.

    mpirun -n 2 python3 scripts/gpu/bench_g5.py --json g5.json
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import _gpulib as gl
import numpy as np

import hvdlite as hvd

OFF = "hvdlite, async completion off"
ON = "hvdlite, async completion on"
RAW = "raw NCCL chain on one stream (floor)"
NBYTES = 4096
TARGET_RATIO = 0.7


def parse_args(argv: list[str] | None = None) -> Any:
    """Command-line options (``--quick``: 5 chains)."""
    p = gl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=200, help="allreduces per chain")
    p.add_argument("--repeats", type=int, default=20, help="timed chains per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed chains per variant")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 5, 1
    if args.iterations < 1:
        p.error("--iterations must be >= 1")
    return args


def closed_form(xp: Any, seed: int, size: int, iterations: int) -> Any:
    """``x_K = mean_r(x0_r) + K`` in float64 (exact for these integer-valued inputs)."""
    return gl.reference_sum(xp, NBYTES // 4, seed, size) / size + iterations


class Chain:
    """One rank's buffers and the three chain variants."""

    def __init__(self, gpu: gl.Gpu, raw: gl.RawNccl) -> None:
        cp, a = gpu.cupy, gpu.args
        self.gpu, self.raw = gpu, raw
        self.x0 = gl.int_values(cp, NBYTES // 4, a.seed, gpu.rank)
        self.x = self.x0.copy()
        self.y = cp.empty_like(self.x)
        self.want = closed_form(cp, a.seed, gpu.size, a.iterations)
        self.kernel = cp.ElementwiseKernel("T y, T inv", "T x", "x = y * inv + (T)1", "g5_next")
        self.inv = np.float32(1.0 / gpu.size)
        # One name per iteration (as per-parameter names in training): cached after chain 1.
        self.names = [f"g5.{k}" for k in range(a.iterations)]
        gpu.sync()

    def reset(self) -> None:
        self.x[...] = self.x0
        gl.poison(self.y)
        self.gpu.sync()

    def hvd_chain(self) -> None:
        x, y, kernel, inv = self.x, self.y, self.kernel, self.inv
        for name in self.names:
            hvd.allreduce(x, name=name, op=hvd.Sum, out=y)
            kernel(y, inv, x)
        self.gpu.sync()

    def raw_chain(self) -> None:
        x, y, kernel, inv, raw = self.x, self.y, self.kernel, self.inv, self.raw
        for _ in range(self.gpu.args.iterations):
            raw.allreduce(x, y)
            kernel(y, inv, x)
        self.gpu.sync()

    def check(self, fn: Callable[[], None], what: str) -> None:
        self.reset()
        fn()
        gl.check_equal(self.gpu, self.x, self.want, what)

    def time(self, name: str, fn: Callable[[], None]) -> np.ndarray:
        """Check, time ``repeats`` chains (each after a reset and a barrier), check again."""
        gpu, a = self.gpu, self.gpu.args
        self.check(fn, f"{name} (before timing)")
        for _ in range(a.warmup):
            self.reset()
            fn()
        times = np.empty(a.repeats, dtype=np.float64)
        for i in range(a.repeats):
            self.reset()
            gpu.barrier()
            t0 = time.perf_counter()
            fn()
            times[i] = time.perf_counter() - t0
        self.check(fn, f"{name} (after timing)")
        return gl.max_over_ranks(gpu.comm, times) / a.iterations


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gpu = gl.Gpu(args)
    raw = gl.RawNccl(gpu)
    chain = Chain(gpu, raw)
    samples: dict[str, np.ndarray] = {}
    for name, on in ((OFF, False), (ON, True), (OFF + " (again)", False)):
        gl.hvd_start(hvd, gpu, async_completion=on)
        samples[name] = chain.time(name, chain.hvd_chain)
    hvd.shutdown()
    samples[RAW] = chain.time(RAW, chain.raw_chain)
    raw.close()
    st = {k: gl.stats(v) for k, v in samples.items()}
    off = float(np.median(np.concatenate([samples[OFF], samples[OFF + " (again)"]])))
    on_ratio = gl.ratio(st[ON]["median_s"], off)
    rows = [
        [k, gl.us(v["median_s"]), gl.us(v["p99_s"]), gl.ratio(v["median_s"], off)]
        for k, v in st.items()
    ]
    table = gl.format_table(["variant", "us / iteration (median)", "p99", "x off"], rows)
    targets = [gl.target("G5 on / off per iteration", on_ratio, TARGET_RATIO, "x")]
    notes = [
        f"{args.iterations} iterations of allreduce({NBYTES} B, Sum) -> x = y/{gpu.size}"
        f" + 1 on the caller's stream; {args.repeats} chains per variant; 'off' runs "
        "before and after 'on', and the ratio uses both"
    ]
    gl.finish(
        gpu, "G5 completion chain", {"stats": st, "on_over_off": on_ratio}, table, targets, notes
    )


if __name__ == "__main__":
    main()
