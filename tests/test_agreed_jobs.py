"""Agreed schedules when a rank leaves them, as real ``mpiexec -n 2`` jobs on host buffers
(the MPI transport of the schedule contract): never a hang, never a wrong sum.

A rank that skips a slot is refused at once (``MismatchError``: nothing enqueued); its peer's
launch never completes, which the watchdog turns into ``StallError`` within the stall
shutdown time, told to every rank; after it every launch raises ``HvdliteError`` naming the
cause. A rank that simply stops launching ends the same way.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from jobs_util import clean_env, mpiexec, run_group

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

_JOB = """
import sys, time, numpy as np, hvdlite as hvd
from hvdlite import _runtime_api as runtime
from hvdlite._ops import ReduceOp
hvd.init(stall_check_time_s=1, stall_shutdown_time_s=3)
me, mode = hvd.rank(), sys.argv[1]
slots = [runtime.Slot(f"g{i}", 16, "float32", int(ReduceOp.SUM)) for i in range(3)]
bufs = [np.zeros(16, np.float32) for _ in slots]
sched, why = runtime.open_schedule("job", slots, [(b.ctypes.data, b.size) for b in bufs], -1)
assert sched is not None, why
for step in range(2):  # agreed steps, exact
    for i, b in enumerate(bufs):
        b[:] = me + step + i
        sched.launch(i)
    for i, b in enumerate(bufs):
        sched.wait(i)
        assert (b == sum(r + step + i for r in range(hvd.size()))).all(), (step, i, b)
print(f"rank {me} agreed steps exact", flush=True)
t0 = time.monotonic()
try:
    if me == 1 and mode == "skip":
        sched.launch(0)
        try:
            sched.launch(2)  # skips slot 1
        except hvd.MismatchError as exc:
            print(f"rank {me} MismatchError: {exc}", flush=True)
    if me == 1:  # launches nothing more; the stall reaches it through the failure channel
        while time.monotonic() - t0 < 30:
            time.sleep(0.05)
            runtime.check_usable()
    else:
        for i in range(3):
            sched.launch(i)
        for i in range(3):
            sched.wait(i)
    print(f"rank {me} finished without error", flush=True)
except hvd.HvdliteError as exc:
    print(f"rank {me} {type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}",
          flush=True)
    try:
        sched.launch(0)
    except hvd.HvdliteError as again:
        print(f"rank {me} launch after the failure: {type(again).__name__}: {again}",
              flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_a_rank_that_leaves_the_schedule_ends_every_rank_with_stall_error(
        tmp_path: Path, mode: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    start = time.monotonic()
    rc, out = run_group([mpiexec(), "-n", "2", sys.executable, str(script), mode],
                        clean_env(), 90)
    wall = time.monotonic() - start
    assert rc is not None, f"the job hung:\n{out}"
    assert rc != 0, out
    assert "rank 0 agreed steps exact" in out and "rank 1 agreed steps exact" in out, out
    assert "finished without error" not in out, out
    if mode == "skip":
        assert re.search(r"rank 1 MismatchError: job: slot 2 \('g2'\) launched out of turn, "
                         r"slot 1 expected", out), out
    # Rank 0's slot never completes: the watchdog's StallError, on both ranks, well within
    # the bound (3 s shutdown time + the watchdog's 1 s period), never a hang.
    stalled = re.search(r"rank 0 StallError after ([\d.]+)s: .*job: slot \d of 3 \('g\d'\) "
                        r"launched \d+ s ago has not completed", out)
    assert stalled, out
    assert float(stalled.group(1)) < 30, out
    assert re.search(r"rank 1 \w+Error after [\d.]+s: .*has not completed", out), out
    assert re.search(r"rank 0 launch after the failure: StallError: .*has not completed", out), out
    assert wall < 80, out


_PERSISTENT_JOB = """
import time, torch, hvdlite.torch as hvd
from hvdlite import _runtime_api
hvd.init(stall_check_time_s=1, stall_shutdown_time_s=3)
me = hvd.rank()
tensors = [torch.zeros(4), torch.zeros(2, 3)]
group = hvd.grouped_allreduce_init(tensors, name="metrics", op=hvd.Sum)
for step in range(3):  # the first negotiated, then on the schedule; exact
    for k, t in enumerate(tensors):
        t.fill_(me + step + k)
    got = group()
    for k, g in enumerate(got):
        assert (g == sum(r + step + k for r in range(hvd.size()))).all(), (step, k, g)
assert group.scheduled, group.unscheduled_reason
print(f"rank {me} scheduled calls exact", flush=True)
t0 = time.monotonic()
try:
    if me == 1:  # stops calling; the stall reaches it through the failure channel
        while time.monotonic() - t0 < 30:
            time.sleep(0.05)
            _runtime_api.check_usable()
    else:
        group()
    print(f"rank {me} finished without error", flush=True)
except hvd.HvdliteError as exc:
    print(f"rank {me} {type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}",
          flush=True)
try:
    group()
except hvd.HvdliteError as again:
    print(f"rank {me} call after the failure: {type(again).__name__}", flush=True)
"""


def test_a_rank_that_stops_calling_a_persistent_allreduce_ends_with_stall_error(
        tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="grouped_allreduce_init is hvdlite.torch's")
    script = tmp_path / "job.py"
    script.write_text(_PERSISTENT_JOB)
    rc, out = run_group([mpiexec(), "-n", "2", sys.executable, str(script)], clean_env(), 90)
    assert rc is not None, f"the job hung:\n{out}"
    assert "rank 0 scheduled calls exact" in out and "rank 1 scheduled calls exact" in out, out
    assert "finished without error" not in out, out
    stalled = re.search(r"rank 0 StallError after ([\d.]+)s: .*grouped_allreduce_init\[metrics\]"
                        r".*has not completed", out)
    assert stalled and float(stalled.group(1)) < 30, out
    assert re.search(r"rank 1 \w+Error after [\d.]+s: .*has not completed", out), out
    assert "rank 0 call after the failure: StallError" in out, out
