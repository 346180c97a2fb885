"""Every collective on CuPy arrays against NumPy references built from every rank's inputs,
fused and unfused, with async completion off and on, with the timeline on (CPU sync), and
through CUDA IPC in small chunks (IPC is what ranks that share a GPU take anyway)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from gpu_util import reinit  # noqa: E402
from mpi_util import all_inputs, op_allowed, reference_allreduce  # noqa: E402

DTYPES = ["bool", "int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
          "float32", "float64", "complex64", "complex128"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]
MODES = {
    "sync": {},
    "async": {"async_completion": True},
    "timeline": {"async_completion": True, "timeline": "/tmp/hvdlite-gpu-test-timeline.json"},
    # CUDA IPC at any rank count, in 4 KiB steps (so the larger calls move in chunks).
    "ipc": {"ipc": "always", "ipc_buffer_bytes": 4096},
}


def _device_ok(dtype: str, op: str) -> bool:
    return op_allowed(dtype, op) and not (op == "Product" and dtype.startswith("complex"))


def _bounds(op: str) -> tuple[int, int]:
    return (1, 2) if op == "Product" else (-8, 8)


def _check(got: Any, want: np.ndarray, what: str) -> None:
    assert isinstance(got, cupy.ndarray), f"{what}: got {type(got)}"
    host = cupy.asnumpy(got)
    assert host.dtype == want.dtype and host.shape == want.shape, (what, host.dtype, host.shape)
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(host, want, err_msg=what)
    else:
        np.testing.assert_allclose(host, want, rtol=1e-3 if want.dtype == np.float16 else 1e-6,
                                   err_msg=what)


@pytest.fixture(scope="module", params=list(MODES))
def mode(request: pytest.FixtureRequest, hvd: Any) -> Iterator[str]:
    with reinit(hvd, **MODES[request.param]):
        yield request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_op_unfused(hvd: Any, mode: str, dtype: str) -> None:
    r, n = hvd.rank(), hvd.size()
    for seed, op in enumerate(OPS):
        if not _device_ok(dtype, op):
            continue
        lo, hi = _bounds(op)
        inputs = all_inputs(100 + seed, n, (3, 5), dtype, lo, hi)
        got = hvd.allreduce(cupy.asarray(inputs[r]), name=f"u.{mode}.{dtype}.{op}",
                            op=getattr(hvd, op))
        _check(got, reference_allreduce(inputs, op), f"{mode} {dtype} {op}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_allreduce_fused(hvd: Any, mode: str, dtype: str) -> None:
    r, n = hvd.rank(), hvd.size()
    shapes = [(7,), (2, 3), (1,), (4, 4, 2)]
    for seed, op in enumerate(OPS):
        if not _device_ok(dtype, op):
            continue
        lo, hi = _bounds(op)
        per = [all_inputs(200 + 10 * seed + i, n, s, dtype, lo, hi) for i, s in enumerate(shapes)]
        got = hvd.grouped_allreduce([cupy.asarray(p[r]) for p in per],
                                    name=f"g.{mode}.{dtype}.{op}", op=getattr(hvd, op))
        for i, p in enumerate(per):
            _check(got[i], reference_allreduce(p, op), f"{mode} {dtype} {op} member {i}")


def test_scale_factors_fused_and_unfused(hvd: Any, mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    for dtype in ("float32", "float64", "int32", "int64"):
        per = [all_inputs(300 + i, n, (6,), dtype) for i in range(3)]
        got = hvd.grouped_allreduce([cupy.asarray(p[r]) for p in per], name=f"sf.{mode}.{dtype}",
                                    op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0)
        for i, p in enumerate(per):
            _check(got[i], reference_allreduce(p, "Average", 0.5, 3.0), f"{dtype} fused {i}")
        one = hvd.allreduce(cupy.asarray(per[0][r]), name=f"sf1.{mode}.{dtype}", op=hvd.Sum,
                            prescale_factor=2.0, postscale_factor=0.25)
        _check(one, reference_allreduce(per[0], "Sum", 2.0, 0.25), f"{dtype} unfused")


def test_in_place_out_and_many_async(hvd: Any, mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    inputs = [all_inputs(400 + i, n, (33,), "float32") for i in range(40)]
    arrays = [cupy.asarray(p[r]) for p in inputs]
    handles = [hvd.allreduce_async_(a, name=f"ip.{mode}.{i}", op=hvd.Sum)
               for i, a in enumerate(arrays)]
    for i, h in enumerate(handles):
        assert h.wait() is arrays[i]
        _check(arrays[i], reference_allreduce(inputs[i], "Sum"), f"in place {i}")
    out = cupy.empty(33, dtype=cupy.float32)
    got = hvd.allreduce(cupy.asarray(inputs[0][r]), name=f"out.{mode}", op=hvd.Max, out=out)
    assert got is out
    _check(out, reference_allreduce(inputs[0], "Max"), "out=")


def test_allgather_uneven_and_even(hvd: Any, mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    for dtype in ("float32", "int64", "uint8", "complex64"):
        parts = [all_inputs(500 + k, n, (k + 1, 3), dtype)[k] for k in range(n)]
        got = hvd.allgather(cupy.asarray(parts[r]), name=f"ag.{mode}.{dtype}")
        _check(got, np.concatenate(parts), f"uneven {dtype}")
        even = all_inputs(550, n, (2, 2), dtype)
        got = hvd.allgather(cupy.asarray(even[r]), name=f"age.{mode}.{dtype}")
        _check(got, np.concatenate(even), f"even {dtype}")


def test_broadcast_every_root(hvd: Any, mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    for root in range(n):
        inputs = all_inputs(600 + root, n, (4, 3), "float64")
        got = hvd.broadcast(cupy.asarray(inputs[r]), root, name=f"bc.{mode}.{root}")
        _check(got, inputs[root], f"root {root}")
        x = cupy.asarray(inputs[r])
        assert hvd.broadcast_(x, root, name=f"bci.{mode}.{root}") is x
        _check(x, inputs[root], f"in place root {root}")


def test_alltoall_and_reducescatter(hvd: Any, mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    rows = [[(src + dst) % 3 + 1 for dst in range(n)] for src in range(n)]
    data = [all_inputs(700, n, (sum(rows[s]), 2), "int32")[s] for s in range(n)]
    got = hvd.alltoall(cupy.asarray(data[r]), splits=rows[r], name=f"a2a.{mode}")
    want = np.concatenate([np.split(data[s], np.cumsum(rows[s])[:-1])[r] for s in range(n)])
    _check(got, want, "alltoall")
    for total in (4 * n, 4 * n + 1):
        inputs = all_inputs(800 + total, n, (total, 3), "float32")
        got = hvd.reducescatter(cupy.asarray(inputs[r]), name=f"rs.{mode}.{total}", op=hvd.Sum)
        full = reference_allreduce(inputs, "Sum")
        base, extra = divmod(total, n)
        sizes = [base + (1 if k < extra else 0) for k in range(n)]
        start = sum(sizes[:r])
        _check(got, full[start:start + sizes[r]], f"reducescatter {total}")


def test_fused_bucket_larger_than_threshold(hvd: Any, mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    per = [all_inputs(900 + i, n, (300 + 100 * i,), "float32") for i in range(6)]
    hvd.shutdown()
    hvd.init(fusion_threshold=4096, **MODES[mode])
    try:
        got = hvd.grouped_allreduce([cupy.asarray(p[r]) for p in per], name=f"big.{mode}",
                                    op=hvd.Sum)
    finally:
        hvd.shutdown()
        hvd.init(**MODES[mode])
    for i, p in enumerate(per):
        _check(got[i], reference_allreduce(p, "Sum"), f"member {i}")


def test_host_device_mismatch_raises_everywhere(hvd: Any, mode: str) -> None:
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    x = np.ones(4, np.float32)
    arg = cupy.asarray(x) if hvd.rank() == 1 else x
    with pytest.raises(hvd.MismatchError, match=r"mix.*device|device.*rank"):
        hvd.allreduce(arg, name=f"mix.{mode}")
    # Not sticky: the next collective works.
    got = hvd.allreduce(cupy.ones(2, cupy.float32), name=f"after-mix.{mode}", op=hvd.Sum)
    _check(got, np.full(2, hvd.size(), np.float32), "after mismatch")


def test_unsupported_device_dtype_is_type_error(hvd: Any, mode: str) -> None:
    with pytest.raises(TypeError, match="int16"):
        hvd.allreduce_async(cupy.ones(3, cupy.int16), name=f"i16.{mode}")
    with pytest.raises(TypeError, match="Product"):
        hvd.allreduce_async(cupy.ones(3, cupy.complex64), name=f"c.{mode}", op=hvd.Product)
