"""The one timing harness of every benchmark (CPU ``scripts/bench_*.py``; the GPU scripts
reach it through ``scripts/gpu/_gpulib.py``, which adds only what needs a GPU).

Every benchmark follows the same rules (see ``docs/benchmarks.md``): the launch must have the
rank count given by ``--np``; results are checked against references rebuilt from every rank's
inputs before anything is timed; warm-up first, then many repeats, medians reported; a short
table is printed last by rank 0 and the full results go to ``--json PATH``. A benchmark that
cannot vouch for its numbers exits with status 2 and a ``REFUSED:`` line instead of reporting.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from mpi4py import MPI

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(__file__).resolve().parent / "data"
REFUSED_EXIT = 2


def install_abort_hook() -> None:
    """Abort the whole MPI job on an uncaught exception so no rank is left waiting (in this
    process only: a child forked later, a compile worker say, inherits the hook but is no
    rank, and its failure is its parent's to report)."""
    owner = os.getpid()

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if os.getpid() != owner:
            sys.__excepthook__(kind, value, tb)
            return
        rank = MPI.COMM_WORLD.Get_rank()
        # The process's own stderr, not sys.stderr: torch.distributed's excepthook (set when a
        # process group starts) calls this one with sys.stderr swapped for a buffer it prints
        # afterwards, which an abort never reaches.
        err = sys.__stderr__ or sys.stderr
        err.write(f"[rank {rank}] uncaught exception, aborting the job:\n")
        traceback.print_exception(kind, value, tb, file=err)
        err.flush()
        # The launcher forwards stderr through a pipe it stops reading once the job is
        # aborted: give it a moment, or the traceback is lost (mpirun --output-filename).
        time.sleep(2.0)
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


def base_parser(description: str, np_default: int | None = None) -> argparse.ArgumentParser:
    """Return an argument parser with the options every benchmark shares.

    ``--np`` is required unless ``np_default`` is given.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--np",
        type=int,
        required=np_default is None,
        default=np_default,
        help="rank count this launch must have; the benchmark refuses to report otherwise",
    )
    p.add_argument("--json", metavar="PATH", help="write the full results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="tiny configuration (seconds), for tests")
    p.add_argument("--seed", type=int, default=1234, help="base seed of every rank's inputs")
    return p


def refuse(comm: MPI.Comm, reason: str) -> None:
    """Exit every rank with status 2; rank 0 says why. Call collectively."""
    if comm.Get_rank() == 0:
        sys.stderr.write(f"REFUSED: {reason}\n")
        sys.stderr.flush()
    comm.Barrier()
    sys.exit(REFUSED_EXIT)


def check_size(comm: MPI.Comm, expected: int) -> None:
    """Refuse to run when the launch does not have the expected rank count."""
    if comm.Get_size() != expected:
        refuse(
            comm,
            f"launched with {comm.Get_size()} ranks but --np {expected} was asked; "
            f"run it as: mpiexec -n {expected} python {' '.join(sys.argv)}",
        )


def check_all(comm: MPI.Comm, ok: bool, what: str, detail: str = "") -> None:
    """Agree across ranks that ``ok`` holds everywhere; refuse (collectively) if not."""
    details = comm.allgather(None if ok else (detail or "failed"))
    bad = [(r, d) for r, d in enumerate(details) if d is not None]
    if bad:
        lines = "; ".join(f"rank {r}: {d}" for r, d in bad)
        refuse(comm, f"correctness check failed for {what}: {lines}")


def load_shapes(name: str, limit: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(tensor name, shape) of a gradient set in ``scripts/data`` (``resnet50``, ``bert_large``),
    checked against the file's element count; the first ``limit`` tensors when given."""
    path = DATA_DIR / f"{name}_grads.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    if spec.get("dtype", "float32") != "float32":
        raise ValueError(f"{path}: expected float32 tensors, file says {spec['dtype']}")
    shapes = [(t["name"], tuple(int(d) for d in t["shape"])) for t in spec["tensors"]]
    total = sum(math.prod(s) for _, s in shapes)
    if total != spec["total_elements"]:
        raise ValueError(f"{path}: shapes sum to {total}, file says {spec['total_elements']}")
    return shapes[:limit]


def split(flat: Any, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> list[Any]:
    """Separate, contiguous per-tensor copies of consecutive slices of a flat NumPy or CuPy
    buffer (like framework gradients)."""
    out, off = [], 0
    for _, shape in shapes:
        n = math.prod(shape)
        out.append(flat[off : off + n].reshape(shape).copy())
        off += n
    return out


def rank_rng(seed: int, rank: int, salt: int = 0) -> np.random.Generator:
    """The generator for one rank's inputs: any rank can rebuild any other rank's data."""
    return np.random.default_rng([seed, rank, salt])


def nonzero_uniform(
    rng: np.random.Generator, n: int, dtype: type[np.floating[Any]] = np.float32
) -> np.ndarray:
    """``n`` random values with magnitude in [0.5, 1.5) and a random sign (never zero)."""
    mag = rng.uniform(0.5, 1.5, size=n).astype(dtype)
    sign = np.where(rng.random(n) < 0.5, -1, 1).astype(dtype)
    return mag * sign


def sum_over_ranks(seed: int, size: int, n: int, salt: int = 0) -> np.ndarray:
    """Float64 sum of every rank's :func:`nonzero_uniform` inputs (``rank_rng(seed, r, salt)``)."""
    acc = np.zeros(n, dtype=np.float64)
    for r in range(size):
        acc += nonzero_uniform(rank_rng(seed, r, salt), n)
    return acc


def gather_to_root(comm: MPI.Comm, obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` as a list on rank 0; ``None`` elsewhere."""
    got = comm.gather(obj, root=0)
    return None if got is None else list(got)


def close(got: np.ndarray, ref: np.ndarray, rtol: float = 1e-5, atol: float = 1e-5) -> str:
    """Empty string if ``got`` matches ``ref``, else a one-line account of the worst miss."""
    if got.shape != ref.shape:
        return f"shape {got.shape} != expected {ref.shape}"
    if got.dtype != ref.dtype:
        return f"dtype {got.dtype} != expected {ref.dtype}"
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    tol = atol + rtol * np.abs(ref.astype(np.float64))
    if bool(np.all(err <= tol)):
        return ""
    i = int(np.argmax(err - tol))
    return f"element {i}: got {got.flat[i]!r}, expected {ref.flat[i]!r}"


def max_over_ranks(comm: MPI.Comm, values: np.ndarray) -> np.ndarray:
    """Element-wise maximum of a float64 array across ranks."""
    src = np.ascontiguousarray(values, dtype=np.float64)
    out = np.empty_like(src)
    comm.Allreduce(src, out, op=MPI.MAX)
    return out


def stats(seconds: np.ndarray) -> dict[str, float]:
    """Summary of a sample of durations (seconds): median, p99, min, max, mean, n."""
    if seconds.size == 0 or not bool(np.all(seconds > 0)):
        raise ValueError("timing sample is empty or holds non-positive durations")
    return {
        "median_s": float(np.median(seconds)),
        "p99_s": float(np.percentile(seconds, 99)),
        "min_s": float(seconds.min()),
        "max_s": float(seconds.max()),
        "mean_s": float(seconds.mean()),
        "n": int(seconds.size),
    }


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def run_facts(ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """Facts every benchmark records: date, machine, versions, MPI library, commit, command."""
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "ranks": ranks,
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(args),
    }


_START: dict[str, Any] = {}


def run_metadata(comm: MPI.Comm, args: argparse.Namespace) -> dict[str, Any]:
    """Facts about this run: date, machine, commit, MPI library, exact command, load.

    The first call records the start (call it right after the size check: the commit is the
    one whose code this process imported); later calls return that plus the finish time and
    the load average then.
    """
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if not _START:
        # Uncommitted edits to the code this run executes make the commit alone not enough.
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "hvdlite", "scripts")
        _START.update(
            run_facts(comm.Get_size(), args),
            load_average_1_5_15min=list(os.getloadavg()),
            uncommitted_code_changes=bool(dirty and dirty != "unknown"),
        )
        return dict(_START)
    return {**_START, "finished_utc": now, "load_average_at_finish": list(os.getloadavg())}


def write_json(comm: MPI.Comm, path: str | None, payload: dict[str, Any]) -> None:
    """Rank 0 writes ``payload`` as indented JSON to ``path`` (no-op without a path)."""
    if path is None or comm.Get_rank() != 0:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain fixed-width text table (also valid Markdown)."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def us(seconds: float) -> float:
    """Seconds to microseconds, rounded to 0.1."""
    return round(seconds * 1e6, 1)


def ms(seconds: float) -> float:
    """Seconds to milliseconds, rounded to 0.001."""
    return round(seconds * 1e3, 3)


def ratio(a: float, b: float) -> float:
    """``a / b`` rounded to 0.001 (``b`` > 0)."""
    return round(a / b, 3)


def human_bytes(n: int) -> str:
    """4 -> '4 B', 4096 -> '4 KiB', 16777216 -> '16 MiB' (exact powers only get a unit)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def verdict(met: bool) -> str:
    """``met`` / ``MISSED`` for target lines."""
    return "met" if met else "MISSED"


def torch_note() -> str:
    """Whether a torch (gloo) baseline can run here, in words."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed: no torch gloo baseline in this run"
    return (
        "torch is installed, but no torch gloo baseline in this run: the script has none, "
        "as the development machine it was written on has no torch to test one with"
    )


def print0(comm: MPI.Comm, text: str) -> None:
    """Print on rank 0 only, flushed."""
    if comm.Get_rank() == 0:
        print(text, flush=True)


def split_names(text: str, known: Iterable[str]) -> list[str]:
    """The comma-separated names in ``text`` (``--profile``'s list), where a name of
    ``known`` may hold commas itself ("torch.distributed all_reduce (4 B), then
    synchronize"): consecutive pieces are joined back while they form the start of a known
    name. Pieces that form no known name are kept as they are (the caller refuses them)."""
    names = set(known)
    out: list[str] = []
    pieces = [p.strip() for p in text.split(",")]
    i = 0
    while i < len(pieces):
        name, j = pieces[i], i
        while name not in names and j + 1 < len(pieces) and any(
                n.startswith(f"{name}, {pieces[j + 1]}") for n in names):
            j += 1
            name = f"{name}, {pieces[j]}"
        if name:
            out.append(name)
        i = j + 1
    return out


def profile_variants(
    comm: MPI.Comm,
    fns: Mapping[str, Callable[[], object]],
    wanted: Sequence[str],
    calls: int,
    top: int = 25,
) -> dict[str, list[dict[str, Any]]]:
    """Where each wanted variant's host time goes: ``calls`` more calls of it under
    ``cProfile`` on every rank together (a barrier before each variant), after its timing.
    Returns, per variant, rank 0's ``top`` functions by own time, each with its three
    heaviest ``callers`` (where a sleep or a lock's wait is spent: the function alone does not
    say which wait it is), the rest of the ranks an empty dict. A variant name not in ``fns``
    is refused collectively."""
    import cProfile
    import pstats

    unknown = [w for w in wanted if w not in fns]
    check_all(comm, not unknown, "--profile", f"no such variant: {unknown}; variants: "
              f"{list(fns)}")
    out: dict[str, list[dict[str, Any]]] = {}
    for name in wanted:
        fn = fns[name]
        comm.Barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        if comm.Get_rank() != 0:
            continue
        st = pstats.Stats(prof)
        rows = []
        for key, (_cc, ncalls, tottime, cumtime, callers) in \
                st.stats.items():  # type: ignore[attr-defined]
            heavy = sorted(callers.items(), key=lambda c: -c[1][2])[:3]
            rows.append({"function": _where(key), "calls": ncalls,
                         "own_us_per_variant_call": tottime / calls * 1e6,
                         "cum_us_per_variant_call": cumtime / calls * 1e6,
                         "callers": [{"function": _where(k), "calls": c[1],
                                      "own_us_per_variant_call": c[2] / calls * 1e6}
                                     for k, c in heavy]})
        rows.sort(key=lambda r: -r["own_us_per_variant_call"])
        out[name] = rows[:top]
    return out


def _where(key: tuple[str, int, str]) -> str:
    path, line, func = key
    return f"{Path(path).name}:{line}({func})"


def format_profile(profiles: Mapping[str, list[dict[str, Any]]]) -> str:
    """The table :func:`profile_variants` returns, one block per variant; under a built-in
    (a sleep, a lock's wait), its heaviest callers, indented."""
    blocks = []
    for name, rows in profiles.items():
        lines = [f"profile of {name!r} (rank 0; us per call of the variant):",
                 f"{'own':>10} {'cumulative':>11} {'calls':>8}  function"]
        for r in rows:
            lines.append(f"{r['own_us_per_variant_call']:10.1f} "
                         f"{r['cum_us_per_variant_call']:11.1f} {r['calls']:8d}  "
                         f"{r['function']}")
            if r["function"].startswith("~:0("):
                lines += [f"{c['own_us_per_variant_call']:10.1f} {'':>11} {c['calls']:8d}"
                          f"    <- {c['function']}" for c in r.get("callers", ())]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def time_round_robin(
    comm: MPI.Comm,
    fns: Mapping[str, Callable[[], object]],
    reps: int,
    warmup: int,
    after: Callable[[], object] | None = None,
    block: int = 1,
    rotate: bool = False,
) -> dict[str, np.ndarray]:
    """Time each variant ``reps`` times, taking turns, so drift hits all alike.

    Each variant is warmed up ``warmup`` times first. Variants take turns in blocks of
    ``block`` repeats (1: one repeat each in turn; more where switching variants costs a
    re-warm); ``rotate``: each block starts one variant later than the last, so no variant
    always runs first or after the same one. A repeat is: barrier, host clock, ``fn()``, host
    clock; ``fn`` must leave nothing pending that its result depends on (a GPU variant
    synchronises inside it where its semantics do not already). ``after`` runs untimed after
    every repeat (e.g. a stream synchronise for variants timed to "result usable"). Returns
    per-variant per-repeat seconds, the slowest rank's.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
            if after is not None:
                after()
    times = {name: np.empty(reps, dtype=np.float64) for name in fns}
    clock = time.perf_counter
    names = list(fns)
    for n, start in enumerate(range(0, reps, block)):
        shift = n % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            fn = fns[name]
            for i in range(start, min(start + block, reps)):
                comm.Barrier()
                t0 = clock()
                fn()
                times[name][i] = clock() - t0
                if after is not None:
                    after()
    return {name: max_over_ranks(comm, t) for name, t in times.items()}


def target(name: str, value: float, limit: float, unit: str = "") -> dict[str, Any]:
    """One target line: ``value <= limit`` decides ``met``."""
    met = bool(value <= limit)
    return {"target": name, "value": value, "limit": limit, "unit": unit, "met": met}


def format_targets(lines: Sequence[Mapping[str, Any]]) -> str:
    """One ``target ...: value [(limit L)] -> met/MISSED`` line per target."""
    return "\n".join(
        f"target {t['target']}: {t['value']}{t.get('unit', '')}"
        + (f" (limit {t['limit']}{t.get('unit', '')})" if "limit" in t else "")
        + f" -> {verdict(t['met'])}"
        for t in lines
    )
