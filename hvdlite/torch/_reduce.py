"""Kept for ``optimizer.py`` until it imports :func:`hvdlite.torch.mpi_ops.allreduce_one`
(the torch layer's allreduce is now a façade over the core's one route, in ``mpi_ops.py``);
delete this module with that import change."""

from hvdlite.torch.mpi_ops import allreduce_one

__all__ = ["allreduce_one"]
