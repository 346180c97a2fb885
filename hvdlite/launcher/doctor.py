"""``python -m hvdlite.doctor``: what a user asks first when an hvdlite job fails.

Run it alone (one rank), under ``mpiexec -n N``, or as ``hvdliterun -np N --check``. Every rank
collects its versions (Python, hvdlite, NumPy, mpi4py and the MPI library, CuPy, NCCL, torch),
the MPI thread level, the CPU cores it may run on, the GPUs it sees and the one it would use
(local rank modulo the device count), whether NCCL can be used, and the resolved configuration
with where each value came from (:func:`hvdlite.config.resolve`). Then it runs a self-test of
about ``--seconds`` (1 s) of allreduces through the public API (``hvdlite.init``,
``allreduce_async``, ``shutdown``) on host memory, and on device memory when CuPy and a GPU are
there, each result compared exactly with a NumPy reference built from every rank's inputs.

Each rank says which interpreter a command that starts with ``python3`` or ``python`` would run
there (the first on the rank's ``PATH``: its path, version and environment), with a warning
where it is not the launcher's interpreter (the one ``hvdliterun`` and this doctor run in); rank
0 warns when the ranks would run different ones.

Each rank also records its host's interfaces, the MPI transport asked for, and the TCP
connections it holds after the self-test (:mod:`hvdlite.launcher.links`); across hosts
(``hvdliterun -H ... --check``), rank 0 prints which links carried the data between each pair
of hosts (TCP, interface, addresses) and whether ranks on one host talked without TCP.

Rank 0 prints every rank's report in rank order, then one verdict line. The exit status is 0
when every check passed on every rank, 1 otherwise; every failure line ends with the fix. The
whole run is bounded by ``--timeout`` (an :func:`hvdlite._exit.exit_guard`): a rank that never
joins makes the job end with a message instead of a hang.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hvdlite import _exit
from hvdlite.config import KNOBS, resolve
from hvdlite.errors import ConfigError
from hvdlite.launcher import links

__all__ = ["Report", "main", "self_test"]

WAIT_S = 10.0  # one collective of the self-test may take this long before it counts as hung
INTERPRETER_NAMES = ("python3", "python")  # the commands whose interpreter each rank reports
PROBE_TIMEOUT_S = 15.0  # an interpreter that does not print its version in this long is broken
_PROBE = "import platform, sys; print(platform.python_version()); print(sys.prefix)"
_THREAD_LEVELS = ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")
_CASES = (  # (dtype, op name, elements): integer-valued data, so every result is exact
    ("float32", "Sum", 1), ("float64", "Sum", 1000), ("int32", "Sum", 4096),
    ("int64", "Max", 17), ("float32", "Min", 65536), ("float64", "Sum", 1 << 18),
)


@dataclass
class Report:
    """One rank's findings: information lines, and failures (each with its fix)."""

    rank: int = 0
    size: int = 1
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    host: str = ""
    addresses: dict[str, str] = field(default_factory=dict)  # {interface: IPv4}
    peers: list[tuple[str, str]] = field(default_factory=list)  # TCP (local, remote) after tests
    pythons: dict[str, str] = field(default_factory=dict)  # {"python3": what it runs here}

    def info(self, label: str, text: str) -> None:
        """An information line."""
        self.lines.append(f"  {label:<14} {text}")

    def warn(self, label: str, text: str, fix: str) -> None:
        """Worth knowing, not a failure."""
        self.lines.append(f"  {label:<14} WARNING: {text}; fix: {fix}")

    def fail(self, label: str, text: str, fix: str) -> None:
        """A failure: the doctor exits non-zero."""
        self.lines.append(f"  {label:<14} FAIL: {text}; fix: {fix}")
        self.failures.append(f"rank {self.rank}: {label}: {text}; fix: {fix}")

    def text(self) -> str:
        """The report as printed."""
        return "\n".join([f"== rank {self.rank} of {self.size} ==", *self.lines])


