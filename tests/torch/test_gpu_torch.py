"""hvdlite.torch on CUDA tensors: the cached CuPy views, torch's current stream, and the gradient
bucket views reduced in place. Marked ``gpu``; skipped without CUDA. Run on a GPU machine, at
1 rank too: ``mpirun -n 1 python -m mpi4py -m pytest tests/torch/test_gpu_torch.py``.

Values are small integers (or halves), so every expected result is exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch_util import cuda_device, knobs, n_rank_path

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


_device = cuda_device


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
    from hvdlite.torch._buckets import Bucket
    from hvdlite.torch.mpi_ops import allreduce_one

    dev = _device(hvd)
    shapes = [(3, 5), (7,), (2, 2, 2), (1,)]
    params = [torch.nn.Parameter(torch.zeros(s, device=dev)) for s in shapes]
    bucket = Bucket(params, "gpu.bucket", 1)
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
        handle = allreduce_one(bucket.buffer, bucket.name, hvd.Sum, 2.0, 1.0,
                               hvd.global_process_set, True, "test")
        assert hvd.synchronize(handle) is bucket.buffer
        for k, (p, s) in enumerate(zip(params, shapes, strict=True)):
            want = 2 * _rank_sum(hvd, lambda r: r + step + k)  # noqa: B023
            assert torch.equal(p.grad, torch.full(s, want, device=dev)), (step, k)
    ptr = bucket.buffer.data_ptr()  # type: ignore[union-attr]
    for p in params:  # in order, each on a 16-byte boundary
        assert p.grad.data_ptr() == ptr
        ptr += -(-p.numel() * p.element_size() // 16) * 16


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


def test_cuda_float_average_is_nccls_average_and_exact(hvd: Any) -> None:
    """Horovod's Average of CUDA float32/float64 with factors of 1 at a power-of-two set size
    reaches the core as its own Average (NCCL averages; the direct and immediate paths take
    it), exactly; float16 and scaled calls stay a Sum with postscale 1/size, exactly too."""
    from hvdlite._engine import default_engine
    from hvdlite._ops import ReduceOp

    n = hvd.size()
    if n & (n - 1):
        pytest.skip("the core's Average is used at power-of-two set sizes only")
    dev = _device(hvd)
    lanes = default_engine().global_channel.lanes
    want = n / 2  # the mean of r + 0.5 over every rank r
    average, plain = (ReduceOp.AVERAGE, 1.0), (ReduceOp.SUM, 1 / n)
    for dtype, pre, core in ((torch.float32, 1.0, average), (torch.float64, 1.0, average),
                             (torch.float16, 1.0, plain), (torch.float32, 2.0, plain)):
        name = f"gpu.avg.{dtype}.{pre}"
        t = torch.full((5,), float(hvd.rank()) + 0.5, device=dev, dtype=dtype)
        for _ in range(3):  # the lane's repeats: the immediate path where it applies
            got = hvd.allreduce(t, name=name, prescale_factor=pre)
            torch.cuda.current_stream(dev).synchronize()
            assert torch.equal(got, torch.full_like(t, want * pre)), (dtype, pre)
        request = lanes.get(f"allreduce.{name}").request
        assert (request.op, request.postscale) == core, (dtype, pre, request)


def test_cuda_call_follows_torchs_current_stream(hvd: Any) -> None:
    """The stream a call is ordered on is torch's current one, looked up by its raw handle
    each call: a call under a side stream, then the default stream again, then another side
    stream, each reduces its producer's values."""
    dev = _device(hvd)
    t = torch.zeros((1 << 20,), device=dev)
    total = _rank_sum(hvd, lambda r: r + 1)
    for k, stream in enumerate((torch.cuda.Stream(dev), None, torch.cuda.Stream(dev), None)):
        ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(
            torch.cuda.default_stream(dev))
        with ctx:
            # t's memory was last written on another stream (its zeros on the default one):
            # the producer's stream waits for that first, as torch asks of any user.
            torch.cuda.current_stream(dev).wait_stream(torch.cuda.default_stream(dev))
            t.fill_(float(hvd.rank() + 1))
            for _ in range(10):  # keep the producer busy on this stream
                t.mul_(1.0)
            got = hvd.allreduce(t, op=hvd.Sum, name="gpu.streams")
            torch.cuda.current_stream(dev).synchronize()
        values = torch.unique(got).tolist()
        assert values == [total], f"call {k}: got the values {values}, expected only {total}"


