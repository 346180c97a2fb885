"""Data-parallel training of a small CuPy MLP on GPUs with hvdlite.

Each rank drives the GPU of its local rank. It draws its own shard of a synthetic
classification problem (labels come from a fixed random "teacher" network that all ranks
share), starts from its own random weights and then takes rank 0's by ``broadcast_``. Every
step runs the forward and backward pass by hand in CuPy, averages the gradients over all ranks
on the GPU (one ``allreduce_async`` per parameter, or one ``grouped_allreduce`` with
``--grouped``) and applies SGD with momentum. Rank 0 prints the loss (averaged over ranks). At
the end every rank's weights are gathered on the GPU and compared bit for bit: the script prints
an ``OK`` line if they are identical everywhere and the loss went down, and exits with status 1
otherwise.

    mpirun -n 2 python3 examples/mlp_cupy.py [--grouped]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import cupy as cp
import numpy as np

import hvdlite as hvd

Params = dict[str, Any]  # name -> cupy.ndarray


def make_shard(seed: int, rank: int, n: int, dim: int, classes: int) -> tuple[Any, Any]:
    """This rank's inputs and labels on the GPU; the teacher (from ``seed`` only) is shared."""
    teacher = np.random.default_rng(seed)
    w1 = teacher.normal(size=(dim, 64))
    w2 = teacher.normal(size=(64, classes))
    x = np.random.default_rng([seed, rank]).normal(size=(n, dim)).astype(np.float32)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1)
    return cp.asarray(x), cp.asarray(y)


def init_params(rng: np.random.Generator, dim: int, hidden: int, classes: int) -> Params:
    """He-initialised weights and zero biases, on the GPU."""
    host = {
        "w1": rng.normal(size=(dim, hidden)) * np.sqrt(2.0 / dim),
        "b1": np.zeros(hidden),
        "w2": rng.normal(size=(hidden, classes)) * np.sqrt(2.0 / hidden),
        "b2": np.zeros(classes),
    }
    return {k: cp.asarray(v, dtype=cp.float32) for k, v in host.items()}


def forward_backward(p: Params, x: Any, y: Any) -> tuple[Any, Params]:
    """Mean cross-entropy of a ReLU MLP on (x, y) (a device scalar) and its gradients."""
    h_pre = x @ p["w1"] + p["b1"]
    h = cp.maximum(h_pre, 0)
    logits = h @ p["w2"] + p["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    probs = cp.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    n = x.shape[0]
    rows = cp.arange(n)
    loss = -cp.log(probs[rows, y] + 1e-12).mean()
    d_logits = probs
    d_logits[rows, y] -= 1
    d_logits /= n
    d_h = (d_logits @ p["w2"].T) * (h_pre > 0)
    grads = {
        "w2": h.T @ d_logits,
        "b2": d_logits.sum(axis=0),
        "w1": x.T @ d_h,
        "b1": d_h.sum(axis=0),
    }
    return loss, grads


def average_gradients(grads: Params, grouped: bool) -> Params:
    """Average each gradient over all ranks on the GPU: one grouped call, or all then wait."""
    if grouped:
        keys = sorted(grads)
        avg = hvd.grouped_allreduce([grads[k] for k in keys], name="grads", op=hvd.Average)
        return dict(zip(keys, avg, strict=True))
    handles = {
        k: hvd.allreduce_async(g, name=f"grad.{k}", op=hvd.Average) for k, g in grads.items()
    }
    return {k: h.wait() for k, h in handles.items()}


def weights_identical(p: Params) -> bool:
    """Gather every rank's flattened weights and compare them bit for bit with rank 0's."""
    flat = cp.concatenate([p[k].ravel() for k in sorted(p)])
    everyone = hvd.allgather(flat[None, :], name="final.weights")
    return bool(cp.all(everyone == everyone[0]))


def train(args: argparse.Namespace) -> tuple[float, float, Params]:
    """Run the loop; return (mean of the first losses, mean of the last, final params)."""
    x, y = make_shard(args.seed, hvd.rank(), args.samples, args.dim, args.classes)
    params = init_params(
        np.random.default_rng([args.seed, 1000 + hvd.rank()]), args.dim, args.hidden, args.classes
    )
    for k in sorted(params):
        hvd.broadcast_(params[k], root_rank=0, name=f"init.{k}")
    velocity = {k: cp.zeros_like(v) for k, v in params.items()}
    batch_rng = np.random.default_rng([args.seed, 2000 + hvd.rank()])
    losses = []
    for step in range(args.steps):
        idx = cp.asarray(batch_rng.choice(args.samples, size=args.batch, replace=False))
        loss, grads = forward_backward(params, x[idx], y[idx])
        grads = average_gradients(grads, args.grouped)
        for k in params:
            velocity[k] = args.momentum * velocity[k] + grads[k]
            params[k] -= args.lr * velocity[k]
        losses.append(hvd.allreduce(loss.reshape(1), name="loss", op=hvd.Average))
        if hvd.rank() == 0 and (step % args.print_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {float(losses[-1][0]):.4f}", flush=True)
    host = cp.asnumpy(cp.concatenate(losses))
    k = max(1, args.steps // 10)
    return float(host[:k].mean()), float(host[-k:].mean()), params


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--samples", type=int, default=8192, help="examples per rank")
    ap.add_argument("--batch", type=int, default=256, help="examples per rank per step")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--print-every", type=int, default=25)
    ap.add_argument(
        "--grouped",
        action="store_true",
        help="average with one grouped_allreduce instead of allreduce_async per parameter",
    )
    args = ap.parse_args()
    hvd.init()
    cp.cuda.Device(hvd.local_rank()).use()
    if hvd.rank() == 0:
        print(
            f"training on {hvd.size()} ranks (GPU of each local rank), {args.samples} "
            f"examples per rank",
            flush=True,
        )
    first, last, params = train(args)
    same = weights_identical(params)
    improved = last < 0.7 * first
    rank = hvd.rank()
    hvd.shutdown()
    ok = same and improved
    if ok and rank == 0:
        print(f"OK: weights identical on all ranks; loss {first:.4f} -> {last:.4f}", flush=True)
    if not ok:
        why = "weights differ across ranks" if not same else "loss did not go down by 30%"
        print(
            f"FAILED on rank {rank}: {why} (loss {first:.4f} -> {last:.4f})",
            file=sys.stderr,
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
