"""Ways out of a job, end to end: a rank killed by a signal (hvdliterun names it once, no
traceback of hvdlite's), ``hvdlite._exit.abort_job`` and ``exit_guard`` with a peer stuck in
user code, and the timeline of a rank that gets SIGTERM. Real jobs, each with a timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs_util import HVDLITE_FRAME, RANK_OF, clean_env, mpiexec, run_group, write_script

from timeline import load, merge, summarize
from timeline.check import check_file

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

JOB_TIMEOUT_S = 60.0


def _script(tmp_path: Path, body: str) -> str:
    return write_script(tmp_path, "job.py", body)


def _job(launcher: str, np_: int, *cmd: str, env: dict[str, str] | None = None,
         timeout_s: float = JOB_TIMEOUT_S) -> tuple[int | None, str, float]:
    """Run ``cmd`` as an ``np_``-rank job under ``mpiexec`` or ``hvdliterun``; returns the exit
    code (None: timed out and killed), the output and the seconds it took."""
    if launcher == "mpiexec":
        full = [mpiexec(), "-n", str(np_), *cmd]
    else:
        full = [sys.executable, "-m", "hvdlite.run", "-np", str(np_), "--", *cmd]
    start = time.monotonic()
    code, out = run_group(full, clean_env() if env is None else env, timeout_s)
    return code, out, time.monotonic() - start


# ---------------------------------------------------------------- a rank killed by a signal

_DIES = """
import os, signal, sys, time
if {rank_of} == 1:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.{sig})
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGSEGV,
                                 signal.SIGABRT])
def test_rank_killed_by_a_signal_is_reported_once(tmp_path: Path, sig: signal.Signals) -> None:
    script = _script(tmp_path, _DIES.format(rank_of=RANK_OF, sig=sig.name))
    code, out, took = _job("hvdliterun", 2, sys.executable, script)
    assert code == 128 + sig, out
    assert took < 10, f"the job took {took:.1f} s to end"
    mine = [ln for ln in out.splitlines() if ln.startswith("hvdliterun:")]
    assert len(mine) == 1, out
    assert "rank 1 " in mine[0] and f"({sig.name})" in mine[0], out
    assert not HVDLITE_FRAME.search(out), f"a traceback through hvdlite's code:\n{out}"
    if sig != signal.SIGINT:  # SIGINT: the user's KeyboardInterrupt traceback, as in Python
        assert "Traceback" not in out, out


# ---------------------------------------------------------------- abort_job and exit_guard

_STUCK_PEER = """
import os, sys, time
from mpi4py import MPI
from hvdlite._exit import abort_job, exit_guard
comm = MPI.COMM_WORLD
if comm.Get_rank() == 1 and sys.argv[1] == "both":
    abort_job(comm, "both abort: rank 1's reason", 5)
if comm.Get_rank() == 1:
    time.sleep(60)  # user code that never calls MPI or hvdlite again
    sys.exit(0)
mode = sys.argv[1]
if mode == "abort":
    abort_job(comm, "tensor 'grad.w' stalled: rank 1 never submitted it", 3)
if mode == "both":
    abort_job(comm, "both abort: rank 0's reason", 5)
if mode == "guard":
    # Arm the guard and leave: the exit itself then waits in MPI_Finalize for rank 1.
    exit_guard(1.0, "rank 1 is absent; exit guarded", comm=comm, backstop_s=0.5)
if mode == "cancelled":
    exit_guard(1.0, "should not be printed", comm=comm).cancel()
    time.sleep(1.5)
    print("rank 0 still here", flush=True)
    abort_job(comm, "cancelled guard: done", 4)
print("rank 0 leaving", flush=True)
"""


@pytest.mark.parametrize("launcher", ["mpiexec", "hvdliterun"])
def test_abort_job_ends_a_job_whose_peer_is_busy(tmp_path: Path, launcher: str) -> None:
    code, out, took = _job(launcher, 2, sys.executable, _script(tmp_path, _STUCK_PEER), "abort")
    assert code == 3, out
    assert took < 10, f"the job took {took:.1f} s to end"
    assert out.count("tensor 'grad.w' stalled") == 1, out
    assert "[hvdlite rank 0] tensor 'grad.w' stalled: rank 1 never submitted it" in out
    if launcher == "hvdliterun":
        assert "rank 0 (host" in out and "failed first with exit code 3" in out, out


def test_every_aborting_rank_says_why(tmp_path: Path) -> None:
    # Ranks that abort at once each print their reason: the launcher stops forwarding output
    # when the job is aborted, and without abort_job's pause 2 of 10 such lines were lost.
    script = _script(tmp_path, _STUCK_PEER)
    for _ in range(3):
        code, out, took = _job("mpiexec", 2, sys.executable, script, "both")
        assert code == 5, out
        assert took < 10, f"the job took {took:.1f} s to end"
        for rank in (0, 1):
            assert f"[hvdlite rank {rank}] both abort: rank {rank}'s reason" in out, out


