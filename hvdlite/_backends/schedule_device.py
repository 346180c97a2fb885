"""What every device transport of an agreed schedule (NCCL, CUDA IPC) does around its own
work: slot ``i`` runs on the transport's own stream, forked from the producer's stream at a
READY event and joined back at a DONE event; at close, a bounded wait for that stream to go
idle. Importing this module has no side effects (CuPy comes in through the caller).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["CLOSE_WAIT_S", "DeviceSlots"]

CLOSE_WAIT_S = 5.0  # longest wait at close for the schedule's stream to go idle


class DeviceSlots:
    """The stream (``priority``) and the READY and DONE events of ``n`` slots on
    ``device_id``; :meth:`done` and :meth:`order` are the schedule contract's (no host wait,
    no allocation per launch). Not thread-safe: a schedule launches from one thread."""

    def __init__(self, cupy: Any, device_id: int, n: int, priority: int) -> None:
        cuda = cupy.cuda
        with cuda.Device(device_id):
            self.stream = cuda.Stream(non_blocking=True, priority=priority)
            self._ready = [cuda.Event(block=False, disable_timing=True) for _ in range(n)]
            self._done = [cuda.Event(block=False, disable_timing=True) for _ in range(n)]
        self.sptr: int = self.stream.ptr

    def fork(self, i: int, stream: Any) -> None:
        """Slot ``i``'s work on :attr:`stream` starts after the work now on ``stream``."""
        ready = self._ready[i]
        ready.record(stream)
        self.stream.wait_event(ready)

    def join(self, i: int) -> None:
        """Slot ``i``'s launch ends here (what :meth:`done` and :meth:`order` see)."""
        self._done[i].record(self.stream)

    def done(self, i: int) -> bool:
        return bool(self._done[i].done)

    def order(self, i: int, stream: Any) -> None:
        stream.wait_event(self._done[i])

    def idle(self, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Whether the stream went idle within ``wait_s`` (a launch that can never complete,
        such as one a peer never matched, must not hang a shutdown: the caller then aborts)."""
        deadline = time.monotonic() + wait_s
        while not self.stream.done and time.monotonic() < deadline:
            time.sleep(1e-3)
        return bool(self.stream.done)
