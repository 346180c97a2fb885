"""Train a small GPT-style language model with the whole data-parallel step captured as one CUDA
graph (``hvd.make_graphed_step``): forward, backward, the gradient buckets' allreduces and the
optimizer replay with no Python, no MPI and no host wait per step.

    hvdliterun -np 2 -- python examples/torch_captured_step.py                 # a GPU per rank
    hvdliterun -np 2 -- python examples/torch_captured_step.py --compile       # compile, capture
    hvdliterun -np 2 -- python examples/torch_captured_step.py --eager         # the same, eager

On a machine without CUDA (or ranks that share a GPU, whose buckets go over CUDA IPC and cannot
be captured yet) it says why and runs the same step eagerly: the fallback a training script
should keep. Each rank trains on its own synthetic token stream (a fixed random bigram
"language"); at the end rank 0 prints the loss and checks that every rank holds the same
parameters (``OK: ...``, exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import hvdlite.torch as hvd


class TinyGPT(nn.Module):
    """Token and position embeddings, causal pre-norm transformer blocks, a tied LM head."""

    def __init__(self, vocab: int, ctx: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(ctx, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.norm(h) @ self.tok.weight.t() * self.tok.weight.shape[1] ** -0.5


def batches(args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """This rank's token stream: a seeded random bigram table (shared by all ranks) sampled
    from a rank-specific start; ``args.steps + 8`` batches of ``batch x (ctx + 1)`` tokens."""
    g = torch.Generator().manual_seed(args.seed)
    table = torch.randint(0, args.vocab, (args.vocab, 4), generator=g)
    g.manual_seed(args.seed * 1000 + hvd.rank() + 1)
    n = (args.steps + 8) * args.batch
    tok = torch.empty(n, args.ctx + 1, dtype=torch.long)
    tok[:, 0] = torch.randint(0, args.vocab, (n,), generator=g)
    for t in range(1, args.ctx + 1):
        pick = torch.randint(0, 4, (n,), generator=g)
        tok[:, t] = table[tok[:, t - 1], pick]
    return tok.view(args.steps + 8, args.batch, args.ctx + 1).to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--ctx", type=int, default=128, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="compile the model whole with each gradient bucket started inside "
                        "its compiled backward (hvd.compile_overlap), while backward goes on")
    p.add_argument("--compile-regions", action="store_true",
                   help="compile it block by block instead (hvd.compile_regions), the "
                        "buckets on the block boundaries")
    p.add_argument("--compile-whole", action="store_true",
                   help="torch.compile the whole model instead (its buckets start only after "
                        "backward)")
    p.add_argument("--eager", action="store_true", help="do not capture the step")
    args = p.parse_args()

    hvd.init()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.ctx, args.width, args.layers, 4).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # Captured, Adam keeps its step counter and learning rate on the device (a schedule
    # changes the tensor in place: the graph reads it at every replay).
    lr = args.lr * hvd.size()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(lr, device=device) if cuda else lr,
                           capturable=cuda)
    # Compiled whole by torch.compile, a model's backward is one autograd operation and every
    # bucket waits for it. compile_overlap starts each bucket inside that backward, where its
    # last gradient is computed; compile_regions compiles block by block with the buckets on
    # the block boundaries (docs/captured-step.md, "Compiled models"). The shapes are fixed
    # here (dynamic=False).
    regions = hvd.compile_regions(model, dynamic=False) if args.compile_regions else None
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(),
        groups=hvd.region_groups(model, regions) if regions is not None else None)
    # (after the optimizer: the first call compiles, and finds the optimizer's hooks then)
    net = hvd.compile_overlap(model, dynamic=False) if args.compile else \
        torch.compile(model) if args.compile_whole else model
    data = batches(args, device)
    tokens = data[0].clone()  # the static input the captured step reads

    def train_step(tokens: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = net(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab).float(),
                                               tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    step = train_step
    if not args.eager:
        try:
            step = hvd.make_graphed_step(train_step, tokens, optimizer=opt)
        except (hvd.HvdliteError, TypeError) as exc:
            if hvd.rank() == 0:
                print(f"not capturing, training eagerly: {exc}", flush=True)
    losses = []
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(data[i + 4])
        if i % 50 == 0 or i == args.steps - 1:
            losses.append(float(hvd.allreduce(loss, name="loss")))
            if hvd.rank() == 0:
                print(f"step {i:4d}  loss {losses[-1]:.3f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    took = time.perf_counter() - start
    flat = torch.cat([q.detach().reshape(-1).float() for q in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name="params")
    same = all(torch.equal(every[0], row) for row in every)
    if hvd.rank() == 0:
        mode = "eager" if step is train_step else "captured"
        print(f"{args.steps} {mode} steps in {took:.2f} s "
              f"({args.steps * args.batch * hvd.size() / took:.0f} sequences/s in all)")
    if not same or not losses[-1] < losses[0]:
        print(f"FAILED on rank {hvd.rank()}: parameters identical: {same}; loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f}", file=sys.stderr)
        sys.exit(1)
    if hvd.rank() == 0:
        print(f"OK: parameters identical on all ranks; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
