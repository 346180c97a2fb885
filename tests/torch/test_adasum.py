"""hvdlite.torch with op=Adasum: the collective on torch tensors against the NumPy reference of
the tree, and ``DistributedOptimizer(op=Adasum)`` (Horovod's delta optimizer) against a
reference that combines every rank's update with that tree."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from mpi_util import adasum_close, reference_adasum
from torch import nn


def _refused(hvd: Any) -> bool:
    """Whether Adasum is refused here: a number of ranks that is not a power of two, as in
    Horovod (its tree pairs the ranks)."""
    return hvd.size() & (hvd.size() - 1) != 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_allreduce_adasum(hvd: Any, dtype: torch.dtype) -> None:
    r, n = hvd.rank(), hvd.size()
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    inputs = [np.random.default_rng([5, q]).normal(size=(40, 3)).astype(np_dtype)
              for q in range(n)]
    if _refused(hvd):  # refused at the call, on every rank, naming the sizes that work
        with pytest.raises(hvd.InvalidArgumentError, match=f"power-of-two.*has {n}; use"):
            hvd.allreduce(torch.from_numpy(inputs[r]), op=hvd.Adasum, name=f"t.ada.{dtype}")
        return
    got = hvd.allreduce(torch.from_numpy(inputs[r].copy()), op=hvd.Adasum, name=f"t.ada.{dtype}")
    assert got.dtype == dtype
    adasum_close(got.numpy(), reference_adasum(inputs), np_dtype, str(dtype))
    x = torch.from_numpy(inputs[r].copy())
    hvd.synchronize(hvd.allreduce_async_(x, op=hvd.Adasum, name=f"t.ada_.{dtype}"))
    adasum_close(x.numpy(), reference_adasum(inputs), np_dtype, f"{dtype} in place")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).cos()


def test_adasum_optimizer_combines_every_ranks_update(hvd: Any) -> None:
    """SGD with lr 0.1: each rank's update is -0.1 * its gradient; the parameters move by the
    Adasum of the updates (per parameter), identically on every rank."""
    n, steps, lr = hvd.size(), 5, 0.1
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    if _refused(hvd):  # the first gradient's allreduce refuses it, on every rank
        x, y = _batch(0, hvd.rank())
        with pytest.raises(hvd.InvalidArgumentError, match="power-of-two"):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return
    ref = _model()
    for step in range(steps):
        updates: list[list[np.ndarray]] = []
        for q in range(n):  # every rank's update, from the same parameters
            ref.zero_grad()
            x, y = _batch(step, q)
            nn.functional.mse_loss(ref(x), y).backward()
            updates.append([-lr * p.grad.numpy().copy() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                combined = reference_adasum([u[i] for u in updates]) if n > 1 else updates[0][i]
                p.add_(torch.from_numpy(combined))
        opt.zero_grad()
        x, y = _batch(step, hvd.rank())
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (got - want).abs().max()
    everyone = hvd.allgather(got.unsqueeze(0), name="ada.params")
    assert all(torch.equal(everyone[0], row) for row in everyone)


def test_adasum_optimizer_rules(hvd: Any) -> None:
    if hvd.size() == 1:
        pytest.skip("one rank: the plain optimizer (Horovod's rule)")
    if _refused(hvd):
        pytest.skip("Adasum needs a power-of-two number of ranks (the test above checks it)")
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    with pytest.raises(AssertionError, match="skip_synchronize"), opt.skip_synchronize():
        pass
    x, y = _batch(0, hvd.rank())
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
