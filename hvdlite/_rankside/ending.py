"""How a rank ends on its own, without MPI: the reason said once, the launcher told, stdio
flushed, ``os._exit``.

The pieces every way of ending a rank shares: the launcher's order to end it
(:mod:`hvdlite._rankside.watchdog`), and a job that cannot go on (:mod:`hvdlite._exit`:
``abort_job`` and ``exit_guard`` add MPI's abort and a time bound on top of these).

- :func:`announce` prints ``[hvdlite rank N] <reason>`` on stderr, once per process however
  many threads and paths get there; a pipe handed to :func:`tell_on_announce` gets ``b"a"``
  when it happens (an exit guard's watchdog process, which then does not print it again).
- :func:`report_to_launcher` leaves the rank's failure report where ``hvdliterun`` reads it.
- :func:`close_timelines` writes every timeline of the process before it ends.
- :func:`exit_now` is the whole sequence: say why, close the timelines, flush, ``os._exit``.

Importing this module has no side effects and does not import MPI.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import IO, Any, NoReturn

from hvdlite._observe import signals
from hvdlite._rankside import protocol

__all__ = [
    "TIMELINE_CLOSE_S",
    "announce",
    "close_timelines",
    "exit_now",
    "flush_stdio",
    "forget_pipe",
    "rank_line",
    "report_to_launcher",
    "tell_on_announce",
]

# Longest wait for the timeline writer before the process ends; below the rank wrapper's
# ABORT_GRACE_S (4 s), after which it SIGTERMs a rank still there. A writer cut off by this
# wait leaves a trace without trace_end, as one survivor's was in a full run on a loaded
# 2-core machine (whether by this wait was not shown); a writer done sooner ends the rank
# sooner.
TIMELINE_CLOSE_S = 3.0

_lock = threading.Lock()
_announced = False
_pipes: list[IO[bytes]] = []


def rank_line(reason: str, comm: Any = None) -> str:
    """``[hvdlite rank N] <reason>`` with the reason on one line. The rank is this process's
    in ``comm``; else in the MPI job (if MPI is up); else from the launcher's environment;
    else ``?``."""
    rank = None
    if comm is not None:
        with contextlib.suppress(Exception):
            rank = str(comm.Get_rank())
    mpi = sys.modules.get("mpi4py.MPI")
    if rank is None and mpi is not None:
        with contextlib.suppress(Exception):
            if mpi.Is_initialized() and not mpi.Is_finalized():
                rank = str(mpi.COMM_WORLD.Get_rank())
    if rank is None:
        from_env = protocol.rank_from_env()
        rank = "?" if from_env is None else str(from_env)
    return f"[hvdlite rank {rank}] {' '.join(reason.split())}"


def _tell(pipe: IO[bytes]) -> None:
    with contextlib.suppress(OSError, ValueError):
        pipe.write(b"a")
        pipe.flush()


def tell_on_announce(pipe: IO[bytes]) -> None:
    """Write ``b"a"`` to ``pipe`` when :func:`announce` prints its line (at once if it did
    already), until :func:`forget_pipe`. Any thread."""
    with _lock:
        _pipes.append(pipe)
        announced = _announced
    if announced:
        _tell(pipe)


def forget_pipe(pipe: IO[bytes]) -> None:
    """Stop telling ``pipe`` (see :func:`tell_on_announce`); a pipe not known is ignored."""
    with _lock:
        if pipe in _pipes:
            _pipes.remove(pipe)


def announce(reason: str, comm: Any = None) -> bool:
    """Print ``[hvdlite rank N] <reason>`` (one line) to the process's stderr (and to
    ``sys.stderr`` as well where it was replaced), once per process.

    Returns True if this call printed it, False if a line was already printed (by any thread,
    for any reason): a job that is ending says why once, not once per path that noticed.
    """
    global _announced
    with _lock:
        if _announced:
            return False
        _announced = True
        pipes = list(_pipes)
    line = rank_line(reason, comm) + "\n"
    # The process's stderr always (the launcher reads it), and sys.stderr too where it was
    # replaced: a job that ends right after must not leave its reason in a buffer (as
    # torch.distributed's excepthook holds sys.stderr while it runs the hook before it).
    for stream in dict.fromkeys((sys.__stderr__, sys.stderr)):
        if stream is None:  # no Python stderr: the file descriptor, if open
            with contextlib.suppress(OSError):
                os.write(2, line.encode())
            continue
        try:
            stream.write(line)
            stream.flush()
        except Exception:  # a closed or broken stderr: the file descriptor may still work
            if stream is sys.__stderr__:
                with contextlib.suppress(OSError):
                    os.write(2, line.encode())
    for pipe in pipes:
        _tell(pipe)
    return True


def flush_stdio() -> None:
    """Flush Python's stdout and stderr (the replaced ones and the originals), ignoring errors:
    ``os._exit`` does not flush them."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def report_to_launcher(exitcode: int) -> None:
    """Under ``hvdliterun``, leave the rank's failure report now: the MPI launcher may kill the
    rank wrapper (which would write it) before it sees this process end. Outside it, nothing."""
    if os.environ.get(protocol.REPORT_DIR_ENV):
        with contextlib.suppress(Exception):
            protocol.write_report(protocol.rank_from_env(), exitcode, signalled=False)
    # And through the rank wrapper to hvdliterun's monitor (any host): the MPI launcher may
    # kill the wrapper before it sees this process end, which would look like a lost host.
    fd = os.environ.get(protocol.WATCHDOG_FD_ENV, "")
    if fd.isdigit():
        with contextlib.suppress(OSError):
            os.write(int(fd), json.dumps({"t": "failing", "code": exitcode}).encode() + b"\n")


def close_timelines() -> None:
    """Close every timeline of this process still open (every one registers itself in
    :data:`hvdlite._observe.signals.LIVE` until its close is done), waiting at most
    ``TIMELINE_CLOSE_S`` in all for their writers. Any thread; errors are ignored.

    All of them, not the one a caller holds: ``shutdown()`` detaches the engine's timeline
    before closing it, and a rank ended meanwhile (its wrapper killed as a peer failed) once
    found none to wait for, so its ``os._exit`` cut the writer off halfway through that close
    (the trace lost its last thousand events and ``trace_end``).
    """
    deadline = time.monotonic() + TIMELINE_CLOSE_S
    for tl in list(signals.LIVE):
        with contextlib.suppress(Exception):
            tl.close(max(0.0, deadline - time.monotonic()))


def exit_now(reason: str, exitcode: int, *, report: bool = False) -> NoReturn:
    """End this process now, without MPI: :func:`announce` ``reason``,
    :func:`close_timelines`, with ``report`` also :func:`report_to_launcher`, flush stdio,
    ``os._exit(exitcode)``. Any thread."""
    announce(reason)
    close_timelines()
    if report:
        report_to_launcher(exitcode)
    flush_stdio()
    os._exit(exitcode)
