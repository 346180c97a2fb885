"""What the GPU benchmarks (``scripts/gpu/bench_*.py``) add to the one harness.

The harness itself is ``scripts/_benchlib.py``, re-exported here so a GPU script imports one
module.

Every benchmark follows the rules of the project's benchmark spec: the launch must have the
rank count given by ``--np`` (checked before CuPy is even imported); each rank drives the GPU of
its local rank; every variant's result is checked against a reference rebuilt from every rank's
inputs before anything is timed (integer-valued float data, so results are exact; never zeros);
warm-up first, then many repeats; a repeat's time is the slowest rank's; medians (and p99) are
reported; baselines run in the same process on the same buffers; rank 0 prints a short table
last and ``--json PATH`` gets everything. A benchmark that cannot vouch for its numbers exits
with status 2 and a ``REFUSED:`` line instead of reporting.

This module imports neither CuPy nor torch at import time, so the pure helpers (argument
parsing, data formulas on NumPy, statistics, tables) also run on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

# The GPU machine's rule: NVLink multicast stays off, whatever the caller's environment says.
# Set before CuPy, torch or NCCL are loaded by any benchmark.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(SAFE_ENV)

from mpi4py import MPI  # noqa: E402 - after the environment above, before any NCCL user

GPU_DIR = Path(__file__).resolve().parent
# The GPU scripts run as ``python3 scripts/gpu/bench_x.py``: the harness one folder up is not
# on their path otherwise.
sys.path.insert(0, str(GPU_DIR.parent))

import _benchlib  # noqa: E402
from _benchlib import (  # noqa: E402,F401 - re-exported: the GPU scripts' one import
    DATA_DIR,
    REFUSED_EXIT,
    _git,
    check_all,
    format_profile,
    format_table,
    format_targets,
    human_bytes,
    install_abort_hook,
    load_shapes,
    max_over_ranks,
    ms,
    print0,
    profile_variants,
    ratio,
    refuse,
    run_facts,
    split,
    split_names,
    stats,
    target,
    time_round_robin,
    us,
)

MIB = 1024 * 1024


# -- launch ------------------------------------------------------------------------------------
def base_parser(description: str) -> argparse.ArgumentParser:
    """The harness's parser with ``--np`` defaulting to 2 (the GPU machine's usual launch)."""
    return _benchlib.base_parser(description, np_default=2)


def join_launch(args: argparse.Namespace) -> tuple[MPI.Intracomm, int, int, int, int]:
    """(a duplicate of COMM_WORLD, rank, size, local rank, local size); refuse (every rank
    exits 2) unless the launch has ``args.np`` ranks."""
    install_abort_hook()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != args.np:
        refuse(
            comm,
            f"launched with {size} ranks but --np {args.np} was asked "
            f"(a launcher/MPI mismatch gives N singletons of size 1); run it as: "
            f"mpirun -n {args.np} python3 {' '.join(sys.argv)}",
        )
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    return comm, rank, size, local_rank, local_size


class Gpu:
    """One rank's view of the launch: the communicator, its GPU and its compute stream.

    Construct it first thing in ``main``: it checks the launch size before CuPy is imported,
    selects the GPU of this rank's local rank and makes a fresh non-blocking stream current, so
    every benchmark's "caller stream" is an ordinary stream, not the legacy default stream.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.comm, self.rank, self.size, self.local_rank, self.local_size = join_launch(args)
        self.cupy = _import_cupy(self.comm)
        count = self.cupy.cuda.runtime.getDeviceCount()
        check_all(
            self.comm,
            count >= self.local_size,
            "GPU count",
            f"{count} GPUs visible for {self.local_size} ranks on this host",
        )
        self.device_id = self.local_rank
        self.cupy.cuda.Device(self.device_id).use()
        self.stream = self.cupy.cuda.Stream(non_blocking=True)
        self.stream.use()

    def barrier(self) -> None:
        """An MPI barrier (host only: device work is not waited for)."""
        self.comm.Barrier()

    def sync(self) -> None:
        """Wait on the CPU until this rank's compute stream has finished."""
        self.stream.synchronize()

    def device_name(self) -> str:
        props = self.cupy.cuda.runtime.getDeviceProperties(self.device_id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)


