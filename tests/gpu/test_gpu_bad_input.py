"""The device bad-input matrix: each case a clear error naming the tensor and the fix, or a
correct result, and the next collective works. CuPy and torch CUDA tensors; at 2 ranks on one
GPU this runs through CUDA IPC, at 1 rank through NCCL."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from jobs_util import import_torch

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

TWO_DEVICES = cupy.cuda.runtime.getDeviceCount() > 1


def _next_collective_works(hvd: Any, tag: str) -> None:
    got = hvd.allreduce(cupy.full(3, hvd.rank() + 1, cupy.int32), name=f"after.{tag}",
                        op=hvd.Sum)
    np.testing.assert_array_equal(cupy.asnumpy(got),
                                  np.full(3, sum(range(1, hvd.size() + 1)), np.int32))


def _raises(hvd: Any, tag: str, call: Callable[[], Any], exc: type[BaseException],
            *needles: str) -> None:
    with pytest.raises(exc) as info:
        call()
    text = str(info.value)
    for needle in needles:
        assert needle in text, f"{tag}: {needle!r} not in the message: {text}"
    _next_collective_works(hvd, tag)


def test_strided_cupy_is_refused_with_the_fix(hvd: Any) -> None:
    x = cupy.arange(20, dtype=cupy.float32)[::2]
    _raises(hvd, "strided", lambda: hvd.allreduce(x, name="bad.strided"), ValueError,
            "'bad.strided'", "not C-contiguous", "cupy.ascontiguousarray(x)")
    t = cupy.ones((4, 6), cupy.float32).T
    _raises(hvd, "transposed", lambda: hvd.allgather(t, name="bad.T"), ValueError,
            "'bad.T'", "cupy.ascontiguousarray(x)")


def test_non_contiguous_torch_cuda_is_refused_with_the_fix(hvd: Any) -> None:
    torch = import_torch()
    import hvdlite.torch as hvd_torch

    x = torch.ones(4, 6, device="cuda").t()
    _raises(hvd, "torch.T", lambda: hvd_torch.allreduce(x, name="bad.torch.T"), ValueError,
            "'allreduce.bad.torch.T'", "x.contiguous()")  # Horovod's torch name


def test_host_and_device_in_one_grouped_call(hvd: Any) -> None:
    parts = [cupy.ones(3, cupy.float32), np.ones(3, np.float32)]
    _raises(hvd, "mixed", lambda: hvd.grouped_allreduce(parts, name="bad.mixed"), ValueError,
            "'bad.mixed'", "share one device", "separate calls")


def test_dtypes_nccl_cannot_reduce(hvd: Any) -> None:
    n = hvd.size()
    # bool: reduced as bytes (Sum and Max are or, Min and Product and), exact.
    flags = cupy.asarray(np.array([hvd.rank() == 0, False, True]))
    got = cupy.asnumpy(hvd.allreduce(flags, name="odd.bool", op=hvd.Sum))
    np.testing.assert_array_equal(got, np.array([True, False, True]))
    got = cupy.asnumpy(hvd.allreduce(flags, name="odd.bool.min", op=hvd.Min))
    np.testing.assert_array_equal(got, np.array([n == 1, False, True]))
    # complex: travels as pairs of its real type; Sum exact, Product refused with the fix.
    z = cupy.full(2, 1 + 2j, cupy.complex64)
    got = cupy.asnumpy(hvd.allreduce(z, name="odd.complex", op=hvd.Sum))
    np.testing.assert_array_equal(got, np.full(2, n * (1 + 2j), np.complex64))
    _raises(hvd, "complex.prod", lambda: hvd.allreduce(z, name="bad.cprod", op=hvd.Product),
            TypeError, "'bad.cprod'", "Product of complex", "host tensor")
    _raises(hvd, "int16", lambda: hvd.allreduce(cupy.ones(2, cupy.int16), name="bad.i16"),
            TypeError, "'bad.i16'", "int16", "cast to int32")


def test_zero_size_tensors(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    empty = cupy.zeros((0, 3), cupy.float32)
    got = hvd.allreduce(empty, name="zero.ar", op=hvd.Sum)
    assert got.shape == (0, 3) and isinstance(got, cupy.ndarray)
    rows = cupy.full((r % 2, 2), r, cupy.int64)  # rank 0 gives no rows
    got = cupy.asnumpy(hvd.allgather(rows, name="zero.ag"))
    want = np.concatenate([np.full((q % 2, 2), q, np.int64) for q in range(n)])
    np.testing.assert_array_equal(got, want)
    got = hvd.broadcast(cupy.zeros(0, cupy.float64), 0, name="zero.bc")
    assert got.shape == (0,)
    _next_collective_works(hvd, "zero")


def test_torch_tensor_that_requires_grad(hvd: Any) -> None:
    torch = import_torch()
    import hvdlite.torch as hvd_torch

    x = torch.full((3,), float(hvd.rank() + 1), device="cuda", requires_grad=True)
    y = hvd_torch.allreduce(x, name="grad.ar", op=hvd_torch.Sum)
    assert y.requires_grad
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float(hvd.size()), device="cuda"))
    assert torch.equal(y.detach(), torch.full((3,), float(sum(range(1, hvd.size() + 1))),
                                              device="cuda"))


def test_tensor_dropped_before_wait_is_kept_alive(hvd: Any) -> None:
    handles = []
    for i in range(8):
        x = cupy.full(1 << 16, float(hvd.rank() + i), cupy.float32)
        handles.append(hvd.allreduce_async(x, name=f"drop.{i}", op=hvd.Sum))
        del x  # hvdlite keeps the input until the collective is done with it
    gc.collect()
    junk = [cupy.full(1 << 16, -1.0, cupy.float32) for _ in range(8)]  # reuse the freed blocks
    for i, h in enumerate(handles):
        want = float(sum(q + i for q in range(hvd.size())))
        got = h.wait()
        assert float(got.min()) == want == float(got.max()), (i, float(got.min()))
    del junk


def test_overwrite_after_a_stream_ordered_wait_is_safe(hvd: Any) -> None:
    """The contract: an input may be written again once wait() returned (sync completion) or,
    with async completion, on a stream that wait() ordered after the collective."""
    x = cupy.full(1 << 18, float(hvd.rank() + 1), cupy.float32)
    h = hvd.allreduce_async(x, name="overwrite", op=hvd.Sum)
    got = h.wait()  # the current stream is ordered after the collective either way
    x.fill(-7.0)  # on the current stream: after the collective has read x
    want = float(sum(range(1, hvd.size() + 1)))
    assert float(got.min()) == want == float(got.max())


@pytest.mark.skipif(not TWO_DEVICES, reason="needs a second GPU visible to the rank")
def test_stream_of_another_device(hvd: Any) -> None:
    mine = cupy.cuda.Device().id
    other = (mine + 1) % cupy.cuda.runtime.getDeviceCount()
    with cupy.cuda.Device(other):
        stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(4, cupy.float32)
    _raises(hvd, "stream", lambda: hvd.allreduce(x, name="bad.stream", stream=stream),
            ValueError, "'bad.stream'", f"stream of device {other}", "tensor's device")


@pytest.mark.skipif(not TWO_DEVICES, reason="needs a second GPU visible to the rank")
def test_tensor_on_another_device_than_the_ranks(hvd: Any) -> None:
    """A tensor on another GPU than the rank's: the collective runs on the tensor's device
    (every rank passing the same device), its result on that device, readable every way.

    Three checks, all reported on one line (printed, and the failure's message), so a failure
    says which failed: the collective's own work (both devices synchronised), a copy to the
    host (``cupy.asnumpy``, on the result's device), a kernel on the result's device. Not
    checked: a kernel on the rank's device reading the result, which needs peer access that
    CuPy does not enable for it: on two H200s (2026-11-27, gpu-validation.md) that read hit
    an illegal address in both completion modes while the three reads here were right, so
    run 63's failure at 7de641c was that read (a test fault), not the result memory; and an
    illegal address is sticky (every later CUDA call of the process fails)."""
    mine = cupy.cuda.Device().id
    other = (mine + 1) % cupy.cuda.runtime.getDeviceCount()
    want = float(sum(range(1, hvd.size() + 1)))
    with cupy.cuda.Device(other):
        x = cupy.full(5, float(hvd.rank() + 1), cupy.float32)
    got = hvd.allreduce(x, name="other.device", op=hvd.Sum)
    assert got.data.device_id == other
    assert cupy.cuda.Device().id == mine, "the call changed the rank's current device"

    def kernel_read() -> str:
        lo, hi = float(got.min()), float(got.max())
        cupy.cuda.Device().synchronize()
        return "ok" if lo == want == hi else f"wrong: min {lo}, max {hi}, want {want}"

    def on_results_device() -> str:
        with cupy.cuda.Device(other):
            return kernel_read()

    def collective() -> str:
        cupy.cuda.Device(other).synchronize()
        cupy.cuda.Device(mine).synchronize()
        return "ok"

    def to_host() -> str:
        host = cupy.asnumpy(got)
        return "ok" if np.array_equal(host, np.full(5, want, np.float32)) else f"wrong: {host}"

    reads = [("collective's work (both devices synchronised)", collective),
             ("cupy.asnumpy", to_host),
             (f"kernel on GPU {other} (the result's)", on_results_device)]
    outcomes = []
    for what, read in reads:
        try:
            outcome = read()
        except Exception as e:  # each read's failure is reported, not the first only
            outcome = f"raised {type(e).__name__}: {e}"
        outcomes.append((what, outcome))
    report = f"rank {hvd.rank()}, other-device result: " + "; ".join(
        f"{what}: {outcome}" for what, outcome in outcomes)
    print(report, flush=True)
    assert all(outcome.startswith("ok") for _, outcome in outcomes), report
    _next_collective_works(hvd, "other.device")
