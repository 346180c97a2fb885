"""Signals held while a caller runs cycles on the main thread (the interrupted-wait race): a
Python signal handler that raises halfway through a cycle would leave the cycle half done and
stop the engine on every rank, so during a wait (``Scheduler.progress``) and during a blocking
call's immediate cycle (``_control/immediate.py``) the user's handlers only note their signal
and run between cycles (:class:`HeldSignals`, :func:`hold_signals`)."""

from __future__ import annotations

import _signal
import signal
import threading
from typing import Any

__all__ = ["HeldSignals", "hold_signals"]

_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident
_getsignal = _signal.getsignal
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


_HELD_NUMBERS = tuple(int(sig) for sig in _HELD_SIGNALS)  # getsignal converts no enum: cheaper
_ALRM, _TERM, _INT, _USR1, _USR2, _HUP = _HELD_NUMBERS
# The handlers of _HELD_SIGNALS last seen to need no holding (none of the user's): while they
# are the same objects, hold_signals costs six getsignal calls (about 0.2 us in all).
_unheld: tuple[Any, ...] = ()


def hold_signals() -> HeldSignals | None:
    """Hold the user's handlers for a cycle on this thread (:meth:`HeldSignals.hold`): the
    holder, to :meth:`~HeldSignals.release` and :meth:`~HeldSignals.deliver` after the cycle,
    or None where there is nothing to hold (off the main thread, or no user handler set: the
    common case, kept to well under a microsecond for the immediate path of a blocking call)."""
    global _unheld
    if _get_ident() != _MAIN_THREAD:
        return None
    seen = _unheld
    # Unrolled identity checks: less than half the cost of building and comparing a tuple.
    if (seen and _getsignal(_ALRM) is seen[0] and _getsignal(_TERM) is seen[1]
            and _getsignal(_INT) is seen[2] and _getsignal(_USR1) is seen[3]
            and _getsignal(_USR2) is seen[4] and _getsignal(_HUP) is seen[5]):
        return None
    handlers = tuple(map(_getsignal, _HELD_NUMBERS))
    held = HeldSignals()
    held.hold()
    if not held.saved:
        _unheld = handlers
        return None
    return held
