"""The captured step's tests that start jobs of their own (``hvd.make_graphed_step``;
``tests/torch/test_gpu_graphs.py`` holds those that run inside an MPI job): the example's
eager fallback on CPU tensors, and a peer gone during replays at two GPUs (the schedule over
NCCL and over CUDA IPC) and with both ranks on one GPU (over CUDA IPC, waiting by stream memory
operations).

A rank that dies or raises while its peer replays a captured training step: the survivor,
blocked on NCCL kernels inside the graph that wait for the gone rank, ends within 15 s, hvdlite
naming the rank. The graph's collectives run on the optimizer's schedule communicator, which
the engine's failure aborts beside its own (the NCCL watchdog). Real ``hvdliterun`` jobs of 2
ranks with a GPU each (the captured step needs NCCL): skipped with fewer GPUs. Run outside any
MPI launcher: ``python3 -m pytest tests/test_captured_step.py``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from jobs_util import (
    GONE,
    HAS_TORCH,
    clean_env,
    needs_torch,
    rank_one_goes,
    run_group,
)


def _two_gpus() -> bool:
    if not HAS_TORCH:
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


_JOB = """
import os, signal, sys, time
{pre}
import torch
import hvdlite.torch as hvd
hvd.init(schedule_transport={transport!r})
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


@needs_torch
@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs (a captured step runs over NCCL)")
@pytest.mark.parametrize("how", list(GONE))
@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_a_rank_gone_during_replays_ends_the_job(tmp_path: Path, how: str,
                                                 transport: str) -> None:
    """Over NCCL the engine's failure aborts the schedule's communicator; over CUDA IPC
    (``schedule_transport="ipc"``) it sets the abort word the graph's spinning waits poll."""
    if transport == "ipc" and importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("the IPC schedule needs NVIDIA's cuda-python")
    rank_one_goes(tmp_path, _JOB.format(how=GONE[how], transport=transport, pre=""), how,
                  f"captured step over {transport}")


def _a_gpu() -> bool:
    if not HAS_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


@needs_torch
@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _a_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("how", list(GONE))
def test_a_rank_gone_during_replays_on_a_shared_gpu_ends_the_job(tmp_path: Path,
                                                                 how: str) -> None:
    """Both ranks on one GPU: ``make_graphed_step`` puts their buckets on a schedule over CUDA
    IPC whose waits are stream memory operations; the engine's failure sets every flag of the
    survivor's inbox, so the waits its graph parks on pass and the job ends, naming rank 1."""
    if importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("the IPC schedule needs NVIDIA's cuda-python")
    rank_one_goes(tmp_path, _JOB.format(how=GONE[how], transport="auto",
                                        pre='os.environ["CUDA_VISIBLE_DEVICES"] = "0"'),
                  how, "captured step of ranks sharing a GPU")


@pytest.mark.mpi
@pytest.mark.timeout(200)
@needs_torch
def test_captured_step_example_falls_back_to_eager_on_the_cpu() -> None:
    """The captured-step example, on CPU tensors (no CUDA graph possible), says why it does not
    capture, trains the same step eagerly, and learns with identical parameters on both ranks
    (its captured run is the next test, at two GPUs)."""
    out = _example("examples/torch_captured_step.py", "--steps", "30", "--width", "64",
                       "--layers", "2", "--ctx", "32", "--batch", "8")
    assert "not capturing, training eagerly: make_graphed_step: static input 0 must be a " \
           "CUDA tensor" in out, out[-6000:]
    ok = re.search(r"^OK: parameters identical on all ranks; loss ([\d.]+) -> ([\d.]+)$", out,
                   re.M)
    assert ok is not None and float(ok.group(2)) < float(ok.group(1)), out[-6000:]


@pytest.mark.gpu
@pytest.mark.timeout(200)
@needs_torch
@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs (a captured step runs over NCCL)")
def test_captured_step_example_captures_on_two_gpus() -> None:
    """The example as its docstring runs it, a GPU per rank: it captures the step, replays it
    200 times, and learns with identical parameters on both ranks."""
    rc, out = run_group([sys.executable, "-m", "hvdlite.run", "-np", "2", "--", sys.executable,
                         "examples/torch_captured_step.py", "--steps", "200"], clean_env(), 170)
    assert rc == 0, f"rc={rc}:\n{out[-6000:]}"
    took = re.search(r"^200 captured steps in .*$", out, re.M)
    assert took is not None, f"the example did not capture:\n{out[-6000:]}"
    print(took.group(0), flush=True)
    ok = re.search(r"^OK: parameters identical on all ranks; loss ([\d.]+) -> ([\d.]+)$", out,
                   re.M)
    assert ok is not None and float(ok.group(2)) < float(ok.group(1)), out[-6000:]


def _example(*argv: str) -> str:
    # No GPU visible: on a GPU machine the example would capture.
    cmd = [sys.executable, "-m", "hvdlite.run", "-np", "2", "--", sys.executable, *argv]
    rc, out = run_group(cmd, clean_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""), 150)
    assert rc == 0, f"{' '.join(argv)} (rc={rc}):\n{out[-6000:]}"
    return out
