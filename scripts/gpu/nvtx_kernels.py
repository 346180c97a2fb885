"""hvdlite's device kernels under NVTX ranges, for an Nsight tool to attribute (1 rank is enough).

A fused grouped allreduce (batched copy-in kernel, NCCL, batched copy-out kernel) and an
alltoall (NCCL send/recv kernel) with NVTX ranges on. Run it under Nsight Compute, e.g.

    HVDLITE_NVTX=1 ncu --nvtx --print-nvtx-rename kernel --kernel-name regex:batched|nccl \
        python3 scripts/gpu/nvtx_kernels.py

and each profiled kernel is reported under the hvdlite range it was launched in.
"""

from __future__ import annotations

import cupy

import hvdlite as hvd


def main() -> None:
    hvd.init(nvtx=True)
    cupy.cuda.Device(hvd.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    n = hvd.size()
    xs = [cupy.full(k + 3, float(hvd.rank() + 1), dtype=cupy.float32) for k in range(3)]
    got = hvd.grouped_allreduce(xs, name="nvtx.grouped", op=hvd.Sum)
    want = n * (n + 1) / 2
    assert all(float(g.min()) == want == float(g.max()) for g in got), got
    a2a = hvd.alltoall(cupy.arange(2 * n, dtype=cupy.float32), name="nvtx.a2a")
    assert a2a.shape == (2 * n,)
    hvd.shutdown()
    print("NVTX KERNELS OK", flush=True)


if __name__ == "__main__":
    main()
