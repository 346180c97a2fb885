"""hvdlite's own threads leave asynchronous signals to the threads that can act on them.

A signal sent to a process (Ctrl-C's SIGINT, a launcher's or a batch system's SIGTERM) is
delivered to any one of its threads that does not block it. CPython runs Python handlers on
the main thread only; when the signal lands on another thread, the main thread learns of it at
its next bytecode, and if it is blocked in a sleep or a wait that the signal did not
interrupt, the handler waits that long: a SIGTERM taken by the timeline's writer thread waited
out the main thread's 60 s sleep (seen in tests/unit/test_timeline.py). So hvdlite's own
service threads block these signals from their first instruction (each inherits the mask its
starter holds while starting it), and the kernel hands them to a thread that can run the
handler now. Synchronous signals (SIGSEGV, SIGFPE, SIGBUS, SIGILL, SIGABRT) and SIGPIPE, which
go to the thread that caused them, are never blocked.

Only threads that run no user code and start no process: a process started from a thread
inherits that thread's mask, so a child of a quiet thread could not be stopped by SIGTERM or
SIGINT. The background thread, the timeline writer, the rank's watchdog and the launcher's
output pumps and relay are quiet; the callbacks thread (``Handle.then``: user code) and the
launcher's monitor, agent and ssh threads (their callbacks start processes) are not.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["ASYNC_SIGNALS", "start_quietly"]

#: The signals hvdlite's threads block: those a program handles, or dies of, asynchronously.
ASYNC_SIGNALS: frozenset[int] = frozenset(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1",
                                       "SIGUSR2", "SIGALRM", "SIGCHLD", "SIGXCPU")
    if hasattr(signal, name))


def start_quietly(thread: threading.Thread) -> threading.Thread:
    """Start ``thread`` with :data:`ASYNC_SIGNALS` blocked in it for its whole life (see the
    module docstring) and return it. The caller's own mask is as before once this returns; a
    signal arriving meanwhile stays pending and is delivered then. Where the platform has no
    ``pthread_sigmask`` the thread is started as it is. Thread-safe."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:
        thread.start()
        return thread
    before = mask(signal.SIG_BLOCK, ASYNC_SIGNALS)
    try:
        thread.start()
    finally:
        mask(signal.SIG_SETMASK, before)
    return thread
