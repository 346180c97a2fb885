"""G2: small-tensor latency, call -> result usable, 4 B / 4 KiB / 64 KiB, p50 and p99.

Every call is timed on its own (host clock, after a barrier; slowest rank per call), one call of
each variant in turn, on the same float32 buffers:

- hvdlite, async completion off: ``allreduce(x, op=Sum, out=y)`` returns once the device
  finished (result usable by anyone);
- hvdlite, async completion on: ``allreduce_async(...).wait()`` returns once the work is
  enqueued and the caller's stream is ordered after it (result usable by work on that stream);
  also the same plus a stream synchronise (result usable on the host);
- hvdlite, async completion on, ``wait()`` alone: the call, then an untimed poll until the
  handle is complete (work negotiated and enqueued), then ``wait()`` timed by itself: the
  cost of ordering the caller's stream after the collective, with no CPU wait on the device;
- raw CuPy NCCL ``allReduce`` + stream synchronise; raw NCCL enqueue only (the floor for
  "stream ordered");
- torch.distributed NCCL ``all_reduce(async_op=True).wait()`` (stream ordered) and the same +
  ``synchronize`` (the torch baselines use op AVG in place on a copy of the input, so repeated
  calls stay finite; the correctness check before timing uses SUM).

After every call the device is synchronised untimed, so no call queues behind another. Targets:
async completion off p50 <= 60 us, p99 <= 150 us; on (call -> ``wait()``) p50 <= 30 us.

    mpirun -n 2 python3 scripts/gpu/bench_g2.py --json g2.json
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import _gpulib as gl
import numpy as np

import hvdlite as hvd

HVD_SYNC = "hvdlite allreduce, async completion off"
HVD_WAIT = "hvdlite async completion on: call -> wait()"
HVD_WAIT_SYNC = "hvdlite async completion on: wait() + stream sync"
HVD_WAIT_ONLY = "hvdlite async completion on: wait() alone, handle enqueued"
RAW_SYNC = "raw NCCL + stream sync"
RAW_ENQ = "raw NCCL enqueue only"
TORCH_WAIT = "torch all_reduce + wait() (stream ordered)"
TORCH_SYNC = "torch all_reduce + wait() + synchronize"
SIZES = [4, 4096, 65536]
TARGETS = [(HVD_SYNC, "median_s", 60.0), (HVD_SYNC, "p99_s", 150.0), (HVD_WAIT, "median_s", 30.0)]


def parse_args(argv: list[str] | None = None) -> Any:
    """Command-line options (``--quick``: 200 repeats)."""
    p = gl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2000, help="timed calls per size and variant")
    p.add_argument("--warmup", type=int, default=100, help="untimed calls per variant")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed baselines")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 200, 20
    return args


class Buffers:
    """One size's input, output, reference and torch copies on this rank."""

    def __init__(self, gpu: gl.Gpu, torch: Any, nbytes: int) -> None:
        cp = gpu.cupy
        n = nbytes // 4
        self.nbytes = nbytes
        self.x = gl.int_values(cp, n, gpu.args.seed, gpu.rank, salt=nbytes)
        self.y = cp.empty(n, dtype=np.float32)
        self.ref = gl.reference_sum(cp, n, gpu.args.seed, gpu.size, salt=nbytes)
        self.t_buf = self.x.copy()  # torch's in-place timing buffer
        gpu.sync()
        self.t = torch.from_dlpack(self.t_buf) if torch is not None else None


def variants(
    gpu: gl.Gpu, raw: gl.RawNccl, torch: Any, b: Buffers, async_block: bool
) -> dict[str, Callable[[], object]]:
    """The variants timed together in one block (hvdlite's completion mode is per block)."""
    name = f"g2.{b.nbytes}"
    stream = gpu.stream
    fns: dict[str, Callable[[], object]] = {}
    if async_block:
        fns[HVD_WAIT] = lambda: hvd.allreduce_async(b.x, name=name, op=hvd.Sum, out=b.y).wait()

        def wait_sync() -> None:
            hvd.allreduce_async(b.x, name=name, op=hvd.Sum, out=b.y).wait()
            stream.synchronize()

        fns[HVD_WAIT_SYNC] = wait_sync
        return fns
    fns[HVD_SYNC] = lambda: hvd.allreduce(b.x, name=name, op=hvd.Sum, out=b.y)

    def raw_sync() -> None:
        raw.allreduce(b.x, b.y)
        stream.synchronize()

    fns[RAW_SYNC] = raw_sync
    fns[RAW_ENQ] = lambda: raw.allreduce(b.x, b.y)
    if torch is not None:
        dist, avg = torch.distributed, torch.distributed.ReduceOp.AVG
        fns[TORCH_WAIT] = lambda: dist.all_reduce(b.t, op=avg, async_op=True).wait()

        def torch_sync() -> None:
            dist.all_reduce(b.t, op=avg, async_op=True).wait()
            torch.cuda.current_stream().synchronize()

        fns[TORCH_SYNC] = torch_sync
    return fns