def _import_cupy(comm: MPI.Comm) -> ModuleType:
    ok, detail = True, ""
    try:
        import cupy
        import cupy.cuda.nccl  # noqa: F401 - the raw NCCL baselines need it
    except Exception as exc:  # ImportError, or a CUDA/NCCL load failure inside it
        ok, detail = False, f"cannot import cupy with NCCL: {exc!r}"
    check_all(comm, ok, "CuPy import", detail)
    return cupy


# Words a knob that lets one rank skip the N-rank code path would be named with. None exists
# in hvdlite.config today; if one appears, every benchmark turns it off and says so.
_SHORTCUT_WORDS = ("shortcut", "single_rank", "size1", "size_one", "one_rank")


def shortcut_knobs() -> list[str]:
    """hvdlite boolean knobs named like a size-1 shortcut (turned off by :func:`hvd_start`)."""
    from hvdlite import config

    found = [k for k in config.KNOBS if any(w in k.name for w in _SHORTCUT_WORDS)]
    bad = [k.name for k in found if k.kind != "bool"]
    if bad:
        raise RuntimeError(f"size-1 shortcut knob(s) {bad} are not booleans: cannot turn off")
    return [k.name for k in found]


def shortcut_note(size: int) -> str:
    """What the benchmarks did about a size-1 shortcut, in words (empty above 1 rank)."""
    if size != 1:
        return ""
    knobs = shortcut_knobs()
    if knobs:
        return f"1 rank: size-1 shortcut knob(s) {', '.join(knobs)} turned off in every run"
    return (
        "1 rank: hvdlite.config has no size-1 shortcut knob, so what ran is the N-rank code "
        "path (the benchmarks would turn such a knob off)"
    )


def hvd_start(hvd: ModuleType, gpu: Gpu, **knobs: Any) -> None:
    """(Re)start hvdlite with ``knobs`` (after a shutdown if it runs) and check its size.

    Any size-1 shortcut knob is turned off unless ``knobs`` names it.
    """
    if hvd.is_initialized():
        hvd.shutdown()
    hvd.init(gpu.comm, **{**dict.fromkeys(shortcut_knobs(), False), **knobs})
    check_all(
        gpu.comm,
        hvd.size() == gpu.size,
        "hvdlite size",
        f"hvd.size() {hvd.size()} != MPI size {gpu.size}",
    )
    check_all(
        gpu.comm,
        hvd.local_rank() == gpu.local_rank,
        "hvdlite local rank",
        f"hvd.local_rank() {hvd.local_rank()} != MPI local rank {gpu.local_rank}",
    )


# -- data: integer-valued floats, rebuildable on any rank ---------------------------------------
_GOLD = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_CHUNK = 1 << 24  # elements generated per step


def mix64(xp: ModuleType, start: int, stop: int, key: int) -> Any:
    """Well-mixed uint64 words for indices ``start..stop-1`` (splitmix64 of index + ``key``)."""
    z = xp.arange(start, stop, dtype=xp.uint64) + xp.uint64((key * _GOLD) & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> xp.uint64(30))) * xp.uint64(_M1)
    z = (z ^ (z >> xp.uint64(27))) * xp.uint64(_M2)
    return z ^ (z >> xp.uint64(31))


def data_key(seed: int, rank: int, salt: int = 0) -> int:
    """The key of one rank's data of one kind (``salt``) under ``seed``."""
    return (seed * 1_000_003 + rank) * 1_000_033 + salt


def int_values(
    xp: ModuleType,
    n: int,
    seed: int,
    rank: int,
    salt: int = 0,
    bound: int = 1024,
    dtype: Any = np.float32,
) -> Any:
    """``n`` integer-valued floats in ``[-bound, bound]`` without 0, from (seed, rank, salt).

    Any rank can rebuild any other rank's values, so references are computed from every
    rank's inputs; sums of a few of them are exact in float32. Built in chunks, so the
    temporaries stay small next to the result.
    """
    out = xp.empty(n, dtype=dtype)
    key = data_key(seed, rank, salt)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        m = mix64(xp, start, stop, key) % xp.uint64(2 * bound)
        v = m.astype(xp.int64) - bound  # [-bound, bound - 1]
        out[start:stop] = xp.where(v >= 0, v + 1, v)  # [-bound, bound] without 0
    return out


