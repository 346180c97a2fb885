"""C6 and C2 across hosts: 2 hosts x 2 ranks over TCP beside 4 ranks on one host, one run.

Builds two hosts from namespaces (tests/multihost/cluster.py; root, iproute2 and sshd needed),
then, round by round with the order alternating, runs on host 1 through ``hvdliterun --tcp``:
a raw MPI ping-pong probe (latency and per-byte time inside a host and across), bench_c6.py and
bench_c2.py, once with ``-H n1:4`` and once with ``-H n1:2,n2:2``. Medians over rounds. The
cost model (scripts/costmodel.py) takes each constant from one measured point (see
``calibrate``); its predictions are printed beside every measured point, then for 8 to 1,024
ranks.

    flock -x /tmp/hvd-cpu.lock python scripts/bench_multihost.py --rounds 3 --json mh.json
    python scripts/bench_multihost.py --probe OUT.json   # (the probe's rank program)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import costmodel as cm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "multihost"))
LAYOUTS = {"1 host x 4": "n1:4", "2 hosts x 2": "n1:2,n2:2"}
C2_N = (10, 100, 1000)
PROBE_SIZES = (8, 1 << 18)


# ---------------------------------------------------------------------------------------------
# The probe (a rank program): half round trips between rank 0 and ranks 1 and 2
# ---------------------------------------------------------------------------------------------


def _idle_barrier(comm: Any) -> None:
    """A barrier that sleeps instead of spinning (4 ranks share 2 cores here)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def probe(out: str, reps: int = 300) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    me = comm.Get_rank()
    result: dict[str, dict[str, float]] = {}
    for peer in (1, 2):
        for size in PROBE_SIZES:
            buf = np.zeros(size, np.uint8)
            times = []
            _idle_barrier(comm)
            if me in (0, peer):
                other = peer if me == 0 else 0
                for i in range(reps + 20):
                    t0 = time.perf_counter()
                    if me == 0:
                        comm.Send(buf, other)
                        comm.Recv(buf, other)
                    else:
                        comm.Recv(buf, other)
                        comm.Send(buf, other)
                    if i >= 20:
                        times.append((time.perf_counter() - t0) / 2)
            _idle_barrier(comm)
            if me == 0:
                result.setdefault(f"peer{peer}", {})[str(size)] = statistics.median(times)
    if me == 0:
        Path(out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def _run(cluster: Any, hosts: str, args: list[str], timeout: float) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "scripts")])
    for i, h in enumerate(cluster.hosts, 1):
        hosts = hosts.replace(f"n{i}:", f"{h.name}:")
    cmd = [sys.executable, "-m", "hvdlite.run", "-np", "4", "-H", hosts, "--tcp", "--",
           sys.executable, *args]
    ran = cluster.run(1, cmd, timeout=timeout, env=env, cwd=str(REPO))
    if ran.returncode != 0:
        raise SystemExit(f"failed ({ran.returncode}): {' '.join(cmd)}\n{ran.stderr[-3000:]}")