# ---------------------------------------------------------------------------------------------
# Local facts
# ---------------------------------------------------------------------------------------------


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cupy_dist() -> str | None:
    """The installed CuPy distribution (``cupy``, ``cupy-cuda12x``, ...), without importing it."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-"):
            return f"{dist.version} ({name})"
    return None


def _import_cupy(report: Report) -> Any:
    """CuPy, or None (the reason is reported)."""
    if importlib.util.find_spec("cupy") is None:
        return None
    try:
        return importlib.import_module("cupy")
    except Exception as exc:  # a broken CUDA install raises anything
        report.fail("CuPy", f"installed but import fails: {type(exc).__name__}: {exc}",
                    "install the CuPy wheel that matches your CUDA (e.g. cupy-cuda12x)")
        return None


def _nccl_version(cupy: Any) -> tuple[str | None, str]:
    """(version, why not) of the NCCL that CuPy's binding loads."""
    if cupy is None:
        return None, "CuPy not installed (hvdlite reaches NCCL through CuPy)"
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        return None, f"cupy.cuda.nccl cannot be imported: {exc}"
    if not getattr(nccl, "available", True):
        return None, "this CuPy was built without NCCL"
    try:
        v = int(nccl.get_version())
    except Exception as exc:
        return None, f"libnccl cannot be loaded: {exc}"
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else str(v), ""


def _versions(report: Report, cupy: Any, mpi: Any) -> str | None:
    import hvdlite

    library = " ".join(mpi.Get_library_version().split("\n", 1)[0].split())
    nccl, why = _nccl_version(cupy)
    items = [
        ("Python", platform.python_version()),
        ("hvdlite", hvdlite.__version__),
        ("numpy", np.__version__),
        ("mpi4py", _dist_version("mpi4py") or "?"),
        ("MPI", f"{library} (MPI {'.'.join(map(str, mpi.Get_version()))})"),
        ("CuPy", _cupy_dist() or "not installed"),
        ("NCCL", nccl or "not installed"),
        ("torch", _dist_version("torch") or "not installed"),
    ]
    for name, version in items:
        report.info(name, version)
    return None if nccl else why


