"""Stall inspector end to end: real ``hvdliterun`` jobs where one rank never submits a tensor.

The warning names the waiting tensor and the missing rank; with a stall shutdown time every
process ends non-zero within the bound instead of waiting forever.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from jobs_util import clean_env, hvdliterun, mpiexec, run_group, write_script

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

# Rank 1 submits "other" instead of "grad.w": both wait for a rank that never sends them.
_DIVERGING = """
import os, sys, numpy as np, hvdlite as hvd
hvd.init()
name = "other" if hvd.rank() == 1 else "grad.w"
try:
    hvd.allreduce(np.ones(4, np.float32), name=name)
except hvd.StallError as exc:
    print(f"rank {hvd.rank()} StallError: {exc}", flush=True)
    sys.exit(3)
print(f"rank {hvd.rank()} finished without error", flush=True)
"""

# Rank 1 submits "late" only after a pause; rank 0, which waits, declares the stall expected,
# which silences the inspector (warning and shutdown), so the job succeeds.
_EXPECTED = """
import time, numpy as np, hvdlite as hvd
hvd.init()
if hvd.rank() == 0:
    with hvd.expect_stall():
        hvd.allreduce(np.ones(2), name="late")
else:
    time.sleep(4)
    hvd.allreduce(np.ones(2), name="late")
print(f"rank {hvd.rank()} done", flush=True)
"""


def test_stall_shutdown_ends_every_rank(tmp_path: Path) -> None:
    """Jobs of 2 and 4 ranks (at once: each waits out its own 3 s) where one rank submits
    another tensor: every rank raises the stall error, naming the tensor and the missing
    ranks, and the job ends non-zero."""
    script = write_script(tmp_path, "stall.py", _DIVERGING)

    def job(np_: int) -> tuple[subprocess.CompletedProcess[str], float]:
        start = time.monotonic()
        proc = hvdliterun("-np", str(np_), "--stall-check-time-s", "1",
                          "--stall-shutdown-time-s", "3", "--", sys.executable, script,
                          timeout=90)
        return proc, time.monotonic() - start

    with ThreadPoolExecutor(2) as pool:
        runs = {np_: pool.submit(job, np_) for np_ in (2, 4)}
        done = {np_: run.result() for np_, run in runs.items()}
    for np_, (proc, elapsed) in done.items():
        out = f"{np_} ranks: {proc.stdout + proc.stderr}"
        assert proc.returncode != 0, out
        assert elapsed < 60, f"the job of {np_} ranks took {elapsed:.0f} s to end"
        assert "finished without error" not in out
        # Every rank raised the stall error, naming the tensor and the missing rank(s).
        raised = {int(r) for r in re.findall(r"rank (\d+) StallError: ", out)}
        assert raised == set(range(np_)), out
        assert "'grad.w' (missing ranks 1," in out, out
        assert out.count("StallError: tensor ") == np_, out


def test_stall_warning_names_tensor_and_missing_rank(tmp_path: Path) -> None:
    script = write_script(tmp_path, "warn.py", """
        import time, numpy as np, hvdlite as hvd
        hvd.init()
        if hvd.rank() == 1:
            time.sleep(3.5)
        hvd.allreduce(np.ones(3), name="slow.tensor")
        print(f"rank {hvd.rank()} done", flush=True)
    """)
    proc = hvdliterun("-np", "2", "--stall-check-time-s", "1", "--", sys.executable, script,
                      env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "hvdlite stall" in out, out
    line = next(ln for ln in out.splitlines() if ln.startswith("slow.tensor"))
    assert re.search(r"allreduce\s+float64\s+\(3,\)\s+0\s+1\b", line), line


def test_expect_stall_silences_the_inspector(tmp_path: Path) -> None:
    script = write_script(tmp_path, "expect.py", _EXPECTED)
    proc = hvdliterun("-np", "2", "--stall-check-time-s", "1", "--stall-shutdown-time-s", "2",
                      "--", sys.executable, script)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "hvdlite stall" not in out and "StallError" not in out, out
    assert "rank 0 done" in out and "rank 1 done" in out


def _mpiexec_job(script: str, **env: str) -> tuple[int | None, str, float]:
    """Run ``script`` on 2 ranks under plain mpiexec: (exit code or None, output, seconds)."""
    start = time.monotonic()
    rc, out = run_group([mpiexec(), "-n", "2", sys.executable, script], clean_env(**env), 60)
    return rc, out, time.monotonic() - start


def _since(out: str, mark: str, ended: float) -> float:
    """Seconds from the wall-clock time a job printed as ``<mark> <time.time()>`` to ``ended``:
    a bound counted from the event it is about, not from the job's start (two ranks importing
    numpy and hvdlite take seconds of their own on a loaded 2-core box)."""
    found = re.search(rf"{re.escape(mark)} ([\d.]+)", out)
    assert found is not None, f"the job never printed {mark!r}:\n{out}"
    return ended - float(found.group(1))


# Rank 1 is busy in its own code (60 s) and never submits: rank 0 raises the stall error at
# the shutdown time and the whole job must end soon after, rank 1 included (hvdlite aborts it).
_SLEEPER = """
import sys, time, numpy as np, hvdlite as hvd
hvd.init()
if hvd.rank() == 1:
    time.sleep(60)
    print("rank 1 woke up", flush=True)
    sys.exit(0)
