"""Process sets, as Horovod's PyTorch API names them.

hvdlite's engine runs every collective on one communicator (the global set). This module keeps
Horovod's objects (:class:`ProcessSet`, :data:`global_process_set`, :func:`add_process_set`,
:func:`remove_process_set`) so code that builds them runs, and :func:`check_process_set` is the
one place that decides whether a collective can run on a given set: today only the global set
(or a set naming every rank in order, which is the same thing) is accepted.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import hvdlite
from hvdlite.errors import HvdliteError

__all__ = [
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "check_process_set",
]


class ProcessSet:
    """A subset of the ranks that a collective runs on (``process_set=``).

    Build it from a list of ranks or an ``mpi4py`` communicator; register it with
    ``hvdlite.torch.init(process_sets=[...])`` or :func:`add_process_set`. The global set
    (:data:`global_process_set`) holds every rank and has id 0.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: Any = None
        self.ranks: list[int] | None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            from mpi4py import MPI

            self.mpi_comm = ranks_or_comm
            world = MPI.COMM_WORLD.Get_group()
            group = ranks_or_comm.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
            self.ranks = sorted(int(r) for r in ranks)
        else:
            try:
                ranks = [int(r) for r in ranks_or_comm]
            except TypeError:
                raise TypeError("ProcessSet expects a list of ranks or an mpi4py communicator, "
                                f"got {type(ranks_or_comm).__name__}") from None
            if any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
                raise ValueError(f"ProcessSet ranks must be distinct and >= 0, got {ranks}")
            self.ranks = sorted(ranks)

    def _all_ranks(self) -> list[int]:
        if self.ranks:
            return self.ranks
        return list(range(hvdlite.size()))  # the global set: every rank

    def size(self) -> int:
        """Number of ranks in this set."""
        return len(self._all_ranks())

    def rank(self) -> int:
        """This process's rank within the set, or -1 if it is not a member."""
        me = hvdlite.rank()
        ranks = self._all_ranks()
        return ranks.index(me) if me in ranks else -1

    def included(self) -> bool:
        """True if this process belongs to the set."""
        return self.rank() >= 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        if self is other:
            return True
        if self.process_set_id is not None and self.process_set_id == other.process_set_id:
            return True
        return self.ranks == other.ranks and self.ranks is not None and bool(self.ranks)

    def __hash__(self) -> int:
        return hash(tuple(self.ranks or ()))

    def __repr__(self) -> str:
        ranks = "all" if self is global_process_set else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_lock = threading.Lock()
_registered: dict[int, ProcessSet] = {0: global_process_set}
_state = {"dynamic": False, "next_id": 1}


def _dynamic_env() -> bool:
    return os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").strip().lower() in {"1", "true"}


def setup(process_sets: Sequence[ProcessSet] | str | None) -> None:
    """Called by ``init``: forget earlier registrations and register ``process_sets``
    (a list of :class:`ProcessSet`, or ``"dynamic"`` to allow :func:`add_process_set`)."""
    with _lock:
        for ps in _registered.values():
            if ps is not global_process_set:
                ps.process_set_id = None
        _registered.clear()
        _registered[0] = global_process_set
        _state["next_id"] = 1
        _state["dynamic"] = _dynamic_env()
        if process_sets is None:
            return
        if isinstance(process_sets, str):
            if process_sets != "dynamic":
                raise ValueError("init(process_sets=...) takes a list of ProcessSet objects or "
                                 f"the string 'dynamic', got {process_sets!r}")
            _state["dynamic"] = True
            return
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            raise TypeError(f"init(process_sets=...): expected ProcessSet objects, got "
                            f"{type(ps).__name__}")
        _register(ps)


def _register(ps: ProcessSet) -> ProcessSet:
    size = hvdlite.size()
    assert ps.ranks is not None
    if any(r >= size for r in ps.ranks):
        raise ValueError(f"{ps!r}: ranks must be < size() ({size})")
    with _lock:
        for other in _registered.values():
            if other is not global_process_set and other.ranks == ps.ranks:
                raise ValueError(f"a process set with ranks {ps.ranks} is already registered "
                                 f"(id {other.process_set_id})")
        ps.process_set_id = _state["next_id"]
        _state["next_id"] += 1
        _registered[ps.process_set_id] = ps
    return ps


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after ``init`` (needs ``init(process_sets="dynamic")`` or
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``, as in Horovod). Collective in Horovod; here it only
    records the set. Returns the registered :class:`ProcessSet`."""
    if not _state["dynamic"]:
        raise ValueError("add_process_set needs dynamic process sets: call "
                         "init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is already registered")
    return _register(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set``; True if it was registered. The global set cannot be
    removed (``ValueError``)."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set expects a ProcessSet, got "
                        f"{type(process_set).__name__}")
    if process_set is global_process_set:
        raise ValueError("the global process set cannot be removed")
    if not _state["dynamic"]:
        raise ValueError("remove_process_set needs dynamic process sets: call "
                         "init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1")
    with _lock:
        pid = process_set.process_set_id
        if pid is None or _registered.get(pid) is not process_set:
            return False
        del _registered[pid]
        process_set.process_set_id = None
    return True


def check_process_set(process_set: Any, what: str) -> None:
    """Accept ``process_set`` for a collective or raise.

    The single seam for engine-level process sets: today the global set, and any registered
    set naming every rank, run on the global communicator; any other set raises
    :class:`hvdlite.HvdliteError` (a ``RuntimeError``) saying so. ``TypeError`` if it is no
    :class:`ProcessSet`.
    """
    if process_set is None or process_set is global_process_set:
        return
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a hvdlite.torch.ProcessSet, got "
                        f"{type(process_set).__name__}")
    if process_set.ranks == list(range(hvdlite.size())):
        return
    raise HvdliteError(
        f"{what}: process_set={process_set!r} is not supported yet: hvdlite runs collectives "
        "on the global process set only; pass process_set=hvd.global_process_set (the default)"
    )
