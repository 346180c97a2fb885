"""G4: overlap of gradient allreduce with a synthetic backward pass (24 x Linear(4096, 4096)).

One training step on the caller's (compute) stream, float32 with TF32 matmuls (``CUPY_TF32=1``
is set before CuPy loads; ``--fp32`` turns it off), per rank:

- forward: ``Y = X_l @ W_l.T`` for every layer (compute load);
- backward, layers in reverse: ``G_l = DY_l.T @ X_l`` (the layer's 64 MiB weight gradient),
  then at once, with no host sync, ``allreduce_async_(G_l, op=Average)``, then
  ``DX = DY_l @ W_l`` (compute load);
- optimizer: wait each handle, then an SGD kernel ``W_l -= lr * G_l`` consumes the result.

``X_l`` and ``DY_l`` hold small integers that differ per rank, so every averaged gradient is
exact and is checked against a float64 reference built from every rank's inputs, after the
warm-up and again after timing. Variants (rows 1024 and 4096): compute only (no comm); hvdlite
with inputs waited on the CPU (the benchmark synchronises the compute stream before each
``allreduce_async_`` call: what Horovod did before CUDA-event-driven readiness); hvdlite with
stream waits (default); the same with async completion; torch DDP on the same layer shapes
(``_g4torch.py``). Also: comm alone (raw NCCL, one fused allreduce of all 1.61 GB of
gradients, CUDA events) and hvdlite comm only (the 24 calls without compute).

Reported per variant: median step time over ``--steps`` steps after warm-up (slowest rank per
step, host clock, the step ends with a stream synchronise); exposed comm = step - compute only
(the compute-only run of the same block); exposed / comm alone. Targets: exposed <= 10% of comm
alone with stream waits + async completion; step <= DDP's.

    mpirun -n 2 python3 scripts/gpu/bench_g4.py --json g4.json [--timeline /tmp/g4.json]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import _g4torch
import _gpulib as gl
import numpy as np

import hvdlite as hvd

COMPUTE = "compute only"
CPU_WAIT = "hvdlite, inputs waited on the CPU"
STREAM = "hvdlite, stream waits"
STREAM_AC = "hvdlite, stream waits + async completion"
COMM_ONLY = "hvdlite comm only (no compute)"
TIMELINE = "hvdlite, stream waits + async completion, timeline on"
COMM_ALONE = "comm alone: raw NCCL, one fused allreduce (events)"
LR = 2.0**-30  # keeps W finite over any number of steps; W only feeds compute load


def parse_args(argv: list[str] | None = None) -> Any:
    """Command-line options (``--quick``: 1024 rows only, 3 steps)."""
    p = gl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 4096], help="batch rows")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    p.add_argument("--fp32", action="store_true", help="plain float32 matmuls (no TF32)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch DDP baselines")
    p.add_argument(
        "--timeline",
        metavar="PATH",
        help="also run the async-completion variant with hvdlite's timeline on",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.steps, args.warmup = [1024], 3, 1
    if min(args.rows) < 1 or args.layers < 1 or args.width < 1:
        p.error("--rows, --layers and --width must be positive")
    return args


class Layers:
    """One rank's layer stack for one batch size: inputs, gradients, weights, references."""

    def __init__(self, gpu: gl.Gpu, rows: int) -> None:
        cp, a = gpu.cupy, gpu.args
        n_layers, w = a.layers, a.width
        self.rows = rows
        # Identical weights on every rank (rank key -1); their values only feed compute load.
        self.W = [self._ints(gpu, -1, 3000 + i, w) * np.float32(2.0**-8) for i in range(n_layers)]
        self.X = [self._ints(gpu, gpu.rank, 1000 + i, rows) for i in range(n_layers)]
        self.DY = [self._ints(gpu, gpu.rank, 2000 + i, rows) for i in range(n_layers)]
        self.G = [cp.empty((w, w), dtype=np.float32) for _ in range(n_layers)]
        self.Y = cp.empty((rows, w), dtype=np.float32)
        self.DX = cp.empty((rows, w), dtype=np.float32)
        self.ref = [self._reference(gpu, i) for i in range(n_layers)]
        self.sgd = cp.ElementwiseKernel("T g, T lr", "T w", "w -= lr * g", "g4_sgd")
        self.lr, self.no_lr = np.float32(LR), np.float32(0.0)
        gpu.sync()

    @staticmethod
    def _ints(gpu: gl.Gpu, rank: int, salt: int, rows: int) -> Any:
        """A (rows, width) float32 matrix of integers in {-2, -1, 1, 2} for (seed, rank, salt)."""
        w = gpu.args.width
        return gl.int_values(gpu.cupy, rows * w, gpu.args.seed, rank, salt, bound=2).reshape(
            rows, w
        )

    def _reference(self, gpu: gl.Gpu, layer: int) -> Any:
        """Average over ranks of DY_l.T @ X_l in float64 (exact for these small integers)."""
        cp, w = gpu.cupy, gpu.args.width
        acc = cp.zeros((w, w), dtype=np.float64)
        for r in range(gpu.size):
            x = self._ints(gpu, r, 1000 + layer, self.rows).astype(np.float64)
            dy = self._ints(gpu, r, 2000 + layer, self.rows).astype(np.float64)
            acc += cp.dot(dy.T, x)
        return (acc / gpu.size).astype(np.float32)

    def step(self, gpu: gl.Gpu, mode: str | None) -> None:
        """One training step; ``mode`` None (no comm), "cpu_wait" or "stream"."""
        cp = gpu.cupy
        for i in range(len(self.W)):
            cp.dot(self.X[i], self.W[i].T, out=self.Y)
        handles = []
        for i in reversed(range(len(self.W))):
            cp.dot(self.DY[i].T, self.X[i], out=self.G[i])
            if mode == "cpu_wait":
                gpu.stream.synchronize()
            if mode is not None:
                handles.append((i, hvd.allreduce_async_(self.G[i], name=f"g4.{i}", op=hvd.Average)))
            cp.dot(self.DY[i], self.W[i], out=self.DX)
        if mode is None:  # same kernels; lr 0 keeps the weights equal across ranks
            for i in reversed(range(len(self.W))):
                self.sgd(self.G[i], self.no_lr, self.W[i])
        for i, h in handles:
            h.wait()
            self.sgd(self.G[i], self.lr, self.W[i])
        gpu.stream.synchronize()

    def comm_only(self, gpu: gl.Gpu) -> None:
        """The allreduces of all the gradients and nothing else; waits for the device."""
        handles = [
            hvd.allreduce_async_(self.G[i], name=f"g4.{i}", op=hvd.Average)
            for i in reversed(range(len(self.G)))
        ]
        for h in handles:
            h.wait()
        gpu.stream.synchronize()

    def check(self, gpu: gl.Gpu, what: str) -> None:
        """Every averaged gradient equals the every-rank reference (run after a comm step)."""
        for i, (g, ref) in enumerate(zip(self.G, self.ref, strict=True)):
            gl.check_equal(gpu, g, ref, f"{what}: gradient of layer {i}")

    def poison(self, gpu: gl.Gpu) -> None:
        for g in self.G:
            gl.poison(g)
        gpu.sync()

    def weights_agree(self, gpu: gl.Gpu, what: str) -> None:
        """The weights are bitwise identical on every rank (the averaged updates agree)."""
        cp = gpu.cupy
        sums = [float(cp.sum(w, dtype=np.float64)) for w in self.W]
        first = [float(w.ravel()[0]) for w in self.W]
        everyone = gpu.comm.allgather((sums, first))
        same = all(e == everyone[0] for e in everyone)
        gl.check_all(gpu.comm, same, what, f"weight checksums differ: {everyone}")