print(f"rank 0 submits at {time.time()!r}", flush=True)
try:
    hvd.allreduce(np.ones(4, np.float32), name="grad.w")
except hvd.StallError as exc:
    print(f"rank 0 StallError: {exc}", flush=True)
    sys.exit(3)
"""


def test_stalled_job_ends_when_a_rank_is_busy_in_user_code(tmp_path: Path) -> None:
    """Issue 12: stall shutdown at 5 s, the job gone within 15 s of the stalled submission on
    both launchers, the message naming the tensor and the missing rank, and a failing exit
    code. The two jobs run at once (each waits out its own 5 s), each timed to its own end."""
    script = write_script(tmp_path, "sleeper.py", _SLEEPER)
    knobs = {"HVDLITE_STALL_CHECK_TIME_SECONDS": "1", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "5"}

    def under_hvdliterun() -> tuple[int | None, str, float]:
        proc = hvdliterun("-np", "2", "--stall-check-time-s", "1", "--stall-shutdown-time-s",
                          "5", "--", sys.executable, script, timeout=60)
        return proc.returncode, proc.stdout + proc.stderr, time.time()

    def under_mpiexec() -> tuple[int | None, str, float]:
        rc, out, _ = _mpiexec_job(script, **knobs)
        return rc, out, time.time()

    with ThreadPoolExecutor(2) as pool:
        jobs = {"hvdliterun": pool.submit(under_hvdliterun), "mpiexec": pool.submit(under_mpiexec)}
        results = {launcher: job.result() for launcher, job in jobs.items()}
    for launcher, (rc, out, ended) in results.items():
        elapsed = _since(out, "rank 0 submits at", ended)
        assert rc not in (0, None), f"{launcher}: {out}"  # None: the job timed out
        assert elapsed < 15, f"{launcher}: job ended {elapsed:.1f} s after the submission " \
            f"(stall shutdown 5 s): {out}"
        print(f"{launcher}: the job ended {elapsed:.1f} s after the stalled submission")
        assert "rank 1 woke up" not in out, f"{launcher}: {out}"
        assert "rank 0 StallError" in out and "grad.w" in out, f"{launcher}: {out}"
        assert re.search(r"missing[^\n]*\b1\b|rank 1", out), f"{launcher}: {out}"


# Rank 0 leaves with a collective still in flight (never waited) while rank 1 is busy in its
# own code: no stall shutdown is configured, so only the exit path's bound ends the job.
_LEAVER = """
import sys, time, numpy as np, hvdlite as hvd
hvd.init()
if hvd.rank() == 1:
    time.sleep(60)
    print("rank 1 woke up", flush=True)
    sys.exit(0)
hvd.allreduce_async(np.ones(4, np.float32), name="left.behind")
print(f"rank 0 exits with a collective in flight at {time.time()!r}", flush=True)
"""


def test_exit_with_a_collective_in_flight_and_a_peer_absent_is_bounded(tmp_path: Path) -> None:
    script = write_script(tmp_path, "leaver.py", _LEAVER)
    rc, out, _ = _mpiexec_job(script)
    elapsed = _since(out, "rank 0 exits with a collective in flight at", time.time())
    assert "rank 1 woke up" not in out, out
    assert rc not in (0, None), out  # None: the job timed out
    assert elapsed < 20, f"job ended {elapsed:.1f} s after rank 0 left (exit bound 10 s): {out}"
    assert out.count("collectives pending") == 1, out  # the reason, printed once


# What the failure-job scripts do once it has happened: a call (it raises on every rank), then
# another (the same sticky error).
_TWO_CALLS = """
try:
    hvd.allreduce(np.ones(4, np.float32), name="doomed", op=hvd.Sum)
