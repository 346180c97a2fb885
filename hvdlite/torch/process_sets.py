"""Process sets, as Horovod's PyTorch API names them, backed by hvdlite's engine-level sets.

A :class:`ProcessSet` here is a :class:`hvdlite.ProcessSet` (so the numpy/CuPy collectives take
it too) with Horovod's conventions: ranks are sorted, ``size()``/``rank()`` are ``None`` until
the set is registered, ``rank()`` raises ``ValueError`` on a rank outside the set, and the
object may be built from an ``mpi4py`` communicator (``mpi_comm``). Sets are registered at
``hvdlite.torch.init(process_sets=[...])`` (ids 1, 2, ... in list order) or, with dynamic
process sets enabled (``init(process_sets="dynamic")`` or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``
at ``init``), by :func:`add_process_set` / :func:`remove_process_set`, which are collective:
every rank calls them, in the same order.

:func:`resolve` is the one place where a collective's ``process_set=`` is checked and mapped
onto the engine: the set's size (``Average`` divides by it), this rank's rank in it, and
:class:`~hvdlite.torch.InvalidArgumentError` (a ``ValueError``, as Horovod's) for a rank
outside the set or a set that is not registered.
"""

from __future__ import annotations

import operator
import os
import re
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import hvdlite
from hvdlite import _api, _sets
from hvdlite import _runtime_api as runtime
from hvdlite.errors import NotInitializedError
from hvdlite.torch.errors import InvalidArgumentError, NotInitializedValueError

__all__ = [
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "resolve",
    "Resolved",
]


class ProcessSet(_sets.ProcessSet):
    """A subset of the ranks that collectives run on (``process_set=``), Horovod's way.

    Build it from a list of ranks (sorted, as Horovod does: a rank's place in the set is its
    order among the members) or an ``mpi4py`` communicator (its ranks in ``MPI.COMM_WORLD``);
    register it with ``hvdlite.torch.init(process_sets=[...])`` or :func:`add_process_set`.
    ``process_set_id`` is ``None`` until then. :data:`global_process_set` holds every rank and
    has id 0. ``ValueError`` for ranks that are not distinct non-negative ints.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.mpi_comm: Any = None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            self.mpi_comm = ranks_or_comm
            super().__init__(ranks_or_comm)  # translated to MPI.COMM_WORLD ranks
            assert self._ranks is not None
            self._ranks = tuple(sorted(self._ranks))
            return
        try:
            ranks = sorted(operator.index(r) for r in ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                             f"an mpi4py Comm object, got {ranks_or_comm!r}") from None
        super().__init__(ranks)  # ValueError: empty, repeated or negative ranks

    def size(self) -> int | None:  # type: ignore[override]
        """Number of ranks in the set; ``None`` while it is not registered (Horovod)."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:  # type: ignore[override]
        """This process's rank within the set (its place among the sorted members); ``None``
        while the set is not registered; ``ValueError`` if this process is not a member.
        Collectives still take global ranks (e.g. ``broadcast``'s ``root_rank``)."""
        if self.process_set_id is None:
            return None
        me = hvdlite.rank()
        ranks = self.ranks
        if me not in ranks:
            raise ValueError(f"Process is not part of provided process set: rank {me} is not "
                             f"in {self!r}")
        return ranks.index(me)

    def included(self) -> bool:
        """True if this process is a member of the set."""
        return hvdlite.rank() in self.ranks

    def __repr__(self) -> str:
        shown: Any = "all" if self._ranks is None else list(self._ranks)
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={shown})"

    __str__ = __repr__


def _global_set() -> ProcessSet:
    ps = ProcessSet.__new__(ProcessSet)
    _sets.ProcessSet.__init__(ps, None)  # every rank (Horovod's constructor wants ranks)
    ps.mpi_comm = None
    ps.process_set_id = 0
    return ps


#: Every rank, id 0: the default ``process_set`` of every collective.
global_process_set = _global_set()

_lock = threading.Lock()
_state = {"dynamic": False}


