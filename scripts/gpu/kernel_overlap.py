"""How much of the communication's time ran beside other kernels, from a kernel trace.

Reads Chrome-trace JSON as ``torch.profiler`` exports it (``prof.export_chrome_trace``;
``bench_t1.py --kernel-trace DIR`` writes one per variant and rank) and reports, per device:
the time some communication ran (the union of their intervals), the time some other kernel ran,
the part of the communication's time during which another kernel ran too (*overlapped*), and
the rest (*alone*: communication the step waited for, or that had nothing beside it to hide under),
the time no kernel ran between the first and the last (*idle*: a host-bound step shows it),
and the host's CUDA calls that wait or allocate (*sync*: stream, event and device
synchronisations; *alloc*: cudaMalloc/cudaFree and their driver forms, which synchronise too).
Where a captured step's graph allows a bucket's allreduce to run beside backward
(``scripts/gpu/graph_overlap.py``) and the step still pays for the communication, this tells
whether the kernels ran side by side at all (issue 39's question after run 83).

Communication is NCCL's kernels, and the CUDA IPC transport's work: its kernels (``hvd_ipc_``,
``hvd_oneshot_``, ``hvd_sched_``: the reduce, the one-shot step, the flags' signals and spins)
and its copies between devices (peer-to-peer memcpys, which the copy engines run: they take no
SM, but a step that waits for them pays them all the same). A captured step's kernels and
copies are traced one by one, as eager ones are.

    python3 scripts/gpu/kernel_overlap.py trace.json [more.json ...]

Exit status 0 when every file was read and had communication; 1 otherwise.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from graph_overlap import report_files

Interval = tuple[float, float]


def _union(spans: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _length(spans: list[Interval]) -> float:
    return sum(b - a for a, b in spans)


def _intersection(xs: list[Interval], ys: list[Interval]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


_COMM_KERNELS = ("nccl", "hvd_ipc_", "hvd_oneshot_", "hvd_sched_")
_PEER_COPIES = ("ptop", "peer")  # torch.profiler's "Memcpy PtoP (Device -> Device)"


def is_comm(name: str) -> bool:
    """Whether a kernel or copy of this name is communication (see the module's docstring)."""
    low = name.lower()
    return low.startswith("memcpy") and any(k in low for k in _PEER_COPIES) \
        or any(k in low for k in _COMM_KERNELS)


def _device_work(trace: dict[str, Any] | list[Any]
                 ) -> dict[int, list[tuple[float, float, str, str]]]:
    """Each device's complete events of category ``kernel`` or ``gpu_memcpy`` as (start us,
    end us, name, category)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out: dict[int, list[tuple[float, float, str, str]]] = defaultdict(list)
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", "")).lower()
        if cat not in ("kernel", "gpu_memcpy"):
            continue
        args = ev.get("args") or {}
        device = int(args.get("device", ev.get("pid", 0)) or 0)
        start = float(ev["ts"])
        out[device].append((start, start + float(ev.get("dur", 0.0)),
                            str(ev.get("name", "")), cat))
    return out


def kernels(trace: dict[str, Any] | list[Any]) -> dict[int, list[tuple[float, float, str]]]:
    """Each device's kernels and peer-to-peer copies as (start us, end us, name); a copy
    within one device is left out (neither communication nor a kernel that hides it)."""
    out = {d: [(a, b, n) for a, b, n, cat in work if cat == "kernel" or is_comm(n)]
           for d, work in _device_work(trace).items()}
    return {d: ks for d, ks in out.items() if ks}


def device_copies(trace: dict[str, Any] | list[Any]) -> dict[int, float]:
    """Each device's time (union, us) in copies that are not peer-to-peer: a profiler that
    reports the IPC transport's copies between devices as device-to-device puts them here
    rather than in the communication, and this says so."""
    return {d: _length(_union([(a, b) for a, b, n, cat in work
                               if cat == "gpu_memcpy" and not is_comm(n)]))
            for d, work in _device_work(trace).items()}


# The host's CUDA calls that hold it until the device catches up (by name, runtime or driver).
_SYNC = ("synchronize",)
_ALLOC = ("cudamalloc", "cudafree", "cumemalloc", "cumemfree")


def host_calls(trace: dict[str, Any] | list[Any]) -> dict[str, float]:
    """The trace's CUDA runtime and driver calls that wait (``sync_us``, ``sync_calls``) or
    allocate (``alloc_us``, ``alloc_calls``), summed over the process's threads."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out = {"sync_us": 0.0, "sync_calls": 0.0, "alloc_us": 0.0, "alloc_calls": 0.0}
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        if str(ev.get("cat", "")).lower() not in ("cuda_runtime", "cuda_driver"):
            continue
        name = str(ev.get("name", "")).lower()
        kind = "sync" if any(k in name for k in _SYNC) else \
            "alloc" if name.startswith(_ALLOC) else ""
        if kind:
            out[f"{kind}_us"] += float(ev.get("dur", 0.0))
            out[f"{kind}_calls"] += 1
    return out


def summary(trace: dict[str, Any] | list[Any]) -> dict[int, dict[str, float]]:
    """Per device: ``comm_us`` (union of the communication's time), ``other_us`` (union of
    the other kernels' time), ``overlapped_us`` (both at once), ``alone_us`` (communication
    with no other kernel), ``span_us`` (first start to last end), ``idle_us`` (nothing
    running within the span), ``comm_kernels`` (kernels and copies), ``other_kernels``,
    ``overlapped_share`` (overlapped / communication time; 0 without any), ``copies_us``
    (:func:`device_copies`), and the process's :func:`host_calls`."""
    out: dict[int, dict[str, float]] = {}
    host = host_calls(trace)
    copies = device_copies(trace)
    for device, ks in sorted(kernels(trace).items()):
        kinds = [is_comm(n) for _, _, n in ks]
        comm = _union([(a, b) for (a, b, _), c in zip(ks, kinds, strict=True) if c])
        other = _union([(a, b) for (a, b, _), c in zip(ks, kinds, strict=True) if not c])
        both = _intersection(comm, other)
        c_us = _length(comm)
        span = max(b for _, b, _ in ks) - min(a for a, _, _ in ks)
        out[device] = {
            "comm_us": c_us, "other_us": _length(other), "overlapped_us": both,
            "alone_us": c_us - both,
            "span_us": span, "idle_us": span - _length(_union([(a, b) for a, b, _ in ks])),
            "comm_kernels": float(sum(kinds)),
            "other_kernels": float(len(kinds) - sum(kinds)),
            "overlapped_share": both / c_us if c_us else 0.0,
            "copies_us": copies.get(device, 0.0),
            **host,
        }
    return out


def report(path: Path) -> tuple[str, bool]:
    """One file's lines, and whether it had communication."""
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"== {path}: UNREADABLE ({exc})", False
    rows = summary(trace)
    if not rows:
        return f"== {path}: no kernel events (category 'kernel')", False
    lines = [f"== {path}",
             f"{'device':>6} {'comm us':>10} {'other us':>10} {'overlapped':>11} "
             f"{'alone us':>9} {'span us':>10} {'idle us':>9} {'comm k':>7} {'other k':>8} "
             f"{'copies us':>10} {'sync us (n)':>14} {'alloc us (n)':>14}"]
    found = False
    for dev, r in rows.items():
        found |= r["comm_kernels"] > 0
        lines.append(f"{dev:>6} {r['comm_us']:>10.0f} {r['other_us']:>10.0f} "
                     f"{r['overlapped_us']:>6.0f} {100 * r['overlapped_share']:>3.0f}% "
                     f"{r['alone_us']:>9.0f} {r['span_us']:>10.0f} {r['idle_us']:>9.0f} "
                     f"{r['comm_kernels']:>7.0f} {r['other_kernels']:>8.0f} "
                     f"{r['copies_us']:>10.0f} {r['sync_us']:>8.0f} ({r['sync_calls']:>3.0f}) "
                     f"{r['alloc_us']:>8.0f} ({r['alloc_calls']:>3.0f})")
    return "\n".join(lines), found


def main(argv: list[str]) -> int:
    return report_files(argv, report, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
