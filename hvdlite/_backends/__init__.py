"""Data plane: one module per transport (``mpi`` for host memory, ``nccl`` for device memory)."""
