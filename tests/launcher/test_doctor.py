"""``python -m hvdlite.doctor`` and ``hvdliterun --check``: real runs, each with a timeout."""

from __future__ import annotations

import platform
import re
import sys

import path_setups
import pytest
from jobs_util import REPO, clean_env, mpiexec, run_group

from hvdlite.config import KNOBS
from hvdlite.run import mpi_flavor

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


def test_hvdliterun_check_names_the_ranks_python3() -> None:
    """The system's python3 ahead of hvdliterun's environment on PATH: every rank says that a
    command starting with python3 runs the system's, with a warning; not a failure."""
    if (why := path_setups.unavailable()) is not None:
        pytest.skip(why)
    path = path_setups.SETUPS["system_first"]
    system = path_setups.command_v("python3", path)
    cmd = [sys.executable, "-m", "hvdlite.run", "-np", "2", "--check"]
    code, out = run_group(cmd, clean_env(PATH=path, PYTHONPATH=str(REPO), **TWO_RANKS),
                          TIMEOUT_S)
    assert code == 0, out
    _check_report(out, 2)
    warning = (rf"^  python3        WARNING: a command that starts with python3 runs "
               rf"{re.escape(str(system))} \(Python [\d.]+\w*, environment [^)]+\), not "
               rf"hvdliterun's interpreter {re.escape(sys.executable)} \(Python "
               rf"{re.escape(platform.python_version())}, environment "
               rf"{re.escape(sys.prefix)}\); fix: put {re.escape(path_setups.ENV_BIN)} first")
    assert len(re.findall(warning, out, re.M)) == 2, out
    assert "is not the same interpreter on every rank" not in out, out


def test_doctor_warns_when_the_ranks_python3_differ() -> None:
    """Rank 0 with this environment first on PATH, rank 1 with the system's (Hydra's -env
    per executable): rank 0 runs the doctor's interpreter, rank 1 is warned, and rank 0's
    summary names the ranks of each interpreter."""
    if (why := path_setups.unavailable()) is not None:
        pytest.skip(why)
    if mpi_flavor(mpiexec()) != "hydra":
        pytest.skip("gives each rank its own PATH with Hydra's -env")
    ours, theirs = path_setups.SETUPS["venv_first"], path_setups.SETUPS["system_first"]
    cmd = [mpiexec(), "-n", "1", "-env", "PATH", ours, *DOCTOR, ":",
           "-n", "1", "-env", "PATH", theirs, *DOCTOR]
    code, out = run_group(cmd, clean_env(PYTHONPATH=str(REPO), **TWO_RANKS), TIMEOUT_S)
    assert code == 0, out
    _check_report(out, 2)
    own = (f"{path_setups.command_v('python3', ours)} (Python {platform.python_version()}, "
           f"environment {sys.prefix})")
    assert f"  python3        {own}: the same as this doctor's interpreter" in out, out
    assert re.search(r"^  python3        WARNING: a command that starts with python3 runs "
                     rf"{re.escape(str(path_setups.command_v('python3', theirs)))} ", out,
                     re.M), out
    summary = re.findall(r"^hvdlite doctor: WARNING: python3 is not the same interpreter on "
                         r"every rank \(rank 0: (.+); rank 1: (.+)\); fix: ", out, re.M)
    assert len(summary) == 1 and summary[0][0] == own, (summary, out)
    assert summary[0][1].startswith(f"{path_setups.command_v('python3', theirs)} (Python "), out
