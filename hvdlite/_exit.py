"""How an hvdlite process ends a job that cannot go on: loudly, once, and in bounded time.

Two tools, for the engine (and the doctor) to call:

- :func:`abort_job` ends the whole job now: one line ``[hvdlite rank N] <reason>`` on stderr
  (once per process, however many threads get there), the timeline closed, stdio flushed, then
  ``comm.Abort(exitcode)``, which makes the MPI launcher end every rank, including ranks busy
  in their own code that never call hvdlite again.
- :func:`exit_guard` bounds what comes after a failure: unless cancelled within ``seconds``,
  the process is ended. A Python timer thread does it while the interpreter still runs
  (:func:`abort_job` when given a communicator, else the reason and ``os._exit``). That is not
  enough at interpreter exit: mpi4py calls ``MPI_Finalize`` from a ``Py_AtExit`` hook, after
  the interpreter has stopped running Python threads, and a finalize that waits for a peer
  stuck in user code would wait forever. So the guard also starts a tiny watchdog process
  (``python -I -S``) that, if this process is still there ``backstop_s`` after the bound,
  prints the reason (unless it was printed already) and sends SIGTERM, then SIGKILL. The
  watchdog ends on its own as soon as this process ends or the guard is cancelled.

What ending a rank without MPI takes (the reason said once, the launcher told, stdio flushed)
is :mod:`hvdlite._rankside.ending`, which the launcher's own order to end a rank
(:mod:`hvdlite._rankside.watchdog`) uses too; this module adds MPI's abort and the time bound,
and nothing below the engine imports it.

Importing this module has no side effects and does not import MPI.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn

from hvdlite._rankside import ending

__all__ = ["ExitGuard", "abort_job", "exit_guard"]

ABORT_GRACE_S = 5.0  # comm.Abort that has not ended the process by then: os._exit
# The MPI launcher forwards a rank's stderr through a pipe that it stops reading once the job
# is aborted: a reason written just before comm.Abort was lost for 2 of 10 ranks aborting at
# once under MPICH's mpiexec (and, inferred, in GPU runs under Open MPI's mpirun that ended
# with no reason). A pause this long lets the launcher read it first.
DRAIN_S = 0.5
BACKSTOP_S = 2.0  # the watchdog process acts this long after the guard's bound
_TERM_GRACE_S = 1.0  # the watchdog's SIGTERM -> SIGKILL delay

# The watchdog process. argv: parent pid, seconds, the line to print, SIGTERM->SIGKILL grace.
# Its stdin is a pipe from the parent: EOF = cancelled or the parent is gone; b"a" = the
# parent printed the reason already.
_WATCHDOG = r"""
import os, select, signal, sys, time
parent, seconds, line = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
term_grace = float(sys.argv[4])
deadline = time.monotonic() + seconds
announced = False
def alive():
    return os.getppid() == parent
while alive():
    left = deadline - time.monotonic()
    if left <= 0:
        break
    ready, _, _ = select.select([0], [], [], min(left, 0.2))
    if ready:
        data = os.read(0, 64)
        if not data:
            sys.exit(0)
        announced = announced or b"a" in data
else:
    sys.exit(0)
if not announced:
    os.write(2, (line + "\n").encode())
os.kill(parent, signal.SIGTERM)
end = time.monotonic() + term_grace
while alive() and time.monotonic() < end:
    time.sleep(0.05)
if alive():
    os.kill(parent, signal.SIGKILL)
