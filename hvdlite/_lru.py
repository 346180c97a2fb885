"""Bounded tables: what hvdlite keeps per tensor name (or per agreed plan) between calls.

Every such table follows one knob, ``cache_capacity`` (Horovod's ``HOROVOD_CACHE_CAPACITY``):
at most that many entries, the least recently used one out first; 0 keeps nothing. A long
job that makes up a new name every step therefore holds the same memory at step 10 million
as at step 2,000 (see docs/architecture.md, "Bounded per-name state").
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Bounded"]

K = TypeVar("K")
V = TypeVar("V")


class Bounded(dict[K, V], Generic[K, V]):
    """A dict of at most ``capacity`` entries in use order, oldest first.

    :meth:`keep` inserts (as the newest) and drops the oldest beyond the capacity; :meth:`used`
    looks a key up and makes it the newest (for a table one thread owns: the key is briefly
    absent). Plain ``get`` reads without reordering: the hot path of a table whose use order
    another table keeps (``Channel.forget``). ``keep`` and ``get`` are safe from any thread
    under the GIL: a key another thread removed in between is simply absent.
    """

    __slots__ = ("capacity",)

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def keep(self, key: K, value: V) -> None:
        if self.capacity <= 0:
            return
        self.pop(key, None)  # re-inserted as the newest
        self[key] = value
        while len(self) > self.capacity:
            try:
                self.pop(next(iter(self)), None)
            except (StopIteration, RuntimeError):  # emptied or changed by another thread
                break

    def used(self, key: K) -> V | None:
        value = self.pop(key, None)
        if value is not None:
            self[key] = value
        return value
