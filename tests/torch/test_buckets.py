"""DistributedOptimizer's gradient buckets and ``gradient_as_bucket_view``, and the per-tensor
view cache of the torch layer: exact results against NumPy references built from every rank's
inputs, gradients that alias their bucket, and gradients a user replaces or sets to None.

Every gradient here is exact: the loss is ``sum_k (p_k * c_k).sum()`` so ``p_k.grad`` is
``c_k``, halves in [-8, 8] derived from (seed, rank); their average over a power-of-two rank
count is exact in float32 (and compared to 1e-6 otherwise).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch_util import knobs

SHAPES = [(3, 4), (5,), (2, 2, 2), (7,), (1,)]


def _coeffs(seed: int, rank: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    rng = np.random.default_rng([seed, rank])
    return [torch.from_numpy(rng.integers(-16, 17, size=s) / 2).to(dtype) for s in SHAPES]


def _mean(seed: int, size: int, extra: Any = None) -> list[np.ndarray]:
    """NumPy reference: the average over ranks of each rank's gradient (``extra(rank, k)``
    added to rank's gradient ``k`` when given)."""
    acc = [np.zeros(s) for s in SHAPES]
    for r in range(size):
        for k, c in enumerate(_coeffs(seed, r)):
            acc[k] += c.double().numpy() + (0.0 if extra is None else extra(r, k))
    return [(a / size).astype(np.float32) for a in acc]


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]


def _backward(params: list[torch.nn.Parameter], coeffs: list[torch.Tensor]) -> None:
    sum((p * c).sum() for p, c in zip(params, coeffs, strict=True)).backward()  # type: ignore[union-attr]


def _check(params: list[torch.nn.Parameter], expected: list[np.ndarray], size: int,
           tol: float = 1e-6) -> None:
    """The gradients are the reference: exactly where the average's 1 / size is exact (a
    power of two), else to ``tol`` (one rounding of the scale, in the wire's precision)."""
    tol = 0.0 if size & (size - 1) == 0 else tol
    for k, (p, e) in enumerate(zip(params, expected, strict=True)):
        assert p.grad is not None, k
        np.testing.assert_allclose(p.grad.float().numpy(), e, rtol=tol, atol=0,
                                   err_msg=f"param {k}")


def _optimizer(hvd: Any, params: list[torch.nn.Parameter], **kwargs: Any) -> Any:
    named = [(f"p{k}", p) for k, p in enumerate(params)]
    return hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=named,
                                    **kwargs)


def _needs_ranks(hvd: Any) -> None:
    if hvd.size() < 2:
        pytest.skip("DistributedOptimizer registers no hooks at size 1 (Horovod's rule)")


@pytest.mark.parametrize("cap_mb", [25.0, 40 / 2**20])
def test_bucket_views_alias_their_buffer_and_reduce_exactly(hvd: Any, cap_mb: float) -> None:
    _needs_ranks(hvd)
    params = _params()
    opt = _optimizer(hvd, params, gradient_as_bucket_view=True, bucket_cap_mb=cap_mb)
    assert (len(opt._buckets) > 1) == (cap_mb < 1)
    assert all(p.grad is None for p in params)  # views come at a bucket's first reduction
    views: list[Any] = []
    for step in range(3):
        opt.zero_grad()
        _backward(params, _coeffs(100 + step, hvd.rank()))
        opt.step()
        _check(params, _mean(100 + step, hvd.size()), hvd.size())
        views = views or [p.grad for p in params]
        for p, view in zip(params, views, strict=True):
            assert p.grad is view  # autograd accumulated into the view; nothing replaced it
    for bucket in opt._buckets:
        assert bucket.buffer is not None
        ptr, item = bucket.buffer.data_ptr(), bucket.buffer.element_size()
        for p in bucket.params:  # views of the bucket in order, each on a 16-byte boundary
            assert p.grad.data_ptr() == ptr
            ptr += -(-p.numel() * item // 16) * 16


def test_bucket_views_take_back_a_replaced_or_missing_grad(hvd: Any) -> None:
    _needs_ranks(hvd)
    params = _params()
    opt = _optimizer(hvd, params, gradient_as_bucket_view=True)
    _backward(params, _coeffs(6, hvd.rank()))
    opt.step()
    views = [p.grad for p in params]
    opt.zero_grad()
    params[0].grad = None  # autograd makes a new gradient tensor
    mine = torch.full(SHAPES[1], float(hvd.rank() + 1))
    params[1].grad = mine  # autograd accumulates into the user's tensor
    _backward(params, _coeffs(7, hvd.rank()))
    opt.step()

    def extra(rank: int, k: int) -> float:
        return float(rank + 1) if k == 1 else 0.0

    _check(params, _mean(7, hvd.size(), extra), hvd.size())
    assert all(p.grad is v for p, v in zip(params, views, strict=True))
    assert mine.data_ptr() != views[1].data_ptr()
    # zero_grad(set_to_none=False): the views stay, zeroed in place (one memset per bucket).
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is v and not bool(v.any()) for p, v in zip(params, views, strict=True))
    _backward(params, _coeffs(8, hvd.rank()))
    assert all(p.grad is v for p, v in zip(params, views, strict=True))  # accumulated there
    opt.step()
    _check(params, _mean(8, hvd.size()), hvd.size())
    # zero_grad() (set_to_none, the default): None, as torch; the reduction copies the fresh
    # gradients into the buffer and points .grad at the views again.
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    _backward(params, _coeffs(9, hvd.rank()))  # the last hook started the bucket
    opt.step()
    _check(params, _mean(9, hvd.size()), hvd.size())
    assert all(p.grad is v for p, v in zip(params, views, strict=True))