# -- every collective, autograd and training on CUDA (at 2 ranks on one GPU: through CUDA IPC)

def test_every_collective_on_cuda(hvd: Any) -> None:
    dev = _device(hvd)
    r, n = hvd.rank(), hvd.size()
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
                  torch.float16):
        x = torch.arange(12, device=dev).to(dtype).reshape(3, 4) + r
        want = sum(torch.arange(12, device=dev).to(torch.float64) + k for k in range(n))
        got = hvd.allreduce(x, op=hvd.Sum, name=f"every.sum.{dtype}")
        assert got.device == dev and got.dtype == dtype
        assert torch.equal(got.to(torch.float64).reshape(-1), want)
        got = hvd.allreduce(x, op=hvd.Max, name=f"every.max.{dtype}")
        assert torch.equal(got.reshape(-1).to(torch.float64),
                           torch.arange(12, device=dev).to(torch.float64) + n - 1)
    avg = hvd.allreduce(torch.full((5,), float(r), device=dev), name="every.avg")
    assert torch.allclose(avg, torch.full((5,), (n - 1) / 2, device=dev))
    grouped = hvd.grouped_allreduce([torch.full((k + 1,), float(r + k), device=dev)
                                     for k in range(4)], op=hvd.Sum, name="every.grouped")
    for k, t in enumerate(grouped):
        assert torch.equal(t, torch.full((k + 1,), _rank_sum(hvd, lambda q, k=k: q + k),
                                         device=dev))
    ag = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int64, device=dev), name="every.ag")
    assert torch.equal(ag, torch.cat([torch.full((q + 1, 2), q, dtype=torch.int64, device=dev)
                                      for q in range(n)]))
    for root in range(n):
        bc = hvd.broadcast(torch.full((3,), float(r), device=dev), root, name=f"every.bc.{root}")
        assert torch.equal(bc, torch.full((3,), float(root), device=dev))
    splits = torch.tensor([q + 1 for q in range(n)], dtype=torch.int32)
    rows = torch.cat([torch.full((q + 1, 2), 10 * r + q, device=dev) for q in range(n)])
    out, received = hvd.alltoall(rows, splits=splits, name="every.a2a")
    assert torch.equal(out, torch.cat([torch.full((r + 1, 2), 10 * q + r, device=dev)
                                       for q in range(n)]))
    assert received.tolist() == [r + 1] * n
    rs = hvd.reducescatter(torch.ones(2 * n, 3, device=dev) * (r + 1), op=hvd.Sum,
                           name="every.rs")
    assert torch.equal(rs, torch.full((2, 3), _rank_sum(hvd, lambda q: q + 1), device=dev))
    handle = hvd.allreduce_async(torch.ones(7, device=dev), op=hvd.Sum, name="every.async")
    assert torch.equal(hvd.synchronize(handle), torch.full((7,), float(n), device=dev))


def test_autograd_on_cuda(hvd: Any) -> None:
    dev = _device(hvd)
    r, n = hvd.rank(), hvd.size()
    x = torch.full((4,), float(r + 1), device=dev, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum, name="ag.grad.ar") * 2).sum().backward()
    # The gradient of a sum allreduce is the allreduce of the upstream gradient.
    assert torch.equal(x.grad, torch.full((4,), 2.0 * n, device=dev))
    y = torch.full((r + 1, 2), 1.0, device=dev, requires_grad=True)
    g = hvd.allgather(y, name="ag.grad.ag")
    (g * torch.arange(g.shape[0], device=dev).unsqueeze(1)).sum().backward()
    start = sum(q + 1 for q in range(r))
    # Each rank's rows receive the average over ranks of their upstream gradient (Horovod's
    # rule); here every rank's upstream gradient is the same.
    want = torch.arange(start, start + r + 1, device=dev, dtype=torch.float32)
    assert torch.equal(y.grad, want.unsqueeze(1).expand(r + 1, 2))


