"""A rank that dies or raises while its peer replays a captured training step
(``hvd.make_graphed_step``): the survivor, blocked on NCCL kernels inside the graph that wait for
the gone rank, ends within 15 s, the rank named. The graph's collectives run on the optimizer's
schedule communicator, which the engine's failure aborts beside its own (the NCCL watchdog).

Real ``hvdliterun`` jobs of 2 ranks with a GPU each (the captured step needs NCCL): skipped on
one GPU. Run it outside any MPI launcher: ``python3 -m pytest tests/gpu/test_gpu_graph_death.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs_util import GONE, HAS_TORCH, NO_TORCH_REASON, rank_one_goes, under_mpi_launcher

if not HAS_TORCH:
    pytest.skip(NO_TORCH_REASON, allow_module_level=True)
import torch  # noqa: E402 - after the skip

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs (a captured step runs over NCCL)", allow_module_level=True)
if under_mpi_launcher():
    pytest.skip("launches its own jobs: run it outside mpirun", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


_JOB = """
import os, signal, sys, time
import torch
import hvdlite.torch as hvd
hvd.init()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6),
                               named_parameters=model.named_parameters())
x = torch.randn(512, 2048, device="cuda")

def step(x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()

graphed = hvd.make_graphed_step(step, x, optimizer=opt)
for i in range(1_000_000):
    graphed()
    if i == 50 and hvd.rank() == 1:
        torch.cuda.synchronize()
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        {how}
    if i % 10 == 0:
        torch.cuda.synchronize()  # rank 0 blocks here on the graph's NCCL kernels
"""

@pytest.mark.parametrize("how", list(GONE))
def test_a_rank_gone_during_replays_ends_the_job(tmp_path: Path, how: str) -> None:
    rank_one_goes(tmp_path, _JOB.format(how=GONE[how]), how, "captured step")