def test_bucket_views_accumulate_over_backward_passes(hvd: Any) -> None:
    _needs_ranks(hvd)
    params = _params()
    opt = _optimizer(hvd, params, gradient_as_bucket_view=True, backward_passes_per_step=2)
    opt.zero_grad()
    _backward(params, _coeffs(11, hvd.rank()))
    _backward(params, _coeffs(12, hvd.rank()))
    opt.step()
    second = _mean(12, hvd.size())
    _check(params, [a + b for a, b in zip(_mean(11, hvd.size()), second, strict=True)],
           hvd.size())


def test_bucket_views_parameter_without_grad_on_some_ranks(hvd: Any) -> None:
    _needs_ranks(hvd)
    params = _params()
    opt = _optimizer(hvd, params, gradient_as_bucket_view=True)
    opt.zero_grad()
    coeffs = _coeffs(13, hvd.rank())
    used = params if hvd.rank() == 0 else params[1:]  # p0 gets no gradient on ranks > 0
    _backward(used, coeffs if hvd.rank() == 0 else coeffs[1:])
    opt.step()

    def extra(rank: int, k: int) -> Any:
        return -_coeffs(13, rank)[0].double().numpy() if k == 0 and rank > 0 else 0.0

    _check(params, _mean(13, hvd.size(), extra), hvd.size())


@pytest.mark.parametrize("view", [False, True])
def test_buckets_of_mixed_dtypes_and_a_small_cap(hvd: Any, view: bool) -> None:
    _needs_ranks(hvd)
    params = _params()
    params[2] = torch.nn.Parameter(torch.zeros(SHAPES[2], dtype=torch.float64))
    opt = _optimizer(hvd, params, gradient_as_bucket_view=view, bucket_cap_mb=30 / 2**20)
    assert all(len({p.dtype for p in b.params}) == 1 for b in opt._buckets)
    assert len(opt._buckets) >= 3
    for step in range(2):
        opt.zero_grad()
        coeffs = _coeffs(20 + step, hvd.rank())
        coeffs[2] = coeffs[2].double()
        _backward(params, coeffs)
        opt.step()
        expected = _mean(20 + step, hvd.size())
        _check(params, expected, hvd.size())


def test_bucket_view_with_compression_is_reduced_correctly(hvd: Any) -> None:
    _needs_ranks(hvd)
    params = _params()
    opt = _optimizer(hvd, params, gradient_as_bucket_view=True,
                     compression=hvd.Compression.fp16)
    for step in range(2):  # fp16 holds these halves exactly: the casts lose nothing
        opt.zero_grad()
        _backward(params, _coeffs(30 + step, hvd.rank()))
        opt.step()
        _check(params, _mean(30 + step, hvd.size()), hvd.size(), tol=2**-10)
    # A cast compressor: the bucket lives in its buffer, cast whole into one float16 twin.
    assert all(b.views and b.wire is not None and b.wire.dtype == torch.float16
               for b in opt._buckets)


