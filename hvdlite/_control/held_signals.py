"""Signals held while a waiting caller runs cycles on the main thread (the interrupted-wait
race): a Python signal handler that raises halfway through a cycle would leave the cycle half
done and stop the engine on every rank, so during a wait the user's handlers only note their
signal and run between cycles (:class:`HeldSignals`)."""

from __future__ import annotations

import _signal
import signal
import threading
from typing import Any

__all__ = ["HeldSignals"]

_MAIN_THREAD = threading.main_thread().ident
# Signals whose user handlers wait while the main thread runs cycles as a waiting caller.
_HELD_SIGNALS = (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2,
                 signal.SIGHUP)


class HeldSignals:
    """While a waiting caller on the main thread (where Python runs signal handlers) runs its
    cycles (:meth:`hold` to :meth:`release`), the user's Python handlers of
    ``_HELD_SIGNALS`` only note their signal, and :meth:`deliver` (after each cycle) runs them
    for the noted signals, on this thread. An exception a handler raises (an alarm, a user's
    SIGINT handler) then reaches the caller between cycles, never halfway through one, where
    it would leave the cycle half done and stop the engine on every rank. Python's own
    ``default_int_handler`` (Ctrl-C) is left alone: inside an MPI wait its KeyboardInterrupt
    is deferred to the end of the round (``FailureChannel.defer``); elsewhere it stops the
    engine, as a Ctrl-C may. Off the main thread (no handler runs there) it does nothing."""

    __slots__ = ("noted", "saved")

    def __init__(self) -> None:
        self.saved: list[tuple[int, Any]] = []
        self.noted: list[tuple[int, Any]] = []

    def hold(self) -> None:
        """Replace the user handlers by the note-taker (main thread only)."""
        if threading.get_ident() != _MAIN_THREAD:
            return
        for sig in _HELD_SIGNALS:
            handler = _signal.getsignal(sig)  # the C function: no enum for SIG_DFL (cheap)
            if callable(handler) and handler is not signal.default_int_handler:
                self.saved.append((sig, handler))
                _signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.noted.append((signum, frame))

    def deliver(self) -> None:
        """Run the handlers of the signals noted so far (each may raise)."""
        if self.noted:
            handlers = dict(self.saved)
            noted, self.noted = self.noted, []
            for signum, frame in noted:
                handlers[signum](signum, frame)

    def release(self) -> None:
        """Put the user handlers back (a signal that comes meanwhile was noted for
        :meth:`deliver`, or runs its own handler once that is back)."""
        done = 0
        try:
            for sig, handler in self.saved:
                _signal.signal(sig, handler)
                done += 1
        finally:
            for sig, handler in self.saved[done:]:  # a handler raised while putting them back
                _signal.signal(sig, handler)
