"""``hvdliterun`` pieces on their own: MPI detection, command building, the rank wrapper."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdlite.config import KNOBS
from hvdlite.launcher import rankwrap as _rankwrap
from hvdlite.run import JobSpec, build_command, build_parser, find_mpiexec, mpi_flavor

WRAPPER = [sys.executable, "-I", os.path.abspath(_rankwrap.__file__)]
FORWARD = (("HVDLITE_CYCLE_TIME_MS", "2.0"), ("HVDLITE_TIMELINE", ""))


def _spec(flavor: str, **changes: object) -> JobSpec:
    fields: dict[str, object] = {
        "mpiexec": "/opt/mpi/bin/mpirun",
        "flavor": flavor,
        "np": 4,
        "command": ("python", "train.py", "--lr", "0.1"),
        "forward_env": FORWARD,
    }
    return JobSpec(**(fields | changes))  # type: ignore[arg-type]


def test_hydra_command() -> None:
    cmd = build_command(_spec("hydra", hosts="a:2,b:2", hostfile="hosts.txt", mpi_args=("-v",)))
    assert cmd == [
        "/opt/mpi/bin/mpirun", "-n", "4", "-hosts", "a:2,b:2", "-f", "hosts.txt",
        "-genvlist", "HVDLITE_CYCLE_TIME_MS,HVDLITE_TIMELINE",
        "-v", *WRAPPER, "python", "train.py", "--lr", "0.1",
    ]  # fmt: skip


def test_openmpi_command_as_root() -> None:
    cmd = build_command(_spec("openmpi", hosts="a:2,b:2", hostfile="h", is_root=True))
    assert cmd == [
        "/opt/mpi/bin/mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none",
        "--allow-run-as-root", "-H", "a:2,b:2", "--hostfile", "h",
        "-x", "HVDLITE_CYCLE_TIME_MS", "-x", "HVDLITE_TIMELINE",
        *WRAPPER, "python", "train.py", "--lr", "0.1",
    ]  # fmt: skip


def test_openmpi_command_not_root() -> None:
    cmd = build_command(_spec("openmpi"))
    assert "--allow-run-as-root" not in cmd
    assert "--oversubscribe" in cmd


def test_unknown_launcher_gets_plain_flags_and_inherits_env() -> None:
    cmd = build_command(_spec("unknown"))
    assert cmd == ["/opt/mpi/bin/mpirun", "-n", "4", *WRAPPER, "python", "train.py", "--lr", "0.1"]


def test_installed_mpiexec_is_found_and_detected() -> None:
    found = find_mpiexec()
    assert found is not None
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        assert found == str(beside)
    # The test environment installs the MPICH wheel (Hydra); Open MPI would say "openmpi".
    assert mpi_flavor(found) in {"hydra", "openmpi"}


def test_missing_mpiexec() -> None:
    assert find_mpiexec("/nonexistent/mpiexec") is None
    assert mpi_flavor("/nonexistent/mpiexec") == "unknown"


def test_every_knob_has_a_flag() -> None:
    options = {opt for action in build_parser()._actions for opt in action.option_strings}
    for k in KNOBS:
        assert k.flag in options
        if k.kind == "bool":
            assert k.flag.replace("--", "--no-", 1) in options


def _wrap(tmp_path: Path | None, code: str,
          rank: str = "5") -> subprocess.CompletedProcess[str]:
    """Run ``code`` under the rank wrapper; ``tmp_path`` None: no report directory."""
    env = {k: v for k, v in os.environ.items()
           if k not in _rankwrap.RANK_ENVS and k != _rankwrap.REPORT_DIR_ENV}
    env["PMI_RANK"] = rank
    if tmp_path is not None:
        env[_rankwrap.REPORT_DIR_ENV] = str(tmp_path)
    return subprocess.run(
        [*WRAPPER, sys.executable, "-c", code],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_wrapper_passes_success_through(tmp_path: Path) -> None:
    result = _wrap(tmp_path, "print('fine')")
    assert result.returncode == 0 and result.stdout == "fine\n"
    assert list(tmp_path.iterdir()) == []


def test_wrapper_gives_the_program_the_launchers_path(tmp_path: Path) -> None:
    # An MPI launcher put a folder of its own first (Open MPI's --prefix does): the program
    # gets the PATH hvdliterun meant, and not the variable that carried it.
    meant = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    env = os.environ | {"PMI_RANK": "0", "PATH": f"/usr/bin:{meant}",
                        _rankwrap.RANK_PATH_ENV: meant}
    code = ("import os, shutil; print(os.environ['PATH']); print(shutil.which('python3')); "
            f"print(os.environ.get({_rankwrap.RANK_PATH_ENV!r}))")
    result = subprocess.run([*WRAPPER, "python3", "-c", code], env=env, capture_output=True,
                            text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        meant, os.path.join(os.path.dirname(sys.executable), "python3"), "None"]


def test_wrapper_reports_exit_code(tmp_path: Path) -> None:
    result = _wrap(tmp_path, "import sys; sys.exit(7)")
    assert result.returncode == 7
    assert result.stderr == "", "the launcher prints the failure, once"
    report = json.loads((tmp_path / "rank-5.json").read_text())
    assert (report["rank"], report["code"], report["signalled"]) == (5, 7, False)
    # Nowhere to report: the wrapper says it itself.
    result = _wrap(None, "import sys; sys.exit(7)")
    assert result.returncode == 7
    assert "hvdliterun: rank 5 ended with exit code 7" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM])
def test_wrapper_dies_by_the_childs_signal(tmp_path: Path, sig: signal.Signals) -> None:
    code = f"import os, signal; os.kill(os.getpid(), signal.{sig.name})"
    result = _wrap(tmp_path, code, "2")
    assert result.returncode == -sig
    assert result.stderr == "", "no traceback (SIGKILL cannot be re-armed) and no second line"
    assert json.loads((tmp_path / "rank-2.json").read_text())["code"] == -sig
    result = _wrap(None, code, "2")
    assert result.returncode == -sig
    assert result.stderr == f"hvdliterun: rank 2 ended with signal {int(sig)} ({sig.name})\n"


def test_wrapper_forwards_signals_and_marks_the_report(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    env = os.environ | {"PMI_RANK": "1", _rankwrap.REPORT_DIR_ENV: str(tmp_path)}
    proc = subprocess.Popen([*WRAPPER, sys.executable, "-c", code], env=env, text=True,
                            stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 42  # the child's own handler decided the exit code
    assert err == "", "the report (marked signalled) is the launcher's to print"
    report = json.loads((tmp_path / "rank-1.json").read_text())
    assert (report["code"], report["signalled"]) == (42, True)


def test_wrapper_cannot_run_missing_program(tmp_path: Path) -> None:
    env = os.environ | {"PMI_RANK": "0", _rankwrap.REPORT_DIR_ENV: str(tmp_path)}
    result = subprocess.run([*WRAPPER, "/nonexistent/prog"], env=env, capture_output=True,
                            text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 127
    assert "cannot run '/nonexistent/prog'" in result.stderr
    assert json.loads((tmp_path / "rank-0.json").read_text())["code"] == 127


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({"PMI_RANK": "3"}, 3),
        ({"OMPI_COMM_WORLD_RANK": "2"}, 2),
        ({"PMIX_RANK": "1"}, 1),
        ({}, None),
    ],
)
def test_rank_from_env(env: dict[str, str], rank: int | None) -> None:
    assert _rankwrap.rank_from_env(env) == rank