def reference_sum(
    xp: ModuleType, n: int, seed: int, size: int, salt: int = 0, bound: int = 1024
) -> Any:
    """Float64 sum over every rank's :func:`int_values` (exact)."""
    acc = xp.zeros(n, dtype=xp.float64)
    for r in range(size):
        acc += int_values(xp, n, seed, r, salt, bound, xp.float64)
    return acc


def mismatch(xp: ModuleType, got: Any, ref: Any) -> str:
    """Empty if ``got`` equals ``ref`` exactly (after casting ``ref``), else the first miss."""
    if tuple(got.shape) != tuple(ref.shape):
        return f"shape {tuple(got.shape)} != expected {tuple(ref.shape)}"
    want = ref.astype(got.dtype)
    bad = xp.flatnonzero(got.ravel() != want.ravel())
    if int(bad.size) == 0:
        return ""
    i = int(bad[0])
    return (
        f"{int(bad.size)} of {got.size} elements differ; first at {i}: got "
        f"{float(got.ravel()[i])!r}, expected {float(want.ravel()[i])!r}"
    )


def check_equal(gpu: Gpu, got: Any, ref: Any, what: str) -> None:
    """Refuse on every rank unless ``got`` equals ``ref`` exactly on every rank."""
    problem = mismatch(gpu.cupy, got, ref)
    check_all(gpu.comm, not problem, what, problem)


def poison(arr: Any) -> None:
    """Fill a float array with NaN so an unwritten output cannot pass a check."""
    arr.fill(float("nan"))


# -- raw NCCL (CuPy) and torch.distributed baselines --------------------------------------------
class RawNccl:
    """A plain NCCL communicator over the launch, built through CuPy (unique id over MPI)."""

    def __init__(self, gpu: Gpu) -> None:
        from cupy.cuda import nccl

        self.nccl = nccl
        self.gpu = gpu
        uid = nccl.get_unique_id() if gpu.rank == 0 else None
        uid = gpu.comm.bcast(uid, root=0)
        with gpu.cupy.cuda.Device(gpu.device_id):
            self.comm = nccl.NcclCommunicator(gpu.size, uid, gpu.rank)
        self.has_avg = hasattr(nccl, "NCCL_AVG")

    def allreduce(self, src: Any, dst: Any, op: str = "sum", stream: Any = None) -> None:
        """Enqueue ``dst = reduce(src)`` (float32) on ``stream`` (default: the bench stream).

        ``op`` is "sum" or "avg"; without ncclAvg in this NCCL binding, "avg" is a sum followed
        by an in-place scale on the same stream.
        """
        s = self.gpu.stream if stream is None else stream
        if src.dtype != np.float32 or dst.dtype != np.float32 or src.size != dst.size:
            raise ValueError(
                f"raw NCCL baseline takes float32 src/dst of one size, got "
                f"{src.dtype}[{src.size}] -> {dst.dtype}[{dst.size}]"
            )
        code = self.nccl.NCCL_SUM
        if op == "avg" and self.has_avg:
            code = self.nccl.NCCL_AVG
        elif op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        self.comm.allReduce(
            src.data.ptr, dst.data.ptr, src.size, self.nccl.NCCL_FLOAT32, code, s.ptr
        )
        if op == "avg" and not self.has_avg:
            with s:
                dst *= np.float32(1.0 / self.gpu.size)

    def close(self) -> None:
        self.gpu.stream.synchronize()
        self.comm.destroy()