def check(
    gpu: gl.Gpu, torch: Any, fns: dict[str, Callable[[], object]], b: Buffers, when: str
) -> None:
    """Each hvdlite / raw variant once on a poisoned output; torch once with SUM on a copy."""
    for name, fn in fns.items():
        if name.startswith("torch"):
            continue
        gl.poison(b.y)
        gpu.sync()
        fn()
        gpu.sync()
        gl.check_equal(gpu, b.y, b.ref, f"{name}, {gl.human_bytes(b.nbytes)} ({when})")
    if torch is not None and any(n.startswith("torch") for n in fns):
        cp = gpu.cupy
        copy = b.x.copy()
        gpu.sync()
        torch.distributed.all_reduce(torch.from_dlpack(copy), async_op=True).wait()
        torch.cuda.synchronize()
        gl.check_equal(
            gpu,
            cp.asarray(copy),
            b.ref,
            f"torch all_reduce SUM, {gl.human_bytes(b.nbytes)} ({when})",
        )


def time_wait_alone(gpu: gl.Gpu, b: Buffers, settle: Callable[[], None]) -> np.ndarray:
    """Seconds spent in ``wait()`` on a handle that already completed (async completion),
    slowest rank per call; the result is checked after every call."""
    clock = time.perf_counter
    samples = np.empty(gpu.args.repeats, dtype=np.float64)
    for i in range(gpu.args.repeats):
        gpu.barrier()
        gl.poison(b.y)
        h = hvd.allreduce_async(b.x, name=f"g2w.{b.nbytes}", op=hvd.Sum, out=b.y)
        while not h.poll():
            pass
        t0 = clock()
        h.wait()
        samples[i] = clock() - t0
        settle()
        gl.check_equal(gpu, b.y, b.ref, f"{HVD_WAIT_ONLY}, {gl.human_bytes(b.nbytes)}")
    return gl.max_over_ranks(gpu.comm, samples)


def run_block(
    gpu: gl.Gpu, raw: gl.RawNccl, torch: Any, bufs: list[Buffers], async_block: bool
) -> dict[int, dict[str, Any]]:
    """Check, time and re-check every size with hvdlite in one completion mode."""

    def settle() -> None:
        gpu.sync()
        if torch is not None:
            torch.cuda.synchronize()

    out: dict[int, dict[str, Any]] = {}
    for b in bufs:
        fns = variants(gpu, raw, torch, b, async_block)
        check(gpu, torch, fns, b, "before timing")
        times = gl.time_round_robin(gpu, fns, gpu.args.repeats, gpu.args.warmup, after=settle)
        if async_block:
            times[HVD_WAIT_ONLY] = time_wait_alone(gpu, b, settle)
        check(gpu, torch, fns, b, "after timing")
        out[b.nbytes] = {k: gl.stats(v) for k, v in times.items()}
    return out


def report(gpu: gl.Gpu, results: dict[int, dict[str, Any]], torch_note: str) -> None:
    """Print the table and targets (rank 0) and write the JSON."""
    rows, targets = [], []
    for nbytes, per in results.items():
        for variant, st in per.items():
            rows.append(
                [gl.human_bytes(nbytes), variant, gl.us(st["median_s"]), gl.us(st["p99_s"])]
            )
        for variant, key, limit in TARGETS:
            label = "p50" if key == "median_s" else "p99"
            targets.append(
                gl.target(
                    f"G2 {gl.human_bytes(nbytes)} {variant} {label}",
                    gl.us(per[variant][key]),
                    limit,
                    " us",
                )
            )
        for base in (RAW_SYNC, TORCH_SYNC):
            if base in per:
                per.setdefault("ratios", {})[f"{HVD_SYNC} / {base} (p50)"] = gl.ratio(
                    per[HVD_SYNC]["median_s"], per[base]["median_s"]
                )
    table = gl.format_table(["size", "variant", "p50 us", "p99 us"], rows)
    notes = [
        f"{gpu.args.repeats} timed calls per size and variant, slowest rank per call; "
        "device synchronised (untimed) after every call"
    ]
    if torch_note:
        notes.append(torch_note)
    gl.finish(
        gpu,
        "G2 small-tensor latency",
        {"sizes": {str(k): v for k, v in results.items()}},
        table,
        targets,
        notes,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gpu = gl.Gpu(args)
    torch, torch_note = (
        (None, "torch baselines skipped (--no-torch)") if args.no_torch else gl.torch_dist(gpu)
    )
    raw = gl.RawNccl(gpu)
    bufs = [Buffers(gpu, torch, nbytes) for nbytes in SIZES]
    gl.hvd_start(hvd, gpu, async_completion=False)
    results = run_block(gpu, raw, torch, bufs, async_block=False)
    gl.hvd_start(hvd, gpu, async_completion=True)
    for nbytes, per in run_block(gpu, raw, torch, bufs, async_block=True).items():
        results[nbytes].update(per)
    hvd.shutdown()
    raw.close()
    gl.torch_close(torch)
    report(gpu, results, torch_note)


if __name__ == "__main__":
    main()
