"""DistributedOptimizer and state broadcast: multi-rank training equals one process training on
the concatenated batch; every rank ends with identical parameters."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

STEPS = 20
BATCH = 8


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 7919 + micro * 131 + rank)
    x = torch.randn(BATCH, 6, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _reference(n: int, passes: int, make_opt: Any) -> torch.Tensor:
    """One process: each step's gradient is the sum over micro-batches of the gradient of the
    mean loss over every rank's micro-batch (what averaging per-rank gradients computes)."""
    model = _model()
    opt = make_opt(model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            xs, ys = zip(*[_batch(step, micro, r) for r in range(n)], strict=True)
            nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return _flat(model)


def _train(hvd: Any, passes: int, make_opt: Any, late_passes: bool = False,
           **kwargs: Any) -> torch.Tensor:
    model = _model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=1 if late_passes else passes,
                                   **kwargs)
    if late_passes:
        opt.set_backward_passes_per_step(passes)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            x, y = _batch(step, micro, hvd.rank())
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return _flat(model)


def _same_everywhere(hvd: Any, t: torch.Tensor) -> None:
    gathered = hvd.allgather(t.unsqueeze(0))
    assert all(torch.equal(gathered[0], row) for row in gathered)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_training_matches_one_process(hvd: Any, passes: int, compression: str) -> None:
    got = _train(hvd, passes, _sgd, late_passes=compression == "fp16",
                 compression=getattr(hvd.Compression, compression))
    _same_everywhere(hvd, got)
    expect = _reference(hvd.size(), passes, _sgd)
    tol = 1e-5 if compression == "none" else 1e-2
    assert torch.allclose(got, expect, atol=tol, rtol=tol), (got - expect).abs().max()


@pytest.mark.parametrize("kwargs", [{"groups": 2}, {"num_groups": 3},
                                    {"gradient_predivide_factor": 2.0}, {"op": "Sum"},
                                    {"sparse_as_dense": True}], ids=str)
def test_optimizer_options(hvd: Any, kwargs: dict[str, Any]) -> None:
    n = hvd.size()
    make_opt = _sgd
    if kwargs.get("op") == "Sum":
        kwargs = {"op": hvd.Sum}

        def make_opt(params: Any) -> torch.optim.Optimizer:  # Sum = Average with lr * n
            return torch.optim.SGD(params, lr=0.1 / n, momentum=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = _train(hvd, 1, make_opt, **kwargs)
    _same_everywhere(hvd, got)
    assert torch.allclose(got, _reference(n, 1, _sgd), atol=1e-5, rtol=1e-5)


def test_explicit_groups_and_hooks_overlap(hvd: Any) -> None:
    model = _model()
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   groups=[[params[0], params[2]]])
    x, y = _batch(0, 0, hvd.rank())
    nn.functional.mse_loss(model(x), y).backward()
    if hvd.size() > 1:  # the hooks started every allreduce during backward()
        assert len(opt._handles) == 3
    opt.step()
    _same_everywhere(hvd, _flat(model))


def test_races_are_refused(hvd: Any) -> None:
    if hvd.size() == 1:
        pytest.skip("no hooks on one rank")
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    x, y = _batch(1, 0, hvd.rank())
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    with opt.skip_synchronize(), warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    opt.zero_grad()