except hvd.HvdliteError as exc:
    print(f"rank {hvd.rank()} HvdliteError: {exc}", flush=True)
try:
    hvd.allreduce(np.ones(1), name="never")
except hvd.HvdliteError as exc:
    print(f"rank {hvd.rank()} again: {type(exc).__name__}", flush=True)
"""


def _failed_job(tmp_path: Path, name: str, script: str) -> str:
    """Run a failure job; every rank must have raised twice and the job ended within 15 s."""
    rc, out, elapsed = _mpiexec_job(write_script(tmp_path, name, script))
    assert rc not in (0, None), out  # None: the job timed out
    assert elapsed < 15, f"job took {elapsed:.1f} s to end: {out}"
    for r in (0, 1):
        assert f"rank {r} HvdliteError" in out and f"rank {r} again: HvdliteError" in out, out
    return out


# Rank 1's data plane breaks in the middle of a collective: its loop fails, tells rank 0, and
# the job ends on its own (the exit guard), with the cause named.
_BROKEN = """
import sys, numpy as np, hvdlite as hvd
from hvdlite._engine import default_engine
hvd.init()
if hvd.rank() == 1:
    def broken(bucket, entries):
        raise OSError("injected transport failure")
    default_engine().mpi.run = broken
""" + _TWO_CALLS + """
sys.exit(1)
"""


def test_a_failed_background_loop_ends_the_job_with_its_cause(tmp_path: Path) -> None:
    out = _failed_job(tmp_path, "broken.py", _BROKEN)
    assert "injected transport failure" in out and "rank 1 failed" in out, out
    assert "Traceback" not in out, out  # no traceback from hvdlite's own plumbing


# Rank 1's background thread fails between cycles (in its look at the agreed schedules, the
# stall watch): the failure is sticky and reaches every rank, as a failed cycle's does, and the
# job ends with its cause, instead of the thread ending alone.
_BROKEN_WATCH = """
import time, numpy as np, hvdlite as hvd
from hvdlite._control.agreed import Schedules
from hvdlite._engine import default_engine
hvd.init()
hvd.barrier()
if hvd.rank() == 1:
    class Broken(Schedules):
        def __bool__(self):
            return True
        def watch(self):
            raise OSError("injected watch failure")
    default_engine().scheduler.schedules.__class__ = Broken
time.sleep(0.5)  # the background loop looks between cycles (a call may run its own cycle)
""" + _TWO_CALLS + """
time.sleep(30)  # the engine's exit guard ends the job, not this script
"""


def test_a_failed_look_between_cycles_ends_the_job_with_its_cause(tmp_path: Path) -> None:
    out = _failed_job(tmp_path, "broken_watch.py", _BROKEN_WATCH)
    assert "[hvdlite rank 1] " in out and "injected watch failure" in out, out
    assert "Exception in thread" not in out, out  # the thread did not end on its own


# A signal handler's exception (here an alarm) in a rank waiting on a collective no peer has
# submitted: the wait is abandoned, and the engine and the job go on (as in Horovod).
_ALARM = """
import signal, time, numpy as np, hvdlite as hvd
hvd.init()
class Alarm(Exception):
    pass
def ring(*_):
    raise Alarm()
signal.signal(signal.SIGALRM, ring)
if hvd.rank() == 1:
    signal.alarm(1)
    try:
        hvd.allreduce(np.ones(2), name="only.rank1")
    except Alarm:
        print("rank 1: wait abandoned", flush=True)
