"""DistributedOptimizer's step (issue 25) against torch DDP (gloo) on the same ranks: the
default (each bucket staged through its buffer) and bucket views, and every case that leaves
the plain path (a replaced, detached or missing ``.grad``, one replaced while on the wire,
fp16 compression, a sparse gradient), ``zero_grad`` with views, gradient accumulation
(``backward_passes_per_step``) and the AMP ``GradScaler`` recipe with ``skip_synchronize``.

Every gradient is exact: the model is ``loss = sum_k (w_k * c_k).sum()`` so ``w_k.grad`` is
``c_k``, halves in [-8, 8] drawn from (seed, rank, step); their average over a power-of-two
number of ranks is exact in float32 (and in float16), so hvdlite's parameters must equal DDP's
bit for bit (SGD with lr 0.5). At one rank the optimizer runs its N-rank path (the
``optimizer_size1_shortcut`` knob off while it is built), as DDP runs its reducer.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch_util import knobs, n_rank_path

SHAPES = [(3, 4), (5,), (2, 2, 2), (7,), (1,), (6, 2)]
STEPS = 3


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ws = nn.ParameterList(
            nn.Parameter(torch.arange(float(np.prod(s))).reshape(s) / 4) for s in SHAPES)

    def forward(self, coeffs: list[torch.Tensor]) -> torch.Tensor:
        return sum((w * c).sum() for w, c in zip(self.ws, coeffs, strict=True))  # type: ignore[return-value]


def _coeffs(seed: int, rank: int) -> list[torch.Tensor]:
    rng = np.random.default_rng([seed, rank])
    return [torch.from_numpy(rng.integers(-16, 17, size=s) / 2).float() for s in SHAPES]


def _exact(hvd: Any) -> None:
    if hvd.size() & (hvd.size() - 1):
        pytest.skip("exact averages need a power-of-two number of ranks")


@pytest.fixture(scope="module")
def ddp(hvd: Any) -> Iterator[None]:
    """A gloo process group over the same ranks (torch DDP is the reference)."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, 0, name="ddp.port")
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size(),
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _hvd_opt(hvd: Any, model: Model, **kwargs: Any) -> Any:
    with n_rank_path():
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                        named_parameters=model.named_parameters(), **kwargs)


def _ddp_train(hvd: Any, passes: int = 1) -> list[torch.Tensor]:
    model = Model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            ctx = ddp.no_sync() if micro < passes - 1 else contextlib.nullcontext()
            with ctx:
                ddp(_coeffs(10 * step + micro, hvd.rank())).backward()
        opt.step()
    return [w.detach().clone() for w in model.ws]


def _equal(got: Model, want: list[torch.Tensor]) -> None:
    for k, (w, e) in enumerate(zip(got.ws, want, strict=True)):
        assert torch.equal(w.detach(), e), (k, (w.detach() - e).abs().max())


def _train(hvd: Any, opt: Any, model: Model, between: Any = None, before: Any = None,
           set_to_none: bool = True) -> None:
    for step in range(STEPS):
        opt.zero_grad(set_to_none)
        if before is not None:
            before(model)
        model(_coeffs(10 * step, hvd.rank())).backward()
        if between is not None:
            between(model)
        opt.step()


def test_staged_step_equals_ddp(hvd: Any, ddp: None) -> None:
    _exact(hvd)
    model = Model()
    opt = _hvd_opt(hvd, model, bucket_cap_mb=100 / 2**20,  # several buckets
                   gradient_as_bucket_view=False)
    assert len(opt._buckets) > 1
    _train(hvd, opt, model)
    _equal(model, _ddp_train(hvd))
    assert all(b.staging is not None and not b.views for b in opt._buckets)
    opt.zero_grad()
    assert all(w.grad is None for w in model.ws)  # torch's semantics, untouched


def test_host_buckets_stay_negotiated_by_default(hvd: Any) -> None:
    model = Model()
    opt = _hvd_opt(hvd, model, bucket_cap_mb=100 / 2**20)
    _train(hvd, opt, model)
    assert opt.agreed_schedule is None
    assert "host memory (optimizer_host_schedule is off" in opt.unscheduled_reason


