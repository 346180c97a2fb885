"""Data-parallel PyTorch training with hvdlite.torch (a Horovod script with one import changed).

A small CNN learns a synthetic 10-class image problem: every image is a noisy copy of one of
ten fixed random 1x16x16 "prototypes" (shared by all ranks through the seed); each rank draws
its own shard. The script follows Horovod's recipe: ``hvd.init()``, learning rate scaled by
``hvd.size()``, ``hvd.DistributedOptimizer`` over ``model.named_parameters()``,
``hvd.broadcast_parameters`` and ``hvd.broadcast_optimizer_state`` from rank 0, and the epoch's
loss and accuracy averaged with ``hvd.allreduce``. Rank 0 prints one line per epoch. At the
end every rank's parameters are gathered and compared: ``OK`` if identical everywhere and the
loss fell, otherwise exit status 1.

    hvdliterun -np 2 -- python examples/torch_mnist_like.py
    mpiexec -n 2 python examples/torch_mnist_like.py --epochs 3 --fp16-allreduce
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import hvdlite.torch as hvd


class Net(nn.Module):
    """Two conv layers and two linear layers, with a SyncBatchNorm between the convs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = hvd.SyncBatchNorm(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_shard(seed: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``n`` images and labels; the prototypes depend on ``seed`` only."""
    protos = torch.randn(10, 1, 16, 16, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = protos[labels] + 1.5 * torch.randn(n, 1, 16, 16, generator=gen)
    return images, labels


def main(argv: list[str] | None = None) -> int:
    """Train, print per-epoch metrics on rank 0, check the ranks agree; 0 on success."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=1024, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by size()")
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)

    hvd.init()
    torch.set_num_threads(max(1, torch.get_num_threads() // hvd.local_size()))
    torch.manual_seed(args.seed + hvd.rank())  # different start everywhere: broadcast fixes it
    images, labels = make_shard(args.seed, hvd.rank(), args.samples)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    losses = []
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(epoch))
        total = torch.zeros(3)  # loss sum, correct, count
        for start in range(0, args.samples, args.batch_size):
            idx = order[start:start + args.batch_size]
            optimizer.zero_grad()
            out = model(images[idx])
            loss = F.cross_entropy(out, labels[idx])
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(idx),
                                   float((out.argmax(1) == labels[idx]).sum()), len(idx)])
        total = hvd.allreduce(total, op=hvd.Sum, name="epoch.metrics")
        losses.append(float(total[0] / total[2]))
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {losses[-1]:.4f} "
                  f"accuracy {float(total[1] / total[2]):.3f}", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()
                      if p.is_floating_point()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="final.params")
    same = all(torch.equal(everyone[0], row) for row in everyone)
    fell = len(losses) > 1 and losses[-1] < 0.7 * losses[0]
    rank = hvd.rank()
    hvd.shutdown()
    if not same:
        print("FAILED: parameters differ between ranks", file=sys.stderr)
        return 1
    if not fell:
        print(f"FAILED: loss did not go down enough ({losses})", file=sys.stderr)
        return 1
    if rank == 0:
        print(f"OK: parameters identical on all ranks; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