def _gpus(report: Report, cupy: Any, local_rank: int, nccl_missing: str | None) -> int:
    """Report the GPUs this rank sees and which it would use; returns the device or -1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if cupy is None:
        report.info("GPUs", f"not checked: CuPy not installed (device memory needs "
                            f"pip install 'hvdlite[gpu]'){shown}")
        report.info("NCCL usable", f"no: {nccl_missing}")
        return -1
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        report.info("GPUs", f"none usable ({type(exc).__name__}: {exc}){shown}")
        report.info("NCCL usable", "no GPU")
        return -1
    if count == 0:
        report.info("GPUs", f"0 visible{shown}")
        report.info("NCCL usable", "no GPU")
        return -1
    names = []
    for i in range(count):
        try:
            names.append(cupy.cuda.runtime.getDeviceProperties(i)["name"].decode())
        except Exception:
            names.append("?")
    device = local_rank % count
    report.info("GPUs", f"{count} visible{shown}: " + ", ".join(
        f"{i}: {n}" for i, n in enumerate(names)))
    report.info("GPU picked", f"{device} (local rank {local_rank} modulo {count})")
    if nccl_missing:
        report.fail("NCCL usable", f"no: {nccl_missing}",
                    "install NCCL (e.g. pip install nvidia-nccl-cu12) where CuPy can load it")
    else:
        report.info("NCCL usable", "yes")
    return device


def _configuration(report: Report, launcher_sources: dict[str, str]) -> bool:
    try:
        config, sources = resolve()
    except ConfigError as exc:
        report.fail("config", str(exc), "correct or unset the setting named above")
        return False
    for k in KNOBS:
        source = sources[k.name]
        if source == k.env and k.name in launcher_sources:
            source = f"{launcher_sources[k.name]}, via hvdliterun"
        report.info("config" if k is KNOBS[0] else "",
                    f"{k.name} = {getattr(config, k.name)!r}  [{source}]")
    return True


def probe_interpreter(path: str) -> tuple[str, str]:
    """(version, environment) of the Python at ``path``: ``platform.python_version()`` and
    ``sys.prefix`` (a virtual environment's folder, or the installation's), as that
    interpreter reports them. OSError (with the reason) when it cannot be run."""
    try:
        proc = subprocess.run([path, "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise OSError(f"it did not answer within {PROBE_TIMEOUT_S:g} s") from None
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or len(lines) != 2:
        why = " ".join((proc.stderr or proc.stdout).split())[-200:]
        raise OSError(f"exit code {proc.returncode}" + (f": {why}" if why else ""))
    return lines[0], lines[1]


def _interpreters(report: Report, under_hvdliterun: bool) -> None:
    """Which interpreter ``python3`` and ``python`` run on this rank's PATH, and whether it
    is this doctor's (under ``hvdliterun --check``, hvdliterun's: it starts the doctor in its
    own interpreter, by its full path)."""
    own = (platform.python_version(), sys.prefix)
    whose = "hvdliterun's interpreter" if under_hvdliterun else "this doctor's interpreter"
    reference = f"{whose} {sys.executable} (Python {own[0]}, environment {own[1]})"
    for name in INTERPRETER_NAMES:
        found = shutil.which(name)
        if found is None:
            report.pythons[name] = "not on PATH"
            report.info(name, "not on PATH")
            continue
        try:
            version, prefix = probe_interpreter(found)
        except OSError as exc:
            report.pythons[name] = f"{found} (does not run)"
            report.warn(name, f"{found} (first on PATH) does not run: {exc}",
                        "repair or remove it, or start the command with another interpreter")
            continue
        text = f"{found} (Python {version}, environment {prefix})"
        report.pythons[name] = text
        if (version, prefix) == own:
            report.info(name, f"{text}: the same as {whose}")
        else:
            report.warn(name, f"a command that starts with {name} runs {text}, not {reference}",
                        f"put {os.path.dirname(sys.executable)} first on PATH where the job is "
                        f"started (a venv: source its bin/activate), or start the command with "
                        f"{sys.executable} in full")


def _interpreter_warnings(reports: Sequence[dict[str, Any]]) -> list[str]:
    """One line per interpreter name that the ranks would not all run alike."""
    lines = []
    for name in INTERPRETER_NAMES:
        ranks_of: dict[str, list[int]] = {}
        for r in reports:
            ranks_of.setdefault(r["pythons"].get(name, "not checked"), []).append(r["rank"])
        if len(ranks_of) > 1:
            each = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} "
                             f"{', '.join(map(str, ranks))}: {text}"
                             for text, ranks in ranks_of.items())
            lines.append(f"WARNING: {name} is not the same interpreter on every rank ({each}); "
                         f"fix: install the same environment at the same path on every host, "
                         f"or start the command with the interpreter's full path")
    return lines


# ---------------------------------------------------------------------------------------------
# Self-test
# ---------------------------------------------------------------------------------------------


def _inputs(rank: int, step: int, dtype: str, n: int) -> np.ndarray:
    rng = np.random.default_rng([rank, step])
    return rng.integers(-100, 101, size=n).astype(dtype)


def _reference(size: int, step: int, dtype: str, op: str, n: int) -> np.ndarray:
    stack = np.stack([_inputs(r, step, dtype, n) for r in range(size)])
    return {"Sum": stack.sum(axis=0), "Min": stack.min(axis=0),
            "Max": stack.max(axis=0)}[op].astype(dtype)


def self_test(hvd: Any, seconds: float, to_device: Callable[[np.ndarray], Any] | None = None,
              to_host: Callable[[Any], np.ndarray] | None = None) -> tuple[int, str | None]:
    """Allreduce for about ``seconds`` (every rank stops at the same step) and check each
    result exactly. Returns (collectives done, first problem or None); never hangs longer
    than ``WAIT_S`` per collective."""
    rank, size = hvd.rank(), hvd.size()
    to_dev = to_device or (lambda a: a)
    to_np = to_host or np.asarray
    tag = "device" if to_device else "host"
    start = time.monotonic()
    step = done = 0
    while True:
        dtype, op, n = _CASES[step % len(_CASES)]
        name = f"doctor.{tag}.{step}"
        try:
            out = hvd.allreduce_async(to_dev(_inputs(rank, step, dtype, n)), name=name,
                                      op=getattr(hvd, op)).wait(WAIT_S)
        except TimeoutError:
            return done, (f"allreduce {name!r} did not complete within {WAIT_S:g} s: a rank is "
                          f"not taking part (stuck, crashed, or started as a separate job)")
        except Exception as exc:
            return done, f"allreduce {name!r} failed: {type(exc).__name__}: {exc}"
        done += 1
        got, want = to_np(out), _reference(size, step, dtype, op, n)
        if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
            bad = int(np.sum(got != want)) if got.shape == want.shape else -1
            return done, (f"allreduce {name!r} ({dtype} {op}, {n} elements) is wrong: "
                          f"{bad} elements differ from the NumPy reference")
        step += 1
        # One agreed decision to stop, so every rank runs the same number of steps.
        over = np.array([int(time.monotonic() - start >= seconds)], np.int32)
        try:
            stop = hvd.allreduce_async(over, name=f"doctor.{tag}.stop.{step}",
                                       op=hvd.Max).wait(WAIT_S)
        except (TimeoutError, Exception) as exc:
            return done, f"the self-test's stop vote failed: {type(exc).__name__}: {exc}"
        if int(stop[0]):
            return done, None


def _run_self_tests(hvd: Any, report: Report, seconds: float, cupy: Any, device: int) -> bool:
    t0 = time.monotonic()
    done, problem = self_test(hvd, seconds)
    took = time.monotonic() - t0
    if problem:
        report.fail("host test", problem, "run the failing case alone; report it with this "
                    "output if it persists")
        return False
    report.info("host test", f"ok: {done} allreduces in {took:.1f} s, all exact")
    if device < 0:
        report.info("device test", "skipped (no CuPy GPU)")
        return True
    cupy.cuda.Device(device).use()
    t0 = time.monotonic()
    done, problem = self_test(hvd, seconds, to_device=cupy.asarray, to_host=cupy.asnumpy)
    took = time.monotonic() - t0
    if problem:
        report.fail("device test", problem, "check the NCCL line above and NCCL_DEBUG=INFO")
        return False
    report.info("device test", f"ok: {done} allreduces on GPU {device} in {took:.1f} s, "
                               f"all exact")
    report.info("device transport", _transport_line())
    report.info("IPC step ordering", _ipc_sync_line())
    report.info("GPU peer access", _peer_line())
    return True


_TRANSPORTS = {
    "ipc": "CUDA IPC for every bucket",
    "nccl": "NCCL for every bucket",
    "mixed": "CUDA IPC for buckets up to ipc_max_bytes, NCCL above",
}


def _peer_line() -> str:
    """Whether the ranks' GPUs can map each other's memory (what CUDA IPC needs)."""
    from hvdlite._api import default_engine

    backend: Any = default_engine().global_channel.backends.get("cuda")
    where = None if backend is None else backend.placement
    if where is None:
        return "not checked (no device collective ran)"
    if not where.one_host:
        return "not applicable: the ranks span hosts"
    gpus = len(where.gpus)
    if gpus == 1:
        return "one GPU shared by every rank (IPC within it)"
    return f"{'yes' if where.peer_access else 'NO'}, between the {gpus} GPUs of this host"


def _transport_line() -> str:
    """Which transport the global set's device buckets take, and the placement behind it."""
    from hvdlite._api import default_engine

    backend: Any = default_engine().global_channel.backends.get("cuda")
    if backend is None or backend.transport is None:
        return "not decided (no device collective ran)"
    where = backend.placement
    why = ("ranks share a GPU" if where.shared else
           "one host, peer access" if where.one_host and where.peer_access else
           "one host, no peer access" if where.one_host else "several hosts")
    return f"{_TRANSPORTS[backend.transport]} ({why}: {where.describe()})"


