"""The dtype table, reduce-op rules, identities, scaling and the NCCL wire rules."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from hvdlite._ops import (
    DTYPES,
    Average,
    DType,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    check_device_dtype,
    check_op,
    finish_reduce,
    lookup_dtype,
    nccl_wire,
    scale_into,
)

ALL = {Average, Sum, Min, Max, Product}
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]

# (kind, allowed ops, NCCL wire) for every carried dtype, written out independently.
EXPECTED: dict[str, tuple[str, set[ReduceOp], tuple[str, int] | None]] = {
    "bool": ("bool", {Sum, Min, Max, Product}, ("uint8", 1)),
    "int8": ("int", ALL, ("int8", 1)),
    "int16": ("int", ALL, None),
    "int32": ("int", ALL, ("int32", 1)),
    "int64": ("int", ALL, ("int64", 1)),
    "uint8": ("int", ALL, ("uint8", 1)),
    "uint16": ("int", ALL, None),
    "uint32": ("int", ALL, ("uint32", 1)),
    "uint64": ("int", ALL, ("uint64", 1)),
    "float16": ("float", ALL | {ReduceOp.ADASUM}, ("float16", 1)),
    "float32": ("float", ALL | {ReduceOp.ADASUM}, ("float32", 1)),
    "float64": ("float", ALL | {ReduceOp.ADASUM}, ("float64", 1)),
    "complex64": ("complex", {Sum, Average, Product}, ("float32", 2)),
    "complex128": ("complex", {Sum, Average, Product}, ("float64", 2)),
}


def test_table_has_exactly_the_carried_dtypes() -> None:
    assert list(DTYPES) == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_row(name: str) -> None:
    kind, ops, _ = EXPECTED[name]
    row = DTYPES[name]
    assert (row.name, row.np_dtype, row.kind, set(row.ops)) == (name, np.dtype(name), kind, ops)
    for op in ReduceOp:
        if op in ops:
            assert check_op(row, op, "t") is op
        else:
            with pytest.raises(TypeError, match=f"op {op.name.title()} is not defined"):
                check_op(row, op, "t")


# -- lookup_dtype -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(EXPECTED))
def test_lookup_accepts_dtype_name_and_type(name: str) -> None:
    row = DTYPES[name]
    assert lookup_dtype(np.dtype(name), "t") is row
    assert lookup_dtype(name, "t") is row
    assert lookup_dtype(np.dtype(name).type, "t") is row


@pytest.mark.parametrize("bad", [object, np.dtype(object), str, np.dtype("U3"), "datetime64[s]",
                                 np.longdouble if np.dtype(np.longdouble).itemsize > 8 else "V4",
                                 "no_such_dtype"])
def test_lookup_refuses_unsupported_naming_the_tensor(bad: object) -> None:
    with pytest.raises(TypeError) as info:
        lookup_dtype(bad, "allreduce of tensor 'w'")
    msg = str(info.value)
    assert msg.startswith("allreduce of tensor 'w': dtype ")
    assert "is not supported; expected one of bool, int8" in msg


@pytest.mark.parametrize("name", [">i4", ">f8", ">c16", ">u2"])
def test_lookup_refuses_non_native_byte_order(name: str) -> None:
    dtype = np.dtype(name)
    if dtype.isnative:  # pragma: no cover - big-endian host
        dtype = dtype.newbyteorder("<")
    with pytest.raises(TypeError) as info:
        lookup_dtype(dtype, "broadcast of tensor 'b'")
    msg = str(info.value)
    assert msg.startswith("broadcast of tensor 'b': byte order ")
    assert "native byte order" in msg


def test_single_byte_dtypes_have_no_byte_order() -> None:
    assert lookup_dtype(np.dtype(">u1"), "t") is DTYPES["uint8"]
    assert lookup_dtype(np.dtype("=i4"), "t") is DTYPES["int32"]


# -- check_op ---------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [1, "sum", None, np.add])
def test_check_op_refuses_non_ops(op: object) -> None:
    with pytest.raises(TypeError, match=r"^tensor 'x': op must be a hvdlite\.ReduceOp"):
        check_op(DTYPES["float32"], op, "tensor 'x'")


def test_check_op_messages_list_allowed_ops() -> None:
    with pytest.raises(TypeError) as info:
        check_op(DTYPES["complex64"], Min, "tensor 'c'")
    assert str(info.value) == ("tensor 'c': op Min is not defined for dtype complex64; "
                               "use one of Average, Sum, Product")
    with pytest.raises(TypeError) as info:
        check_op(DTYPES["bool"], Average, "tensor 'm'")
    assert str(info.value) == ("tensor 'm': op Average is not defined for dtype bool; "
                               "use one of Sum, Min, Max, Product")


# -- identities -------------------------------------------------------------------------------

# How the ranks' values combine, per op (NumPy's add/multiply on bool are or/and).
def _adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Horovod's pairwise Adasum rule, in float64 (a coefficient stays 1 at a zero norm)."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    dot, asq, bsq = float(a64 @ b64), float(a64 @ a64), float(b64 @ b64)
    ac = 1.0 - dot / asq * 0.5 if asq > 0 else 1.0
    bc = 1.0 - dot / bsq * 0.5 if bsq > 0 else 1.0
    return (ac * a64 + bc * b64).astype(a.dtype).reshape(a.shape)


COMBINE: dict[ReduceOp, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    Sum: np.add, Average: np.add, Product: np.multiply, Min: np.minimum, Max: np.maximum,
    ReduceOp.ADASUM: _adasum_pair,
}


def _samples(row: DType) -> np.ndarray:
    if row.kind == "bool":
        return np.array([True, False, True])
    if row.kind == "int":
        info = np.iinfo(row.np_dtype)
        return np.array([info.min, info.max, 0, 1, info.max // 3], dtype=row.np_dtype)
    values = [0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, 65504.0]
    if row.kind == "complex":
        return np.array([complex(v, -v) for v in values if math.isfinite(v)], row.np_dtype)
    return np.array(values, dtype=row.np_dtype)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_identity_changes_nothing(name: str) -> None:
    row = DTYPES[name]
    x = _samples(row)
    for op in sorted(row.ops):
        if op is ReduceOp.ADASUM:  # norms and dot products of infinities are not numbers
            x = x[np.isfinite(x)]
        ident = np.full_like(x, row.identity(op))
        with np.errstate(over="raise", invalid="raise"):
            got = COMBINE[op](x, ident)
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got, x, err_msg=f"{name} {op.name}")


@pytest.mark.parametrize(("name", "op", "expected"), [
    ("int8", Min, 127), ("int8", Max, -128), ("uint8", Min, 255), ("uint8", Max, 0),
    ("int64", Min, 2**63 - 1), ("uint64", Min, 2**64 - 1), ("int32", Max, -(2**31)),
    ("float16", Min, math.inf), ("float64", Max, -math.inf),
    ("bool", Min, True), ("bool", Max, False), ("bool", Sum, False), ("bool", Product, True),
    ("int16", Sum, 0), ("int16", Average, 0), ("uint32", Product, 1),
    ("complex64", Sum, 0), ("complex128", Product, 1), ("float32", Average, 0.0),
])
def test_identity_values(name: str, op: ReduceOp, expected: object) -> None:
    got = DTYPES[name].identity(op)
    assert got == expected
    assert np.array(got).astype(DTYPES[name].np_dtype) == expected  # representable exactly


def test_sum_identity_has_the_dtype() -> None:
    for row in DTYPES.values():
        assert np.asarray(row.identity(Sum)).dtype == row.np_dtype
        assert np.asarray(row.identity(Product)).dtype == row.np_dtype


# -- scaling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", INTS)
@pytest.mark.parametrize("factor", [0.5, 0.3, 1.75, -0.5])
def test_integer_scaling_truncates_toward_zero(name: str, factor: float) -> None:
    row = DTYPES[name]
    info = np.iinfo(row.np_dtype)
    values = [v for v in (-7, -5, -3, -1, 0, 1, 3, 5, 7, 100, -100)
              if info.min <= v <= info.max and info.min <= math.trunc(v * factor) <= info.max]
    src = np.array(values, dtype=row.np_dtype)
    expected = [math.trunc(float(v) * factor) for v in values]
    dst = np.empty_like(src)
    scale_into(np, dst, src, factor)
    assert dst.tolist() == expected
    np.testing.assert_array_equal(src, np.array(values, dtype=row.np_dtype))  # input untouched


def test_integer_scaling_in_place_and_in_float64() -> None:
    big = 2**60 + 12345
    buf = np.array([big, -big, 9], np.int64)
    scale_into(np, buf, buf, 0.1)
    assert buf.tolist() == [math.trunc(float(big) * 0.1), -math.trunc(float(big) * 0.1), 0]


def test_unit_factor_is_an_exact_copy() -> None:
    src = np.array([2**62 + 1, -(2**62) - 3], np.int64)  # not exact in float64
    dst = np.zeros_like(src)
    scale_into(np, dst, src, 1.0)
    assert dst.tolist() == src.tolist()
    scale_into(np, src, src, 1.0)
    assert src.tolist() == [2**62 + 1, -(2**62) - 3]


@pytest.mark.parametrize("name", FLOATS + COMPLEX)
def test_float_scaling_keeps_precision(name: str) -> None:
    row = DTYPES[name]
    src = np.array([1.0, -3.0, 0.1, 1000.0], dtype=row.np_dtype)
    dst = np.empty_like(src)
    scale_into(np, dst, src, 0.25)
    assert dst.dtype == row.np_dtype
    np.testing.assert_array_equal(dst, src * row.np_dtype.type(0.25))


def test_integer_average_truncates_toward_zero() -> None:
    """Horovod's integer Average is C division: the quotient truncated toward zero."""
    for name in ("int8", "int32", "int64", "uint16"):
        row = DTYPES[name]
        info = np.iinfo(row.np_dtype)
        sums = [s for s in (-7, -6, -5, -1, 0, 1, 5, 6, 7, info.min, info.max)
                if info.min <= s <= info.max]
        for n in (2, 3, 4):
            buf = np.array(sums, row.np_dtype)
            finish_reduce(np, buf, Average, n, 1.0, row)
            assert buf.tolist() == [int(s / n) if abs(s) < 2**52 else -(-s // n) if s < 0
                                    else s // n for s in sums], (name, n)
            assert buf.dtype == row.np_dtype
    buf = np.array([-7, 7], np.int32)
    finish_reduce(np, buf, Average, 2, 1.0, DTYPES["int32"])
    assert buf.tolist() == [-3, 3]  # not -4 (floor) nor -3.5 (a float)


def test_unsigned_average() -> None:
    row = DTYPES["uint8"]
    buf = np.array([255, 7, 0], np.uint8)
    finish_reduce(np, buf, Average, 4, 1.0, row)
    assert buf.tolist() == [63, 1, 0]


def test_integer_average_then_postscale() -> None:
    row = DTYPES["int64"]
    buf = np.array([-7, 7, 9], np.int64)
    finish_reduce(np, buf, Average, 2, 0.5, row)
    # trunc(-7/2) = -3, then trunc(-3 * 0.5) = -1: divide first, then scale.
    assert buf.tolist() == [math.trunc(int(s / 2) * 0.5) for s in (-7, 7, 9)] == [-1, 1, 2]


@pytest.mark.parametrize("name", FLOATS + COMPLEX)
def test_float_average_and_postscale(name: str) -> None:
    row = DTYPES[name]
    sums = np.array([3.0, -1.0, 0.5], dtype=row.np_dtype)
    buf = sums.copy()
    finish_reduce(np, buf, Average, 4, 2.0, row)
    one = row.np_dtype.type
    np.testing.assert_array_equal(buf, (sums / one(4)) * one(2.0))


@pytest.mark.parametrize("op", [Sum, Min, Max, Product])
def test_non_average_ops_only_postscale(op: ReduceOp) -> None:
    row = DTYPES["int16"]
    buf = np.array([-9, 9, 4], np.int16)
    finish_reduce(np, buf, op, 3, 1.0, row)
    assert buf.tolist() == [-9, 9, 4]
    finish_reduce(np, buf, op, 3, 0.5, row)
    assert buf.tolist() == [-4, 4, 2]


def test_average_over_one_contributor_divides_nothing() -> None:
    buf = np.array([-7, 3], np.int32)
    finish_reduce(np, buf, Average, 1, 1.0, DTYPES["int32"])
    assert buf.tolist() == [-7, 3]


# -- NCCL -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(EXPECTED))
def test_nccl_wire(name: str) -> None:
    wire = EXPECTED[name][2]
    if wire is None:
        with pytest.raises(KeyError):
            nccl_wire(DTYPES[name])
        with pytest.raises(TypeError) as info:
            check_device_dtype(DTYPES[name], Sum, "allreduce of tensor 'd'")
        assert str(info.value).startswith(
            f"allreduce of tensor 'd': dtype {name} is not supported for device tensors")
        assert "int32" in str(info.value)
        return
    assert nccl_wire(DTYPES[name]) == wire
    for op in [None, *DTYPES[name].ops]:
        if op is Product and EXPECTED[name][0] == "complex":
            continue
        check_device_dtype(DTYPES[name], op, "t")  # no error


@pytest.mark.parametrize("name", COMPLEX)
def test_complex_product_refused_on_device(name: str) -> None:
    with pytest.raises(TypeError, match=r"^tensor 'z': Product of complex device tensors"):
        check_device_dtype(DTYPES[name], Product, "tensor 'z'")
