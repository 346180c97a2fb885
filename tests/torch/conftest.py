"""Shared fate for the ``hvdlite.torch`` tests (run under ``mpiexec -n 2 ... pytest``).

The same rules as ``tests/mpi/conftest.py``: the ranks meet before every test, a test that
fails on one rank fails on all, every test has a timeout, and each rank writes a JSON tally
for ``tests/test_torch_jobs.py``. Without torch nothing here is collected.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import zlib
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mpi"))

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]

from mpi4py import MPI  # noqa: E402
from mpi_util import allgather_ints, timed_barrier  # noqa: E402

TEST_TIMEOUT_S = 60.0
_outcomes = pytest.StashKey[dict[str, str]]()
_counts: dict[str, int] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each test a timeout; check every rank collected the same tests."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S, func_only=True))
    digest = zlib.crc32("\n".join(item.nodeid for item in items).encode())
    if len(set(allgather_ints(digest, "comparing collected tests"))) != 1:
        print("ranks collected different tests", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start every test together on all ranks."""
    timed_barrier(f"before {item.nodeid}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """At teardown, fail this rank too if the test failed on any rank."""
    report: pytest.TestReport = yield
    outcomes = item.stash.setdefault(_outcomes, {})
    outcomes[report.when] = report.outcome
    if report.when == "teardown":
        failed_here = any(o == "failed" for o in outcomes.values())
        flags = allgather_ints(int(failed_here), f"agreeing on the outcome of {item.nodeid}")
        bad = [r for r, f in enumerate(flags) if f]
        if bad and not failed_here:
            report.outcome = "failed"
            report.longrepr = f"shared fate: {item.nodeid} failed on rank(s) {bad}"
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Tally outcomes for the per-rank JSON report."""
    if report.failed:
        _counts["failed" if report.when == "call" else "errors"] += 1
    elif report.skipped:
        _counts["skipped"] += 1
    elif report.passed and report.when == "call":
        _counts["passed"] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write this rank's tally where the job runner asked (``HVDLITE_MPI_REPORT_DIR``)."""
    out_dir = os.environ.get("HVDLITE_MPI_REPORT_DIR")
    if out_dir:
        comm = MPI.COMM_WORLD
        record = {"rank": comm.Get_rank(), "size": comm.Get_size(), "exitstatus": int(exitstatus)}
        record.update(_counts)
        (Path(out_dir) / f"rank{comm.Get_rank()}.json").write_text(json.dumps(record))


@pytest.fixture(scope="session")
def hvd() -> Iterator[Any]:
    """``hvdlite.torch``, initialised once for the job and shut down at its end."""
    import hvdlite.torch as hvd_torch

    hvd_torch.init()
    yield hvd_torch
    hvd_torch.shutdown()