@pytest.mark.parametrize("views", [True, False])
def test_host_buckets_on_an_agreed_schedule_equal_ddp(hvd: Any, ddp: None, views: bool) -> None:
    """With ``optimizer_host_schedule`` the host buckets are launched by the autograd thread on
    an agreed schedule over MPI from the second step: one launch per bucket per step, and the
    parameters equal DDP's bit for bit."""
    _exact(hvd)
    model = Model()
    with knobs(optimizer_host_schedule=True, optimizer_size1_shortcut=False):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(),
                                       bucket_cap_mb=100 / 2**20, gradient_as_bucket_view=views)
        _train(hvd, opt, model)
    assert opt.unscheduled_reason == "", opt.unscheduled_reason
    n = len(opt.bucket_names)
    assert n > 1 and opt.agreed_schedule.launches == n * (STEPS - 1)
    _equal(model, _ddp_train(hvd))


def test_default_step_reduces_in_bucket_views_and_equals_ddp(hvd: Any, ddp: None) -> None:
    _exact(hvd)
    model = Model()
    opt = _hvd_opt(hvd, model, bucket_cap_mb=100 / 2**20)  # the default: bucket views
    assert len(opt._buckets) > 1
    _train(hvd, opt, model)
    _equal(model, _ddp_train(hvd))
    for bucket in opt._buckets:  # the gradients the step read live in the bucket's buffer
        assert bucket.buffer is not None
        ptr = bucket.buffer.data_ptr()
        for w in bucket.params:  # in order, each on a 16-byte boundary
            assert w.grad.data_ptr() == ptr
            ptr += -(-w.numel() * w.element_size() // 16) * 16


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("case", ["replaced", "detached", "missing", "module_zero_grad",
                                  "replaced_in_flight"])
def test_each_fallback_equals_ddp(hvd: Any, ddp: None, case: str, views: bool) -> None:
    """A ``.grad`` the user replaces (before backward: backward accumulates into it), detaches,
    sets to None, or replaces while its bucket is on the wire (the reduced value wins, as in
    Horovod): the bucket copies it in (one batched copy) and the step equals DDP's."""
    _exact(hvd)
    model = Model()
    opt = _hvd_opt(hvd, model, gradient_as_bucket_view=views)
    want = _ddp_train(hvd)
    before = between = None
    if case == "replaced":
        def before(m: Model) -> None:
            for w in m.ws:
                w.grad = torch.zeros_like(w)
    elif case == "detached":
        def between(m: Model) -> None:
            for w in m.ws:
                w.grad = w.grad.detach()
    elif case == "missing":  # after zero_grad(set_to_none=False): the others stay views
        def before(m: Model) -> None:
            m.ws[0].grad = None
    elif case == "module_zero_grad":
        def before(m: Model) -> None:
            m.zero_grad()
    else:
        def between(m: Model) -> None:
            m.ws[1].grad = torch.full_like(m.ws[1], 1000.0)  # not what DDP reduces
    _train(hvd, opt, model, between=between, before=before, set_to_none=case != "missing")
    _equal(model, want)


@pytest.mark.parametrize("views", [False, True])
def test_fp16_compression_casts_the_bucket_and_equals_ddp(hvd: Any, ddp: None,
                                                          views: bool) -> None:
    """fp16 compression: one cast of the bucket (its staging buffer is float16, or its views'
    buffer has a float16 twin); halves up to 32 are exact in float16."""
    _exact(hvd)
    model = Model()
    opt = _hvd_opt(hvd, model, compression=hvd.Compression.fp16,
                   gradient_as_bucket_view=views)
    _train(hvd, opt, model)
    _equal(model, _ddp_train(hvd))
    bucket = opt._buckets[0]
    if views:
        assert bucket.views and bucket.wire is not None and bucket.wire.dtype == torch.float16
    else:
        assert bucket.staging is not None and bucket.staging.dtype == torch.float16


def test_sparse_gradient_bucket_falls_back(hvd: Any) -> None:
    """An embedding with sparse gradients: its bucket never gets views (SparseAdam needs them
    sparse) and reduces the gradient itself; the dense bucket beside it does get views. Both
    equal the average of every rank's."""
    _exact(hvd)
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    lin = nn.Linear(3, 1, bias=False)
    nn.init.constant_(emb.weight, 0.5)
    nn.init.constant_(lin.weight, 0.25)
    named = [("emb", emb.weight), ("lin", lin.weight)]
    with n_rank_path():
        opt = hvd.DistributedOptimizer(torch.optim.SGD([emb.weight, lin.weight], lr=0.0),
                                       named_parameters=named, gradient_as_bucket_view=True,
                                       groups=[[emb.weight], [lin.weight]])
    for _ in range(2):
        opt.zero_grad()
        lin(emb(torch.tensor([me % 10, (me + 3) % 10]))).sum().backward()
        opt.step()
    assert emb.weight.grad.is_sparse
    dense = emb.weight.grad.to_dense()
    want = torch.zeros(10, 3)
    for r in range(n):
        for i in (r % 10, (r + 3) % 10):
            want[i] += 0.25 / n
    assert torch.equal(dense, want)
    want_lin = sum(0.5 * 2 * torch.ones(1, 3) for _ in range(n)) / n
    assert torch.equal(lin.weight.grad, want_lin)
    viewed = {b.params[0] is lin.weight: bool(b.views) for b in opt._buckets}
    assert viewed == {True: True, False: False}


def test_zero_grad_with_views(hvd: Any) -> None:
    """``zero_grad(set_to_none=False)``: one memset per bucket, the gradients stay views and
    backward accumulates into them; ``zero_grad()``: None, as torch."""
    _exact(hvd)
    model = Model()
    opt = _hvd_opt(hvd, model, bucket_cap_mb=100 / 2**20, gradient_as_bucket_view=True)
    assert all(w.grad is None for w in model.ws)
    model(_coeffs(1, hvd.rank())).backward()
    opt.step()
    views = [w.grad for w in model.ws]
    opt.zero_grad(set_to_none=False)
    assert all(w.grad is v and not bool(v.any()) for w, v in zip(model.ws, views, strict=True))
    model(_coeffs(2, hvd.rank())).backward()
    assert all(w.grad is v for w, v in zip(model.ws, views, strict=True))
    opt.step()
    for w, c in zip(model.ws, _mean(hvd, 2), strict=True):
        assert torch.equal(w.grad, c)
    opt.zero_grad()
    assert all(w.grad is None for w in model.ws)


def _mean(hvd: Any, seed: int) -> list[torch.Tensor]:
    n = hvd.size()
    per = [_coeffs(seed, r) for r in range(n)]
    return [sum(c[k] for c in per) / n for k in range(len(SHAPES))]  # type: ignore[misc]


def test_backward_passes_per_step_equals_ddp_no_sync(hvd: Any, ddp: None) -> None:
    _exact(hvd)
    model = Model()
    opt = _hvd_opt(hvd, model, backward_passes_per_step=2)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            model(_coeffs(10 * step + micro, hvd.rank())).backward()
        opt.step()
    _equal(model, _ddp_train(hvd, passes=2))


def test_amp_grad_scaler_recipe_with_skip_synchronize(hvd: Any, ddp: None) -> None:
    """``scaler.scale(loss).backward(); opt.synchronize(); scaler.unscale_(opt);
    clip_grad_norm_; with opt.skip_synchronize(): scaler.step(opt); scaler.update()`` equals
    the same recipe on DDP (a power-of-two scale: exact)."""
    _exact(hvd)

    def run(distributed: bool) -> list[torch.Tensor]:
        model = Model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        if distributed:
            opt = _hvd_opt(hvd, model)
            fwd: Any = model
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            fwd = nn.parallel.DistributedDataParallel(model)
        for step in range(STEPS):
            opt.zero_grad()
            scaler.scale(fwd(_coeffs(10 * step, hvd.rank()))).backward()
            if distributed:
                opt.synchronize()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # large: leaves them exact
            if distributed:
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
        return [w.detach().clone() for w in model.ws]

    got, want = run(True), run(False)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), k