def block(
    gpu: gl.Gpu, st: Layers, fns: dict[str, Callable[[], object]], label: str
) -> dict[str, np.ndarray]:
    """Warm up every variant, check the comm ones, time them round robin, check again."""
    a = gpu.args

    def check_all_variants(when: str) -> None:
        for name, fn in fns.items():
            if name == COMPUTE:
                continue
            if name != COMM_ONLY:  # comm only re-averages what the step before produced
                st.poison(gpu)
            fn()
            st.check(gpu, f"{name}, {st.rows} rows ({when})")

    for fn in fns.values():
        for _ in range(a.warmup):
            fn()
    check_all_variants(f"{label}, before timing")
    times = gl.time_round_robin(gpu.comm, fns, a.steps, 0)
    check_all_variants(f"{label}, after timing")
    st.weights_agree(gpu, f"weights after the {label} block, {st.rows} rows")
    return times


def comm_alone(gpu: gl.Gpu, raw: gl.RawNccl, elements: int) -> np.ndarray:
    """Raw NCCL Average of one buffer of all gradients (in place), device time per call."""
    cp = gpu.cupy
    flat = cp.full(elements, float(gpu.rank + 1), dtype=np.float32)
    want = cp.full(1, (gpu.size + 1) / 2, dtype=np.float64)
    raw.allreduce(flat, flat, op="avg")
    gpu.sync()
    gl.check_all(
        gpu.comm,
        bool((flat == want[0]).all()),
        "raw NCCL fused allreduce",
        f"some element differs from {float(want[0])}, the mean of the ranks' values",
    )
    return gl.device_time(gpu, lambda: raw.allreduce(flat, flat, op="avg"), gpu.args.steps, 2)


