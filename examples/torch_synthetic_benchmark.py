"""Synthetic PyTorch training throughput with hvdlite.torch, in the shape of Horovod's
``pytorch_synthetic_benchmark.py``: a torchvision model (ResNet-50 by default) trained on one
fixed random batch per rank with ``hvd.DistributedOptimizer``; prints images/s per GPU (per
rank on CPU) for each iteration, their mean +- 1.96 std, and the total over all ranks.

    hvdliterun -np 2 -- python examples/torch_synthetic_benchmark.py
    hvdliterun -np 2 -- python examples/torch_synthetic_benchmark.py --model tiny --no-cuda

``--model`` names any ``torchvision.models`` constructor (needs ``pip install torchvision``)
or ``tiny``, a small built-in CNN that needs nothing more (for smoke tests on CPU).
"""

from __future__ import annotations

import argparse
import sys
import timeit

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import hvdlite.torch as hvd


def build_model(name: str) -> nn.Module:
    """``tiny`` or a torchvision model by name; exits with a clear message otherwise."""
    if name == "tiny":
        return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1000))
    try:
        from torchvision import models
    except ImportError:
        sys.exit(f"--model {name} needs torchvision, which is not installed: "
                 "pip install torchvision (or pass --model tiny)")
    if not hasattr(models, name):
        sys.exit(f"torchvision.models has no model {name!r}")
    model: nn.Module = getattr(models, name)()
    return model


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; rank 0 prints the results. Returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="compress gradients to float16 for the allreduce")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-warmup-batches", type=int, default=10)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU")
    parser.add_argument("--use-adasum", action="store_true",
                        help="combine updates with Adasum (a power-of-two number of ranks)")
    args = parser.parse_args(argv)

    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // hvd.local_size()))
    device = torch.device("cuda" if cuda else "cpu")

    model = build_model(args.model).to(device)
    # Average: the learning rate scales with the ranks; Adasum keeps one process's.
    lr = 0.01 if args.use_adasum else 0.01 * hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    def log(msg: str) -> None:
        if hvd.rank() == 0:
            print(msg, flush=True)

    unit = "GPU" if cuda else "rank"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {unit}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} img/sec per {unit}")
        rates.append(rate)
    t = torch.tensor(rates, dtype=torch.float64)
    mean = float(t.mean())
    conf = 1.96 * float(t.std()) if len(rates) > 1 else 0.0
    log(f"Img/sec per {unit}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {unit}(s): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * conf:.1f}")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
