"""The timeline's signal hook: every queued event reaches the file before a SIGTERM (or
SIGINT) takes effect.

A writer made on the main thread hooks SIGTERM (and SIGINT when its handler is not Python's
default ``KeyboardInterrupt`` one, which already ends through ``atexit``): the hook writes every
queued event of every open timeline, then hands the signal on to the handler that was there
before (a user's handler runs as before; ``SIG_DFL``: every timeline is closed and the signal
is re-raised with its default action, so the process still dies by it). A handler installed
later replaces the hook and is never overwritten; when the last timeline closes, the hook gives
the signal back only if it is still the installed handler.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any, Protocol

__all__ = ["LIVE", "HOOKED", "hook", "unhook"]

_SIGNAL_FLUSH_S = 5.0  # the signal hook waits this long at most for a writer


class Flushable(Protocol):
    """What the hook uses of an open timeline."""

    def flush(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float | None = None) -> None: ...



LIVE: set[Flushable] = set()  # open timelines of this process
HOOKED: dict[int, Any] = {}  # signal -> the handler the hook hands it on to
_in_hook: set[int] = set()


def hook() -> None:
    """Hook SIGTERM, and SIGINT unless Python's KeyboardInterrupt handler has it (that one ends
    through ``atexit``, which closes the timeline). Main thread only; never over a handler
    installed from C (``getsignal`` is None: nothing to chain to) or one that ignores it."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        if sig in HOOKED:
            continue  # the hook is installed, or a later handler replaced it: leave that one
        current = signal.getsignal(sig)
        if current is None or current == signal.SIG_IGN or current is signal.default_int_handler:
            continue
        signal.signal(sig, _on_signal)
        HOOKED[sig] = current


def unhook() -> None:
    """Give each hooked signal back to its previous handler, if the hook is still installed."""
    if threading.current_thread() is not threading.main_thread():
        return  # the hook stays; with no open timeline it only hands signals on
    for sig, previous in list(HOOKED.items()):
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, previous)
            del HOOKED[sig]


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Write every open timeline's queue, then let the previous handler have the signal."""
    previous = HOOKED.get(signum, signal.SIG_DFL)
    if signum in _in_hook:  # a later handler chained back to us: act as the default
        previous = signal.SIG_DFL
    for tl in list(LIVE):
        tl.flush(_SIGNAL_FLUSH_S)
    if callable(previous):
        _in_hook.add(signum)
        try:
            previous(signum, frame)
        finally:
            _in_hook.discard(signum)
        return
    if previous == signal.SIG_IGN:
        return
    # The default action: the process ends by this signal, with every timeline closed.
    for tl in list(LIVE):
        tl.close(_SIGNAL_FLUSH_S)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
