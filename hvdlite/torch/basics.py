"""Lifecycle, topology and build queries of ``hvdlite.torch`` (Horovod's ``hvd.init`` & co.).

Everything here answers for hvdlite itself: MPI is always the controller and the host data
plane; NCCL carries device tensors when CuPy (with its NCCL binding) is installed; there is
no Gloo, oneCCL, DDL or ROCm support.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Sequence
from typing import Any

import hvdlite
from hvdlite._ops import ReduceOp
from hvdlite.errors import NotInitializedError
from hvdlite.torch import process_sets as _ps
from hvdlite.torch.errors import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidArgumentError,
    NotInitializedValueError,
)
from hvdlite.torch.process_sets import ProcessSet

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built",
    "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ccl_built", "cuda_built",
    "rocm_built", "ddl_built", "mlsl_built", "start_timeline", "stop_timeline",
    "HorovodInternalError", "HostsUpdatedInterrupt", "InvalidArgumentError",
    "NotInitializedValueError", "Average", "Sum",
    "Min", "Max", "Product", "Adasum", "resolve_op",
]


def _query(fn: Any) -> int:
    try:
        return int(fn())
    except NotInitializedError as exc:
        raise NotInitializedValueError(
            f"{exc}; with hvdlite.torch, call hvd.init() first") from None


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


#: Horovod's Adasum op (adaptive summation: ``hvdlite/_adasum.py``); float tensors, a
#: power-of-two number of ranks.
Adasum = ReduceOp.ADASUM

# The communicator init(comm=[ranks]) made for a job it starts: the engine runs on it until
# shutdown, which frees it (each made and never freed costs one of MPI's ~2,000).
_made: dict[str, Any] = {}


def resolve_op(op: Any, average: Any, what: str) -> ReduceOp:
    """Horovod's op rules: ``op`` wins; the deprecated ``average`` (True -> Average, False ->
    Sum) is accepted alone; neither -> Average. ``ValueError`` if both are given, ``TypeError``
    for an unknown op."""
    if op is not None and average is not None:
        raise ValueError(f"{what}: the op parameter supersedes average; pass only one of them")
    if average is not None:
        warnings.warn("the average argument is deprecated; pass op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{what}: op must be one of hvd.Average, Sum, Min, Max, Product, Adasum; "
                        f"got {op!r}")
    return op


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None,
         **overrides: Any) -> None:
    """Start hvdlite on every rank (collective; idempotent while running).

    ``comm``: an ``mpi4py`` communicator or a list of ``MPI.COMM_WORLD`` ranks (default: all
    of ``MPI.COMM_WORLD``). ``process_sets``: :class:`ProcessSet` objects registered with the
    engine now (ids 1, 2, ... in list order; the same list on every rank), or ``"dynamic"`` to
    allow :func:`add_process_set`/:func:`remove_process_set` later (as does
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``). ``ValueError`` for a set given twice, a set naming
    every rank (the global set) or a rank ``>= size``. While already running, the given sets
    get the ids of the registered sets with the same ranks (``ValueError`` if none).
    ``overrides`` are hvdlite knobs (see ``hvdlite.config``). ``HOROVOD_TIMELINE=DYNAMIC``
    starts no timeline at init: call :func:`start_timeline` later.
    """
    from mpi4py import MPI

    sets, dynamic = _ps.init_sets(process_sets)
    running, made = hvdlite.is_initialized(), None
    if not running:
        _free_made()  # (a shutdown through hvdlite's own API left it)
    if comm is not None and not hasattr(comm, "Get_rank"):
        try:
            ranks = sorted(int(r) for r in comm)
        except TypeError:
            raise TypeError("init(comm=...) takes an mpi4py communicator or a list of ranks, "
                            f"got {type(comm).__name__}") from None
        world = MPI.COMM_WORLD.Get_group()
        group = world.Incl(ranks)
        comm = made = MPI.COMM_WORLD.Create_group(group)
        group.Free()
        world.Free()
    try:
        _start(comm, running, sets, dynamic, overrides)
    except BaseException:
        if not hvdlite.is_initialized():
            _free(made)
        raise
    if running:
        _free(made)  # hvdlite runs on another: this one only carried the allgather
    elif made is not None:
        _made["comm"] = made  # the engine's: freed at shutdown


def _start(comm: Any, running: bool, sets: Any, dynamic: bool,
           overrides: dict[str, Any]) -> None:
    from mpi4py import MPI

    if os.environ.get("HOROVOD_TIMELINE", "").strip().upper() == "DYNAMIC":
        overrides.setdefault("timeline", "")
    if running:
        hvdlite.init(comm, **overrides)  # a no-op while running
        _ps.adopt(sets)
    else:
        _ps.check_init_ranks(sets, (comm if comm is not None else MPI.COMM_WORLD).Get_size())
        hvdlite.init(comm, process_sets=sets, **overrides)
        _ps.started(dynamic)


def shutdown() -> None:
    """Stop hvdlite on this rank and, through it, on every rank (pending work fails)."""
    hvdlite.shutdown()
    _free_made()


def _free_made() -> None:
    if not hvdlite.is_initialized():
        _free(_made.pop("comm", None))


def _free(comm: Any) -> None:
    from mpi4py import MPI

    if comm is not None and comm != MPI.COMM_NULL and not MPI.Is_finalized():
        comm.Free()


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return hvdlite.is_initialized()


def size() -> int:
    """Number of ranks. Before ``init()``: :class:`NotInitializedValueError` (both hvdlite's
    ``NotInitializedError`` and Horovod's ``ValueError``), as every query here."""
    return _query(hvdlite.size)


def rank() -> int:
    """This process's rank."""
    return _query(hvdlite.rank)


def local_size() -> int:
    """Number of ranks on this host."""
    return _query(hvdlite.local_size)


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return _query(hvdlite.local_rank)


def cross_size() -> int:
    """Number of hosts (ranks sharing this local rank)."""
    return _query(hvdlite.cross_size)


def cross_rank() -> int:
    """This host's index among the hosts."""
    return _query(hvdlite.cross_rank)


def is_homogeneous() -> bool:
    """True if every host runs the same number of ranks (the runtime decides it at init).
    Raises ValueError before init, as Horovod does."""
    return bool(_query(hvdlite.is_homogeneous))


def mpi_threads_supported() -> bool:
    """True if the MPI library runs with ``MPI_THREAD_MULTIPLE``."""
    from mpi4py import MPI

    hvdlite.size()  # NotInitializedError before init, as Horovod's raises
    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def mpi_built() -> bool:
    """True: hvdlite always runs over MPI (mpi4py)."""
    return True


def mpi_enabled() -> bool:
    """True: MPI is hvdlite's controller and host data plane."""
    return True


def gloo_built() -> bool:
    """False: hvdlite has no Gloo controller."""
    return False


def gloo_enabled() -> bool:
    """False: hvdlite has no Gloo controller."""
    return False


def nccl_built() -> int:
    """NCCL's version code (e.g. 22304) if device collectives can run here (CuPy with its
    NCCL binding importable), else 0."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        from cupy.cuda import nccl

        return int(nccl.get_version())
    except Exception:  # noqa: BLE001 - no CUDA driver, no NCCL: not available
        return 0


def cuda_built() -> bool:
    """True if hvdlite can move CUDA tensors here (CuPy and a CUDA build of torch)."""
    import torch

    return importlib.util.find_spec("cupy") is not None and torch.version.cuda is not None


def rocm_built() -> bool:
    """False: no ROCm support."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL support."""
    return False


def ddl_built() -> bool:
    """False: no IBM DDL support."""
    return False


def mlsl_built() -> bool:
    """False: no MLSL support."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``file_path`` (see ``hvdlite.start_timeline``)."""
    if not isinstance(file_path, str) or not file_path:
        raise ValueError(f"start_timeline: file_path must be a non-empty str, got {file_path!r}")
    hvdlite.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the running timeline, leaving its file complete."""
    hvdlite.stop_timeline()