def _ipc_sync_line() -> str:
    """How the global set's CUDA IPC steps are ordered: device semaphores, or the fallback
    (interprocess events and an MPI barrier per step) and why (``_gpu/semaphores.py``)."""
    from hvdlite._api import default_engine

    backend: Any = default_engine().global_channel.backends.get("cuda")
    made = {} if backend is None else backend._made
    ipc = [comm for (kind, _), comm in made.items() if kind == "ipc"]
    if not ipc:
        return "not applicable (no CUDA IPC communicator was made)"
    return ipc[0].protocol_why


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _gather(hvd: Any, report: Report) -> list[dict[str, Any]] | None:
    """Every rank's report on every rank, through hvdlite's allgather; None on a failure."""
    data = np.frombuffer(json.dumps(report.__dict__).encode(), np.uint8)
    try:
        longest = int(hvd.allreduce_async(np.array([data.size], np.int64), name="doctor.len",
                                          op=hvd.Max).wait(WAIT_S)[0])
        padded = np.zeros(longest, np.uint8)
        padded[: data.size] = data
        rows = hvd.allgather_async(padded.reshape(1, -1), name="doctor.reports").wait(WAIT_S)
    except Exception:
        return None
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in np.asarray(rows)]


def _print_all(reports: Sequence[dict[str, Any]]) -> int:
    failures = [f for r in reports for f in r["failures"]]
    for r in reports:
        print(Report(**r).text())
    if len({r["host"] for r in reports}) > 1 or any(r["peers"] for r in reports):
        print("== links (TCP connections the ranks held after the self-test) ==")
        for line in links.describe_links(reports):
            print(f"  {line}")
    for line in _interpreter_warnings(reports):
        print(f"hvdlite doctor: {line}")
    n = len(reports)
    if failures:
        print(f"hvdlite doctor: {len(failures)} problem(s) on {n} rank(s):")
        for f in failures:
            print(f"  {f}")
    else:
        print(f"hvdlite doctor: all checks passed on {n} rank(s)")
    sys.stdout.flush()
    return 1 if failures else 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hvdlite.doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0,
                    help="length of each allreduce self-test (default 1)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="end the job if the doctor has not finished by then (default 60 s)")
    # Given by hvdliterun --check only (its settings' sources, JSON).
    ap.add_argument("--launcher-sources", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the doctor on this rank; returns the exit status (0: every check passed)."""
    args = _parser().parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    guard = _exit.exit_guard(args.timeout, f"hvdlite doctor did not finish within "
                             f"{args.timeout:g} s: a rank is stuck or missing (rerun with "
                             f"--timeout larger, or check the launcher)", comm=world)
    report = Report(rank=world.Get_rank(), size=world.Get_size(), host=socket.gethostname(),
                    addresses=links.addresses())
    report.info("host", f"{report.host} (pid {os.getpid()}); "
                        + (", ".join(f"{k} {v}" for k, v in report.addresses.items())
                           or "no IPv4 interface but loopback"))
    report.info("MPI transport", links.mpi_transport())
    _interpreters(report, args.launcher_sources is not None)
    cupy = _import_cupy(report)
    nccl_missing = _versions(report, cupy, MPI)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores == 1:
        report.warn("CPU cores", "1 (the training and background threads share it)",
                    "launch with hvdliterun, or give mpirun --bind-to none")
    else:
        report.info("CPU cores", str(cores))
    config_ok = _configuration(report, json.loads(args.launcher_sources or "{}"))
    import hvdlite as hvd

    try:
        hvd.init()
    except Exception as exc:
        report.fail("init", f"hvdlite.init() failed: {type(exc).__name__}: {exc}",
                    "fix the configuration above" if not config_ok else
                    "see the message; run with HVDLITE_LOG_LEVEL=debug for more")
        print(report.text(), flush=True)
        _exit.abort_job(world, f"hvdlite doctor: init failed on rank {report.rank}: {exc}")
    level = MPI.Query_thread()
    level_name = _THREAD_LEVELS[level] if 0 <= level < len(_THREAD_LEVELS) else str(level)
    if level < MPI.THREAD_MULTIPLE:
        report.warn("thread level", f"MPI_THREAD_{level_name}",
                    "use an MPI (and mpi4py) with MPI_THREAD_MULTIPLE")
    else:
        report.info("thread level", f"MPI_THREAD_{level_name}")
    report.info("ranks", f"rank {hvd.rank()} of {hvd.size()}, local rank {hvd.local_rank()} "
                         f"of {hvd.local_size()}")
    device = _gpus(report, cupy, hvd.local_rank(), nccl_missing)
    tests_ok = _run_self_tests(hvd, report, args.seconds, cupy, device)
    report.peers = links.tcp_peers()  # the connections the self-test's traffic went over
    reports = _gather(hvd, report) if tests_ok else None
    if reports is None:  # not every rank got this far: say what this one knows, end the job
        print(report.text(), flush=True)
        _exit.abort_job(world, f"hvdlite doctor: rank {report.rank} failed: "
                               f"{'; '.join(report.failures) or 'collecting the reports failed'}")
    status = _print_all(reports) if report.rank == 0 else (
        1 if any(r["failures"] for r in reports) else 0)
    hvd.shutdown()
    guard.cancel()
    return status


if __name__ == "__main__":
    sys.exit(main())
