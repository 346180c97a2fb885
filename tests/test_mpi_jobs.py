"""Run the multi-rank suite (``tests/mpi/``) as real ``mpiexec`` jobs at 1, 2 and 4 ranks.

Each rank runs ``python -m mpi4py -m pytest`` so an unhandled error aborts the whole job, and
``tests/mpi/conftest.py`` makes a failure on one rank fail every rank. Every rank writes a small
JSON tally; this runner checks the exit code, every rank's tally and the printed summaries.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from jobs_util import REPO, clean_env, mpiexec, run_group

MPI_TESTS = REPO / "tests" / "mpi"
JOB_TIMEOUT_S = {1: 150, 2: 200, 4: 300}
TAIL_CHARS = 12_000
# A pytest -q summary, e.g. "12 passed, 1 skipped in 3.21s" (maybe framed by "="). Not anchored:
# the ranks share mpiexec's stdout, so two ranks' summaries can run together on one line
# ("... in 8.13s236 passed, ...").
SUMMARY = re.compile(
    r"(\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)"
    r"(?:, \d+ \w+)* in [\d.]+s)"
)


def _job_env(size: int, report_dir: Path) -> dict[str, str]:
    # The suite sets hvdlite knobs itself (clean_env drops the caller's).
    return clean_env(HVDLITE_MPI_REPORT_DIR=str(report_dir), HVDLITE_EXPECTED_SIZE=str(size),
                     PYTHONFAULTHANDLER="1")


def _tail(text: str) -> str:
    return text if len(text) <= TAIL_CHARS else "...\n" + text[-TAIL_CHARS:]


@pytest.mark.mpi
@pytest.mark.timeout(max(JOB_TIMEOUT_S.values()) + 60)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_mpi_suite(size: int, tmp_path: Path) -> None:
    """``tests/mpi`` passes on every rank of an ``mpiexec -n size`` job."""
    cmd = [
        mpiexec(), "-n", str(size),
        sys.executable, "-m", "mpi4py", "-m", "pytest", str(MPI_TESTS),
        "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=120",
        f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml"),
    ]  # fmt: skip
    start = time.monotonic()
    rc, out = run_group(cmd, _job_env(size, tmp_path), JOB_TIMEOUT_S[size])
    wall = time.monotonic() - start
    print(f"mpiexec -n {size}: rc={rc} wall={wall:.1f}s")
    where = f"mpiexec -n {size} (rc={rc}, {wall:.0f}s); output tail:\n{_tail(out)}"
    assert rc is not None, f"job timed out after {JOB_TIMEOUT_S[size]}s: {where}"
    assert rc == 0, f"job failed: {where}"
    tallies = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(t["rank"] for t in tallies) == list(range(size)), f"missing tallies: {where}"
    for t in tallies:
        assert t["size"] == size and t["exitstatus"] == 0, f"rank {t}: {where}"
        assert t["passed"] > 0 and t["failed"] == 0 and t["errors"] == 0, f"rank {t}: {where}"
    summaries = SUMMARY.findall(out)
    assert summaries, f"no pytest summary line: {where}"
    assert all("passed" in s for s in summaries), f"a rank passed nothing: {where}"
    assert not any(re.search(r"\d+ (failed|errors?)\b", s) for s in summaries), where