def test_cached_view_follows_the_tensors_memory(hvd: Any) -> None:
    n, me = hvd.size(), hvd.rank()
    t = torch.full((4,), float(me + 1))
    assert torch.equal(hvd.allreduce_(t, op=hvd.Sum, name="cache.a"),
                       torch.full((4,), float(n * (n + 1) // 2)))
    t.data = torch.full((4,), float(me))  # new memory behind the same tensor object
    assert torch.equal(hvd.allreduce_(t, op=hvd.Sum, name="cache.a"),
                       torch.full((4,), float(n * (n - 1) // 2)))
    t.resize_(2, 2)  # same memory, new shape
    t.fill_(1.0)
    assert torch.equal(hvd.allreduce_(t, op=hvd.Sum, name="cache.b"), torch.full((2, 2), n * 1.0))
    t.t_()  # square: same pointer and shape, strides swapped
    assert t.is_contiguous() is False
    with pytest.raises(ValueError, match="contiguous"):
        hvd.allreduce_(t, name="cache.c")
    u = torch.full((3,), float(me + 2))
    h1 = hvd.allreduce_async(u, op=hvd.Sum, name="cache.d")
    out = hvd.synchronize(h1)
    assert out is not u and torch.equal(u, torch.full((3,), float(me + 2)))
    assert torch.equal(out, torch.full((3,), float(sum(r + 2 for r in range(n)))))
    assert hvd.synchronize(h1) is out  # the result is computed once


def test_fp16_factors_and_bf16_take_the_general_path_exactly(hvd: Any) -> None:
    n, me = hvd.size(), hvd.rank()
    half = torch.full((5,), float(me + 1), dtype=torch.float16)
    got = hvd.allreduce(half, op=hvd.Sum, prescale_factor=1 / 3, name="gp.h")
    expect = sum((torch.full((5,), float(r + 1), dtype=torch.float16).float() / 3).half()
                 .float() for r in range(n)).half()
    assert torch.equal(got, expect)
    bf = torch.full((5,), float(me + 1), dtype=torch.bfloat16)
    assert torch.equal(hvd.allreduce(bf, op=hvd.Sum, name="gp.b"),
                       torch.full((5,), float(n * (n + 1) // 2), dtype=torch.bfloat16))


def test_results_are_reused_only_once_nothing_refers_to_them(hvd: Any) -> None:
    n, me = hvd.size(), hvd.rank()
    t = torch.full((16,), float(me + 1))
    total = float(n * (n + 1) // 2)
    results = [hvd.allreduce(t, op=hvd.Sum, name="ring") for _ in range(3)]  # all held
    assert len({r.data_ptr() for r in results}) == 3
    view = results[1][4:8]
    del results[1:]  # results[0] held; the second kept busy by its view; the third free
    t.fill_(float(me + 10))
    again = hvd.synchronize(hvd.allreduce_async(t, op=hvd.Sum, name="ring"))
    assert torch.equal(results[0], torch.full((16,), total))
    assert torch.equal(view, torch.full((4,), total))
    assert torch.equal(again, torch.full((16,), float(sum(r + 10 for r in range(n)))))


def test_ranks_that_build_different_buckets_fail_at_the_first_step(hvd: Any) -> None:
    """The buckets are checked alike on every rank before the first is reduced (the
    runtime's one agreement, hvdlite/torch/_scheduled.py): a rank whose model differs (here
    the last rank has one more parameter) gets MismatchError on every rank, naming that rank
    and the first differing bucket, instead of a stall on a bucket the others never reduce."""
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    shapes = SHAPES + ([(6,)] if hvd.rank() == hvd.size() - 1 else [])
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.1),
        named_parameters=[(f"agree.{k}", p) for k, p in enumerate(params)],
        groups=[[p] for p in params[:len(SHAPES)]], op=hvd.Sum)
    opt.zero_grad()
    last = hvd.size() - 1
    with pytest.raises(hvd.MismatchError, match=rf"gradient buckets: the ranks differ \(rank "
                                                rf"{last}: 6 entries, expected 5"):
        sum((p * 1.0).sum() for p in params[:len(SHAPES)]).backward()  # type: ignore[union-attr]
        opt.step()
    with pytest.raises(hvd.MismatchError, match="gradient buckets: the ranks differ"):
        opt.synchronize()  # and again at the next try, on every rank


def test_agreed_buckets_keep_being_negotiated_on_the_cpu(hvd: Any) -> None:
    """CPU buckets go over MPI: after the agreement no lane opens, and later steps still
    reduce exactly."""
    params = _params()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0),
                                   named_parameters=[(f"cpu.agree.{k}", p)
                                                     for k, p in enumerate(params)])
    for step in range(3):
        opt.zero_grad()
        _backward(params, _coeffs(step, hvd.rank()))
        opt.step()
        _check(params, _mean(step, hvd.size()), hvd.size())
    assert opt.agreed_schedule is None


@pytest.mark.parametrize("tail_bytes,want", [
    (70, ["p4", "p1"]),  # the first parameters up to the cap: p0 (48 bytes) and p1 (20)
    (40, ["p4", "p0"]),  # p0 alone, over the cap: the last bucket holds one at least
    (None, ["p4"]),  # no cap of its own: one bucket of everything
])
def test_last_bucket_holds_the_first_parameters_up_to_its_cap(
        hvd: Any, tail_bytes: int | None, want: list[str]) -> None:
    """Without ``groups``, the last bucket reduced holds the first parameters (backward
    computes their gradients last) up to ``last_bucket_cap_mb``, so little is left to reduce
    after backward; the buckets still reduce exactly. The five parameters (48, 20, 32, 28 and
    4 bytes) fit one 200-byte bucket, in reverse order: p4, p3, p2, p1, p0."""
    _needs_ranks(hvd)
    params = _params()
    tail_mb = None if tail_bytes is None else tail_bytes / 2**20
    opt = _optimizer(hvd, params, bucket_cap_mb=200 / 2**20, last_bucket_cap_mb=tail_mb)
    assert opt.bucket_names == [f"DistributedOptimizer.{n}.bucket{i}"
                                for i, n in enumerate(want)]
    for step in range(2):
        opt.zero_grad()
        _backward(params, _coeffs(300 + step, hvd.rank()))
        opt.step()
        _check(params, _mean(300 + step, hvd.size()), hvd.size())


@pytest.mark.parametrize("bad", [0, -1.0, "1", True])
def test_bad_last_bucket_cap_is_a_value_error(hvd: Any, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"last_bucket_cap_mb must be a positive number or "
                                         r"None, got"):
        _optimizer(hvd, _params(), last_bucket_cap_mb=bad)


@pytest.mark.parametrize("views,to_none", [(True, True), (True, False), (False, True)])
def test_buckets_follow_the_order_backward_made_the_gradients_ready(
        hvd: Any, views: bool, to_none: bool) -> None:
    """Registered p0, p1, p2, p3, but the forward chain is x * p1 * p2 * p3 * p0, so backward
    makes p0's gradient first and p1's last (as a class token registered before the layers).
    Before the first step the buckets guess reverse registration order ([p3, p2], [p1],
    [p0] with a 40-byte cap and a 16-byte last bucket: p0 last); after it they follow what
    backward did ([p0, p3], [p2], [p1]: p1 last), and every step reduces exactly (each
    gradient is x, every parameter being 1), with views and staged, zeroing to None and in
    place; the new buckets open the agreed schedule (host buckets: ``optimizer_host_schedule``)
    and run on it from the second step."""
    _needs_ranks(hvd)
    shapes = [(4,), (4,), (4,), (4,)]
    params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
    named = [(f"r{k}", p) for k, p in enumerate(params)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=named,
                                   gradient_as_bucket_view=views, bucket_cap_mb=40 / 2**20,
                                   last_bucket_cap_mb=16 / 2**20)
    name = "DistributedOptimizer.{}.bucket{}".format
    assert opt.bucket_names == [name("r3", 0), name("r1", 1), name("r0", 2)]
    with knobs(optimizer_host_schedule=True):  # read when the schedule opens: step 0's end
        _steps_in_ready_order(hvd, opt, params, name, to_none)
    schedule = opt.agreed_schedule
    assert schedule is not None, opt.unscheduled_reason
    assert schedule.launches == 3 * 2  # three buckets, steps 1 and 2


def _steps_in_ready_order(hvd: Any, opt: Any, params: list[torch.nn.Parameter], name: Any,
                          to_none: bool) -> None:
    for step in range(3):
        opt.zero_grad(set_to_none=to_none)
        x = torch.full((4,), float(hvd.rank() + step + 1))
        (x * params[1] * params[2] * params[3] * params[0]).sum().backward()
        opt.step()
        if step == 0:
            assert opt.bucket_names == [name("r0", 0), name("r2", 1), name("r1", 2)]
        want = sum(r + step + 1 for r in range(hvd.size())) / hvd.size()
        for k in range(4):
            assert params[k].grad is not None
            assert torch.equal(params[k].grad, torch.full((4,), float(want))), (step, k)


def test_realias_takes_back_every_kind_of_gradient_into_its_view() -> None:
    """``Bucket.realias`` per case, on one bucket: gradients all made afresh (zero_grad's
    None, then backward: the batched copy without a per-member comparison), a mix of a
    view, a fresh gradient, a missing one and a tensor over the view's own memory, and a
    sparse one (False, nothing touched). Afterwards every ``.grad`` is its view and holds
    the value it had (zero where it had none)."""
    from hvdlite.torch._buckets import Bucket

    params = _params()
    bucket = Bucket(params, "realias", 1)
    bucket.make_views()
    coeffs = _coeffs(7, 0)

    def check(want: list[torch.Tensor]) -> None:
        for p, v, w in zip(params, bucket.views, want, strict=True):
            assert p.grad is v
            assert torch.equal(v, w)

    for p, c in zip(params, coeffs, strict=True):  # all fresh
        p.grad = c.clone()
    assert bucket.realias()
    check(coeffs)
    assert bucket.realias()  # the steady state: nothing to do
    check(coeffs)

    fresh = [c * 2 for c in coeffs]
    params[1].grad = fresh[1].clone()
    params[2].grad = None
    params[3].grad = bucket.views[3].view(-1).view(SHAPES[3])  # the view's memory, new object
    assert bucket.realias()
    check([coeffs[0], fresh[1], torch.zeros(SHAPES[2]), coeffs[3], coeffs[4]])

    before = [v.clone() for v in bucket.views]
    params[0].grad = torch.ones(SHAPES[0])
    params[4].grad = torch.zeros(SHAPES[4]).to_sparse()
    assert not bucket.realias()
    assert all(torch.equal(v, b) for v, b in zip(bucket.views, before, strict=True))
    assert params[4].grad.is_sparse and torch.equal(params[0].grad, torch.ones(SHAPES[0]))


@pytest.mark.parametrize(("dtype", "sizes", "offsets", "total"), [
    (torch.float32, [10, 12, 1, 3], [0, 12, 24, 28], 31),  # a 10-class head's bias first
    (torch.bfloat16, [3, 8, 9], [0, 8, 16], 25),
    (torch.float64, [1, 1, 2], [0, 2, 4], 6),
    (torch.complex128, [1, 3, 1], [0, 1, 4], 5),  # 16 bytes an element: no padding
])
def test_bucket_members_start_on_16_byte_boundaries(dtype: torch.dtype, sizes: list[int],
                                                    offsets: list[int], total: int) -> None:
    """Every member's view starts on a 16-byte boundary of the bucket's buffer (a compiled
    backward writes a gradient in place only into an aligned view); the padding between is
    zeros, the agreed size is the padded buffer's, and the views cover every member."""
    from hvdlite.torch import _buckets, _scheduled

    params = [torch.nn.Parameter(torch.ones(n, dtype=dtype)) for n in sizes]
    bucket = _buckets.Bucket(params, "aligned", 1)
    assert (bucket.offsets, bucket.total) == (offsets, total)
    bucket.make_views()
    assert bucket.buffer is not None and bucket.buffer.numel() == total
    for p, view, at in zip(params, bucket.views, offsets, strict=True):
        assert view.data_ptr() == bucket.buffer.data_ptr() + at * p.element_size()
        assert view.data_ptr() % 16 == 0 and p.grad is view and view.shape == p.shape
    covered = torch.zeros(total, dtype=torch.bool)
    for p, at in zip(params, offsets, strict=True):
        covered[at:at + p.numel()] = True
    assert not bucket.buffer[~covered].any()  # the padding is zeros
    (slot,) = _scheduled.slots([bucket], [dtype], 0, 1.0, 1.0)
    assert slot.count == total
