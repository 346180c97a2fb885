"""I1-I3: hvdlite's CUDA IPC transport (``hvdlite._gpu.ipc.IpcCommunicator``) against NCCL
(CuPy's ``NcclCommunicator``), called directly on the same buffers, float32 SUM, out of place.

- I1: allreduce of 4 B .. 1 MiB, device time (CUDA events on the stream around one call, the
  slowest rank's, median of ``--reps-small``), two ways: back to back with the host (the
  stream idles while the host issues the call, so a call whose host part is longer than its
  kernels is timed at its host time), and held (the stream spins 300 us on every rank first,
  the call is issued during the spin, so the events time what the device does: its kernels
  and the wait for the peers). Target (2 GPUs): IPC <= 0.5x NCCL up to 64 KiB, held. Beside
  both the host time of the call (from before it to its return). With a GPU per rank, the
  floor beside them (``_ipcfloor.py``): an empty kernel, and a kernel that only exchanges a
  flag with every peer, the least device time any one-shot allreduce can take.
- I2: allreduce of 64, 128 and 256 MiB, device time, median of ``--reps-large``; IPC with
  hvdlite's default staging slot (``ipc_buffer_bytes``, 16 MiB: a large call moves in chunks,
  ordered by the protocol's fences) and with one slot as large as the call (informational). Target
  (2 GPUs): IPC (default slot) <= 0.9x NCCL.
- I3: ``--mm-reps`` 4096 x 4096 float32 matmuls on the compute stream, timed by events on it,
  alone and with a 64 MiB allreduce running repeatedly on a second stream for the whole
  window (as many calls as the compute takes by the calibration: comm alone, agreed over
  ranks), through IPC and through NCCL. Target (2 GPUs): IPC slows compute by <= 3%.

How IPC moves data (``hvdlite/_gpu/ipc.py``): each rank copies its input into its staging slot
(``cudaMemcpyAsync``), signals its peers and waits for theirs (device semaphores: stream memory
operations; or, the fallback, interprocess events and a host barrier), then a kernel on the
caller's stream reads every rank's slot and reduces. Its device time therefore includes the
stream's idle time while the host issues those steps (and, with events, runs the barrier):
what a caller of the transport waits for. The report says which protocol ran.

Every variant's result is checked exact (integer-valued floats, a float64 reference from every
rank's inputs) before timing and again after. Where the launch's ranks share a GPU (2 ranks on
a one-GPU host), NCCL cannot run: only IPC is measured, correctness still checked, and every
time is labelled "no timing claims: contexts take turns" (no targets). At 1 rank both run (IPC
is a copy in and a one-input reduce; NCCL a device copy); no target applies.

    mpirun -n 2 python3 scripts/gpu/bench_ipc.py --json ipc.json
    mpirun -n 1 python3 scripts/gpu/bench_ipc.py --np 1 --quick
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import _gpulib as gl
import numpy as np
from _ipcfloor import bench_floor
from mpi4py import MPI

KIB, MIB = 1024, 1024 * 1024
I1_SIZES = [4, 64, KIB, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB]
I1_QUICK = [4, 4 * KIB, 64 * KIB, MIB]
I1_TARGET_MAX = 64 * KIB
I2_SIZES = [64 * MIB, 128 * MIB, 256 * MIB]
I2_QUICK = [64 * MIB]
I3_BYTES = 64 * MIB
X_I1, X_I2, MAX_I3 = 0.5, 0.9, 0.03
NO_CLAIMS = "no timing claims: contexts take turns"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = gl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--reps-small", type=int, default=200, help="timed calls per I1 size")
    p.add_argument("--reps-large", type=int, default=20, help="timed calls per I2 size")
    p.add_argument("--i3-reps", type=int, default=10, help="timed compute windows per I3 variant")
    p.add_argument("--mm-reps", type=int, default=20, help="matmuls per I3 compute window")
    p.add_argument("--slot-mib", type=int, default=0,
                   help="IPC staging slot in MiB (default: hvdlite's ipc_buffer_bytes)")
    p.add_argument("--skip", nargs="*", default=[], choices=["I1", "I2", "I3"])
    args = p.parse_args(argv)
    if args.quick:
        args.reps_small, args.reps_large, args.i3_reps, args.mm_reps = 30, 5, 3, 5
    if min(args.reps_small, args.reps_large, args.i3_reps, args.mm_reps) < 1:
        p.error("repeat counts must be positive")
    return args


class Launch(gl.Gpu):
    """gl.Gpu, except that ranks may share a GPU (``shared``: then NCCL cannot run)."""

    def __init__(self, args: argparse.Namespace) -> None:  # no super(): it refuses sharing
        self.args = args
        self.comm, self.rank, self.size, self.local_rank, self.local_size = gl.join_launch(args)
        self.cupy = gl._import_cupy(self.comm)
        count = self.cupy.cuda.runtime.getDeviceCount()
        gl.check_all(self.comm, count >= 1, "GPU count", "no CUDA device")
        self.device_id = self.local_rank % count
        self.shared = bool(self.comm.allreduce(int(count < self.local_size), op=MPI.MAX))
        self.cupy.cuda.Device(self.device_id).use()
        self.stream = self.cupy.cuda.Stream(non_blocking=True)
        self.stream.use()


class Transports:
    """The communicators: IPC with the default slot, IPC with a large slot (I2), NCCL."""

    def __init__(self, gpu: Launch, slot: int, big_slot: int) -> None:
        from cupy.cuda import nccl

        from hvdlite._gpu.ipc import ONESHOT_BYTES, IpcCommunicator

        self.nccl = nccl
        self.gpu = gpu

        def wait(req: MPI.Request) -> None:
            req.Wait()

        # As the engine makes it: one-shot kernels for small calls where each rank has a GPU.
        oneshot = 0 if gpu.shared else ONESHOT_BYTES
        self.ipc = IpcCommunicator(gpu.comm, gpu.cupy, nccl, gpu.device_id, slot, wait,
                                   oneshot_bytes=oneshot)
        # The same without them, beside it: every small call a step of stream memory ops.
        self.ipc_memops = (IpcCommunicator(gpu.comm, gpu.cupy, nccl, gpu.device_id, slot, wait)
                           if self.ipc.oneshot_bytes else None)
        # The agreed protocol's fallback beside it, same slot: what the semaphores change.
        self.ipc_events = (IpcCommunicator(gpu.comm, gpu.cupy, nccl, gpu.device_id, slot, wait,
                                           protocol="events")
                           if self.ipc.protocol != "events" else None)
        self.protocol = f"{self.ipc.protocol} ({self.ipc.protocol_why})"
        self.ipc_big = (IpcCommunicator(gpu.comm, gpu.cupy, nccl, gpu.device_id, big_slot, wait)
                        if big_slot > slot else None)
        self.raw = None if gpu.shared else gl.RawNccl(gpu)

    def ipc_call(self, comm: Any, src: Any, dst: Any, stream: Any = None) -> Callable[[], None]:
        s = self.gpu.stream if stream is None else stream
        nccl = self.nccl
        return lambda: comm.allReduce(src.data.ptr, dst.data.ptr, src.size, nccl.NCCL_FLOAT32,
                                      nccl.NCCL_SUM, s.ptr)

    def nccl_call(self, src: Any, dst: Any, stream: Any = None) -> Callable[[], None]:
        raw = self.raw
        assert raw is not None
        return lambda: raw.allreduce(src, dst, "sum", stream)

    def close(self) -> None:
        self.gpu.sync()
        self.ipc.destroy()
        if self.ipc_memops is not None:
            self.ipc_memops.destroy()
        if self.ipc_events is not None:
            self.ipc_events.destroy()
        if self.ipc_big is not None:
            self.ipc_big.destroy()
        if self.raw is not None:
            self.raw.close()


def variants(t: Transports, src: Any, dst: Any, big: bool,
             stream: Any = None) -> dict[str, Callable[[], None]]:
    out = {"IPC": t.ipc_call(t.ipc, src, dst, stream)}
    if t.ipc_memops is not None and not big:
        out["IPC, no one-shot kernel"] = t.ipc_call(t.ipc_memops, src, dst, stream)
    if t.ipc_events is not None:
        out["IPC, events protocol"] = t.ipc_call(t.ipc_events, src, dst, stream)
    if big and t.ipc_big is not None:
        out["IPC, one slot per call"] = t.ipc_call(t.ipc_big, src, dst, stream)
    if t.raw is not None:
        out["NCCL"] = t.nccl_call(src, dst, stream)
    return out


def checked(gpu: Launch, fns: dict[str, Callable[[], None]], dst: Any, ref: Any, what: str,
            stream: Any = None) -> None:
    """Run each variant once into a poisoned ``dst``; refuse unless exact on every rank."""
    for name, fn in fns.items():
        gl.poison(dst)
        gpu.sync()
        fn()
        (gpu.stream if stream is None else stream).synchronize()
        gl.check_equal(gpu, dst, ref, f"{name} allreduce, {what}")


def bench_sizes(gpu: Launch, t: Transports, sizes: list[int], reps: int, warmup: int,
                big: bool, salt0: int) -> dict[int, dict[str, dict[str, float]]]:
    cp, args = gpu.cupy, gpu.args
    out: dict[int, dict[str, dict[str, float]]] = {}
    for i, nbytes in enumerate(sizes):
        n = nbytes // 4
        src = gl.int_values(cp, n, args.seed, gpu.rank, salt0 + i)
        ref = gl.reference_sum(cp, n, args.seed, gpu.size, salt0 + i)
        dst = cp.empty(n, dtype=cp.float32)
        fns = variants(t, src, dst, big)
        what = gl.human_bytes(nbytes)
        checked(gpu, fns, dst, ref, f"{what}, before timing")
        out[nbytes] = {}
        for name, fn in fns.items():
            device, host = gl.device_and_host_time(gpu, fn, reps, warmup)
            out[nbytes][name] = {**gl.stats(device), "host_median_s": float(np.median(host))}
            if not big:  # small calls: the device's own time, the host's issuing hidden
                held, late = gl.held_device_time(gpu, fn, reps, 2)
                out[nbytes][name].update(held_median_s=float(np.median(held)),
                                         held_p99_s=float(np.percentile(held, 99)),
                                         held_late=late)
        checked(gpu, fns, dst, ref, f"{what}, after timing")
        del src, ref, dst
        cp.get_default_memory_pool().free_all_blocks()
    return out


def bench_i3(gpu: Launch, t: Transports) -> dict[str, Any]:
    """Compute (matmuls on the bench stream) alone and with concurrent allreduces."""
    cp, args = gpu.cupy, gpu.args
    n = I3_BYTES // 4
    src = gl.int_values(cp, n, args.seed, gpu.rank, 99)
    ref = gl.reference_sum(cp, n, args.seed, gpu.size, 99)
    dst = cp.empty(n, dtype=cp.float32)
    comm_stream = cp.cuda.Stream(non_blocking=True)
    fns = variants(t, src, dst, False, comm_stream)
    checked(gpu, fns, dst, ref, "I3 buffer, before timing", comm_stream)
    with gpu.stream:
        a = gl.int_values(cp, 4096 * 4096, args.seed, gpu.rank, 98, bound=4).reshape(4096, 4096)
        b = gl.int_values(cp, 4096 * 4096, args.seed, gpu.rank, 97, bound=4).reshape(4096, 4096)
        c = cp.empty_like(a)
    gpu.sync()

    def compute() -> None:
        with gpu.stream:
            for _ in range(args.mm_reps):
                cp.matmul(a, b, out=c)

    alone = gl.device_time(gpu, compute, args.i3_reps, 2)
    res: dict[str, Any] = {"compute alone": gl.stats(alone)}
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for name, fn in fns.items():
        comm_t = float(np.median(_stream_time(gpu, fn, comm_stream, 5)))
        calls = int(gpu.comm.allreduce(math.ceil(float(np.median(alone)) / comm_t) + 1,
                                       op=MPI.MAX))
        times = np.empty(args.i3_reps)
        for i in range(args.i3_reps + 1):  # the first is warm-up
            gpu.barrier()
            start.record(gpu.stream)
            compute()
            end.record(gpu.stream)
            for _ in range(calls):
                fn()
            end.synchronize()
            comm_stream.synchronize()
            if i:
                times[i - 1] = cp.cuda.get_elapsed_time(start, end) * 1e-3
        times = gl.max_over_ranks(gpu.comm, times)
        res[f"compute with {name}"] = {**gl.stats(times), "comm_calls": calls,
                                       "comm_alone_s": comm_t,
                                       "slowdown": round(float(np.median(times))
                                                         / float(np.median(alone)) - 1, 4)}
    checked(gpu, fns, dst, ref, "I3 buffer, after timing", comm_stream)
    return res


def _stream_time(gpu: Launch, fn: Callable[[], None], stream: Any, reps: int) -> np.ndarray:
    """Device time of ``fn`` on ``stream`` (events), slowest rank per repeat."""
    cp = gpu.cupy
    start, end = cp.cuda.Event(), cp.cuda.Event()
    fn()
    stream.synchronize()
    out = np.empty(reps)
    for i in range(reps):
        gpu.barrier()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        out[i] = cp.cuda.get_elapsed_time(start, end) * 1e-3
    return gl.max_over_ranks(gpu.comm, out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gpu = Launch(args)
    from hvdlite.config import Config

    slot = (args.slot_mib * MIB) if args.slot_mib else Config().ipc_buffer_bytes
    i1 = I1_QUICK if args.quick else I1_SIZES
    i2 = I2_QUICK if args.quick else I2_SIZES
    t = Transports(gpu, slot, max(i2) if "I2" not in args.skip else 0)
    res: dict[str, Any] = {"shared_gpu": gpu.shared, "slot_bytes": slot,
                           "protocol": t.protocol}
    if "I1" not in args.skip:
        res["I1"] = bench_sizes(gpu, t, i1, args.reps_small, 20, False, 0)
        if gpu.size >= 2 and not gpu.shared:  # (spinning kernels of contexts taking turns)
            res["floor"] = bench_floor(gpu, args.reps_small)
    if "I2" not in args.skip:
        res["I2"] = bench_sizes(gpu, t, i2, args.reps_large, 3, True, 50)
    if "I3" not in args.skip:
        res["I3"] = bench_i3(gpu, t)
    t.close()
    report(gpu, res, slot)


def report(gpu: Launch, res: dict[str, Any], slot: int) -> None:
    label = f" ({NO_CLAIMS})" if gpu.shared else ""
    rows: list[list[object]] = []
    targets: list[dict[str, Any]] = []
    claim = gpu.size >= 2 and not gpu.shared
    for part in ("I1", "I2"):
        for nbytes, st in res.get(part, {}).items():
            nccl = st.get("NCCL", {}).get("median_s")
            nccl_held = st.get("NCCL", {}).get("held_median_s")
            for name, s in st.items():
                r = gl.ratio(s["median_s"], nccl) if nccl and name != "NCCL" else None
                held = s.get("held_median_s")
                rh = (gl.ratio(held, nccl_held) if held is not None and nccl_held
                      and name != "NCCL" else None)
                rows.append([part, gl.human_bytes(nbytes), name + label, gl.us(s["median_s"]),
                             gl.us(s["p99_s"]), gl.us(s["host_median_s"]), r,
                             gl.us(held) if held is not None else "-", rh,
                             s.get("held_late", "-")])
            if claim and nccl:
                ipc_r = gl.ratio(st["IPC"]["median_s"], nccl)
                if part == "I1" and nbytes <= I1_TARGET_MAX and nccl_held:
                    targets.append(gl.target(
                        f"I1 {gl.human_bytes(nbytes)}: IPC / NCCL device time, host hidden",
                        gl.ratio(st["IPC"]["held_median_s"], nccl_held), X_I1, "x"))
                if part == "I2":
                    targets.append(gl.target(f"I2 {gl.human_bytes(nbytes)}: IPC (default slot) "
                                             "/ NCCL device time", ipc_r, X_I2, "x"))
    i1 = res.get("I1") or {}
    nccl4 = i1[min(i1)].get("NCCL", {}) if i1 else {}
    for name, s in res.get("floor", {}).items():  # against NCCL's call of its size, or 4 B
        size = s.get("nbytes")
        nccl = (i1.get(size) or {}).get("NCCL", {}) if size else nccl4
        rows.append(["I1", gl.human_bytes(size) if size else "-", name, gl.us(s["median_s"]),
                     gl.us(s["p99_s"]), gl.us(s["host_median_s"]),
                     gl.ratio(s["median_s"], nccl["median_s"]) if nccl else None,
                     gl.us(s["held_median_s"]),
                     gl.ratio(s["held_median_s"], nccl["held_median_s"]) if nccl else None,
                     s["held_late"]])
    table = gl.format_table(["part", "bytes", "transport", "median us", "p99 us",
                             "host us (median)", "vs NCCL", "held us", "held vs NCCL",
                             "late"], rows)
    i3 = res.get("I3")
    if i3 is not None:
        i3_rows = [[k + label, gl.ms(v["median_s"]), v.get("comm_calls"), v.get("slowdown")]
                   for k, v in i3.items()]
        table += "\n" + gl.format_table(["I3 compute window", "median ms", "comm calls",
                                         "slowdown"], i3_rows)
        if claim and "compute with IPC" in i3:
            targets.append(gl.target("I3: compute slowed by concurrent IPC",
                                     i3["compute with IPC"]["slowdown"], MAX_I3))
    notes = [f"IPC staging slot {gl.human_bytes(slot)} (two per rank); IPC's protocol: "
             f"{res.get('protocol')}; device time includes the stream's idle time while it "
             "waits for the peers (a barrier, or their flags) and, where the host is slower "
             "than the device, while the host issues the call; 'held': the same call behind "
             "a 300 us spin on every rank, so the events time the device's own work (the I1 "
             "target's figure); 'late': repeats whose call outlasted the spin on some rank; "
             "'floor' rows (scripts/gpu/_ipcfloor.py): an empty kernel, and one kernel that "
             "only exchanges a flag with every peer (and the same exchange by stream memops, "
             "no kernel), against NCCL's smallest call: no one-shot allreduce signalling "
             "that way takes less device time than the exchange; 'candidate: LL "
             "one-shot' rows: the one-shot shape with data and epoch in one 8-byte store "
             "(_ipcfloor.py), checked exact, against NCCL at its size"]
    if gpu.shared:
        notes.append(f"ranks share a GPU: NCCL cannot run, IPC only; {NO_CLAIMS} (no MPS): "
                     "correctness only, no targets")
    elif gpu.size == 1:
        notes.append("1 rank: IPC is a copy in and a one-input reduce, NCCL a device copy; "
                     "no target applies (I1-I3 are 2-GPU targets)")
    gl.finish(gpu, "I (CUDA IPC vs NCCL)", res_json(res), table, targets, notes)


def res_json(res: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe results (size keys as strings)."""
    return {k: ({str(n): v for n, v in val.items()} if k in ("I1", "I2") else val)
            for k, val in res.items()}


if __name__ == "__main__":
    main()
