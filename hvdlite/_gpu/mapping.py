"""Peers' allocations mapped into this process through CUDA IPC, opened once and kept bounded.

A CUDA IPC handle names the *base* of an allocation (``cudaMalloc``'s block), never a pointer
inside it, so :class:`PeerMappings` opens each (peer, handle) once (the driver counts a second
open of a handle in one context and returns the same base; each open needs its close), hands
out ``base + offset`` for any offset, and keeps at most
``capacity`` unpinned mappings open, closing the least recently used one beyond that. The
communicator's staging slots and semaphore inboxes are pinned (open until :meth:`close_all`);
buffers registered per call (bucket views, fusion buffers) are the unpinned ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

__all__ = ["PeerMappings"]


class PeerMappings:
    """(peer, handle) -> base pointer in this process, LRU-bounded for the unpinned ones.

    ``open_fn(handle)`` maps an allocation and returns its base; ``close_fn(base)`` unmaps it.
    An evicted mapping is closed at once, so a caller whose device work may still read one
    must pin it, or use it again (which makes it the newest) before others push it out.
    """

    def __init__(self, open_fn: Callable[[bytes], int], close_fn: Callable[[int], None],
                 capacity: int) -> None:
        if capacity < 1:  # (0 would close a mapping before its caller could use it)
            raise ValueError(f"PeerMappings capacity must be >= 1, got {capacity}")
        self._open, self._close = open_fn, close_fn
        self.capacity = capacity
        self._lru: OrderedDict[tuple[int, bytes], int] = OrderedDict()  # unpinned, oldest first
        self._pinned: dict[tuple[int, bytes], int] = {}
        self.opens = 0  # handles opened so far (each (peer, handle) once while it is kept)

    def get(self, peer: int, handle: bytes, offset: int = 0, pinned: bool = False) -> int:
        """The address of ``offset`` bytes into ``peer``'s allocation named by ``handle``,
        mapping it on first use; ``pinned`` keeps it out of the bound until close_all."""
        if offset < 0:
            raise ValueError(f"an offset into a peer's allocation must be >= 0, got {offset}")
        key = (peer, bytes(handle))
        base = self._pinned.get(key)
        if base is None:
            base = self._lru.pop(key, None)
            if base is None:
                base = self._open(key[1])
                self.opens += 1
            if pinned:
                self._pinned[key] = base
            else:
                self._lru[key] = base
                while len(self._lru) > self.capacity:
                    _, old = self._lru.popitem(last=False)
                    self._close(old)
        return base + offset

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def close_all(self) -> None:
        """Unmap every allocation (pinned ones included)."""
        for table in (self._lru, self._pinned):
            while table:
                _, base = table.popitem()
                self._close(base)
