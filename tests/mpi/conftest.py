"""Shared fate for multi-rank tests (run under ``mpiexec ... python -m mpi4py -m pytest``).

Every rank runs the same tests in the same order. Around each test the ranks meet at a barrier
with a deadline (a rank that never arrives aborts the whole job with a message instead of a
silent hang), and after each test they agree on its outcome: a test that failed on any rank
fails on every rank, naming the ranks where it failed. Each test also gets a pytest-timeout
(function only, so the barriers stay outside it) that turns a hang into a failure. Each rank's
tally for the job runner is written by the root conftest (``HVDLITE_TEST_REPORT_DIR``).
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
from mpi4py import MPI
from mpi_util import allgather_ints, timed_barrier

TEST_TIMEOUT_S = 60.0

_outcomes = pytest.StashKey[dict[str, str]]()


def pytest_configure(config: pytest.Config) -> None:
    """Register this suite's marker."""
    config.addinivalue_line(
        "markers", "before_init: needs hvdlite never initialised in this process (runs first)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run ``before_init`` tests first, give each test a timeout, check ranks agree on tests."""
    items.sort(key=lambda item: item.get_closest_marker("before_init") is None)
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S, func_only=True))
    digest = zlib.crc32("\n".join(item.nodeid for item in items).encode())
    digests = allgather_ints(digest, "comparing collected tests")
    if len(set(digests)) != 1:
        print(f"ranks collected different tests: {digests}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start every test together on all ranks."""
    timed_barrier(f"before {item.nodeid}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Record each phase's outcome; at teardown, fail this rank too if any rank failed."""
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


@pytest.fixture(scope="session")
def comm() -> MPI.Intracomm:
    """``MPI.COMM_WORLD`` (hvdlite runs on its own duplicate of it)."""
    return MPI.COMM_WORLD


@pytest.fixture(scope="session")
def hvd() -> Iterator[Any]:
    """hvdlite, initialised once for the job and shut down at its end.

    Tests that need their own init/shutdown cycles must leave it initialised with defaults.
    """
    import hvdlite

    hvdlite.init()
    yield hvdlite
    hvdlite.shutdown()


@pytest.fixture
def restart(hvd: Any) -> Iterator[Callable[..., Any]]:
    """``restart(**overrides)``: shut hvdlite down and init it again with config overrides.

    Whatever the test did, hvdlite is left initialised with the defaults afterwards.
    """

    def _restart(**overrides: Any) -> Any:
        hvd.shutdown()
        hvd.init(**overrides)
        return hvd

    yield _restart
    hvd.shutdown()
    hvd.init()