def free_port() -> int:
    """A TCP port that was free on this host a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torch_dist(gpu: Gpu, timeout_s: float = 30.0) -> tuple[Any, str]:
    """torch.distributed with NCCL over the launch, or ``(None, why not)``.

    env:// rendezvous on 127.0.0.1 with a port picked by rank 0; ranks from MPI. Any failure
    on any rank drops the torch baselines on every rank (with the reason) instead of failing
    the benchmark. Returns ``(torch, "")`` when usable.
    """
    port = gpu.comm.bcast(free_port() if gpu.rank == 0 else None, root=0)
    mod: Any = None
    why = ""
    try:
        import datetime

        import torch
        import torch.distributed as dist

        mod = torch

        os.environ.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(gpu.rank),
                "WORLD_SIZE": str(gpu.size),
                "LOCAL_RANK": str(gpu.local_rank),
            }
        )
        torch.cuda.set_device(gpu.device_id)
        dist.init_process_group(
            "nccl",
            init_method="env://",
            rank=gpu.rank,
            world_size=gpu.size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        t = torch.full((4,), float(gpu.rank + 1), device=f"cuda:{gpu.device_id}")
        dist.all_reduce(t)
        want = float(gpu.size * (gpu.size + 1) // 2)
        if not bool((t == want).all()):
            why = f"torch all_reduce check: got {t.tolist()}, expected {want}"
    except Exception as exc:  # any failure only drops the torch baselines
        why = f"torch.distributed NCCL unusable: {exc!r}"
    whys = gpu.comm.allgather(why)
    if any(whys):
        if mod is not None and not why:
            try:
                mod.distributed.destroy_process_group()
            except Exception as exc:  # only cleanup; the reason is already recorded
                why = f"(cleanup failed: {exc!r})"
        reasons = "; ".join(f"rank {r}: {w}" for r, w in enumerate(whys) if w)
        print0(gpu.comm, f"NOTE: torch baselines dropped: {reasons}")
        return None, reasons
    return mod, ""


def torch_close(torch: Any) -> None:
    """Tear down torch.distributed (no-op without torch)."""
    if torch is not None:
        torch.cuda.synchronize()
        torch.distributed.destroy_process_group()


# -- timing -----------------------------------------------------------------------------------
def device_time(gpu: Gpu, fn: Callable[[], object], reps: int, warmup: int) -> np.ndarray:
    """Per-repeat device time of ``fn``'s work on the bench stream, by CUDA events (seconds).

    Only for work enqueued entirely on the bench stream (raw NCCL, kernels). Each repeat starts
    after a stream synchronise and a barrier; the slowest rank's time is returned.
    """
    return device_and_host_time(gpu, fn, reps, warmup)[0]


def device_and_host_time(gpu: Gpu, fn: Callable[[], object], reps: int,
                         warmup: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`device_time`, and beside it the host time of each repeat's ``fn()`` call (from
    before the call to its return, seconds; the slowest rank's): where the stream idles
    while the host issues the work, the device time includes that host time."""
    cp = gpu.cupy
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(warmup):
        fn()
    gpu.sync()
    out = np.empty(reps, dtype=np.float64)
    host = np.empty(reps, dtype=np.float64)
    for i in range(reps):
        gpu.barrier()
        start.record(gpu.stream)
        t0 = time.perf_counter()
        fn()
        host[i] = time.perf_counter() - t0
        end.record(gpu.stream)
        end.synchronize()
        out[i] = cp.cuda.get_elapsed_time(start, end) * 1e-3
    return max_over_ranks(gpu.comm, out), max_over_ranks(gpu.comm, host)


