"""Reduce operations and the dtype table.

Every dtype hvdlite carries is one row of :data:`DTYPES`; every reduce op one member of
:class:`ReduceOp`. The collectives and both backends look things up here instead of branching on
types, so adding a dtype is adding a row.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ReduceOp", "Sum", "Average", "Min", "Max", "Product", "Adasum", "DType", "DTYPES",
           "lookup_dtype"]


class ReduceOp(enum.IntEnum):
    """How :func:`hvdlite.allreduce` combines the ranks' tensors.

    ``Average`` is ``sum / n`` where ``n`` is the process set's size, joined ranks included (they
    contribute zeros), as in Horovod; on integer tensors the quotient is truncated toward zero
    (C integer division, as Horovod computes it). On ``bool`` tensors ``Sum`` and
    ``Max`` are a logical or, ``Min`` and ``Product`` a logical and; ``Average`` is refused.
    """

    AVERAGE = 0
    SUM = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    #: Adaptive summation (float16/32/64 allreduce over a power-of-two number of ranks; see
    #: ``hvdlite/_adasum.py``): parallel gradients average, orthogonal ones add.
    ADASUM = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

_ALL_OPS = frozenset(ReduceOp) - {ReduceOp.ADASUM}
_FLOAT_OPS = frozenset(ReduceOp)  # Adasum: floating point only
_NO_ORDER = frozenset({ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.PRODUCT})
_LOGICAL = frozenset({ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT})


@dataclass(frozen=True)
class DType:
    """One carried dtype: its NumPy dtype, its family and the reduce ops it allows."""

    name: str
    np_dtype: np.dtype
    kind: str  # "bool", "int", "float", "complex"
    ops: frozenset[ReduceOp]
    nccl_name: str | None  # name of the matching ncclDataType_t, None if NCCL has none

    def identity(self, op: ReduceOp) -> object:
        """The value a rank that has joined contributes, so it changes no result."""
        if op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.ADASUM):  # Adasum(a, 0) = a
            return self.np_dtype.type(0)
        if op is ReduceOp.PRODUCT:
            return self.np_dtype.type(1)
        if self.kind == "bool":
            return op is ReduceOp.MIN
        if self.kind == "int":
            info = np.iinfo(self.np_dtype)
            return info.max if op is ReduceOp.MIN else info.min
        return np.inf if op is ReduceOp.MIN else -np.inf


def _row(name: str, kind: str, nccl: str | None) -> DType:
    ops = {"bool": _LOGICAL, "complex": _NO_ORDER, "float": _FLOAT_OPS}.get(kind, _ALL_OPS)
    return DType(name, np.dtype(name), kind, ops, nccl)


DTYPES: dict[str, DType] = {
    row.name: row
    for row in (
        _row("bool", "bool", "uint8"),
        _row("int8", "int", "int8"),
        _row("int16", "int", None),
        _row("int32", "int", "int32"),
        _row("int64", "int", "int64"),
        _row("uint8", "int", "uint8"),
        _row("uint16", "int", None),
        _row("uint32", "int", "uint32"),
        _row("uint64", "int", "uint64"),
        _row("float16", "float", "float16"),
        _row("float32", "float", "float32"),
        _row("float64", "float", "float64"),
        _row("complex64", "complex", None),
        _row("complex128", "complex", None),
    )
}


_BY_NP: dict[np.dtype, DType] = {row.np_dtype: row for row in DTYPES.values()}


def lookup_dtype(dtype: object, what: Any, name: str | None = None) -> DType:
    """The table row for ``dtype``; ``TypeError`` naming the call (``what``, or a collective
    kind and a tensor ``name``) and the carried dtypes if none."""
    row = _BY_NP.get(dtype) if isinstance(dtype, np.dtype) else None  # hot path: no name lookup
    if row is not None:
        return row
    if name is not None:
        what = f"{what.name.lower()} of tensor {name!r}"
    try:
        np_dtype = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        np_dtype = None
    if np_dtype is not None and not np_dtype.isnative:
        raise TypeError(f"{what}: byte order {np_dtype.byteorder!r} is not supported; pass "
                        "x.astype(x.dtype.newbyteorder('=')) (native byte order)")
    key = np_dtype.name if np_dtype is not None else str(dtype)
    row = DTYPES.get(key)
    if row is None:
        raise TypeError(
            f"{what}: dtype {key} is not supported; expected one of {', '.join(DTYPES)}"
        )
    return row


def check_op(row: DType, op: object, what: str) -> ReduceOp:
    """Validate ``op`` for ``row``: ``TypeError`` if it is no ReduceOp or the dtype refuses it."""
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{what}: op must be a hvdlite.ReduceOp (Sum, Average, ...), got {op!r}")
    if op not in row.ops:
        allowed = ", ".join(o.name.title() for o in sorted(row.ops))
        raise TypeError(
            f"{what}: op {op.name.title()} is not defined for dtype {row.name}; "
            f"use one of {allowed}"
        )
    return op


def scale_into(xp: Any, dst: Any, src: Any, factor: float) -> None:
    """``dst[...] = src * factor`` with hvdlite's scaling rules, for NumPy or CuPy (``xp``).

    Float and complex tensors scale in their own precision; integer tensors are scaled in
    float64 and truncated toward zero; a factor of 1 is a plain copy (or nothing in place).
    """
    if factor == 1.0:
        if dst is not src:
            xp.copyto(dst, src)
        return
    xp.multiply(src, factor, out=dst, casting="unsafe")


def finish_reduce(xp: Any, buf: Any, op: ReduceOp, contributors: int, postscale: float,
                  row: DType) -> None:
    """In place on the reduced ``buf``: divide for Average, then apply ``postscale``."""
    if op is ReduceOp.AVERAGE and contributors > 1:
        if row.kind == "int":
            # Truncation toward zero: floor, then one up where a negative quotient had a
            # remainder (exact for every integer width, no float round trip).
            rem = xp.remainder(buf, contributors)
            xp.floor_divide(buf, contributors, out=buf)
            buf += ((rem != 0) & (buf < 0)).astype(buf.dtype)
        else:
            xp.divide(buf, contributors, out=buf)
    scale_into(xp, buf, buf, postscale)


# NCCL carries these element types; complex travels as pairs of its real type.
_NCCL_WIRE = {"complex64": ("float32", 2), "complex128": ("float64", 2)}


def nccl_wire(row: DType) -> tuple[str, int]:
    """(NCCL element type name, elements per value) for ``row``; KeyError if NCCL has none."""
    if row.name in _NCCL_WIRE:
        return _NCCL_WIRE[row.name]
    if row.nccl_name is None:
        raise KeyError(row.name)
    return row.nccl_name, 1


def check_device_dtype(row: DType, op: ReduceOp | None, what: str) -> None:
    """``TypeError`` if NCCL cannot carry ``row`` (or reduce it with ``op``) on the device."""
    if row.name not in _NCCL_WIRE and row.nccl_name is None:
        raise TypeError(f"{what}: dtype {row.name} is not supported for device tensors (NCCL "
                        "has no 16-bit integers); cast to int32/uint32 or use a host tensor")
    if op is ReduceOp.PRODUCT and row.kind == "complex":
        raise TypeError(f"{what}: Product of complex device tensors is not supported by NCCL; "
                        "use a host tensor")
