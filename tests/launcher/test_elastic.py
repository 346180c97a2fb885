"""Elastic ``hvdliterun`` end to end on one host: a rank SIGKILLed mid-step, a discovery script
that drops a slot and adds it back (the torch job ``tests/elastic_train.py``, checked against
its exact one-process replay), repeated failures up to ``--reset-limit`` and one beyond (the
NumPy job ``tests/elastic_numpy.py``, exact totals)."""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import elastic_numpy
import pytest
from elastic_util import RECOVERY_LIMIT_S, TRAIN, check_job, events
from jobs_util import clean_env, needs_torch

from hvdlite import run

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(150)]

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 120
NUMPY_JOB = str(REPO / "tests" / "elastic_numpy.py")
THREE_HOSTS = f"localhost:1,127.0.0.1:1,{socket.gethostname()}:1"


def hvdliterun(*args: str, script: str = TRAIN, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hvdlite.run", *args, "--", sys.executable, script],
        env=clean_env(**env), cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=JOB_TIMEOUT_S, check=False)


@needs_torch
def test_torch_jobs_go_on_after_a_killed_rank_and_a_slot_dropped_and_added(
        tmp_path: Path) -> None:
    """Two torch jobs at once (each world starts in seconds of imports per rank on a 2-core
    machine, so they share the wait), each checked against its exact one-process replay:

    - rank 1 SIGKILLs itself in the middle of the step that would be commit 4 (before its
      allreduce): its host (127.0.0.1, a second name of this machine) is blacklisted, as
      Horovod does, and the job goes on at 1 rank on localhost from commit 3;
    - a discovery script drops a slot and adds it back: 2 -> 1 -> 2 ranks, the slot that came
      back joining within --elastic-timeout of the script listing it."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    with ThreadPoolExecutor(2) as pool:
        killed = pool.submit(hvdliterun, "-np", "2", "--min-np", "1",
                             "-H", "localhost:1,127.0.0.1:1", ELASTIC_KILL="0:4:1")
        discovered = pool.submit(
            hvdliterun, "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(script), "--elastic-timeout", "60",
            ELASTIC_HOSTS="0:3:localhost:1;1:1:localhost:2", ELASTIC_HOSTS_FILE=str(hosts),
            ELASTIC_STEP_S="0.3")
        res, grown_res = killed.result(), discovered.result()

    assert res.returncode == 0, res.stdout + res.stderr
    facts = check_job(res.stdout)
    assert facts["sizes"] == [2, 1], facts["sizes"]
    assert facts["restored"][1]["commit"] == 3
    assert "rank 1 (host 127.0.0.1) failed with signal 9 (SIGKILL); host(s) 127.0.0.1 " \
        "blacklisted" in res.stderr, res.stderr
    kill = next(e for e in facts["events"] if e["kind"] == "killing")
    recovery = facts["restored"][1]["time"] - kill["time"]
    print(f"recovery after SIGKILL: {recovery:.1f} s")
    assert recovery < RECOVERY_LIMIT_S

    res = grown_res
    assert res.returncode == 0, res.stdout + res.stderr
    facts = check_job(res.stdout)
    assert facts["sizes"] == [2, 1, 2], facts["sizes"]
    assert res.stderr.count("asking the ranks to reset") == 2, res.stderr
    grown = facts["restored"][2]["time"]
    listed = next(e["time"] for e in facts["events"]
                  if e["gen"] == 1 and e["kind"] == "committed" and e["rank"] == 0)
    print(f"added slot joined after {grown - listed:.1f} s")
    assert grown - listed < 60


def test_repeated_failures_up_to_the_reset_limit() -> None:
    # NumPy job (worlds start fast): two ranks killed in turn, 3 -> 2 -> 1 ranks (three names
    # of this machine as three hosts of one slot: each failure blacklists one), two resets
    # allowed; the total is exact for the sizes the steps ran at, and each world started from
    # the step before the one that was killed.
    res = hvdliterun("-np", "3", "--min-np", "1", "--reset-limit", "2", "-H", THREE_HOSTS,
                     script=NUMPY_JOB, ELASTIC_KILL="0:4:2,1:8:1")
    assert res.returncode == 0, res.stdout + res.stderr
    ev = events(res.stdout)
    starts = {(e["gen"], e["rank"]): e["step"] for e in ev if e["kind"] == "restored"}
    assert starts == {(0, 0): 0, (0, 1): 0, (0, 2): 0, (1, 0): 3, (1, 1): 3, (2, 0): 7}, starts
    done = [e for e in ev if e["kind"] == "done"]
    sizes = [3] * 3 + [2] * 4 + [1] * (elastic_numpy.STEPS - 7)
    assert len(done) == 1 and done[0]["sizes"] == sizes, done
    assert done[0]["total"] == elastic_numpy.expected(sizes)
    assert "reset 2 of at most 2" in res.stderr, res.stderr


def test_reset_limit_ends_the_job_with_a_clear_message() -> None:
    res = hvdliterun("-np", "2", "--min-np", "1", "--max-np", "2", "--reset-limit", "1",
                     "-H", THREE_HOSTS, script=NUMPY_JOB, ELASTIC_KILL="0:2:1,1:5:0")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "world 1: 2 ranks" in res.stderr
    assert "number of resets during elastic job exceeded limit: 1 (--reset-limit)" \
        in res.stderr, res.stderr
    assert "rank 0 (host" in res.stderr.splitlines()[-1], res.stderr
    assert not [e for e in events(res.stdout) if e["kind"] == "done"]


@pytest.mark.parametrize("args, message", [
    (["-np", "2", "--min-np", "3"], "--min-np must be between 1 and -np"),
    (["-np", "2", "--min-np", "1", "--max-np", "1"], "--max-np must be >= -np"),
    (["-np", "2", "--min-np", "1", "--reset-limit", "-1"], "--reset-limit must be >= 0"),
    (["-np", "2", "--host-discovery-script", "/bin/true", "--elastic-timeout", "0"],
     "argument --elastic-timeout-s/--elastic-timeout: expected a number > 0, got '0'"),
])
def test_bad_elastic_flags(args: list[str], message: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run.main([*args, "--", "true"])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_too_few_slots_ends_after_elastic_timeout(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    code = run.main(["-np", "2", "--host-discovery-script", str(script), "--elastic-timeout",
                     "2", "--", "true"])
    err = capsys.readouterr().err
    assert code == 1
    assert "not enough slots: 2 needed (--min-np 2, -np 2), 1 available (localhost:1) after " \
        "--elastic-timeout 2 s" in err, err
