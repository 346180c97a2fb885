"""hvdlite.torch: a drop-in for ``import horovod.torch as hvd`` on hvdlite's engine.

Change ``import horovod.torch as hvd`` to ``import hvdlite.torch as hvd``; ``docs/horovod.md``
lists the supported names and every known difference. Needs PyTorch
(``pip install hvdlite[torch]``).
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised without torch only
    raise ImportError(
        "hvdlite.torch needs PyTorch, which is not installed: pip install hvdlite[torch] "
        "(or pip install torch)"
    ) from _exc

from hvdlite.errors import HvdliteError, MismatchError, NotInitializedError, ShutdownError
from hvdlite.torch import elastic, mpi_ops
from hvdlite.torch.basics import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidArgumentError,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mlsl_built,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hvdlite.torch.compression import Compression
from hvdlite.torch.functional_ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from hvdlite.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hvdlite.torch.graphs import GraphedStep, make_graphed_step
from hvdlite.torch.mpi_ops import (
    Handle,
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from hvdlite.torch.optimizer import DistributedOptimizer
from hvdlite.torch.overlap import compile_overlap, overlap_backend
from hvdlite.torch.persistent import PersistentGroupedAllreduce, grouped_allreduce_init
from hvdlite.torch.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from hvdlite.torch.regions import compile_regions, find_regions, region_groups
from hvdlite.torch.split import compile_split, split_backend
from hvdlite.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "compile_overlap", "compile_regions", "compile_split", "find_regions", "overlap_backend",
    "region_groups", "split_backend",
    "Adasum", "Average", "Compression", "DistributedOptimizer", "GraphedStep", "Handle",
    "HorovodInternalError",
    "HostsUpdatedInterrupt", "HvdliteError", "InvalidArgumentError", "Max", "Min",
    "MismatchError", "NotInitializedError", "PersistentGroupedAllreduce", "ProcessSet",
    "Product", "ShutdownError", "Sum", "SyncBatchNorm", "add_process_set", "allgather",
    "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "gloo_built",
    "gloo_enabled", "global_process_set", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allreduce_init", "grouped_reducescatter",
    "grouped_reducescatter_async", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "make_graphed_step",
    "mlsl_built",
    "mpi_built", "mpi_enabled", "mpi_ops", "mpi_threads_supported", "nccl_built", "poll",
    "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline",
    "synchronize",
]