def measure(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    from cluster import Cluster, unavailable

    why = unavailable()
    if why:
        raise SystemExit(why)
    cluster = Cluster(base=base / "_hosts", shared=base, n=2)
    cluster.start()
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in LAYOUTS}
    try:
        for rnd in range(args.rounds):
            order = list(LAYOUTS) if rnd % 2 == 0 else list(reversed(LAYOUTS))
            for name in order:
                out = base / f"r{rnd}-{name.replace(' ', '')}"
                out.mkdir()
                s = str(REPO / "scripts")
                _run(cluster, LAYOUTS[name], [f"{s}/bench_multihost.py", "--probe",
                                              str(out / "probe.json")], 300)
                _run(cluster, LAYOUTS[name], [f"{s}/bench_c6.py", "--np", "4", "--repeats",
                                              str(args.c6_repeats), "--json",
                                              str(out / "c6.json")], 600)
                _run(cluster, LAYOUTS[name], [f"{s}/bench_c2.py", "--np", "4", "--reps",
                                              str(args.c2_reps), "--json",
                                              str(out / "c2.json")], 600)
                raw[name].append({k: json.loads((out / f"{k}.json").read_text())
                                  for k in ("probe", "c6", "c2")})
                print(f"round {rnd + 1}/{args.rounds}: {name} done", flush=True)
    finally:
        cluster.stop()
    return raw


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def summarise(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, runs in raw.items():
        c6w = [r["c6"]["worst_rank"] for r in runs]
        row: dict[str, Any] = {
            "c6_hvd_p50_s": _median([w["hvdlite allreduce (sync)"]["median_s"] for w in c6w]),
            "c6_hvd_p99_s": _median([w["hvdlite allreduce (sync)"]["p99_s"] for w in c6w]),
            "c6_raw_p50_s": _median([min(w["mpi4py Allreduce"]["median_s"],
                                         w["mpi4py Allreduce [hvdlite not started]"]["median_s"])
                                     for w in c6w]),
        }
        for n in C2_N:
            res = [r["c2"]["results"][str(n)] for r in runs]
            row[f"c2_cached_{n}_s"] = _median([x["hvdlite, cache on"]["per_tensor_s"]
                                               for x in res])
            row[f"c2_nocache_{n}_s"] = _median([x["hvdlite, cache off"]["per_tensor_s"]
                                                for x in res])
            row[f"c2_raw_{n}_s"] = _median([x["raw MPI Allreduce per tensor"]["per_tensor_s"]
                                            for x in res])
        for peer in ("peer1", "peer2"):
            for size in PROBE_SIZES:
                row[f"probe_{peer}_{size}_s"] = _median([r["probe"][peer][str(size)]
                                                         for r in runs])
        row["rounds"] = len(runs)
        out[name] = row
    return out


def _request_bytes(n: int = 1000) -> int:
    sys.path.insert(0, str(REPO))
    from hvdlite._vocab.messages import Kind, Request, pack_request

    reqs = [pack_request(Request(f"c2.n{n}.{i:04d}", Kind.ALLREDUCE, "float32", (1,)))
            for i in range(n)]
    return round(len(pickle.dumps(reqs, pickle.HIGHEST_PROTOCOL)) / n)


def calibrate(s: dict[str, Any]) -> cm.Constants:
    """Each constant from one measured point; every other point is a prediction.

    Latency and per-byte terms: the 2-host run's probe (ranks 0-1 share a host, 0-2 do not).
    hvdlite's Python costs: the one-host run (C6 for ``c_call``; C2 at N=1000, cached for
    ``c_tensor``, cache off for ``c_req``). ``w_net``: the 2-host run's C6."""
    one, two = s["1 host x 4"], s["2 hosts x 2"]
    big = PROBE_SIZES[1]

    def ab(peer: str) -> tuple[float, float]:
        small, large = two[f"probe_{peer}_{PROBE_SIZES[0]}_s"], two[f"probe_{peer}_{big}_s"]
        return small, max(large - small, 0.0) / big

    (a_shm, b_shm), (a_net, b_net) = ab("peer1"), ab("peer2")
    k = cm.Constants(a_shm, b_shm, a_net, b_net, 0.0, 0.0, 0.0, r=_request_bytes())
    n = C2_N[-1]
    k = replace(k, c_call=one["c6_hvd_p50_s"] - cm.c6_latency(k, 4, 4).seconds)
    k = replace(k, c_tensor=one[f"c2_cached_{n}_s"] - cm.cached_step(k, 4, 4, n).seconds / n)
    extra = one[f"c2_nocache_{n}_s"] * n - cm.uncached_round(k, 4, 4, n).seconds
    k = replace(k, c_req=max(extra, 0.0) / (4 * n))
    return replace(k, w_net=max(two["c6_hvd_p50_s"] - cm.c6_latency(k, 4, 2).seconds, 0.0) / 2)


def beside(s: dict[str, Any], k: cm.Constants) -> str:
    """Measured points with the model's predictions beside them."""
    lines = ["| point | layout | measured | model |", "|---|---|---|---|"]
    for name, ppn in (("1 host x 4", 4), ("2 hosts x 2", 2)):
        row = s[name]
        lines.append(f"| C6 p50, 4 B sync allreduce | {name} | "
                     f"{row['c6_hvd_p50_s'] * 1e6:.1f} us | "
                     f"{cm.c6_latency(k, 4, ppn).seconds * 1e6:.1f} us |")
        for n in C2_N:
            cached = cm.cached_step(k, 4, ppn, n).seconds / n
            uncached = cm.uncached_round(k, 4, ppn, n).seconds / n
            lines.append(f"| C2 per tensor, cached, N={n} | {name} | "
                         f"{row[f'c2_cached_{n}_s'] * 1e6:.1f} us | {cached * 1e6:.1f} us |")
            lines.append(f"| C2 per tensor, cache off, N={n} | {name} | "
                         f"{row[f'c2_nocache_{n}_s'] * 1e6:.1f} us | {uncached * 1e6:.1f} us |")
    return "\n".join(lines)


def measured_table(s: dict[str, Any]) -> str:
    lines = ["| layout | C6 p50 (raw Allreduce) | C6 p99 | C2 cached per tensor N=10/100/1000 "
             "| C2 cache off N=10/100/1000 | raw Allreduce per tensor N=1000 | ping-pong 8 B "
             "rank 0-1 / 0-2 |", "|---|---|---|---|---|---|---|"]
    for name, row in s.items():
        cached = " / ".join(f"{row[f'c2_cached_{n}_s'] * 1e6:.1f}" for n in C2_N)
        nocache = " / ".join(f"{row[f'c2_nocache_{n}_s'] * 1e6:.1f}" for n in C2_N)
        lines.append(
            f"| {name} | {row['c6_hvd_p50_s'] * 1e6:.1f} us ({row['c6_raw_p50_s'] * 1e6:.1f}) | "
            f"{row['c6_hvd_p99_s'] * 1e6:.0f} us | {cached} us | {nocache} us | "
            f"{row['c2_raw_1000_s'] * 1e6:.1f} us | "
            f"{row['probe_peer1_8_s'] * 1e6:.1f} / {row['probe_peer2_8_s'] * 1e6:.1f} us |")
    return "\n".join(lines)


def constants_text(k: cm.Constants) -> str:
    return (f"alpha_shm {k.alpha_shm * 1e6:.1f} us, beta_shm {k.beta_shm * 1e9:.2f} ns/B, "
            f"alpha_net {k.alpha_net * 1e6:.1f} us, beta_net {k.beta_net * 1e9:.2f} ns/B, "
            f"c_call {k.c_call * 1e6:.1f} us, c_tensor {k.c_tensor * 1e6:.2f} us, "
            f"c_req {k.c_req * 1e6:.2f} us, w_net {k.w_net * 1e6:.1f} us, r {k.r} B, "
            f"words {k.words}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--c6-repeats", type=int, default=2000)
    ap.add_argument("--c2-reps", type=int, default=7)
    ap.add_argument("--json", metavar="PATH", help="write the raw runs and the summary")
    ap.add_argument("--model-only", metavar="JSON", help="re-print from an earlier --json")
    ap.add_argument("--workdir", default="/tmp/hvdlite-bench-multihost")
    args = ap.parse_args()
    if args.probe:
        probe(args.probe)
        return
    if args.model_only:
        saved = json.loads(Path(args.model_only).read_text())
        raw, meta = saved["raw"], saved["meta"]
    else:
        base = Path(args.workdir)
        subprocess.run(["rm", "-rf", str(base)], check=True)
        base.mkdir(parents=True)
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        raw = measure(args, base)
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=False).stdout.strip()
        meta = {"started_utc": started, "commit": commit, "cpus": os.cpu_count(),
                "command": " ".join(sys.argv), "rounds": args.rounds}
    s = summarise(raw)
    k = calibrate(s)
    print(f"meta: {json.dumps(meta)}")
    print("\n## measured (medians over rounds)\n" + measured_table(s))
    print("\n## constants (alpha, beta: the probe; c_call, c_tensor, c_req: the one-host run's "
          "C6 and C2 at N=1000; w_net: the two-host run's C6)\n" + constants_text(k))
    print("\n## measured beside the model\n" + beside(s, k))
    print("\n## the model, 8 ranks per host, N=100\n" + cm.table(k))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "raw": raw, "summary": s,
                                               "constants": vars(k)}, indent=1))


if __name__ == "__main__":
    main()