def test_synchronize_then_clip_recipe(hvd: Any) -> None:
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    x, y = _batch(2, 0, hvd.rank())
    nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    _same_everywhere(hvd, grads)
    nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with opt.skip_synchronize():
        opt.step()
    _same_everywhere(hvd, _flat(model))
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(_sgd(model.parameters()), named_parameters=[("a", 1)])
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(_sgd(model.parameters()), backward_passes_per_step=0)
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(_sgd(model.parameters()), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    assert isinstance(opt, torch.optim.SGD)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_with_sparse_adam(hvd: Any, sparse_as_dense: bool) -> None:
    """Sparse gradients are gathered, or (sparse_as_dense) reduced densely and handed back
    sparse as in Horovod: either way SparseAdam steps and matches one process."""
    n, me = hvd.size(), hvd.rank()

    def run(ranks: list[int], distributed: bool) -> torch.Tensor:
        torch.manual_seed(3)
        emb = nn.Embedding(10, 3, sparse=True)
        opt: Any = torch.optim.SparseAdam(emb.parameters(), lr=0.05)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=emb.named_parameters(),
                                           sparse_as_dense=sparse_as_dense)
        for step in range(5):
            opt.zero_grad()
            idx = torch.cat([torch.tensor([(step + r) % 10, (3 * r + 1) % 10]) for r in ranks])
            (emb(idx).pow(2).sum() / (2 * len(ranks))).backward()
            opt.step()
            assert emb.weight.grad is not None and emb.weight.grad.is_sparse
        return emb.weight.detach().clone()

    got = run([me], True)
    _same_everywhere(hvd, got.reshape(-1))
    assert torch.allclose(got, run(list(range(n)), False), atol=1e-6)


def _state(opt: torch.optim.Optimizer) -> list[Any]:
    sd = opt.state_dict()
    out: list[Any] = [(k, g[k]) for g in sd["param_groups"] for k in sorted(g) if k != "params"]
    for pid in sorted(sd["state"]):
        for k, v in sorted(sd["state"][pid].items()):
            out.append((f"{pid}.{k}", v.clone() if torch.is_tensor(v) else v))
    return out


def _equal(a: Any, b: Any) -> bool:
    """Exact equality of nested state (tensors bit for bit, same dtypes and Python types)."""
    if type(a) is not type(b):
        return False
    if torch.is_tensor(a):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


