"""Inside a rank started by ``hvdliterun``: the thread that ends the rank when the job is over.

The rank wrapper (:mod:`hvdlite.launcher.rankwrap`) holds the rank's connection to the launcher's
monitor (:mod:`hvdlite.launcher.monitor`). When the launcher orders the job to end (a host was
lost) or the wrapper loses the launcher (this host is cut off), the wrapper writes one line,
``{"t": "abort", "reason": ..., "code": ...}``, to a socket it handed to the rank
(``HVDLITE_WATCHDOG_FD``). This module's thread waits on that socket, apart from hvdlite's
cycles: a rank blocked inside MPI (a negotiation or a collective that waits for a peer that is
gone) releases the GIL there, so the thread still runs. It prints the reason once, closes the
timeline (the survivors' traces are kept), flushes stdio and ends the process with
``os._exit(code)``, without MPI, which may never return. It does the same when the socket
closes while the rank runs: the wrapper was killed (the MPI launcher ends a failed job by
killing the wrappers; without this, a rank blocked in MPI would lose its trace to the guard's
SIGKILL).

Where the rank does not use hvdlite (or is stuck holding the GIL), the wrapper escalates to
SIGTERM, then SIGKILL.

The same socket carries the rank's side of the launcher <-> rank channel: :func:`send` a
message to the launcher's monitor, :func:`subscribe` to the launcher's other messages (the
hook for launcher-side control such as elastic training). Importing this module has no side
effects.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from hvdlite._rankside import ending
from hvdlite._rankside.protocol import RESERVED_TYPES, WATCHDOG_FD_ENV
from hvdlite._threads import start_quietly

__all__ = ["FD_ENV", "send", "start", "subscribe"]

FD_ENV = WATCHDOG_FD_ENV
log = logging.getLogger("hvdlite")

_lock = threading.Lock()
_thread: threading.Thread | None = None
_subscribers: list[Callable[[dict[str, Any]], None]] = []


def start() -> bool:
    """Start the watchdog thread once per process (later calls do nothing). A rank it ends
    writes every open timeline first (:func:`hvdlite._rankside.ending.close_timelines`).

    Returns True if the process has a watchdog channel (started under ``hvdliterun``), False
    otherwise (then nothing is started). Never blocks; any thread.
    """
    global _thread
    with _lock:
        if _thread is not None:
            return True
        text = os.environ.get(FD_ENV, "")
        if not text.isdigit():
            return False
        fd = int(text)
        try:
            os.fstat(fd)
            os.set_inheritable(fd, False)  # not for the rank's own subprocesses
        except OSError:
            return False
        _thread = threading.Thread(target=_watch, args=(fd,), name="hvdlite-watchdog",
                                   daemon=True)
        start_quietly(_thread)
        return True


def subscribe(callback: Callable[[dict[str, Any]], None]) -> None:
    """Call ``callback(message)`` for every message from the launcher other than ``abort``
    (sent by ``Monitor.send`` / ``broadcast``), on the watchdog thread: keep it short. The
    thread runs once :func:`start` was called (``hvdlite.init`` does). Any thread."""
    with _lock:
        _subscribers.append(callback)


def send(message: dict[str, Any]) -> bool:
    """Send ``message`` (a dict with a string ``"t"``, JSON-serialisable) to the launcher's
    monitor, through the rank wrapper; it arrives as an ``Event`` of kind ``message``. False
    when the process was not started by ``hvdliterun`` or the wrapper is gone. Any thread;
    never blocks for long (one small write to a local socket).

    Raises ValueError for a type of the channel's own (``exit``, ``abort``, ``hello``,
    ``beat``, ``orphaned``, ``failing``): those are hvdlite's, and the wrapper would drop them.
    """
    kind = message.get("t")
    if isinstance(kind, str) and kind in RESERVED_TYPES:
        raise ValueError(f"watchdog.send: message type {kind!r} is reserved for hvdlite's own "
                         f"channel ({', '.join(sorted(RESERVED_TYPES))}); give the message "
                         "another \"t\"")
    text = os.environ.get(FD_ENV, "")
    if not text.isdigit() or not isinstance(kind, str):
        return False
    try:
        os.write(int(text), json.dumps(message).encode() + b"\n")
    except OSError:
        return False
    return True


def _watch(fd: int) -> None:
    buf = b""
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            # The wrapper closes its end only after this process ended: it was killed (the MPI
            # launcher ends a failed job that way), and the guard's SIGKILL follows.
            _end("the rank wrapper was killed: the MPI launcher is ending the job", 1)
        buf += data
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            try:
                msg = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if not isinstance(msg, dict):
                continue
            if msg.get("t") == "abort":
                code = msg.get("code", 1)
                _end(str(msg.get("reason", "the launcher ended the job")),
                     code if isinstance(code, int) and not isinstance(code, bool) else 1)
            with _lock:
                callbacks = list(_subscribers)
            for callback in callbacks:
                try:
                    callback(msg)
                except Exception:  # a subscriber's bug must not stop the watchdog
                    log.exception("hvdlite: a launcher message subscriber failed")


def _end(reason: str, code: int) -> NoReturn:
    # No failure report: the launcher ordered this end, or its wrapper is gone.
    ending.exit_now(f"{reason}; this rank ends now (its timeline is written)", code)
