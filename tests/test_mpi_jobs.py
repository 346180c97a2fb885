"""Run the multi-rank suite (``tests/mpi/``) as real ``mpiexec`` jobs at 1, 2 and 4 ranks.

Each rank runs ``python -m mpi4py -m pytest`` so an unhandled error aborts the whole job, and
``tests/mpi/conftest.py`` makes a failure on one rank fail every rank. Every rank writes a small
JSON tally; this runner checks the exit code, every rank's tally and the printed summaries, and
that the only tests skipped inside a job are those that need more ranks than it has.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs_util import REPO, run_pytest_job

MPI_TESTS = REPO / "tests" / "mpi"
JOB_TIMEOUT_S = {1: 150, 2: 200, 4: 300}
# At one rank, the tests of what happens between ranks skip; at 2 and 4 nothing may.
ONE_RANK_SKIPS = {
    r"^(a cross-rank mismatch )?needs (at least two|2) ranks": "a test between ranks",
    r"^needs a second rank to hold the first request in flight$": "a test between ranks",
    r"^needs a rank whose cache hit waits for the others$": "a test between ranks",
}


@pytest.mark.mpi
@pytest.mark.timeout(max(JOB_TIMEOUT_S.values()) + 60)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_mpi_suite(size: int, tmp_path: Path) -> None:
    """``tests/mpi`` passes on every rank of an ``mpiexec -n size`` job."""
    # The suite sets hvdlite knobs itself (clean_env drops the caller's).
    run_pytest_job(size, MPI_TESTS, tmp_path, JOB_TIMEOUT_S[size],
                   ONE_RANK_SKIPS if size == 1 else {}, HVDLITE_EXPECTED_SIZE=str(size))

