"""Telling the other ranks that this rank's background loop failed.

Every rank keeps one receive posted on the control communicator for a failure message from
any rank. A rank whose loop fails sends its error to every peer; the peers notice it while
they poll their own collectives (negotiation and host data plane) and fail with it, instead
of waiting forever for a rank that will never arrive.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from mpi4py import MPI

from hvdlite.errors import HvdliteError

__all__ = ["FailureChannel"]

log = logging.getLogger("hvdlite")

_TAG = 7_001  # only hvdlite's private communicator carries it
_MAX_BYTES = 4096
_SEND_WAIT_S = 5.0
_GRACE_S = 2.0  # how long an interrupt waits for its round to complete


class FailureChannel:
    """The posted receive, its check, and the announcement of a local failure."""

    def __init__(self, comm: MPI.Intracomm, generation: int) -> None:
        self.comm = comm
        # Notices carry the engine's generation (agreed at init): one left unmatched when an
        # earlier engine failed everywhere at once must not fail a later engine.
        self.generation = generation
        self._buf = np.zeros(_MAX_BYTES, dtype=np.uint8)
        self._status = MPI.Status()
        self._req = comm.Irecv([self._buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=_TAG)
        self._error: HvdliteError | None = None
        # An exception a signal handler raised in a waiting caller while it waited inside a
        # round (KeyboardInterrupt, a test timeout's alarm): kept until the round is complete,
        # then raised to the caller, so the engine and the peers' rounds stay intact.
        self._deferred: BaseException | None = None
        self._deferred_at = 0.0
        self.last_raised: BaseException | None = None  # a deferred interrupt given up on

    def defer(self, exc: BaseException) -> None:
        if self._deferred is None:
            self._deferred = exc
            self._deferred_at = time.monotonic()

    def take_deferred(self) -> BaseException | None:
        exc, self._deferred = self._deferred, None
        return exc

    def check(self) -> None:
        """Raise the failure a peer announced, if any (cheap: one MPI_Test); and a deferred
        interrupt whose round has not completed within the grace (the peers are not coming:
        the interrupt then ends the wait the hard way, as a failure of this rank's engine)."""
        while self._error is None and self._req.Test(self._status):
            self._received()
        if self._error is not None:
            raise self._error
        if self._deferred is not None and time.monotonic() - self._deferred_at > _GRACE_S:
            exc, self._deferred = self._deferred, None
            self.last_raised = exc
            raise exc

    def wait(self, req: MPI.Request) -> None:
        """Block (GIL released, inside MPI) until ``req`` completes or a peer's failure
        notice arrives, which is raised. One GIL hand-off per wait, where polling from Python
        pays one per poll (each costing up to a switch interval while the training thread is
        busy in Python)."""
        if self._error is not None:
            raise self._error
        while MPI.Request.Waitany([req, self._req], self._status) == 1:
            self._received()
            if self._error is not None:
                raise self._error

    def _received(self) -> None:
        count = self._status.Get_count(MPI.BYTE)
        generation, _, text = self._buf[:count].tobytes().decode("utf-8", "replace").partition(
            ":")
        if generation != str(self.generation):  # a stale notice: listen again
            self._req = self.comm.Irecv([self._buf, MPI.BYTE], source=MPI.ANY_SOURCE,
                                        tag=_TAG)
            return
        self._error = HvdliteError(
            f"rank {self._status.Get_source()} failed, so this rank stopped too: {text}")

    def announce(self, message: str) -> None:
        """Send ``message`` to every other rank; wait a little for the sends to leave."""
        wire = f"{self.generation}:{message}".encode()[:_MAX_BYTES]
        data = np.frombuffer(wire, dtype=np.uint8).copy()
        me = self.comm.Get_rank()
        reqs = [self.comm.Isend([data, MPI.BYTE], dest=r, tag=_TAG)
                for r in range(self.comm.Get_size()) if r != me]
        deadline = time.monotonic() + _SEND_WAIT_S
        while reqs and not MPI.Request.Testall(reqs):
            if time.monotonic() > deadline:
                log.error("hvdlite: some ranks did not take the failure notice")
                return
            time.sleep(1e-3)

    def close(self) -> None:
        if self._req != MPI.REQUEST_NULL and not self._req.Test():
            self._req.Cancel()
            self._req.Wait()
