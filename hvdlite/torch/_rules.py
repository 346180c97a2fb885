"""Horovod's reduction rules on torch tensors, written once for every ``hvdlite.torch``
collective that reduces: ``Average`` is a ``Sum`` with ``postscale / set size`` (joined ranks
count in the divisor, integer averages truncate toward zero); float16 and bfloat16 are scaled
in float32; a core argument ``ValueError`` becomes Horovod's ``InvalidArgumentError``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hvdlite._ops import ReduceOp
from hvdlite.errors import HvdliteError
from hvdlite.torch.errors import InvalidArgumentError

__all__ = ["invalid", "check_tensor", "horovod_name", "scale", "factors"]

_LOW = (torch.float16, torch.bfloat16)  # scaled in float32 by Horovod's rules
_HALF_MAX = 65504.0


def invalid(exc: ValueError) -> BaseException:
    """A core argument ``ValueError`` as Horovod's flavour (:class:`InvalidArgumentError`,
    both a ``ValueError`` and a ``RuntimeError``); hvdlite's own errors unchanged."""
    if isinstance(exc, (InvalidArgumentError, HvdliteError)):
        return exc
    return InvalidArgumentError(str(exc))


def check_tensor(t: Any, what: str) -> torch.Tensor:
    """``t`` if it is a torch tensor this layer can reduce; ``TypeError`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not supported here; use "
                        "sparse_allreduce_async or tensor.to_dense()")
    return t


def horovod_name(op: str, name: Any) -> Any:
    """The name the core gets for a user's ``name``: horovod.torch's ``<op>.<name>`` (its
    ``GetOpName``), so timeline rows, errors and stall reports read as Horovod's. None and
    "" stay unnamed (the core numbers them ``<op>.noname.N``, as Horovod does); a name that is
    not a str goes on for the core to refuse."""
    if type(name) is str:
        return f"{op}.{name}" if name else None
    return name


def scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` by Horovod's rules (a new tensor; ``t`` itself for a factor of 1):
    float16/bfloat16 multiply in float32, integers in float64 truncated toward zero."""
    if factor == 1.0:
        return t
    if t.dtype in _LOW:
        return (t.float() * factor).to(t.dtype)
    if t.dtype == torch.bool:
        raise TypeError("cannot scale a bool tensor; cast it first")
    if t.is_floating_point() or t.is_complex():
        return t * factor
    return torch.trunc(t.double() * factor).to(t.dtype)


def _factor(value: Any, label: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: {label} must be a real number, got {value!r}")
    return float(value)


def factors(dtype: torch.dtype, op: ReduceOp, pre: Any, post: Any, size: int,
             what: str) -> tuple[ReduceOp, float, float, bool]:
    """Horovod's rules for the torch-side paths: (the core's op, prescale, postscale, whether
    the factors must be applied in torch: bfloat16, or float16 with a factor float16 cannot
    hold). ``Average`` is a ``Sum`` with ``postscale / size``."""
    pre_f = _factor(pre, "prescale_factor", what)
    post_f = _factor(post, "postscale_factor", what)
    if op is ReduceOp.AVERAGE:
        if dtype == torch.bool:
            raise TypeError(f"{what}: op Average is not defined for bool tensors; use Sum "
                            "(logical or), Min or Max")
        op, post_f = ReduceOp.SUM, post_f / size
    in_torch = dtype == torch.bfloat16 or (
        dtype == torch.float16 and not (_exact_half(pre_f) and _exact_half(post_f)))
    return op, pre_f, post_f, in_torch


def _exact_half(factor: float) -> bool:
    return abs(factor) <= _HALF_MAX and float(np.float16(factor)) == factor
