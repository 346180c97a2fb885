"""Process sets: subsets of the ranks that run collectives among themselves.

Each set negotiates its own order (its own coordinator, response cache and stall inspector)
and moves data on its own communicators (MPI, and NCCL per device). Sets are registered at
:func:`hvdlite.init` (``process_sets=``) or later with :func:`add_process_set`, which every
rank calls in the same order: the change is agreed like a collective on the global set, so
every rank creates the set's communicators at the same point of the global order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hvdlite._engine import default_engine
from hvdlite._handles import Handle
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.messages import Kind, Request

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "set_id_of"]


class ProcessSet:
    """A set of ranks (global ranks, in the order that gives them their rank in the set).

    ``process_set_id`` is None until the set is registered (``init(process_sets=...)`` or
    :func:`add_process_set`). ``ranks=None`` means every rank (the global set).
    """

    def __init__(self, ranks: Any = None) -> None:
        if ranks is not None and hasattr(ranks, "Get_group"):  # an mpi4py communicator
            from mpi4py import MPI

            ranks = MPI.Group.Translate_ranks(ranks.Get_group(), list(range(ranks.Get_size())),
                                              MPI.COMM_WORLD.Get_group())
        self._ranks: tuple[int, ...] | None = None if ranks is None else _checked_ranks(ranks)
        self.process_set_id: int | None = None

    @property
    def given_ranks(self) -> tuple[int, ...] | None:
        """The ranks this set was made with, in set order; None for the global set (every
        rank, whatever the job's size). Needs no running hvdlite."""
        return self._ranks

    @property
    def ranks(self) -> list[int]:
        """The member ranks (every rank for the global set, once initialised)."""
        if self._ranks is None:
            return list(range(default_engine().size))
        return list(self._ranks)

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set; ValueError if it is not a member."""
        me = default_engine().rank
        ranks = self.ranks
        if me not in ranks:
            raise ValueError(f"rank {me} is not in process set {self.process_set_id} "
                             f"(ranks {ranks})")
        return ranks.index(me)

    def included(self) -> bool:
        """Whether this process is a member of the set."""
        return default_engine().rank in self.ranks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(tuple(self._ranks or ()))

    def __repr__(self) -> str:
        shown = "all" if self._ranks is None else list(self._ranks)
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={shown})"


def _checked_ranks(ranks: Any) -> tuple[int, ...]:
    try:
        out = tuple(int(r) for r in ranks)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"process set ranks must be a sequence of ints, got {ranks!r}") from exc
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise ValueError(f"process set ranks must be distinct non-negative ints, got "
                         f"{list(out)}")
    return out


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


def set_id_of(process_set: Any) -> int:
    """The id of a registered ``ProcessSet`` (or a plain id); errors say how to register."""
    if isinstance(process_set, ProcessSet):
        if process_set.process_set_id is None:
            raise ValueError(f"{process_set!r} is not registered; pass it to "
                             "hvdlite.init(process_sets=[...]) or hvdlite.add_process_set")
        return process_set.process_set_id
    if isinstance(process_set, int) and not isinstance(process_set, bool):
        return process_set
    raise TypeError(f"process_set must be a hvdlite.ProcessSet, got "
                    f"{type(process_set).__name__}")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set; collective: every rank calls it, in the same order.

    Blocks until every rank agreed (the change runs at the same point of the global order
    everywhere). Returns the registered set. Raises ValueError for bad or already
    registered ranks, MismatchError if the ranks disagree about it.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    engine = default_engine()
    ranks = tuple(ps.ranks)
    if max(ranks) >= engine.size:
        raise ValueError(f"process set ranks must be < size ({engine.size}), got {list(ranks)}")
    if ps.process_set_id is not None and ps.process_set_id in engine.sets:
        raise ValueError(f"{ps!r} is already registered")
    if ranks in engine.sets.values():
        known = next(k for k, v in engine.sets.items() if v == ranks)
        raise ValueError(f"a process set with ranks {list(ranks)} is already registered (id "
                         f"{known}); use it or remove it first")
    ps.process_set_id = _agree_set_change(0, engine.next_set_id(), ranks)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collective, like :func:`add_process_set`); its pending
    collectives fail. Returns False if it was not registered; the global set stays."""
    set_id = process_set.process_set_id
    engine = default_engine()
    if set_id is None or set_id == 0 or set_id not in engine.sets:
        return False
    _agree_set_change(1, set_id, engine.sets[set_id])
    process_set.process_set_id = None
    return True


def _agree_set_change(action: int, set_id: int, ranks: tuple[int, ...]) -> int:
    """Agree a process-set change on the global set and wait until every rank applied it."""
    engine = default_engine()
    engine.scheduler.check_usable()
    name = f"process_set.{'add' if action == 0 else 'remove'}.{set_id}"
    handle = Handle(name)
    req = Request(name, Kind.PROCESS_SET, shape=ranks, op=action, root=set_id)
    engine.scheduler.submit(Entry(req, None, None, handle), False, engine.global_channel)
    return int(handle.wait())
