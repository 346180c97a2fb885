"""An elastic world's output, less MPICH's alarms about a world the driver ends on purpose.

In an elastic job a rank that ends its world (killed, failed, or leaving for new hosts) is
followed by the next world, not by a failed job, and the driver says what happened in one line
of its own. MPICH's Hydra still prints, as the world is torn down, the "BAD TERMINATION"
banner on stdout (:class:`BannerFilter`: always left out of an elastic world) and a few lines
of its process manager's teardown on stderr (``[proxy:1@host] ...: assert (!closed) failed``,
``[mpiexec@host] main (...): process manager error waiting for completion``, ssh's
``Connection to HOST closed by remote host.``; :class:`NoiseFilter`: held back, and printed
only where the driver could not say why the world ended). Importing this module has no side
effects.
"""

from __future__ import annotations

import os
import re
import threading
from typing import IO

from hvdlite._threads import start_quietly

__all__ = ["TEARDOWN_NOISE", "BannerFilter", "NoiseFilter"]

# What Hydra's mpiexec and proxies print when a world's rank or proxy goes away under them
# (MPICH 4-5): "[mpiexec@host] FUNCTION (FILE:LINE): MESSAGE" with one of these messages.
_HYDRA_MESSAGES = (
    "assert (!closed) failed",
    "callback returned error status",
    "demux engine error waiting for event",
    "error waiting for event",
    "one of the processes terminated badly; aborting",
    "launcher returned error waiting for completion",
    "process manager error waiting for completion",
    "write error (Bad file descriptor)",
    "write error (Broken pipe)",
    "write error (Connection reset by peer)",
    "sock write error",
    "unable to write data to proxy",
    "unable to send signal downstream",
)
# Hydra writes a line's tag and its message apart, so two processes' lines can interleave:
# "[proxy:1@vm] [mpiexec@vm] HYDT_... (...): one of the processes ...", then the proxy's own
# message bare, or a tag alone. Such lines count as the teardown they are made of.
_TAG = rb"\[(?:mpiexec|proxy:[^@\]]*)@[^\]]*\]"
_MESSAGE = (rb"\w+ \([^)]*\): (?:" + b"|".join(re.escape(m.encode()) for m in _HYDRA_MESSAGES)
            + rb")")
TEARDOWN_NOISE = re.compile(
    rb"^(?:(?:" + _TAG + rb" ?)+(?:" + _MESSAGE + rb")?|" + _MESSAGE
    + rb"|Connection to \S+ closed by remote host\.)\s*$")
_PREFIXES = (b"[mpiexec@", b"[proxy:", b"Connection to ")


class BannerFilter:
    """Copies the MPI launcher's stdout to ours, less MPICH's "BAD TERMINATION" banner: in an
    elastic job a rank that ends its world is followed by the next world, not a failed job
    (the driver says what happened in one line of its own)."""

    RULE = b"=" * 20

    def __init__(self, source: IO[bytes], sink: IO[bytes]) -> None:
        self.source, self.sink = source, sink
        self.buf = b""
        self.partial = False  # part of the current line went out already
        self.blank = False  # a blank line held back: it may open a banner
        self.banner = 0  # lines left in the banner (0: not in one)
        self.thread = threading.Thread(target=self._run, name="hvdliterun-banner",
                                       daemon=True)
        start_quietly(self.thread)

    def _write(self, data: bytes) -> None:
        try:
            self.sink.write(data)
            self.sink.flush()
        except (OSError, ValueError):
            pass

    def _line(self, line: bytes) -> None:
        if self.partial:
            self.partial = False
            self._write(line + b"\n")
        elif self.banner:
            self.banner -= 1
            if line.startswith(b"Please see the FAQ"):
                self.banner = 0
        elif line.startswith(self.RULE):
            self.banner, self.blank = 12, False
        elif not line.strip():
            if self.blank:
                self._write(b"\n")
            self.blank = True
        else:
            if self.blank:
                self._write(b"\n")
            self.blank = False
            self._write(line + b"\n")

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.source.fileno(), 65536)
            except OSError:
                data = b""
            if not data:
                break
            *lines, self.buf = (self.buf + data).split(b"\n")
            for line in lines:
                self._line(line)
            if self.buf and not self.banner and (self.partial or not self.buf.startswith(b"=")):
                if self.blank and not self.partial:
                    self._write(b"\n")
                    self.blank = False
                self._write(self.buf)
                self.partial, self.buf = True, b""
        if self.buf and not self.banner:
            self._write(self.buf)

    def join(self, timeout: float = 2.0) -> None:
        """Wait for the MPI launcher's stdout to be copied out (it closed)."""
        self.thread.join(timeout)


class NoiseFilter:
    """Copies the MPI launcher's stderr to ours line by line, holding back the lines of
    ``TEARDOWN_NOISE``; :meth:`finish` prints them (``keep``) or drops them (the driver ended
    the world on purpose, or knows why it ended, and says so in one line of its own)."""

    def __init__(self, source: IO[bytes], sink: IO[bytes]) -> None:
        self.source, self.sink = source, sink
        self.held: list[bytes] = []
        self.thread = threading.Thread(target=self._run, name="hvdliterun-noise", daemon=True)
        start_quietly(self.thread)

    def _write(self, data: bytes) -> None:
        try:
            self.sink.write(data)
            self.sink.flush()
        except (OSError, ValueError):
            pass

    def _run(self) -> None:
        buf = b""
        while True:
            try:
                data = os.read(self.source.fileno(), 65536)
            except OSError:
                data = b""
            if not data:
                break
            *lines, buf = (buf + data).split(b"\n")
            out = []
            for line in lines:
                if TEARDOWN_NOISE.match(line):
                    self.held.append(line + b"\n")
                else:
                    out.append(line + b"\n")
            if buf and not any(buf.startswith(p) or p.startswith(buf) for p in _PREFIXES):
                out.append(buf)  # a partial line that is no Hydra or ssh line: now
                buf = b""
            if out:
                self._write(b"".join(out))
        if buf:
            self._write(buf)

    def finish(self, keep: bool, timeout: float = 2.0) -> None:
        """Wait for the MPI launcher's stderr to be copied out (it closed); then print the
        held lines if ``keep``, else drop them."""
        self.thread.join(timeout)
        held, self.held = self.held, []
        if keep and held:
            self._write(b"".join(held))