@pytest.mark.parametrize("launcher", ["mpiexec", "hvdliterun"])
def test_exit_guard_ends_an_exit_stuck_in_finalize(tmp_path: Path, launcher: str) -> None:
    code, out, took = _job(launcher, 2, sys.executable, _script(tmp_path, _STUCK_PEER), "guard")
    assert code not in (None, 0), out
    assert "rank 0 leaving" in out
    assert took < 10, f"the job took {took:.1f} s to end (without the guard: 60 s)"
    assert out.count("rank 1 is absent; exit guarded") == 1, out
    assert "[hvdlite rank 0] rank 1 is absent" in out


def test_cancelled_exit_guard_does_nothing(tmp_path: Path) -> None:
    code, out, took = _job("mpiexec", 2, sys.executable, _script(tmp_path, _STUCK_PEER),
                           "cancelled")
    assert code == 4, out
    assert "rank 0 still here" in out and "should not be printed" not in out, out
    assert took < 10


def test_exit_guard_without_mpi(tmp_path: Path) -> None:
    """Without a communicator the guard prints the reason once and exits with the code."""
    script = _script(tmp_path, """
        import time
        from hvdlite._exit import exit_guard
        exit_guard(0.5, "no progress in 0.5 s", exitcode=5)
        time.sleep(30)
    """)
    start = time.monotonic()
    code, out = run_group([sys.executable, script], clean_env(), 30)
    assert code == 5, out
    assert time.monotonic() - start < 10
    assert out.count("[hvdlite rank ?] no progress in 0.5 s") == 1, out


# ---------------------------------------------------------------- timeline and SIGTERM

_TRACED = """
import os, sys, time
import numpy as np
import hvdlite as hvd
hvd.init()
for i in range(400):  # about 2,000 timeline events per rank
    hvd.allreduce(np.ones(4, np.float32), name=f"grad.{i % 50}")
with open(os.path.join(sys.argv[1], f"rank{hvd.rank()}.pid"), "w") as f:
    f.write(str(os.getpid()))
if sys.argv[2] == "wait":
    time.sleep(60)
hvd.shutdown()
"""


def _timed(path: Path) -> list[dict[str, object]]:
    return [ev for ev in load(str(path), lenient=True).events if ev.get("ph") != "M"]


def test_sigterm_keeps_the_trace(tmp_path: Path) -> None:
    """SIGTERM to rank 1 with the timeline on: its trace keeps >= 99% of the events a clean
    run records (and is closed); rank 0, ended by the launcher, keeps a file the tools read."""
    script = _script(tmp_path, _TRACED)
    clean_dir, kill_dir = tmp_path / "clean", tmp_path / "killed"
    clean_dir.mkdir()
    kill_dir.mkdir()
    env = clean_env(HVDLITE_TIMELINE=str(clean_dir / "trace.{rank}.json"))
    code, out, _ = _job("mpiexec", 2, sys.executable, script, str(clean_dir), "done", env=env)
    assert code == 0, out
    clean = _timed(clean_dir / "trace.1.json")
    assert len(clean) >= 2000, len(clean)

    env = clean_env(HVDLITE_TIMELINE=str(kill_dir / "trace.{rank}.json"))
    proc = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, script, str(kill_dir), "wait"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        pid_file = kill_dir / "rank1.pid"
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out
    killed = _timed(kill_dir / "trace.1.json")
    print(f"SIGTERM: the trace kept {len(killed)} of the {len(clean)} events of a clean run")
    assert len(killed) >= 0.99 * len(clean), f"{len(killed)} of {len(clean)} events kept"
    allreduces = [ev for ev in killed if ev.get("name") == "MPI_ALLREDUCE" and ev["ph"] == "B"]
    assert len(allreduces) == 400
    assert check_file(str(kill_dir / "trace.1.json")).ok  # strict: closed by the hook
    # Rank 0 was ended by the launcher (a signal): a loadable file, at a write boundary.
    res = check_file(str(kill_dir / "trace.0.json"))
    assert res.ok, res.errors
    assert summarize.main([str(kill_dir / "trace.0.json"), str(kill_dir / "trace.1.json"),
                           "--json"]) == 0
    merged = tmp_path / "merged.json"
    assert merge.main([str(merged), str(kill_dir / "trace.0.json"),
                       str(kill_dir / "trace.1.json")]) == 0
    assert json.loads(merged.read_text())
