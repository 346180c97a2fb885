"""Helpers for tests that start their own MPI jobs (the suite runner, examples, benchmarks,
the launcher): finding mpiexec, a clean environment, running a job in its own process group
with a hard timeout, and knowing whether we already are inside a job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdlite.run import find_mpiexec

REPO = Path(__file__).resolve().parent.parent

# Variables that common launchers (MPICH/Hydra, Open MPI, PMIx) set in every rank.
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                  "PMIX_RANK")


def under_mpi_launcher() -> bool:
    """True inside a rank of an MPI job (tests that start jobs must not nest them)."""
    return any(var in os.environ for var in _LAUNCHER_VARS)


def mpiexec() -> str:
    """The MPI launcher hvdliterun would use, or fail the test saying what to install."""
    found = find_mpiexec()
    if found is None:
        pytest.fail("mpiexec not found next to the interpreter or on PATH; install hvdlite[local]")
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without HVDLITE_*/HOROVOD_* (a stray knob must not change what a
    test checks), unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env | extra


def run_group(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group from the repository root; kill the whole group on
    timeout (the exit code is then None). Returns stdout and stderr together."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


# A pytest -q summary, e.g. "12 passed, 1 skipped in 3.21s" (maybe framed by "="). Not anchored:
# the ranks share mpiexec's stdout, so two ranks' summaries can run together on one line
# ("... in 8.13s236 passed, ...").
SUMMARY = re.compile(
    r"(\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)"
    r"(?:, \d+ \w+)* in [\d.]+s)"
)
TAIL_CHARS = 12_000


def run_pytest_job(size: int, tests: Path, report_dir: Path, timeout_s: float,
                   **env: str) -> None:
    """Run ``tests`` as ``mpiexec -n size python -m mpi4py -m pytest`` and assert that it
    finished in time, exited 0, and that every rank wrote a tally (the shared-fate conftest of
    tests/mpi, ``HVDLITE_MPI_REPORT_DIR``) with passes and no failures or errors."""
    cmd = [
        mpiexec(), "-n", str(size),
        sys.executable, "-m", "mpi4py", "-m", "pytest", str(tests),
        "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=120",
        f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml"),
    ]  # fmt: skip
    job_env = clean_env(HVDLITE_MPI_REPORT_DIR=str(report_dir), PYTHONFAULTHANDLER="1", **env)
    start = time.monotonic()
    rc, out = run_group(cmd, job_env, timeout_s)
    wall = time.monotonic() - start
    print(f"mpiexec -n {size} {tests.relative_to(REPO)}: rc={rc} wall={wall:.1f}s")
    tail = out if len(out) <= TAIL_CHARS else "...\n" + out[-TAIL_CHARS:]
    where = f"mpiexec -n {size} (rc={rc}, {wall:.0f}s); output tail:\n{tail}"
    assert rc is not None, f"job timed out after {timeout_s}s: {where}"
    assert rc == 0, f"job failed: {where}"
    tallies = [json.loads(p.read_text()) for p in sorted(report_dir.glob("rank*.json"))]
    assert sorted(t["rank"] for t in tallies) == list(range(size)), f"missing tallies: {where}"
    for t in tallies:
        assert t["size"] == size and t["exitstatus"] == 0, f"rank {t}: {where}"
        assert t["passed"] > 0 and t["failed"] == 0 and t["errors"] == 0, f"rank {t}: {where}"
    summaries = SUMMARY.findall(out)
    assert summaries, f"no pytest summary line: {where}"
    assert not any(re.search(r"\d+ (failed|errors?)\b", s) for s in summaries), where
