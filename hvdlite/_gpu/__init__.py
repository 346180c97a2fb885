"""Device support: streams, events, batched copy kernels and retirement of finished work.

Nothing here is imported until a device tensor is submitted, so hvdlite imports and runs on
the host without CuPy, NCCL or a GPU.
"""