def test_a_dropped_optimizers_schedule_is_closed_by_the_next_open(hvd: Any) -> None:
    """An optimizer let go with its agreed schedule open: the next schedule's open closes the
    dropped one's transport (its MPI communicator freed), so a process that builds optimizers
    again and again does not run out of communicators (MPICH: about 2,000)."""
    import gc

    transports = []
    for _ in range(3):
        model = Model()
        with knobs(optimizer_host_schedule=True, optimizer_size1_shortcut=False):
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                           named_parameters=model.named_parameters(),
                                           bucket_cap_mb=100 / 2**20)
            _train(hvd, opt, model)
        assert opt.agreed_schedule is not None, opt.unscheduled_reason
        transports.append(opt.agreed_schedule.transport)
        assert transports[-1].comm is not None
        del opt, model
        gc.collect()
    # Each open closed the schedules dropped before it; the last one waits for the next.
    assert [t.comm is None for t in transports] == [True, True, False]


@pytest.mark.parametrize("op", ["average", "adasum"])
def test_a_dropped_optimizer_is_collected(hvd: Any, op: str) -> None:
    """A DistributedOptimizer let go after training is collected with its model: its hooks
    (which autograd keeps, out of the collector's sight) hold it weakly."""
    import gc
    import weakref

    if op == "adasum" and hvd.size() & (hvd.size() - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    model = Model()
    kw = {"op": hvd.Adasum} if op == "adasum" else {"bucket_cap_mb": 100 / 2**20}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), **kw)
    _train(hvd, opt, model)
    gone, params = weakref.ref(opt), weakref.ref(next(model.parameters()))
    del opt, model
    gc.collect()
    assert (gone(), params()) == (None, None)


