"""The NumPy training example and the CPU benchmarks run end to end under ``mpiexec -n 2``.

These start real two-rank jobs in subprocesses (with a timeout) and check what the jobs say
about themselves: the example's own cross-rank weight check, a benchmark's correctness checks
and JSON output, and a benchmark's refusal to report from a launch of the wrong size. Timings
are never asserted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 150
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(
        any(v in os.environ for v in _LAUNCHER_VARS),
        reason="starts its own mpiexec jobs; not run from inside one",
    ),
]


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found next to the interpreter or on PATH; install hvdlite[local]")
    return found


def _run_job(ranks: int, *argv: str) -> tuple[int, str]:
    """Run ``python argv...`` on ``ranks`` ranks; return (exit code, stdout+stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, *argv]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {JOB_TIMEOUT_S} s:\n{out[-6000:]}")
    return proc.returncode, out


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_mlp_example_trains_and_ends_with_identical_weights() -> None:
    rc, out = _run_job(2, "examples/mlp_numpy.py")
    assert rc == 0, out[-6000:]
    ok = re.search(r"^OK: weights identical on all ranks; loss ([\d.]+) -> ([\d.]+)$", out, re.M)
    assert ok is not None, out[-6000:]
    first, last = float(ok.group(1)), float(ok.group(2))
    assert last < first
    assert out.count("OK: weights identical") == 1, "only rank 0 prints the OK line"


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_mlp_example_exits_nonzero_when_its_check_fails() -> None:
    # Three steps cannot cut the loss by 30%: the example must say so and fail, not print OK.
    rc, out = _run_job(2, "examples/mlp_numpy.py", "--steps", "3")
    assert rc == 1, out[-6000:]
    assert "FAILED: loss did not go down" in out
    assert "OK:" not in out


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_bench_c1_quick_checks_and_reports(tmp_path: Path) -> None:
    path = tmp_path / "c1.json"
    rc, out = _run_job(2, "scripts/bench_c1.py", "--np", "2", "--quick", "--json", str(path))
    assert rc == 0, out[-6000:]
    assert "REFUSED" not in out
    res = json.loads(path.read_text())
    assert res["benchmark"] == "C1"
    assert res["meta"]["ranks"] == 2
    assert res["tensors"] == 30
    variants = res["results"]
    assert len(variants) == 5
    for name, r in variants.items():
        assert r["n"] == 3, name
        assert r["median_s"] > 0, name
    assert {"target", "value", "met"} <= set(res["targets"][0])
    assert out.rstrip().splitlines()[-1].startswith("| hvdlite grouped_allreduce")


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_bench_refuses_a_launch_of_the_wrong_size(tmp_path: Path) -> None:
    path = tmp_path / "c1.json"
    rc, out = _run_job(2, "scripts/bench_c1.py", "--np", "4", "--quick", "--json", str(path))
    assert rc == 2, out[-6000:]
    assert "REFUSED: launched with 2 ranks but --np 4 was asked" in out
    assert not path.exists()
