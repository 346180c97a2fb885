"""Root test configuration.

``tests/mpi/`` and ``tests/torch/`` hold multi-rank tests. They only make sense under an MPI
launcher, so a plain ``python -m pytest`` does not collect them; ``tests/test_mpi_jobs.py``
runs ``tests/mpi`` instead, as real ``mpiexec`` jobs at 1, 2 and 4 ranks, and
``tests/test_torch_jobs.py`` runs ``tests/torch`` at 2. Under a launcher the roles flip:
everything that starts jobs of its own (the suite runners, the example and benchmark jobs, the
launcher tests) is ignored, so an ``mpiexec ... pytest`` never spawns nested jobs.

Every pytest process (launched or not) writes a tally when ``HVDLITE_TEST_REPORT_DIR`` is set:
``rank<R>.json`` there, with the counts pytest's summary line gives, each test's outcome and
each skip's reason (module-level skips included). The job runners (``tests/jobs_util.py``) and
the GPU test command (``scripts/gpu/gpu_tests.sh``) read it; the job runners' inner skips are
listed at the end of the terminal summary.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs_util import INNER_SKIPS, LAUNCHER_RANK_VARS, LAUNCHER_SIZE_VARS, under_mpi_launcher

collect_ignore = (["test_mpi_jobs.py", "test_torch_jobs.py", "test_captured_step.py",
                   "test_example_and_bench.py",
                   "test_memory_job.py", "launcher", "multihost"]
                  if under_mpi_launcher() else ["mpi", "torch"])

# The suite runs as from its activated virtual environment (README's command need not activate
# it): a job's bare `python` is this interpreter, since hvdliterun hands the ranks the caller's
# PATH as it is (docs/config.md).
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = os.pathsep.join([_BIN, os.environ.get("PATH", "")])

REPORT_DIR_VAR = "HVDLITE_TEST_REPORT_DIR"
_COUNTS = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")
_tally: dict[str, Any] = {"counts": dict.fromkeys(_COUNTS, 0), "tests": {}, "skips": {}}
# How bad each outcome is: a test's recorded outcome is the worst of its phases.
_RANK = {"passed": 0, "xfailed": 1, "xpassed": 1, "skipped": 2, "failed": 3, "error": 4}


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _record(nodeid: str, outcome: str) -> None:
    tests = _tally["tests"]
    if _RANK[outcome] >= _RANK.get(tests.get(nodeid, "passed"), 0):
        tests[nodeid] = outcome


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Count a module that skipped itself or failed to import, as the summary line does."""
    if report.failed:
        _tally["counts"]["errors"] += 1
        _record(report.nodeid, "error")
    elif report.skipped:
        _tally["counts"]["skipped"] += 1
        _tally["skips"][report.nodeid] = _skip_reason(report)
        _record(report.nodeid, "skipped")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Count each phase's outcome the way the terminal summary does."""
    counts = _tally["counts"]
    xfail = hasattr(report, "wasxfail")
    if report.failed:
        key = "failed" if report.when == "call" else "errors"
        counts[key] += 1
        _record(report.nodeid, "failed" if key == "failed" else "error")
    elif report.skipped:
        counts["xfailed" if xfail else "skipped"] += 1
        if not xfail:
            _tally["skips"][report.nodeid] = _skip_reason(report)
        _record(report.nodeid, "xfailed" if xfail else "skipped")
    elif report.when == "call":
        counts["xpassed" if xfail else "passed"] += 1
        _record(report.nodeid, "xpassed" if xfail else "passed")


def _rank_and_size() -> tuple[int, int]:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    rank = next((int(os.environ[v]) for v in LAUNCHER_RANK_VARS if v in os.environ), 0)
    size = next((int(os.environ[v]) for v in LAUNCHER_SIZE_VARS if v in os.environ), 1)
    return rank, size


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write this process's tally where ``HVDLITE_TEST_REPORT_DIR`` asks."""
    out_dir = os.environ.get(REPORT_DIR_VAR)
    if not out_dir:
        return
    rank, size = _rank_and_size()
    record = {"rank": rank, "size": size, "exitstatus": int(exitstatus),
              **_tally["counts"], "tests": _tally["tests"], "skips": _tally["skips"]}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record, indent=1))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List the tests the job runners saw skipped inside their jobs (else invisible here)."""
    if not INNER_SKIPS:
        return
    terminalreporter.section("skipped inside the MPI jobs (reason: count per rank)")
    for job, reason, count in INNER_SKIPS:
        terminalreporter.write_line(f"{job}: {reason}: {count}")
