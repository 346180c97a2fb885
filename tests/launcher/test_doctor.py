"""``python -m hvdlite.doctor`` and ``hvdliterun --check``: real runs, each with a timeout."""

from __future__ import annotations

import re
import sys

import pytest
from jobs_util import clean_env, mpiexec, run_group

from hvdlite.config import KNOBS

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

TIMEOUT_S = 60.0
DOCTOR = [sys.executable, "-m", "hvdlite.doctor"]


def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


GPUS = _gpus()
# Two ranks on one host need two GPUs for the device test; with fewer, the 2-rank checks run
# with the GPUs hidden (the failure itself is checked by test_doctor_names_ranks_sharing_a_gpu).
TWO_RANKS = {"CUDA_VISIBLE_DEVICES": ""} if 0 < GPUS < 2 else {}


def _check_report(out: str, ranks: int) -> None:
    assert f"hvdlite doctor: all checks passed on {ranks} rank(s)" in out, out
    for r in range(ranks):
        assert f"== rank {r} of {ranks} ==" in out, out
    for label in ("Python", "hvdlite", "numpy", "mpi4py", "MPI", "CuPy", "NCCL", "torch",
                  "thread level", "GPUs", "NCCL usable", "host test"):
        pattern = rf"^  {re.escape(label.ljust(14))} \S"  # labels are padded to 14
        assert len(re.findall(pattern, out, re.M)) == ranks, (label, out)
    for k in KNOBS:  # every knob, with its source, on every rank
        assert len(re.findall(rf"^ +(config +)?{k.name} = .*  \[.+\]$", out, re.M)) == ranks, k
    tests = re.findall(r"host test +ok: (\d+) allreduces in ([\d.]+) s, all exact", out)
    assert len(tests) == ranks and all(int(n) > 0 for n, _ in tests), out
    assert "MPI_THREAD_MULTIPLE" in out


def test_doctor_alone() -> None:
    code, out = run_group(DOCTOR, clean_env(), TIMEOUT_S)
    assert code == 0, out
    _check_report(out, 1)
    assert "CuPy" in out and "GPUs" in out


def test_doctor_under_mpiexec_with_sources() -> None:
    env = clean_env(HVDLITE_FUSION_THRESHOLD="1MiB", **TWO_RANKS)
    code, out = run_group([mpiexec(), "-n", "2", *DOCTOR], env, TIMEOUT_S)
    assert code == 0, out
    _check_report(out, 2)
    assert out.count("fusion_threshold = 1048576  [HVDLITE_FUSION_THRESHOLD]") == 2, out
    assert out.count("cycle_time_ms = 1.0  [default]") == 2, out


def test_hvdliterun_check() -> None:
    cmd = [sys.executable, "-m", "hvdlite.run", "-np", "2", "--fusion-threshold", "2MiB",
           "--check"]
    code, out = run_group(cmd, clean_env(**TWO_RANKS), TIMEOUT_S)
    assert code == 0, out
    _check_report(out, 2)
    assert out.count("fusion_threshold = 2097152  [--fusion-threshold, via hvdliterun]") == 2


def test_hvdliterun_check_takes_no_command() -> None:
    cmd = [sys.executable, "-m", "hvdlite.run", "-np", "2", "--check", "--", "python", "x.py"]
    code, out = run_group(cmd, clean_env(), TIMEOUT_S)
    assert code == 2 and "--check runs the doctor on every rank" in out, out


def test_doctor_fails_with_the_fix() -> None:
    env = clean_env(HVDLITE_CYCLE_TIME_MS="fast")
    code, out = run_group([mpiexec(), "-n", "2", *DOCTOR], env, TIMEOUT_S)
    assert code not in (0, None), out
    assert "FAIL: HVDLITE_CYCLE_TIME_MS: bad value for 'cycle_time_ms'" in out, out
    assert "fix: correct or unset the setting named above" in out


@pytest.mark.skipif(not 0 < GPUS < 2, reason="needs a host with exactly one GPU")
def test_doctor_names_ranks_sharing_a_gpu() -> None:
    """Two ranks on one GPU: NCCL refuses, and the doctor says which ranks and what to do."""
    code, out = run_group([mpiexec(), "-n", "2", *DOCTOR], clean_env(), TIMEOUT_S)
    assert code not in (0, None), out
    assert "ranks [0, 1] on host" in out and "share one GPU" in out, out
    assert "Traceback" not in out, out
