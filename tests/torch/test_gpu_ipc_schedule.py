"""The agreed schedule over CUDA IPC (``schedule_transport`` "ipc", or "auto" for a captured
step; ``hvdlite/_backends/schedule_ipc.py``) on CUDA, inside an MPI job with a GPU per rank:
the optimizer's buckets reduce exactly (integer-valued averages, shares of every size, an empty
one included), eagerly and in a step captured by ``make_graphed_step``, whose replays equal
eager steps. With a GPU per rank the schedule's waits are spinning kernels; where ranks share
a GPU (where NCCL refuses them, and the schedule opens over IPC under "auto" too) they are
stream memory operations. Marked ``gpu``; skipped at one rank or where NVIDIA's cuda-python is
missing."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch_util import cuda_device, knobs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _ipc_ready(hvd: Any) -> None:
    if hvd.size() < 2:
        pytest.skip("needs two ranks")
    if importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("needs NVIDIA's cuda-python (pip install hvdlite[gpu])")


def _optimizer(hvd: Any, params: list[torch.nn.Parameter], tag: str, lr: float = 0.0,
               cap: float = 800 / 2**20) -> Any:
    with knobs(optimizer_size1_shortcut=False):
        return hvd.DistributedOptimizer(
            torch.optim.SGD(params, lr=lr),
            named_parameters=[(f"{tag}.{k}", p) for k, p in enumerate(params)],
            bucket_cap_mb=cap)


def test_ipc_schedule_buckets_reduce_exactly(hvd: Any) -> None:
    """Buckets of several sizes over the IPC schedule (with the 800-byte cap: 53, 300, 1 and
    2048 elements; the 1-element bucket leaves every rank but the first an empty share): each
    step's gradients are the exact average of every rank's, the eager launches after each
    slot's first as its own CUDA graph (one driver call instead of about ten)."""
    _ipc_ready(hvd)
    from hvdlite._backends.schedule_ipc import IpcScheduleTransport

    dev = cuda_device(hvd)
    shapes = [(64, 32), (1,), (300,), (32,), (7, 3)]
    params = [torch.nn.Parameter(torch.zeros(s, device=dev)) for s in shapes]
    opt = _optimizer(hvd, params, "ipcsched")
    for step in range(6):
        opt.zero_grad()
        torch.stack([(p * float(hvd.rank() + step + k)).sum()
                     for k, p in enumerate(params)]).sum().backward()
        if step == 0:  # the first step opens the schedule, under the knob
            with knobs(schedule_transport="ipc"):
                opt.step()
        else:
            opt.step()
        for k, (p, s) in enumerate(zip(params, shapes, strict=True)):
            want = sum(r + step + k for r in range(hvd.size())) / hvd.size()
            assert p.grad is not None
            assert torch.equal(p.grad, torch.full(s, float(want), device=dev)), (step, k)
    schedule = opt.agreed_schedule
    assert schedule is not None, opt.unscheduled_reason
    assert isinstance(schedule.transport, IpcScheduleTransport), type(schedule.transport)
    assert schedule.transport.graphs_built == len(opt.bucket_names), \
        (schedule.transport.graphs_built, opt.bucket_names)


@pytest.mark.parametrize("via", ["ipc", "auto"])
def test_ipc_schedule_captured_replays_equal_eager_nccl_steps(hvd: Any, via: str) -> None:
    """A step captured with the IPC schedule (``schedule_transport`` ipc from the start, or
    auto: moved there by ``make_graphed_step`` from NCCL, or opened there where ranks share a
    GPU): 8 replays on new batches equal 8 eager steps of the same model (on the NCCL
    schedule, or the IPC one where ranks share a GPU), to fp32 rounding (both sum two ranks'
    gradients exactly; the average's division is the only rounding), ranks bit-equal."""
    _ipc_ready(hvd)
    dev = cuda_device(hvd)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 1)).to(dev)

    eager, captured = model(), model()
    opt_e = _optimizer(hvd, list(eager.parameters()), f"ipc_e_{via}", lr=0.1,
                       cap=4000 * 4 / 2**20)
    opt_c = _optimizer(hvd, list(captured.parameters()), f"ipc_c_{via}", lr=0.1,
                       cap=4000 * 4 / 2**20)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 7919 + hvd.rank())
        x = torch.randn(8, 16, generator=gen)
        return x.to(dev), x.sum(dim=1, keepdim=True).sin().to(dev)

    def step_of(m: torch.nn.Module, opt: Any) -> Any:
        def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        return train_step

    sx, sy = batch(0)
    with knobs(schedule_transport=via):
        graphed = hvd.make_graphed_step(step_of(captured, opt_c), sx.clone(), sy.clone(),
                                        optimizer=opt_c, warmup_steps=3)
    # auto: the schedule opened over NCCL at the first warm-up step and moved to IPC before
    # the last one, which the capture took (ranks sharing a GPU: opened over IPC).
    assert opt_c.agreed_schedule is not None and opt_c.agreed_schedule.via == "ipc"
    eager_step = step_of(eager, opt_e)
    for _ in range(3):
        eager_step(sx, sy)  # the captured model's warm-up steps, on the same batch
    for s in range(1, 9):
        x, y = batch(s)
        graphed(x, y)
        eager_step(x, y)
    torch.cuda.synchronize(dev)
    got = torch.cat([p.detach().reshape(-1) for p in captured.parameters()])
    want = torch.cat([p.detach().reshape(-1) for p in eager.parameters()])
    assert float((got - want).abs().max()) <= 1e-6 * max(1.0, float(want.abs().max()))
    everyone = hvd.allgather(got.unsqueeze(0), name=f"ipcsched.params.{via}")
    assert all(torch.equal(everyone[0], row) for row in everyone)