def _dynamic_env() -> bool:
    """``HOROVOD_DYNAMIC_PROCESS_SETS`` read as Horovod reads it: a positive integer."""
    match = re.match(r"\s*[+-]?\d+", os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", ""))
    return match is not None and int(match.group()) > 0


def init_sets(process_sets: Sequence[Any] | str | None) -> tuple[list[ProcessSet], bool]:
    """``init``'s ``process_sets`` argument checked: (sets to register, in order; dynamic?).

    ``"dynamic"`` (any case) registers none now and allows :func:`add_process_set`; a list
    holds :class:`ProcessSet` objects (``global_process_set`` in it is skipped: it always
    exists). ``ValueError`` for a set given twice; ``TypeError`` for anything else.
    """
    if process_sets is None:
        return [], False
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError("init(process_sets=...) takes a list of ProcessSet objects or the "
                             f"string 'dynamic', got {process_sets!r}")
        return [], True
    sets: list[ProcessSet] = []
    seen: dict[tuple[int, ...], int] = {}
    for i, ps in enumerate(process_sets):
        if not isinstance(ps, ProcessSet):
            raise TypeError(f"init(process_sets=...): expected hvdlite.torch.ProcessSet objects, "
                            f"got {type(ps).__name__}")
        if ps.given_ranks is None:  # the global set
            continue
        if ps.given_ranks in seen:
            raise ValueError(f"Horovod could not be initialized because process_sets entry "
                             f"number {i} is a duplicate of entry {seen[ps.given_ranks]}: {ps!r}")
        seen[ps.given_ranks] = i
        sets.append(ps)
    return sets, False


def check_init_ranks(sets: Sequence[ProcessSet], size: int) -> None:
    """``ValueError`` before starting the engine for a set naming a rank ``>= size`` or
    naming every rank (that is the global set, as Horovod counts duplicates)."""
    for i, ps in enumerate(sets):
        ranks = ps.ranks
        if ranks[-1] >= size:
            raise ValueError(f"init(process_sets=...): entry number {i} ({ps!r}) names ranks "
                             f">= size ({size})")
        if len(ranks) == size:
            raise ValueError(f"Horovod could not be initialized because process_sets entry "
                             f"number {i} is a duplicate of the global process set: {ps!r}")


def started(dynamic: bool) -> None:
    """Called by ``init`` once the engine runs: whether sets may be added and removed
    (``"dynamic"`` given, or ``HOROVOD_DYNAMIC_PROCESS_SETS`` a positive integer now)."""
    with _lock:
        _state["dynamic"] = dynamic or _dynamic_env()


def adopt(sets: Sequence[ProcessSet]) -> None:
    """``init`` while already running: give each set the id of the registered set with the
    same ranks, as Horovod does; ``ValueError`` if there is none (register it with
    :func:`add_process_set`)."""
    known = {ranks: set_id for set_id, ranks in runtime.sets().items()}
    for ps in sets:
        set_id = known.get(ps.given_ranks or ())
        if set_id is None:
            raise ValueError(f"hvdlite.torch is already initialized and {ps!r} is not "
                             "registered; call hvd.shutdown() first or use add_process_set")
        ps.process_set_id = set_id


def _require_dynamic(what: str) -> None:
    if not hvdlite.is_initialized():
        raise NotInitializedValueError(f"{what}: Horovod has not been initialized; use "
                                       "hvd.init().")
    if not _state["dynamic"]:
        raise ValueError(f"{what}: set HOROVOD_DYNAMIC_PROCESS_SETS=1 or call "
                         "init(process_sets='dynamic') to allow adding and removing process "
                         "sets after initialization")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after ``init`` and return it (a :class:`ProcessSet` is built from
    a list of ranks). Collective: every rank calls it, in the same order; it returns once
    every rank has created the set.

    Needs dynamic process sets (``init(process_sets="dynamic")`` or
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``), else ``ValueError``, as in Horovod. ``ValueError``
    for a duplicate (a registered set with the same ranks, the global set included) or a
    rank ``>= size()``.
    """
    _require_dynamic("add_process_set")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    try:
        return _sets.add_process_set(ps)  # type: ignore[return-value]
    except ValueError as exc:
        raise ValueError(f"Attempted to add a duplicate or invalid process set: {exc}") from None


def remove_process_set(process_set: _sets.ProcessSet) -> bool:
    """Unregister ``process_set`` (collective, like :func:`add_process_set`); its id becomes
    ``None``. Returns ``False``, as Horovod does, for the global set and for a set that is not
    registered. Needs dynamic process sets (``ValueError`` otherwise)."""
    if not isinstance(process_set, _sets.ProcessSet):
        raise TypeError(f"remove_process_set expects a ProcessSet, got "
                        f"{type(process_set).__name__}")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    _require_dynamic("remove_process_set")
    if runtime.set_ranks(set_id) != process_set.given_ranks:  # unknown here, or stale
        process_set.process_set_id = None
        return False
    return _sets.remove_process_set(process_set)


class Resolved(NamedTuple):
    """A collective's process set, checked: what to pass to the core (``None`` for the global
    set), its size, and this rank's rank in it."""

    core: Any
    size: int
    rank: int


def resolve(process_set: Any, what: str) -> Resolved:
    """Check ``process_set`` for a collective on this rank and map it onto the engine.

    The global set (or ``None``) is every rank. ``TypeError`` for anything but a
    :class:`hvdlite.ProcessSet`; :class:`~hvdlite.torch.InvalidArgumentError` (a
    ``ValueError``, Horovod's error type here) if the set is not registered (never, removed,
    or from before a restart) or this rank is not a member.
    """
    try:
        rank, size = _api.rank(), _api.size()
    except NotInitializedError as exc:
        raise NotInitializedValueError(f"{what}: {exc}; call hvd.init() first") from None
    if process_set is None or process_set is global_process_set:
        return Resolved(None, size, rank)
    if not isinstance(process_set, _sets.ProcessSet):
        raise TypeError(f"{what}: process_set must be a hvdlite.torch.ProcessSet, got "
                        f"{type(process_set).__name__}")
    set_id = process_set.process_set_id
    if set_id == 0:
        return Resolved(None, size, rank)
    ranks = runtime.set_ranks(set_id)
    given = process_set.given_ranks
    if ranks is None or (given is not None and given != ranks):
        raise InvalidArgumentError(
            f"{what}: {process_set!r} does not exist or has not been registered; pass it to "
            "hvd.init(process_sets=[...]) or hvd.add_process_set first")
    if rank not in ranks:
        raise InvalidArgumentError(
            f"{what}: rank {rank} is not a member of the provided process set "
            f"{process_set!r}; call its collectives on its member ranks only")
    return Resolved(process_set, len(ranks), ranks.index(rank))
