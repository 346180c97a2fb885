"""Adasum on device tensors (CuPy and torch CUDA) against the NumPy reference of the tree:
float16/32/64, single tensors, fused buckets, grouped calls, scale factors. At 2 and 4 ranks on
one GPU the halves travel through CUDA IPC; at 1 rank the result is the input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from jobs_util import import_torch

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from mpi_util import adasum_close, reference_adasum  # noqa: E402


def _inputs(seed: int, n: int, shape: tuple[int, ...], dtype: str) -> list[np.ndarray]:
    return [np.random.default_rng([seed, r]).normal(size=shape).astype(dtype) for r in range(n)]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_device_adasum_single_fused_grouped(hvd: Any, dtype: str) -> None:
    r, n = hvd.rank(), hvd.size()
    for i, shape in enumerate([(1,), (3, 5), (4099,), (1 << 18,)]):
        inputs = _inputs(20 + i, n, shape, dtype)
        got = hvd.allreduce(cupy.asarray(inputs[r]), name=f"dada.{dtype}.{i}", op=hvd.Adasum)
        assert isinstance(got, cupy.ndarray) and got.dtype == np.dtype(dtype)
        adasum_close(cupy.asnumpy(got), reference_adasum(inputs), dtype, f"{dtype} {shape}")
    per = [[x * np.asarray(10.0 ** (i - 1), dtype) for x in _inputs(50 + i, n, s, dtype)]
           for i, s in enumerate([(5,), (300,), (64, 3)])]
    handles = [hvd.allreduce_async(cupy.asarray(p[r]), name=f"dfa.{dtype}.{i}", op=hvd.Adasum)
               for i, p in enumerate(per)]
    for i, (h, p) in enumerate(zip(handles, per, strict=True)):
        adasum_close(cupy.asnumpy(h.wait()), reference_adasum(p), dtype, f"async {i}")
    got = hvd.grouped_allreduce([cupy.asarray(p[r]) for p in per], name=f"dga.{dtype}",
                                op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5)
    for i, p in enumerate(per):
        adasum_close(cupy.asnumpy(got[i]), reference_adasum(p), dtype, f"grouped {i}")


def test_torch_cuda_adasum(hvd: Any) -> None:
    torch = import_torch()
    import hvdlite.torch as hvd_torch

    r, n = hvd.rank(), hvd.size()
    inputs = _inputs(70, n, (257,), "float32")
    x = torch.from_numpy(inputs[r]).cuda()
    got = hvd_torch.allreduce(x, op=hvd_torch.Adasum, name="tada")
    assert got.is_cuda
    adasum_close(got.cpu().numpy(), reference_adasum(inputs), "float32", "torch cuda")
