"""Gradients of the synchronous collectives: Horovod's rules, and finite differences of the
summed loss of every rank where those rules are the true gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch_util import make


def _grad(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    out = fn(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(g)
    assert x.grad is not None
    return x.grad


def _finite_difference(hvd: Any, fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
                       g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """d(sum over ranks of <g_r, fn(x)_r>)/dx on this rank, one coordinate at a time, every
    rank taking part in every evaluation (only the probing rank perturbs)."""
    n, me = hvd.size(), hvd.rank()
    out = torch.zeros_like(x)
    for owner in range(n):
        for i in range(x.numel()):
            vals = []
            for sign in (1.0, -1.0):
                xp = x.clone()
                if me == owner:
                    xp.view(-1)[i] += sign * eps
                y = fn(xp)
                y = y[0] if isinstance(y, tuple) else y
                local = (y * g).sum().reshape(1)
                vals.append(hvd.allreduce(local, op=hvd.Sum).item())
            if me == owner:
                out.view(-1)[i] = (vals[0] - vals[1]) / (2 * eps)
    return out


def test_allreduce_grad(hvd: Any) -> None:
    n, me = hvd.size(), hvd.rank()
    x = make(1, me, (3,), torch.float64)
    gs = [make(2, r, (3,), torch.float64) for r in range(n)]
    for op, expect in ((hvd.Sum, sum(gs)), (hvd.Average, sum(gs) / n)):
        def f(t: torch.Tensor, op: Any = op) -> torch.Tensor:
            return hvd.allreduce(t, op=op)
        got = _grad(f, x, gs[me])
        assert torch.allclose(got, expect)
        assert torch.allclose(got, _finite_difference(hvd, f, x, gs[me]), atol=1e-6)
    got = _grad(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0,
                                        postscale_factor=0.5), x, gs[me])
    assert torch.allclose(got, sum(gs))
    xs = [x, make(3, me, (2, 2), torch.float64)]
    ys = [t.clone().requires_grad_() for t in xs]
    outs = hvd.grouped_allreduce(ys, op=hvd.Sum)
    (outs[0].sum() * (me + 1) + outs[1].sum()).backward()
    total = n * (n + 1) / 2
    assert torch.allclose(ys[0].grad, torch.full((3,), total, dtype=torch.float64))
    assert torch.allclose(ys[1].grad, torch.full((2, 2), float(n), dtype=torch.float64))


def test_allgather_grad(hvd: Any) -> None:
    n, me = hvd.size(), hvd.rank()
    x = make(4, me, (me + 1, 2), torch.float64)
    rows = n * (n + 1) // 2
    gs = [make(5, r, (rows, 2), torch.float64) for r in range(n)]
    got = _grad(hvd.allgather, x, gs[me])
    start = me * (me + 1) // 2
    assert torch.allclose(got, (sum(gs) / n)[start:start + me + 1])  # Horovod: averaged
    xs = [x.clone().requires_grad_(), make(6, me, (1,), torch.float64).requires_grad_()]
    outs = hvd.grouped_allgather(xs)
    (outs[0].sum() + outs[1].sum()).backward()
    assert torch.allclose(xs[0].grad, torch.ones_like(x))
    assert torch.allclose(xs[1].grad, torch.ones(1, dtype=torch.float64))


def test_broadcast_grad(hvd: Any) -> None:
    n, me = hvd.size(), hvd.rank()
    gs = [make(7, r, (4,), torch.float64) for r in range(n)]
    for root in range(n):
        got = _grad(lambda t, root=root: hvd.broadcast(t, root), make(8, me, (4,),
                    torch.float64), gs[me])
        expect = sum(gs) / n if me == root else torch.zeros(4, dtype=torch.float64)
        assert torch.allclose(got, expect)


def test_alltoall_grad(hvd: Any) -> None:
    n, me = hvd.size(), hvd.rank()
    splits = torch.tensor([j + 1 for j in range(n)], dtype=torch.int32)
    x = make(9, me, (int(splits.sum()), 1), torch.float64)
    recv_rows = n * (me + 1)
    g = make(10, me, (recv_rows, 1), torch.float64)

    def f(t: torch.Tensor) -> Any:
        return hvd.alltoall(t, splits)

    got = _grad(f, x, g)
    assert torch.allclose(got, _finite_difference(hvd, f, x, g), atol=1e-6)


def test_reducescatter_grad(hvd: Any) -> None:
    n, me = hvd.size(), hvd.rank()
    x = make(11, me, (2 * n, 3), torch.float64)
    g = torch.ones(2, 3, dtype=torch.float64)
    # Horovod's rule: the gathered gradients, times size() for Sum.
    assert torch.allclose(_grad(lambda t: hvd.reducescatter(t, op=hvd.Sum), x, g),
                          torch.full((2 * n, 3), float(n), dtype=torch.float64))
    assert torch.allclose(_grad(lambda t: hvd.reducescatter(t, op=hvd.Average), x, g),
                          torch.ones(2 * n, 3, dtype=torch.float64))
    ys = [x.clone().requires_grad_()]
    hvd.grouped_reducescatter(ys, op=hvd.Average)[0].sum().backward()
    assert torch.allclose(ys[0].grad, torch.ones(2 * n, 3, dtype=torch.float64))
