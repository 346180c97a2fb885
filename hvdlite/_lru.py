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
_MISSING = object()
V = TypeVar("V")


class Bounded(dict[K, V], Generic[K, V]):
    """A dict of at most ``capacity`` entries in use order, oldest first; or, for entries
    that each hold several (``keep(..., weight=n)``: a plan over n responses), of at most
    ``capacity`` weight in all.

    :meth:`keep` inserts (as the newest) and drops the oldest beyond the capacity; :meth:`used`
    looks a key up and makes it the newest (for a table one thread owns: the key is briefly
    absent). Plain ``get`` reads without reordering: the hot path of a table whose use order
    another table keeps (``Channel.forget``). ``keep``, ``drop`` and ``get`` of entries of
    weight 1 are safe from any thread under the GIL: a key another thread removed in between
    is simply absent.
    """

    __slots__ = ("capacity", "_weights", "_extra")

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._weights: dict[K, int] = {}  # entries kept with a weight other than 1
        self._extra = 0  # their weights less one each (so the total is len(self) + _extra)

    def keep(self, key: K, value: V, weight: int = 1) -> None:
        if self.capacity <= 0 or weight > self.capacity:
            return
        self.drop(key)  # re-inserted as the newest
        self[key] = value
        if weight != 1:
            self._weights[key] = weight
            self._extra += weight - 1
        while len(self) + self._extra > self.capacity:
            try:
                self.drop(next(iter(self)))
            except (StopIteration, RuntimeError):  # emptied or changed by another thread
                break

    def drop(self, key: K) -> None:
        """Remove ``key`` if present (any thread, for entries of weight 1)."""
        if self.pop(key, _MISSING) is not _MISSING and self._weights:
            self._extra -= self._weights.pop(key, 1) - 1

    def used(self, key: K) -> V | None:
        value = self.pop(key, None)
        if value is not None:
            self[key] = value
        return value