def _small_buckets(hvd: Any, model: Model) -> Any:
    """SGD on ``model`` with buckets of at most 100 bytes (several)."""
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                    named_parameters=model.named_parameters(),
                                    bucket_cap_mb=100 / 2**20)


def test_move_schedule_of_host_buckets_stays_on_mpi_and_still_equals_ddp(hvd: Any,
                                                                       ddp: None) -> None:
    """``move_schedule`` (what ``make_graphed_step`` asks under ``schedule_transport=auto``):
    before the schedule opens it answers why there is none; host buckets' schedule stays on
    MPI, named; a bad ``via`` is ``ValueError``; mid-step (a bucket launched) ``HvdliteError``;
    and the steps after it still equal DDP's bit for bit."""
    _exact(hvd)
    model = Model()
    with knobs(optimizer_host_schedule=True, optimizer_size1_shortcut=False):
        opt = _small_buckets(hvd, model)
        assert opt.move_schedule("ipc") == "the first step has not run yet"
        with pytest.raises(ValueError, match="via must be one of nccl, ipc, got 'mpi'"):
            opt.move_schedule("mpi")
        launched: list[Any] = []

        def between(model: Model) -> None:
            schedule = opt.agreed_schedule
            if schedule is None:
                return
            assert schedule.via == "mpi"
            assert opt.move_schedule("ipc") == \
                "its buckets are in host memory (their schedule runs over MPI)"
            assert opt.agreed_schedule is schedule
            launched.append(schedule.launches)

        _train(hvd, opt, model, before=between)
        assert launched, opt.unscheduled_reason
        model(_coeffs(99, hvd.rank())).backward()  # buckets launched by the hooks
        with pytest.raises(hvd.HvdliteError, match="only between steps"):
            opt.move_schedule("nccl")
        opt.synchronize()
        opt.zero_grad()
    _equal(model, _ddp_train(hvd))


def test_move_schedule_of_buckets_on_no_schedule_says_why(hvd: Any, ddp: None) -> None:
    """Buckets on no schedule (host buckets with ``optimizer_host_schedule`` off; ranks that
    share a GPU are the case that opens one): ``move_schedule("ipc")`` tries to open one there
    (one exchange on every rank) and answers why it cannot, the same on every rank; "nccl" has
    nothing to move. The optimizer keeps negotiating, and its steps still equal DDP's bit for
    bit."""
    _exact(hvd)
    model = Model()
    with knobs(optimizer_host_schedule=False, optimizer_size1_shortcut=False):
        opt = _small_buckets(hvd, model)
        asked: list[str] = []

        def between(model: Model) -> None:
            if not asked and opt.unscheduled_reason != "the first step has not run yet":
                asked.append(opt.move_schedule("ipc"))
                asked.append(opt.move_schedule("nccl"))
                assert opt.agreed_schedule is None

        _train(hvd, opt, model, before=between)
    assert asked and "in host memory" in asked[0] and "optimizer_host_schedule" in asked[0], \
        asked
    assert asked[1] == "its buckets are on no schedule to move to nccl", asked
    everyone = hvd.allgather_object(asked)
    assert all(a == everyone[0] for a in everyone)
    _equal(model, _ddp_train(hvd))