"""


def _hard_exit_later(seconds: float, exitcode: int) -> None:
    timer = threading.Timer(seconds, os._exit, (exitcode,))
    timer.daemon = True
    timer.start()


def abort_job(comm: Any, reason: str, exitcode: int = 1) -> NoReturn:
    """End the whole MPI job now because of ``reason``; never returns.

    Prints the reason once (:func:`hvdlite._rankside.ending.announce`), closes every open
    timeline (waiting at most ``ending.TIMELINE_CLOSE_S`` for their writers:
    :func:`hvdlite._rankside.ending.close_timelines`), leaves the failure report
    for ``hvdliterun``, flushes stdio and, ``DRAIN_S`` later (the launcher has forwarded the
    reason by then), calls ``comm.Abort(exitcode)``, which makes the MPI launcher end every
    rank. If MPI is already finalized, or Abort fails or does not end the process within
    ``ABORT_GRACE_S``, the process ends with ``os._exit(exitcode)``. Safe from any thread;
    ``comm`` may be None (no MPI: just exit).
    """
    ending.announce(reason, comm)
    ending.close_timelines()
    ending.report_to_launcher(exitcode)
    ending.flush_stdio()
    _hard_exit_later(ABORT_GRACE_S, exitcode)
    if comm is not None:
        time.sleep(DRAIN_S)
        mpi = sys.modules.get("mpi4py.MPI")
        usable = True
        if mpi is not None:
            with contextlib.suppress(Exception):
                usable = bool(mpi.Is_initialized()) and not mpi.Is_finalized()
        if usable:
            with contextlib.suppress(Exception):
                comm.Abort(exitcode)
    os._exit(exitcode)


class ExitGuard:
    """An armed :func:`exit_guard`; :meth:`cancel` disarms it."""

    def __init__(self, seconds: float, reason: str, comm: Any, exitcode: int,
                 backstop_s: float | None) -> None:
        self.seconds = seconds
        self.reason = reason
        self._comm = comm
        self._exitcode = exitcode
        self._cancelled = threading.Event()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.name = "hvdlite-exit-guard"
        self._watchdog: subprocess.Popen[bytes] | None = None
        if backstop_s is not None:
            self._watchdog = self._start_watchdog(seconds + backstop_s)
            if self._watchdog is not None and self._watchdog.stdin is not None:
                ending.tell_on_announce(self._watchdog.stdin)  # it then prints nothing
        self._timer.start()

    @property
    def armed(self) -> bool:
        """True until cancelled (or fired)."""
        return not self._cancelled.is_set()

    def _start_watchdog(self, after_s: float) -> subprocess.Popen[bytes] | None:
        line = ending.rank_line(f"{self.reason} (process ended by hvdlite's exit guard after "
                                f"{after_s:g} s)", self._comm)
        try:
            return subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), repr(after_s),
                 line, repr(_TERM_GRACE_S)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
        except OSError:
            return None

    def _fire(self) -> None:
        if self._cancelled.is_set():
            return
        if self._comm is not None:
            abort_job(self._comm, self.reason, self._exitcode)
        ending.exit_now(self.reason, self._exitcode, report=True)

    def cancel(self) -> None:
        """Disarm: the timer stops and the watchdog process ends. Idempotent."""
        self._cancelled.set()
        self._timer.cancel()
        proc, self._watchdog = self._watchdog, None
        if proc is not None:
            if proc.stdin is not None:
                ending.forget_pipe(proc.stdin)
                with contextlib.suppress(OSError, ValueError):
                    proc.stdin.close()  # EOF: the watchdog exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)


def exit_guard(seconds: float, reason: str, *, comm: Any = None, exitcode: int = 1,
               backstop_s: float | None = BACKSTOP_S) -> ExitGuard:
    """Make sure this process is gone ``seconds`` from now unless the guard is cancelled.

    After ``seconds``: with ``comm``, :func:`abort_job` (the whole job ends); without,
    the reason is printed once and the process exits with ``exitcode``. Unless ``backstop_s``
    is None, a watchdog process also ends this process (SIGTERM, then SIGKILL 1 s later) if it
    is still there ``backstop_s`` after the bound: that covers an exit stuck in
    ``MPI_Finalize``, where no Python thread runs any more (arming the guard from ``atexit``,
    ``backstop_s=0`` makes the bound exact). Returns the :class:`ExitGuard`; ``cancel()``
    disarms it.
    """
    if seconds <= 0 or (backstop_s is not None and backstop_s < 0):
        raise ValueError(f"exit_guard needs seconds > 0 and backstop_s >= 0, got {seconds} "
                         f"and {backstop_s}")
    return ExitGuard(seconds, reason, comm, exitcode, backstop_s)
