"""hvdlite: an asynchronous collective scheduler for data-parallel training.

Importing hvdlite has no side effects: MPI is touched only by :func:`init`, and CuPy, NCCL and
torch are imported only when a call needs them. See ``docs/architecture.md`` for the design.
"""

from __future__ import annotations

from hvdlite._collectives import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    barrier_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from hvdlite._engine import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from hvdlite._handles import Handle
from hvdlite._ops import Average, Max, Min, Product, ReduceOp, Sum
from hvdlite.errors import (
    BackendUnavailableError,
    ConfigError,
    HvdliteError,
    MismatchError,
    NotInitializedError,
    ShutdownError,
    StallError,
)

__version__ = "0.1.0"

__all__ = [
    "Average",
    "BackendUnavailableError",
    "ConfigError",
    "Handle",
    "HvdliteError",
    "Max",
    "Min",
    "MismatchError",
    "NotInitializedError",
    "Product",
    "ReduceOp",
    "ShutdownError",
    "StallError",
    "Sum",
    "__version__",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "barrier_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "cross_rank",
    "cross_size",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "shutdown",
    "size",
    "synchronize",
]
