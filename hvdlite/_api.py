"""The module-level API over the process's default engine: init, shutdown and the queries.

``hvdlite.init()`` creates the default :class:`~hvdlite._engine.Engine` (kept in
``hvdlite._engine``); every other function here forwards to it.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from hvdlite import _engine
from hvdlite._engine import Engine, default_engine, is_initialized
from hvdlite.config import load_config

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "is_homogeneous", "default_engine", "start_timeline",
           "stop_timeline", "stats", "expect_stall"]

_atexit_registered = False


def init(comm: MPI.Intracomm | None = None, *, config: str | None = None,
         process_sets: Sequence[Any] | None = None, **overrides: Any) -> None:
    """Start hvdlite on every rank of ``comm`` (default ``MPI.COMM_WORLD``).

    Collective: every rank of ``comm`` must call it. Idempotent while running (later calls
    return at once and ignore their arguments). After :func:`shutdown` it starts a fresh
    engine. ``config`` is a YAML file; ``process_sets`` lists :class:`hvdlite.ProcessSet`
    objects (or rank lists) registered now, numbered 1, 2, ... in order (the same list on
    every rank); ``overrides`` are knob names from :mod:`hvdlite.config` and win over the
    environment and the file. Raises
    :class:`hvdlite.ConfigError` for unknown knobs or bad values.
    """
    global _atexit_registered

    def make() -> Engine:
        cfg = load_config(config, overrides)
        from hvdlite._sets import ProcessSet

        sets = [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in process_sets or ()]
        engine = Engine(comm, cfg, [ps.ranks for ps in sets])
        for set_id, ps in enumerate(sets, start=1):  # as Engine numbered them
            ps.process_set_id = set_id
        return engine

    if not _engine.start_default(make):
        return
    if not _atexit_registered:
        # Registered after mpi4py's own exit hook, so it runs before MPI is finalised.
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True


def _shutdown_at_exit() -> None:
    engine = _engine.take_default()
    if engine is not None:
        engine.shutdown(at_exit=True)
    _engine.keep_retired_at_exit()  # also after an explicit shutdown: they outlive engines


def shutdown() -> None:
    """Stop hvdlite on this rank and, through it, on every rank.

    Blocks until the background thread agreed the stop with the other ranks. Pending handles
    (here and on the other ranks) fail with :class:`hvdlite.ShutdownError`. Idempotent; also
    runs at interpreter exit. Afterwards :func:`init` may be called again.
    """
    engine = _engine.take_default()
    if engine is not None:
        engine.shutdown()


def start_timeline(path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``path`` (rank 0; every rank if ``path``
    contains ``{rank}``), replacing one already running. Thread-safe; not collective.
    With device tensors, inputs and completions are then waited on the CPU (see README)."""
    engine = default_engine()
    old = engine.tracer.swap_timeline(engine.open_timeline(path, mark_cycles))
    if old is not None:
        old.close()


def stop_timeline() -> None:
    """Stop the running timeline (if any) and leave its file complete and valid JSON."""
    default_engine().tracer.close()


def stats() -> dict[str, Any]:
    """This rank's counters: per op count, bytes, latency p50/p99; negotiation time; fusion
    efficiency; response-cache hit rate. Cheap; always collected. Not collective."""
    return default_engine().tracer.stats.snapshot()


@contextlib.contextmanager
def expect_stall() -> Iterator[None]:
    """Within this block, this rank announces that a long stall is expected (say, rank 0
    alone runs an evaluation), so the stall inspector neither warns nor shuts down."""
    engine = default_engine()
    with engine.scheduler.lock:
        engine.scheduler.expecting_stall += 1
    try:
        yield
    finally:
        with engine.scheduler.lock:
            engine.scheduler.expecting_stall -= 1


def rank() -> int:
    """This process's rank in hvdlite's communicator. Raises NotInitializedError before init."""
    return default_engine().rank


def size() -> int:
    """Number of ranks. Raises NotInitializedError before init."""
    return default_engine().size


def local_rank() -> int:
    """Rank among the processes on this host (the GPU index hvdlite uses)."""
    return default_engine().local_rank


def local_size() -> int:
    """Number of ranks on this host."""
    return default_engine().local_size


def cross_rank() -> int:
    """Index of this host among the hosts (rank among processes with the same local rank)."""
    return default_engine().cross_rank


def cross_size() -> int:
    """Number of processes with this process's local rank (hosts, in a regular layout)."""
    return default_engine().cross_size


def is_homogeneous() -> bool:
    """True if every host runs the same number of ranks (decided at :func:`init` from every
    rank's ``local_size``). Raises NotInitializedError before init; any thread."""
    return default_engine().homogeneous