_HOLD_SOURCE = r"""
extern "C" __global__ void hvd_bench_hold(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


def held_device_time(gpu: Gpu, fn: Callable[[], object], reps: int, warmup: int,
                     hold_s: float = 3e-4) -> tuple[np.ndarray, int]:
    """Device time of ``fn``'s work with the host's issuing hidden: each repeat holds the
    bench stream in a kernel that spins ``hold_s`` (the device's clock), records the start
    event behind it, then calls ``fn``; where the call returns before the hold ends, the
    events time only what the device does (for a collective: its kernels and the wait for
    the peers' streams, which the same hold on every rank keeps aligned to the barrier's
    skew). Returns the slowest rank's times and how many repeats' calls outlasted the hold
    on some rank (then that repeat still includes host time)."""
    cp = gpu.cupy
    hold = cp.RawKernel(_HOLD_SOURCE, "hvd_bench_hold")
    start, end = cp.cuda.Event(), cp.cuda.Event()
    ns = np.uint64(int(hold_s * 1e9))
    for _ in range(warmup):
        fn()
    gpu.sync()
    out = np.empty(reps, dtype=np.float64)
    late = 0
    for i in range(reps):
        gpu.barrier()
        t0 = time.perf_counter()
        with gpu.stream:  # (a RawKernel launches on CuPy's current stream)
            hold((1,), (1,), (ns,))
        start.record(gpu.stream)
        fn()
        late += time.perf_counter() - t0 > hold_s
        end.record(gpu.stream)
        end.synchronize()
        out[i] = cp.cuda.get_elapsed_time(start, end) * 1e-3
    return max_over_ranks(gpu.comm, out), int(gpu.comm.allreduce(late, op=MPI.SUM))


# Suffix of a baseline timed before hvdlite started: its background thread could not take the
# GIL or a core from it. Targets take the faster of a baseline's two measurements.
ALONE = " [hvdlite not started]"


def fastest(results: Mapping[str, Mapping[str, Any]], *names: str) -> str | None:
    """Of ``names`` (each also as ``name + ALONE``) those in ``results``, the lowest median's
    key; None when none is there."""
    found = [k for n in names for k in (n, n + ALONE) if k in results]
    return min(found, key=lambda k: results[k]["median_s"]) if found else None


def metadata(gpu: Gpu) -> dict[str, Any]:
    """Facts about this run: date, machine, GPU, library versions, commit, exact command."""
    cp = gpu.cupy
    meta: dict[str, Any] = {
        **run_facts(gpu.size, gpu.args),
        "gpu": gpu.device_name(),
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cp.cuda.runtime.driverGetVersion(),
        "nccl_cupy": cp.cuda.nccl.get_version(),
        # The device machine gets a copy of the working tree whose .git may lag behind it:
        # the launcher can name the commit the tree really is (HVDLITE_BENCH_COMMIT).
        "git_commit": os.environ.get("HVDLITE_BENCH_COMMIT") or _git("rev-parse", "--short",
                                                                     "HEAD"),
        # None: unknown (the named commit was not checked against the tree).
        "git_dirty": (None if os.environ.get("HVDLITE_BENCH_COMMIT") else
                      bool(_git("status", "--porcelain", "--untracked-files=no"))),
        "commit_source": ("HVDLITE_BENCH_COMMIT" if os.environ.get("HVDLITE_BENCH_COMMIT")
                          else "git"),
        "size1_shortcut_knobs_turned_off": shortcut_knobs(),
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(
                ("NCCL_", "HVDLITE_", "HOROVOD_", "CUPY_", "TORCH_", "NVSHMEM_", "CUDA_VISIBLE")
            )
        },
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        meta["torch"] = torch.__version__
        nccl_v = getattr(torch.cuda, "nccl", None)
        meta["nccl_torch"] = str(nccl_v.version()) if nccl_v is not None else "unknown"
    return meta


def finish(
    gpu: Gpu,
    name: str,
    results: dict[str, Any],
    table: str,
    targets: Sequence[Mapping[str, Any]],
    notes: Sequence[str] = (),
) -> None:
    """Rank 0: write the JSON (``--json``), then print notes, targets and the table last."""
    if gpu.rank != 0:
        return
    notes = [*notes, *filter(None, [shortcut_note(gpu.size)])]
    text = "\n".join([*(f"note: {n}" for n in notes), format_targets(targets), table])
    meta = metadata(gpu)
    payload = {
        "benchmark": name,
        "meta": meta,
        "results": results,
        "targets": list(targets),
        "notes": list(notes),
        "table": text,
    }
    if gpu.args.json:
        path = Path(gpu.args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    print(f"\n== {name} ({gpu.size} ranks, {meta['gpu']}, commit {meta['git_commit']})", flush=True)
    print(text, flush=True)
