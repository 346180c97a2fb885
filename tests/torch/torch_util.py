"""Deterministic per-rank torch inputs and single-process references for ``tests/torch``.

Every rank derives its inputs from ``(seed, rank)``, so each rank can rebuild every rank's
inputs and compute the expected result itself, without communication.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES


def make(seed: int, rank: int, shape: Sequence[int], dtype: torch.dtype, low: int = -8,
         high: int = 8) -> torch.Tensor:
    """Rank ``rank``'s input for test ``seed``: small integers (or halves for floats)."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.uint8:
        low = max(low, 0)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    values = torch.randint(low, high + 1, tuple(shape), generator=gen)
    if dtype.is_floating_point:
        values = values.double() + 0.5 * torch.randint(0, 2, tuple(shape), generator=gen)
    return values.to(dtype)


def scale_ref(t: torch.Tensor, f: float) -> torch.Tensor:
    """Horovod's scaling rule: 16-bit floats in float32, integers truncated toward zero."""
    if f == 1.0:
        return t
    if t.dtype in (torch.float16, torch.bfloat16):
        return (t.float() * f).to(t.dtype)
    if t.is_floating_point():
        return t * f
    return torch.trunc(t.double() * f).to(t.dtype)


def reduce_ref(inputs: list[torch.Tensor], op: str, pre: float = 1.0,
               post: float = 1.0) -> torch.Tensor:
    """Expected allreduce of ``inputs`` (one per rank) with Horovod's rules."""
    dtype = inputs[0].dtype
    bf16 = dtype == torch.bfloat16
    xs = [t.float() * pre for t in inputs] if bf16 else [scale_ref(t, pre) for t in inputs]
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("Sum", "Average"):
            acc = acc + x
        elif op == "Min":
            acc = torch.minimum(acc, x)
        elif op == "Max":
            acc = torch.maximum(acc, x)
        else:
            acc = acc * x
    if op == "Average":
        post = post / len(inputs)
    if bf16:
        return (acc * post).to(dtype)
    return scale_ref(acc.to(dtype), post)


def cuda_device(hvd: Any) -> torch.device:
    """This rank's GPU (local rank modulo the devices), made current."""
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


@contextlib.contextmanager
def knobs(**overrides: Any) -> Iterator[None]:
    """Within: the running engine's configuration with ``overrides`` (knobs read while the
    block runs, such as the optimizer's when it is built or opens its schedule)."""
    from hvdlite._engine import default_engine

    engine = default_engine()
    config = engine.config
    engine.config = dataclasses.replace(config, **overrides)
    try:
        yield
    finally:
        engine.config = config


@contextlib.contextmanager
def n_rank_path() -> Iterator[None]:
    """Within: a ``DistributedOptimizer`` built now runs its N-rank path even at one rank (the
    ``optimizer_size1_shortcut`` knob off; the optimizer reads it only when it is built)."""
    with knobs(optimizer_size1_shortcut=False):
        yield