def timeline_run(gpu: gl.Gpu, st: Layers) -> tuple[np.ndarray, dict[str, Any]]:
    """The async-completion variant with hvdlite's timeline on (few steps)."""
    path = gpu.args.timeline
    gl.hvd_start(hvd, gpu, async_completion=True, timeline=path)
    fns: dict[str, Callable[[], object]] = {TIMELINE: lambda: st.step(gpu, "stream")}
    a = gpu.args
    steps, a.steps = a.steps, min(a.steps, 3)
    try:
        times = block(gpu, st, fns, "timeline")[TIMELINE]
    finally:
        a.steps = steps
    hvd.shutdown()
    mine = path.replace("{rank}", str(gpu.rank)) if path else ""
    exists = gpu.comm.allgather(bool(mine) and os.path.exists(mine))
    return times, {"path": path, "exists_per_rank": exists}


def cupy_variants(gpu: gl.Gpu, rows: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The compute-only and hvdlite variants at one batch size (samples in seconds)."""
    st = Layers(gpu, rows)
    gl.hvd_start(hvd, gpu, async_completion=False)
    samples = block(
        gpu,
        st,
        {
            COMPUTE: lambda: st.step(gpu, None),
            CPU_WAIT: lambda: st.step(gpu, "cpu_wait"),
            STREAM: lambda: st.step(gpu, "stream"),
            COMM_ONLY: lambda: st.comm_only(gpu),
        },
        "async completion off",
    )
    gl.hvd_start(hvd, gpu, async_completion=True)
    ac = block(
        gpu,
        st,
        {COMPUTE: lambda: st.step(gpu, None), STREAM_AC: lambda: st.step(gpu, "stream")},
        "async completion on",
    )
    samples[f"{COMPUTE} (async-completion block)"] = ac.pop(COMPUTE)
    samples.update(ac)
    hvd.shutdown()
    extra: dict[str, Any] = {}
    if gpu.args.timeline and rows == gpu.args.rows[0]:
        samples[TIMELINE], extra["timeline"] = timeline_run(gpu, st)
    return samples, extra


def run_rows(gpu: gl.Gpu, raw: gl.RawNccl, torch: Any, rows: int) -> dict[str, Any]:
    """Every variant at one batch size; returns samples (seconds) and facts."""
    a = gpu.args
    samples, extra = cupy_variants(gpu, rows)
    pool = gpu.cupy.get_default_memory_pool()
    pool.free_all_blocks()  # the layer stack is gone: room for the fused buffer
    samples[COMM_ALONE] = comm_alone(gpu, raw, a.layers * a.width * a.width)
    pool.free_all_blocks()
    if torch is not None:
        samples.update(_g4torch.run(gpu, torch, rows, LR))
    return {"samples": samples, **extra}


def summarise(
    rows: int, samples: dict[str, np.ndarray]
) -> tuple[dict[str, Any], list[Any], list[dict[str, Any]]]:
    """Stats, exposed comm and ratios for one batch size; table rows; targets."""
    st = {k: gl.stats(v) for k, v in samples.items()}
    med = {k: v["median_s"] for k, v in st.items()}
    comm = med[COMM_ALONE]
    base = {
        CPU_WAIT: COMPUTE,
        STREAM: COMPUTE,
        STREAM_AC: f"{COMPUTE} (async-completion block)",
        TIMELINE: f"{COMPUTE} (async-completion block)",
        _g4torch.DDP25: _g4torch.COMPUTE,
        _g4torch.DDP100: _g4torch.COMPUTE,
    }
    derived: dict[str, Any] = {}
    table = []
    for name, m in med.items():
        row: list[Any] = [rows, name, gl.ms(m), None, None]
        if name in base and base[name] in med:
            exposed = m - med[base[name]]
            derived[name] = {"exposed_s": exposed, "exposed_over_comm_alone": exposed / comm}
            row[3], row[4] = gl.ms(exposed), round(exposed / comm, 3)
        table.append(row)
    targets = [
        gl.target(
            f"G4 {rows} rows: {STREAM_AC} exposed / comm alone",
            round(derived[STREAM_AC]["exposed_over_comm_alone"], 3),
            0.10,
            "",
        )
    ]
    ddp = [med[k] for k in (_g4torch.DDP25, _g4torch.DDP100) if k in med]
    if ddp:
        targets.append(
            gl.target(
                f"G4 {rows} rows: {STREAM_AC} step / best DDP step",
                gl.ratio(med[STREAM_AC], min(ddp)),
                1.0,
                "x",
            )
        )
    return {"stats": st, "derived": derived, "comm_alone_s": comm}, table, targets


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "cupy" in sys.modules:
        raise RuntimeError("CuPy was imported before CUPY_TF32 could be set")
    os.environ["CUPY_TF32"] = "0" if args.fp32 else "1"
    gpu = gl.Gpu(args)
    torch, torch_note = (
        (None, "torch baselines skipped (--no-torch)") if args.no_torch else gl.torch_dist(gpu)
    )
    raw = gl.RawNccl(gpu)
    results: dict[str, Any] = {}
    table: list[Any] = []
    targets: list[dict[str, Any]] = []
    for rows in args.rows:
        got = run_rows(gpu, raw, torch, rows)
        summary, t_rows, t_targets = summarise(rows, got.pop("samples"))
        results[str(rows)] = {**summary, **got}
        table += t_rows
        targets += t_targets
    raw.close()
    gl.torch_close(torch)
    gb = args.layers * args.width * args.width * 4 / 1e9
    notes = [
        f"{args.layers} x Linear({args.width}, {args.width}, no bias), {gb:.2f} GB of "
        f"float32 gradients; matmuls {'float32' if args.fp32 else 'TF32 (CUPY_TF32=1)'}; "
        f"median of {args.steps} steps after {args.warmup} warm-up, slowest rank per step",
        f"'{CPU_WAIT}': the benchmark synchronises the compute stream on the CPU before "
        "each allreduce_async_ call (what Horovod did before event-driven readiness)",
        "exposed = step - compute only of the same block; comm alone = raw NCCL Average "
        "of one buffer of all gradients, CUDA events",
    ]
    if torch_note:
        notes.append(torch_note)
    for rows, res in results.items():
        if "timeline" in res:
            notes.append(
                f"timeline run ({rows} rows): file {res['timeline']['path']} exists "
                f"per rank: {res['timeline']['exists_per_rank']}"
            )
    text = gl.format_table(["rows", "variant", "step ms", "exposed ms", "exposed/comm"], table)
    gl.finish(gpu, "G4 overlap", results, text, targets, notes)


if __name__ == "__main__":
    main()