OPTIMIZERS = [name for name in ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW",
                                 "Adamax", "LBFGS", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD")
              if hasattr(torch.optim, name)]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_broadcast_optimizer_state_round_trip(hvd: Any, cls: str) -> None:
    me = hvd.rank()
    kwargs = {"SGD": {"lr": 0.1, "momentum": 0.9}, "RMSprop": {"lr": 0.01, "centered": True}}
    opt_cls = getattr(torch.optim, cls)
    model = _model(seed=me)  # different on every rank
    opt = opt_cls(model.parameters(), **kwargs.get(cls, {"lr": 0.01}))
    for step in range(3 + me):  # different state (and step counts) on every rank
        x, y = _batch(step, 0, me)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    opt.param_groups[0]["lr"] = 0.5 + me
    root_state = hvd.broadcast_object(_state(opt) if me == 0 else None, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    got = _state(opt)
    assert len(got) == len(root_state)
    for a, b in zip(got, root_state, strict=True):
        assert a[0] == b[0] and _equal(a[1], b[1]), a[0]
    # a fresh optimizer (no state yet) receives the root's state too
    fresh = opt_cls(model.parameters(), **kwargs.get(cls, {"lr": 0.01}))
    if me == 0:
        fresh.load_state_dict(opt.state_dict())
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    assert len(_state(fresh)) == len(root_state)


@pytest.mark.parametrize("cls", ["SGD", "SparseAdam"])
def test_broadcast_optimizer_state_without_state_gives_zero_grads(hvd: Any, cls: str) -> None:
    """As Horovod (which then takes a dummy step): a rank whose optimizer has no state gets a
    zero gradient on every parameter that requires one and has none; frozen parameters keep
    None, and nothing steps (the parameters do not move)."""
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    live = nn.Parameter(torch.full((3, 2), 2.0))
    kept = nn.Parameter(torch.ones(4))
    kept.grad = torch.full((4,), 7.0)
    if cls == "SGD":
        opt: Any = torch.optim.SGD([frozen, live, kept], lr=0.1, momentum=0.9,
                                   weight_decay=0.1)
    else:
        opt = torch.optim.SparseAdam([live], lr=0.1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert frozen.grad is None
    assert live.grad is not None and live.grad.is_sparse == (cls == "SparseAdam")
    assert torch.equal(live.grad.to_dense(), torch.zeros(3, 2))
    assert torch.equal(live.detach(), torch.full((3, 2), 2.0))
    assert torch.equal(kept.grad, torch.full((4,), 7.0))
    assert hvd.broadcast(live.grad.to_dense(), root_rank=0, name="bos.zero").abs().sum() == 0


class _TwoBranches(nn.Module):
    """Two branches whose gradients backward makes ready in the order the forward ran them
    (later nodes first): ``flip`` runs them the other way round."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, flip: bool = False) -> torch.Tensor:
        if flip:
            yb = self.b(x)
            return (self.a(x).tanh() + yb.tanh()).sum(dim=1, keepdim=True)
        ya = self.a(x)
        return (ya.tanh() + self.b(x).tanh()).sum(dim=1, keepdim=True)


def _python_hooks(model: nn.Module) -> int:
    return sum(1 for p in model.parameters() for h in p._post_accumulate_grad_hooks.values()
               if not hasattr(h, "__self__"))  # list.append, bound to the list: a C hook


def _branch_step(hvd: Any, model: _TwoBranches, opt: Any, step: int, flip: bool) -> None:
    x, y = _batch(step, 0, hvd.rank())
    nn.functional.mse_loss(model(x, flip), y).backward()


def test_after_the_first_step_one_python_hook_a_bucket_starts_it_in_backward(hvd: Any) -> None:
    """From the second step, each bucket's members are counted by C-level hooks and only
    the member backward makes ready last has a Python hook, which starts the bucket during
    backward: the same parameters on every rank, step after step."""
    if hvd.size() == 1:
        pytest.skip("no hooks on one rank")
    model = _TwoBranches()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   bucket_cap_mb=120 / 2**20, last_bucket_cap_mb=None)
    assert len(opt._buckets) == 2  # a weight (96 B) and a bias (16 B) each
    assert _python_hooks(model) == 8  # per parameter, and the first step's order watchers
    for step in range(4):
        opt.zero_grad()
        _branch_step(hvd, model, opt, step, False)
        if step > 0:
            assert _python_hooks(model) == len(opt._buckets)
            assert len(opt._handles) == len(opt._buckets), "a bucket waited for step()"
        opt.step()
        _same_everywhere(hvd, _flat(model))


def test_a_step_in_another_order_goes_back_to_per_parameter_hooks(hvd: Any) -> None:
    """One bucket of both branches: the first step shows backward's order, the second runs
    the branches the other way round, so the counted bucket's last member is not last. That
    step is still right (the bucket starts at step()), and from then on every parameter has
    its Python hook again, which starts the bucket in backward whatever the order."""
    if hvd.size() == 1:
        pytest.skip("no hooks on one rank")
    model, ref = _TwoBranches(), _TwoBranches()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    ref_opt = _sgd(ref.parameters())
    assert len(opt._buckets) == 1
    for step, flip in enumerate([False, True, True, False]):
        opt.zero_grad()
        ref_opt.zero_grad()
        _branch_step(hvd, model, opt, step, flip)
        if step == 1:
            assert _python_hooks(model) == 1 and not opt._handles  # counted, missed
        if step >= 2:
            assert _python_hooks(model) == 4 and len(opt._handles) == 1
        opt.step()
        xs, ys = zip(*[_batch(step, 0, r) for r in range(hvd.size())], strict=True)
        nn.functional.mse_loss(ref(torch.cat(xs), flip), torch.cat(ys)).backward()
        ref_opt.step()
        assert torch.allclose(_flat(model), _flat(ref), atol=1e-5, rtol=1e-5), step


def test_counted_hooks_refuse_gradients_accumulated_after_the_bucket_started(hvd: Any) -> None:
    """With counted hooks, a second whole backward before step() raises in backward (the
    last member's hook), and a second backward that reaches only some members raises in
    step(): the gradients are not to be trusted either way."""
    if hvd.size() == 1:
        pytest.skip("no hooks on one rank")
    model = _TwoBranches()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    x, y = _batch(0, 0, hvd.rank())
    for _ in range(2):  # the first step shows the order; counted hooks from the second
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert _python_hooks(model) == 1
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    model.b(x).sum().backward()  # only branch b's parameters again (not the last member)
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        opt.step()