def test_cuda_training_matches_one_process_on_the_whole_batch(hvd: Any) -> None:
    """20 steps of DistributedOptimizer on CUDA: the same parameters as one process on the
    concatenated batch, and the very same bits on every rank."""
    dev = _device(hvd)
    n, steps, batch = hvd.size(), 20, 8

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                                   torch.nn.Linear(12, 1)).to(dev)

    def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 7919 + rank)
        x = torch.randn(batch, 6, generator=gen)
        return x.to(dev), x.sum(dim=1, keepdim=True).sin().to(dev)

    def flat(m: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    for step in range(steps):
        ref_opt.zero_grad()
        xs, ys = zip(*[data(step, q) for q in range(n)], strict=True)
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    mine = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.5),
                                   named_parameters=mine.named_parameters())
    hvd.broadcast_parameters(mine.state_dict(), root_rank=0)
    for step in range(steps):
        opt.zero_grad()
        x, y = data(step, hvd.rank())
        torch.nn.functional.mse_loss(mine(x), y).backward()
        opt.step()
    got, want = flat(mine), flat(ref)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    everyone = hvd.allgather(got.unsqueeze(0), name="train.params")
    assert all(torch.equal(everyone[0], row) for row in everyone)


class _SlowGrad(torch.autograd.Function):
    """Identity whose backward first spins the GPU for ``cycles`` (``torch.cuda._sleep``):
    the gradients behind it, and so their bucket's READY event, come only after the spin."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cycles: int) -> torch.Tensor:
        ctx.cycles = cycles
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        torch.cuda._sleep(ctx.cycles)
        return grad, None


@pytest.mark.parametrize("views,scheduled", [(True, True), (False, True), (True, False)])
def test_cuda_step_is_stream_ordered(hvd: Any, views: bool, scheduled: bool) -> None:
    """step() returns while the gradients' producer (a ~0.2 s spin) still runs, so it did not
    wait on the host for their allreduce (which cannot finish before the spin); a kernel
    launched right after step() on the current stream reads the reduced gradients, exactly.
    On the agreed schedule (from the second step) and negotiated (the schedule off: every
    step, the first one's bucket set-up included). In both completion modes (the suite runs
    in each).

    Two host waits are not the optimizer's and are kept out: CUDA loads a kernel's module at
    its first launch (lazy loading), and that load waits for the device (run 110: the first
    views step's gradient copy waited out the spin), so a throwaway optimizer runs one step
    first; and the first step's end opens the schedule, one blocking exchange that builds its
    communicator, so a scheduled first step is not asked to beat the spin."""
    dev = _device(hvd)
    shapes = [(64, 32), (32,), (7, 3)]

    def optimizer(tag: str) -> tuple[Any, list[torch.nn.Parameter]]:
        params = [torch.nn.Parameter(torch.zeros(s, device=dev)) for s in shapes]
        with n_rank_path():
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(params, lr=0.0),
                named_parameters=[(f"{tag}.{k}", p) for k, p in enumerate(params)],
                gradient_as_bucket_view=views)
        return opt, params

    cycles = int(torch.cuda.get_device_properties(dev).clock_rate * 1000 * 0.2)  # ~0.2 s
    with knobs(optimizer_schedule=False):
        warm, warm_params = optimizer(f"so{views}{scheduled}.warm")
        sum((p * 1.0).sum() for p in warm_params).backward()
        warm.step()
    opt, params = optimizer(f"so{views}{scheduled}")
    with knobs(optimizer_schedule=scheduled):
        for step in range(3):
            opt.zero_grad()
            coeffs = [torch.full(s, float(hvd.rank() + step + k) / 2, device=dev)
                      for k, s in enumerate(shapes)]
            torch.cuda.synchronize(dev)
            sum((_SlowGrad.apply(p, cycles) * c).sum()
                for p, c in zip(params, coeffs, strict=True)).backward()
            opt.step()
            stream = torch.cuda.current_stream(dev)
            busy = not stream.query()  # the spin is still running: step() did not wait for it
            read = torch.cat([p.grad.reshape(-1) for p in params])  # launched after step()
            torch.cuda.synchronize(dev)
            assert busy or (scheduled and step == 0), \
                f"step {step}: the current stream was idle when step() returned"
            want = torch.cat([torch.full(s, _rank_sum(hvd, lambda r: (r + step + k) / 2)  # noqa: B023
                                         / hvd.size(), device=dev).reshape(-1)
                              for k, s in enumerate(shapes)])
            assert torch.equal(read, want), step
    if not scheduled:  # (scheduled, it may still negotiate: ranks sharing a GPU do)
        assert "optimizer_schedule knob is off" in opt.unscheduled_reason


@pytest.mark.parametrize("views,compression,predivide", [
    (True, "none", 1.0), (False, "none", 1.0), (True, "fp16", 1.0), (False, "none", 2.0)])
def test_cuda_optimizer_lane_reduces_exactly_in_the_agreed_order(
        hvd: Any, views: bool, compression: str, predivide: float) -> None:
    """From the second step the buckets are launched by the autograd thread on the agreed
    schedule (CUDA over NCCL: a GPU per rank, or one rank): exact averages every step, a
    bucket left without gradients on some ranks reduced as zeros, and one launch per bucket
    per step. Two ranks sharing a GPU (CUDA IPC) keep negotiating, exactly too."""
    dev = _device(hvd)
    shapes = [(64, 32), (32,), (7, 3), (5,), (300,)]
    params = [torch.nn.Parameter(torch.zeros(s, device=dev)) for s in shapes]
    with n_rank_path():
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(params, lr=0.0),
            named_parameters=[(f"lane{views}{compression}{predivide}.{k}", p)
                              for k, p in enumerate(params)],
            gradient_as_bucket_view=views, bucket_cap_mb=800 / 2**20,
            compression=getattr(hvd.Compression, compression),
            gradient_predivide_factor=predivide)
    steps = 4
    for step in range(steps):
        opt.zero_grad()
        # Parameter 3 is used by rank 0 only at odd steps: elsewhere its gradient is None.
        used = [k for k in range(len(shapes)) if k != 3 or (step % 2 and hvd.rank() == 0)]
        sum((params[k] * float(hvd.rank() + step + k)).sum() for k in used).backward()
        opt.step()
        for k, (p, s) in enumerate(zip(params, shapes, strict=True)):
            if k == 3:
                want = float(step + 3) if step % 2 else 0.0  # rank 0's value, or zeros
            else:
                want = _rank_sum(hvd, lambda r: r + step + k)  # noqa: B023
            assert torch.equal(p.grad, torch.full(s, want / hvd.size(), device=dev)), (step, k)
    from hvdlite._engine import default_engine

    nccl = default_engine().device_transport(0) == "nccl"
    assert (opt.agreed_schedule is not None) == nccl, opt.unscheduled_reason
    if nccl:
        n = len(opt.bucket_names)
        assert n >= 3 and opt.agreed_schedule.launches == n * (steps - 1)
    else:
        assert "not NCCL" in opt.unscheduled_reason


@pytest.mark.parametrize("inplace", [False, True])
def test_persistent_grouped_allreduce_on_cuda(hvd: Any, inplace: bool) -> None:
    """``grouped_allreduce_init`` on CUDA tensors: on the NCCL schedule with a GPU per rank
    (no host wait: torch's current stream is ordered after it), on the negotiated route where
    ranks share a GPU (the reason says so); exact sums either way, call after call. In place,
    the results are in the tensors themselves, which lie end to end in the buffer."""
    dev = _device(hvd)
    shapes = [(4, 3), (7,)]
    tensors = [torch.zeros(s, device=dev) for s in shapes]
    group = hvd.grouped_allreduce_init(tensors, name=f"gpu.persistent.{inplace}", op=hvd.Sum,
                                       inplace=inplace)
    if inplace:
        assert tensors[1].data_ptr() == tensors[0].data_ptr() + 12 * 4
    shared = torch.cuda.device_count() < hvd.local_size()
    for step in range(3):
        for k, t in enumerate(tensors):
            t.fill_(float(hvd.rank() + k + step))
        got = group()
        torch.cuda.current_stream(dev).synchronize()
        assert not inplace or all(g is t for g, t in zip(got, tensors, strict=True))
        for k, g in enumerate(got):
            want = _rank_sum(hvd, lambda r, k=k, step=step: r + k + step)
            values = torch.unique(g).tolist()
            assert values == [want], f"step {step}, tensor {k}: got {values}, expected {want}"
        assert group.scheduled == (not shared), group.unscheduled_reason
