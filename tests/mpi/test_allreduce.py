"""allreduce: every reduce op on every dtype, scale factors, in-place and ``out=`` variants."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mpi_util import (
    ALL_DTYPES,
    COMPLEX_DTYPES,
    FLOAT_DTYPES,
    INT_DTYPES,
    OP_NAMES,
    all_inputs,
    assert_equal_result,
    make_input,
    op_allowed,
    reference_allreduce,
    seed_for,
)

SHAPES = [(7,), (2, 3, 4)]
SIGNED_INTS = [d for d in INT_DTYPES if d.startswith("int")]


def _bounds(op: str) -> tuple[int, int]:
    # Products over up to 4 ranks must not overflow int8/float16.
    return (1, 2) if op == "Product" else (-8, 8)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_allowed_op(hvd: Any, dtype: str) -> None:
    """Every op the contract allows for ``dtype``, two shapes, submitted together."""
    rank, size = hvd.rank(), hvd.size()
    cases = [(op, shape) for op in OP_NAMES if op_allowed(dtype, op) for shape in SHAPES]
    handles, kept = [], []
    for op, shape in cases:
        x = make_input(seed_for(dtype, op, shape), rank, shape, dtype, *_bounds(op))
        kept.append((x, x.copy()))
        name = f"every_op.{dtype}.{op}.{len(shape)}d"
        handles.append(hvd.allreduce_async(x, name=name, op=getattr(hvd, op)))
    for (op, shape), handle, (x, before) in zip(cases, handles, kept, strict=True):
        inputs = all_inputs(seed_for(dtype, op, shape), size, shape, dtype, *_bounds(op))
        want = reference_allreduce(inputs, op)
        assert_equal_result(hvd.synchronize(handle), want, f"{op} on {dtype}{shape}")
        np.testing.assert_array_equal(x, before, err_msg="allreduce modified its input")


@pytest.mark.parametrize("dtype", ["float32", "int64", "complex64"])
def test_blocking_call_defaults_to_average(hvd: Any, dtype: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("default_op", dtype)
    got = hvd.allreduce(make_input(seed, rank, (5, 2), dtype), name=f"default_op.{dtype}")
    want = reference_allreduce(all_inputs(seed, size, (5, 2), dtype), "Average")
    assert_equal_result(got, want, f"default op on {dtype}")


UNDEFINED = [(d, op) for d in ALL_DTYPES for op in OP_NAMES if not op_allowed(d, op)]


@pytest.mark.parametrize(("dtype", "op"), UNDEFINED)
def test_undefined_op_is_type_error(hvd: Any, dtype: str, op: str) -> None:
    """Min/Max on complex and Average on bool fail at the call, on every rank alike."""
    name = f"undefined.{dtype}.{op}"
    x = make_input(1, hvd.rank(), (3,), dtype)
    with pytest.raises(TypeError, match=name):
        hvd.allreduce(x, name=name, op=getattr(hvd, op))
    # Nothing was sent: the same name still works with a valid op.
    want = reference_allreduce(all_inputs(1, hvd.size(), (3,), dtype), "Sum")
    assert_equal_result(hvd.allreduce(x, name=name, op=hvd.Sum), want)


def test_op_that_is_not_a_reduce_op_is_type_error(hvd: Any) -> None:
    with pytest.raises(TypeError, match="bad_op"):
        hvd.allreduce(np.ones(3), name="bad_op", op="sum")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + COMPLEX_DTYPES)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_float_scale_factors(hvd: Any, dtype: str, op: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("fscale", dtype, op)
    x = make_input(seed, rank, (4, 3), dtype)
    got = hvd.allreduce(
        x, name=f"fscale.{dtype}.{op}", op=getattr(hvd, op), prescale_factor=0.5,
        postscale_factor=3.0,
    )  # fmt: skip
    want = reference_allreduce(all_inputs(seed, size, (4, 3), dtype), op, 0.5, 3.0)
    assert_equal_result(got, want, f"{op} on {dtype} with prescale 0.5, postscale 3")


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_scale_factors_whole(hvd: Any, dtype: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("iscale", dtype)
    x = make_input(seed, rank, (6,), dtype, -3, 3)
    got = hvd.allreduce(
        x, name=f"iscale.{dtype}", op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0
    )
    want = reference_allreduce(all_inputs(seed, size, (6,), dtype, -3, 3), "Sum", 2.0, 3.0)
    assert_equal_result(got, want, f"Sum on {dtype} with prescale 2, postscale 3")
    assert np.array_equal(want, 6 * np.sum(all_inputs(seed, size, (6,), dtype, -3, 3), axis=0))


@pytest.mark.parametrize("dtype", SIGNED_INTS)
def test_integer_postscale_truncates_toward_zero(hvd: Any, dtype: str) -> None:
    rank = hvd.rank()
    # Rank 0 holds the odd values, the others zeros, so the sum is odd and of either sign.
    values = np.array([-7, -5, -3, -1, 1, 3, 5, 7], dtype=dtype)
    x = values if rank == 0 else np.zeros_like(values)
    got = hvd.allreduce(x, name=f"itrunc_post.{dtype}", op=hvd.Sum, postscale_factor=0.5)
    assert_equal_result(got, np.array([-3, -2, -1, 0, 0, 1, 2, 3], dtype=dtype))


@pytest.mark.parametrize("dtype", SIGNED_INTS)
def test_integer_prescale_truncates_toward_zero(hvd: Any, dtype: str) -> None:
    size = hvd.size()
    x = np.array([-7, -5, -3, -1, 1, 3, 5, 7], dtype=dtype)
    got = hvd.allreduce(x, name=f"itrunc_pre.{dtype}", op=hvd.Sum, prescale_factor=0.5)
    # Each rank's scaled tensor is truncated before the sum.
    want = (size * np.array([-3, -2, -1, 0, 0, 1, 2, 3])).astype(dtype)
    assert_equal_result(got, want)


@pytest.mark.parametrize("dtype", ["bool", "uint16", "int32", "float32", "complex128"])
def test_in_place(hvd: Any, dtype: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("inplace", dtype)
    want = reference_allreduce(all_inputs(seed, size, (3, 5), dtype), "Sum")
    x = make_input(seed, rank, (3, 5), dtype)
    assert hvd.allreduce_(x, name=f"inplace.{dtype}", op=hvd.Sum) is x
    assert_equal_result(x, want, "allreduce_")
    y = make_input(seed, rank, (3, 5), dtype)
    handle = hvd.allreduce_async_(y, name=f"inplace_async.{dtype}", op=hvd.Sum)
    assert hvd.synchronize(handle) is y
    assert_equal_result(y, want, "allreduce_async_")


@pytest.mark.parametrize("dtype", ["int8", "float64", "complex64"])
def test_out_argument(hvd: Any, dtype: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("out", dtype)
    op_name = "Sum" if dtype.startswith("complex") else "Max"
    op = getattr(hvd, op_name)
    want = reference_allreduce(all_inputs(seed, size, (2, 6), dtype), op_name)
    x = make_input(seed, rank, (2, 6), dtype)
    before = x.copy()
    out = np.zeros((2, 6), dtype=dtype)
    assert hvd.allreduce(x, name=f"out.{dtype}", op=op, out=out) is out
    assert_equal_result(out, want, "allreduce(out=)")
    np.testing.assert_array_equal(x, before)
    out2 = np.zeros((2, 6), dtype=dtype)
    handle = hvd.allreduce_async(x, name=f"out_async.{dtype}", op=op, out=out2)
    assert handle.wait() is out2
    assert_equal_result(out2, want, "allreduce_async(out=)")
