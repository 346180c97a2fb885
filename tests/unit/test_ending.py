"""hvdlite._rankside.ending: the reason a rank ends is said once per process, and every pipe
handed to tell_on_announce (an exit guard's watchdog process) learns it was said."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# One process per case: "once per process" is the point. The rank comes from the launcher's
# environment (no MPI here).
_PROBE = """
import os, sys
from hvdlite._rankside import ending

def pipe():
    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, os.fdopen(w, "wb")

def heard(r):
    try:
        return os.read(r, 64)
    except BlockingIOError:
        return b""

early_r, early = pipe()
gone_r, gone = pipe()
ending.tell_on_announce(early)
ending.tell_on_announce(gone)
ending.forget_pipe(gone)
print("before", heard(early_r), flush=True)
print("first", ending.announce("first reason,\\n  on two lines"), flush=True)
print("second", ending.announce("second reason"), flush=True)
late_r, late = pipe()
ending.tell_on_announce(late)
print("heard", heard(early_r), heard(late_r), heard(gone_r), flush=True)
ending.exit_now("third reason", 7)
"""


def _run(code: str, rank: int) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh process that the launcher's environment makes rank ``rank``."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PMI_RANK": str(rank)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=50, env=env)


@pytest.mark.timeout(60)
def test_the_reason_is_said_once_and_the_pipes_hear_it() -> None:
    out = _run(_PROBE, 3)
    assert out.returncode == 7, out.stderr
    assert out.stdout.splitlines() == [
        "before b''", "first True", "second False", "heard b'a' b'a' b''"], out.stdout
    assert out.stderr == "[hvdlite rank 3] first reason, on two lines\n", out.stderr


_SWAPPED = """
import io, sys
from hvdlite._rankside import ending

held = io.StringIO()
sys.stderr = held  # as torch.distributed's excepthook holds it while the hook before it runs
ending.announce("the reason")
sys.stdout.write("held: " + held.getvalue())
ending.exit_now("another reason", 5)  # the job ends before the buffer is ever printed
"""


@pytest.mark.timeout(60)
def test_the_reason_reaches_the_process_stderr_while_sys_stderr_is_a_buffer() -> None:
    out = _run(_SWAPPED, 1)
    assert out.returncode == 5, out.stderr
    assert out.stderr == "[hvdlite rank 1] the reason\n", out.stderr
    assert out.stdout == "held: [hvdlite rank 1] the reason\n", out.stdout


# A rank told to end while another thread closes its timeline (shutdown() detaches the
# engine's timeline, then closes it): exit_now knows no timeline, yet must wait for that one.
_CLOSING = """
import sys, threading
from hvdlite._observe.timeline import Timeline
from hvdlite._rankside import ending
tl = Timeline(sys.argv[1], 0, hook_signals=False)
for i in range(int(sys.argv[2])):
    tl.instant("grad", "tick", {"i": i})
threading.Thread(target=tl.close).start()
ending.exit_now("the launcher ended the job", 5)
"""


@pytest.mark.timeout(60)
def test_exit_now_waits_for_a_timeline_another_thread_is_closing(tmp_path: Path) -> None:
    from timeline import load

    path, count = tmp_path / "trace.json", 50_000
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PMI_RANK": "0"}
    out = subprocess.run([sys.executable, "-c", _CLOSING, str(path), str(count)],
                         capture_output=True, text=True, timeout=50, env=env)
    assert out.returncode == 5, out.stderr
    events = load(str(path)).events  # strict: the file was closed
    ticks = [ev["args"]["i"] for ev in events if ev.get("name") == "tick"]
    assert ticks == list(range(count)), f"{len(ticks)} of {count} events written"
    assert [ev["name"] for ev in events if ev.get("ph") == "M"][-1] == "trace_end"
