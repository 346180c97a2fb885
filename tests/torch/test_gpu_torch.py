"""hvdlite.torch on CUDA tensors: the cached CuPy views, torch's current stream, and the gradient
bucket views reduced in place. Marked ``gpu``; skipped without CUDA. Run on a GPU machine, at
1 rank too: ``mpirun -n 1 python -m mpi4py -m pytest tests/torch/test_gpu_torch.py``.

Values are small integers (or halves), so every expected result is exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _device(hvd: Any) -> torch.device:
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _rank_sum(hvd: Any, f: Any) -> float:
    return float(sum(f(r) for r in range(hvd.size())))


def test_cuda_tensor_from_a_side_stream_is_reduced_after_its_producer(hvd: Any) -> None:
    dev = _device(hvd)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        a = torch.full((1 << 22,), 1.0, device=dev)
        for _ in range(20):  # keep the producer busy on the side stream
            a = a * 1.0
        t = a + float(hvd.rank())
        h = hvd.allreduce_async(t, op=hvd.Sum, name="gpu.side")
        out = hvd.synchronize(h)
        side.synchronize()
    assert torch.equal(out, torch.full_like(t, _rank_sum(hvd, lambda r: 1.0 + r)))


def test_cached_cuda_view_follows_the_tensors_memory(hvd: Any) -> None:
    dev = _device(hvd)
    t = torch.full((8,), float(hvd.rank() + 1), device=dev)
    for _ in range(3):  # the same tensor again: the cached view
        t.fill_(float(hvd.rank() + 1))
        hvd.allreduce_(t, op=hvd.Sum, name="gpu.cache")
        assert torch.equal(t, torch.full_like(t, _rank_sum(hvd, lambda r: r + 1)))
    t.data = torch.full((8,), 2.0 * (hvd.rank() + 1), device=dev)  # new memory, same object
    hvd.allreduce_(t, op=hvd.Sum, name="gpu.cache")
    assert torch.equal(t, torch.full_like(t, _rank_sum(hvd, lambda r: 2 * (r + 1))))
    got = hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, name="gpu.oop")
    assert got.device == dev and got.data_ptr() != t.data_ptr()
    assert torch.equal(got, torch.full_like(t, _rank_sum(hvd, lambda r: _rank_sum(
        hvd, lambda q: 2 * (q + 1)) / 2)))


def test_cuda_bucket_views_are_reduced_in_place(hvd: Any) -> None:
    from hvdlite.torch import _reduce
    from hvdlite.torch._buckets import Bucket

    dev = _device(hvd)
    shapes = [(3, 5), (7,), (2, 2, 2), (1,)]
    params = [torch.nn.Parameter(torch.zeros(s, device=dev)) for s in shapes]
    bucket = Bucket(params, "gpu.bucket")
    assert bucket.viewable()
    bucket.make_views()
    assert all(p.grad is v for p, v in zip(params, bucket.views, strict=True))
    for step in range(3):
        bucket.buffer.zero_()  # type: ignore[union-attr]
        coeffs = [torch.full(s, float(hvd.rank() + step + k), device=dev)
                  for k, s in enumerate(shapes)]
        sum((p * c).sum() for p, c in zip(params, coeffs, strict=True)).backward()  # type: ignore[union-attr]
        assert all(p.grad is v for p, v in zip(params, bucket.views, strict=True))
        assert bucket.realias()
        handle = _reduce.bucket_async(bucket.arrays, bucket.views, bucket.name, hvd.Sum, 2.0,
                                      1.0, hvd.global_process_set)
        outs = hvd.synchronize(handle)
        assert outs == bucket.views
        for k, (p, s) in enumerate(zip(params, shapes, strict=True)):
            want = 2 * _rank_sum(hvd, lambda r: r + step + k)  # noqa: B023
            assert torch.equal(p.grad, torch.full(s, want, device=dev)), (step, k)
    ptr = bucket.buffer.data_ptr()  # type: ignore[union-attr]
    for p in params:
        assert p.grad.data_ptr() == ptr
        ptr += p.numel() * p.element_size()


def test_cuda_optimizer_with_bucket_views_matches_every_rank(hvd: Any) -> None:
    if hvd.size() < 2:
        pytest.skip("DistributedOptimizer registers no hooks at size 1 (Horovod's rule)")
    dev = _device(hvd)
    params = [torch.nn.Parameter(torch.zeros(s, device=dev)) for s in [(4, 4), (9,)]]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0),
                                   named_parameters=[("a", params[0]), ("b", params[1])],
                                   gradient_as_bucket_view=True, op=hvd.Sum)
    opt.zero_grad()
    sum((p * float(hvd.rank() + 1)).sum() for p in params).backward()  # type: ignore[union-attr]
    opt.step()
    for p in params:
        assert torch.equal(p.grad, torch.full_like(p, _rank_sum(hvd, lambda r: r + 1)))


def test_cuda_results_are_reused_only_once_nothing_refers_to_them(hvd: Any) -> None:
    dev = _device(hvd)
    t = torch.full((16,), float(hvd.rank() + 1), device=dev)
    total = _rank_sum(hvd, lambda r: r + 1)
    r1 = hvd.allreduce(t, op=hvd.Sum, name="gpu.ring")
    r2 = hvd.synchronize(hvd.allreduce_async(t, op=hvd.Sum, name="gpu.ring"))
    assert r1.data_ptr() != r2.data_ptr()  # r1 is still held
    view = r2[4:8]
    del r2  # its view keeps the memory busy
    t.fill_(float(hvd.rank() + 10))
    r3 = hvd.allreduce(t, op=hvd.Sum, name="gpu.ring")
    assert view.data_ptr() not in range(r3.data_ptr(), r3.data_ptr() + r3.nbytes)
    assert torch.equal(r1, torch.full_like(t, total))
    assert torch.equal(view, torch.full((4,), total, device=dev))
    assert torch.equal(r3, torch.full_like(t, _rank_sum(hvd, lambda r: r + 10)))