time.sleep(2)
got = hvd.allreduce(np.ones(2), name="after", op=hvd.Sum)
print(f"rank {hvd.rank()} after: {got.tolist()}", flush=True)
hvd.barrier()
"""


def test_an_interrupted_wait_leaves_the_engine_working(tmp_path: Path) -> None:
    script = write_script(tmp_path, "alarm.py", _ALARM)
    rc, out, _ = _mpiexec_job(script)
    assert rc == 0, out
    assert "rank 1: wait abandoned" in out, out
    assert "rank 0 after: [2.0, 2.0]" in out and "rank 1 after: [2.0, 2.0]" in out, out


# The race of issue 33, made certain: rank 1's SIGALRM handler raises while rank 1 itself runs
# a negotiation cycle as a waiting caller, outside any MPI wait (the signal is raised at the
# very start of the cycle's Python code, so its handler runs there, before the round begins).
# The wait must be abandoned after the round; the engine goes on on both ranks.
_ALARM_IN_CYCLE = """
import signal, time, numpy as np, hvdlite as hvd
from hvdlite import _engine
hvd.init()
class Alarm(Exception):
    pass
def ring(*_):
    raise Alarm()
signal.signal(signal.SIGALRM, ring)
driver = _engine.default_engine().scheduler
plain = driver.cycle
fired = []
def cycle(caller):
    if caller and not fired:
        fired.append(1)
        signal.raise_signal(signal.SIGALRM)  # its handler runs at the next bytecode: here
    return plain(caller)
if hvd.rank() == 1:
    driver.cycle = cycle
    try:
        hvd.allreduce(np.ones(2), name="only.rank1")
    except Alarm:
        print("rank 1: wait abandoned", flush=True)
    driver.cycle = plain
time.sleep(1)
got = hvd.allreduce(np.ones(2), name="after", op=hvd.Sum)
print(f"rank {hvd.rank()} after: {got.tolist()}", flush=True)
hvd.barrier()
"""


def test_an_alarm_inside_a_callers_cycle_leaves_the_engine_working(tmp_path: Path) -> None:
    script = write_script(tmp_path, "alarm_in_cycle.py", _ALARM_IN_CYCLE)
    rc, out, _ = _mpiexec_job(script)
    assert rc == 0, out
    assert "rank 1: wait abandoned" in out, out
    assert "rank 0 after: [2.0, 2.0]" in out and "rank 1 after: [2.0, 2.0]" in out, out


# The same race on the immediate path (_control/immediate.py): a blocking allreduce that
# repeats its lane with nothing else pending runs its cycle on the calling thread without a
# wait (run_now -> Scheduler.cycle_alone). Rank 1's SIGALRM is raised at the very start of
# that cycle's round, so without the held signals its handler raises inside the cycle and
# stops the engine on every rank. Held, the cycle completes (the collective is done on both
# ranks) and the alarm reaches rank 1's caller after it; the engine goes on.
_ALARM_IN_IMMEDIATE = """
import signal, sys, numpy as np, hvdlite as hvd
from hvdlite import _engine
hvd.init()
class Alarm(Exception):
    pass
def ring(*_):
    raise Alarm()
signal.signal(signal.SIGALRM, ring)
x = np.ones(2)
for _ in range(3):  # the lane is cached: the next call takes the immediate path
    hvd.allreduce(x, name="repeat", op=hvd.Sum)
neg = _engine.default_engine().global_channel.negotiator
plain = neg.round_alone
callers = []
def round_alone(*args):
    if not callers:
        callers.append(sys._getframe(2).f_code.co_name)  # cycle_alone's caller
        signal.raise_signal(signal.SIGALRM)  # its handler runs at the next bytecode: here
    return plain(*args)
if hvd.rank() == 1:
    neg.round_alone = round_alone
try:
    got = hvd.allreduce(x, name="repeat", op=hvd.Sum)
    print(f"rank {hvd.rank()} repeat: {got.tolist()}", flush=True)
except Alarm:
    print(f"rank 1: alarm after the cycle of {callers}", flush=True)
neg.round_alone = plain
got = hvd.allreduce(np.ones(2), name="after", op=hvd.Sum)
print(f"rank {hvd.rank()} after: {got.tolist()}", flush=True)
hvd.barrier()
"""


def test_an_alarm_inside_an_immediate_cycle_leaves_the_engine_working(tmp_path: Path) -> None:
    script = write_script(tmp_path, "alarm_in_immediate.py", _ALARM_IN_IMMEDIATE)
    rc, out, _ = _mpiexec_job(script)
    assert rc == 0, out
    assert "rank 1: alarm after the cycle of ['_cycle']" in out, out  # immediate.py's _cycle
    assert "rank 0 repeat: [2.0, 2.0]" in out, out  # the collective was done
    assert "rank 0 after: [2.0, 2.0]" in out and "rank 1 after: [2.0, 2.0]" in out, out
