"""Errors: cross-rank mismatches raise on every rank; bad arguments fail at the call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from mpi_util import (
    all_inputs,
    assert_equal_result,
    make_input,
    reference_allreduce,
    seed_for,
    timed_barrier,
)

needs_two = pytest.mark.skipif(
    "__import__('mpi4py.MPI').MPI.COMM_WORLD.Get_size() < 2",
    reason="a cross-rank mismatch needs at least two ranks",
)


def _check_still_works(hvd: Any, name: str) -> None:
    """After an error, the same name and a fresh one both reduce correctly."""
    rank, size = hvd.rank(), hvd.size()
    for tag in (name, f"{name}.fresh"):
        seed = seed_for("after", tag)
        got = hvd.allreduce(make_input(seed, rank, (3,), "int32"), name=tag, op=hvd.Sum)
        want = reference_allreduce(all_inputs(seed, size, (3,), "int32"), "Sum")
        assert_equal_result(got, want, f"allreduce of {tag!r} after an error")


def _check_group_still_works(hvd: Any, name: str, parts: int) -> None:
    """After an error, a grouped call under the same name reduces correctly."""
    rank, size = hvd.rank(), hvd.size()
    seeds = [seed_for("group_after", name, j) for j in range(parts)]
    tensors = [make_input(s, rank, (j + 1,), "int32") for j, s in enumerate(seeds)]
    got = hvd.grouped_allreduce_async(tensors, name=name, op=hvd.Sum).wait(timeout=20)
    for j, s in enumerate(seeds):
        want = reference_allreduce(all_inputs(s, size, (j + 1,), "int32"), "Sum")
        assert_equal_result(got[j], want, f"group {name!r} part {j} after an error")


def _mismatch(hvd: Any, name: str, submit: Callable[[int], Any], *expected: str) -> None:
    """``submit(rank)`` raises MismatchError here, naming ``name`` and every expected value."""
    with pytest.raises(hvd.MismatchError) as info:
        submit(hvd.rank()).wait(timeout=20)
    message = str(info.value)
    assert name in message, message
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"
    _check_still_works(hvd, name)


@needs_two
def test_shape_mismatch(hvd: Any) -> None:
    name = "mismatch.shape"
    _mismatch(
        hvd, name,
        lambda r: hvd.allreduce_async(np.ones(2 if r == 0 else 3), name=name, op=hvd.Sum),
        "(2,)", "(3,)",
    )  # fmt: skip


@needs_two
def test_dtype_mismatch(hvd: Any) -> None:
    name = "mismatch.dtype"
    _mismatch(
        hvd, name,
        lambda r: hvd.allreduce_async(np.ones(4, "float32" if r == 0 else "float64"), name=name),
        "float32", "float64",
    )  # fmt: skip


@needs_two
def test_op_mismatch(hvd: Any) -> None:
    name = "mismatch.op"
    _mismatch(
        hvd, name,
        lambda r: hvd.allreduce_async(np.ones(4), name=name, op=hvd.Sum if r == 0 else hvd.Max),
        "Sum", "Max",
    )  # fmt: skip


@needs_two
def test_root_rank_mismatch(hvd: Any) -> None:
    name = "mismatch.root"
    _mismatch(
        hvd, name,
        lambda r: hvd.broadcast_async(np.ones(4), 0 if r == 0 else 1, name=name),
        "root",
    )  # fmt: skip


@needs_two
def test_prescale_mismatch(hvd: Any) -> None:
    name = "mismatch.prescale"
    _mismatch(
        hvd, name,
        lambda r: hvd.allreduce_async(
            np.ones(4), name=name, op=hvd.Sum, prescale_factor=1.0 if r == 0 else 2.5
        ),
        "prescale", "1.0", "2.5",
    )  # fmt: skip


@needs_two
def test_postscale_mismatch(hvd: Any) -> None:
    name = "mismatch.postscale"
    _mismatch(
        hvd, name,
        lambda r: hvd.allreduce_async(
            np.ones(4), name=name, op=hvd.Sum, postscale_factor=0.25 if r == 0 else 4.0
        ),
        "postscale", "0.25", "4.0",
    )  # fmt: skip


@needs_two
def test_allgather_trailing_shape_mismatch(hvd: Any) -> None:
    name = "mismatch.allgather"
    _mismatch(
        hvd, name,
        lambda r: hvd.allgather_async(np.ones((2, 3 if r == 0 else 4)), name=name),
        "(3,)", "(4,)",
    )  # fmt: skip


@needs_two
def test_grouped_part_shape_mismatch(hvd: Any) -> None:
    name = "mismatch.group_part"
    _mismatch(
        hvd, name,
        lambda r: hvd.grouped_allreduce_async([np.ones(2), np.ones(2 + min(r, 1))], name=name),
        "(2,)", "(3,)",
    )  # fmt: skip
    _check_group_still_works(hvd, name, parts=2)


@needs_two
def test_group_size_mismatch(hvd: Any, restart: Callable[..., Any]) -> None:
    """Rank 0 groups two tensors, the others three: every rank fails, nothing is left over."""
    restart()
    name = "mismatch.group_size"
    _mismatch(
        hvd, name,
        lambda r: hvd.grouped_allreduce_async([np.ones(1)] * (2 + min(r, 1)), name=name),
    )  # fmt: skip
    _check_group_still_works(hvd, name, parts=3)


@needs_two
def test_blocking_call_raises_mismatch_and_other_tensors_are_unaffected(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("bystander")
    bystander = hvd.allreduce_async(
        make_input(seed, rank, (6,), "int64"), name="bystander", op=hvd.Sum
    )
    with pytest.raises(hvd.MismatchError, match="mismatch.blocking"):
        hvd.allreduce(np.ones(rank + 1), name="mismatch.blocking")
    want = reference_allreduce(all_inputs(seed, size, (6,), "int64"), "Sum")
    assert_equal_result(bystander.wait(timeout=20), want)
    _check_still_works(hvd, "mismatch.blocking")


# --- local validation: every rank makes the same bad call, so nobody is left waiting ---------


def _refused(
    hvd: Any,
    name: str,
    call: Callable[[], Any],
    errors: type[Exception] | tuple[type[Exception], ...],
) -> None:
    with pytest.raises(errors) as info:
        call()
    assert name in str(info.value), f"{name!r} not in {info.value!r}"
    _check_still_works(hvd, name)


@pytest.mark.parametrize("values", [np.array([1, "a"], dtype=object), np.array(["a", "b"])])
def test_unsupported_dtype(hvd: Any, values: np.ndarray) -> None:
    name = f"bad_dtype.{values.dtype.kind}"
    _refused(hvd, name, lambda: hvd.allreduce(values, name=name), TypeError)


def test_non_contiguous_input(hvd: Any) -> None:
    strided = np.arange(20.0).reshape(4, 5)[:, ::2]
    assert not strided.flags.c_contiguous
    name = "bad.strided"
    _refused(hvd, name, lambda: hvd.allreduce(strided, name=name), (TypeError, ValueError))
    _refused(hvd, name, lambda: hvd.allgather(strided, name=name), (TypeError, ValueError))


@pytest.mark.parametrize("where", ["negative", "size"])
def test_bad_root_rank(hvd: Any, where: str) -> None:
    root = -1 if where == "negative" else hvd.size()
    name = f"bad_root.{where}"
    _refused(hvd, name, lambda: hvd.broadcast(np.ones(3), root, name=name), ValueError)
    _refused(hvd, name, lambda: hvd.broadcast_async_(np.ones(3), root, name=name), ValueError)


def test_out_with_wrong_shape(hvd: Any) -> None:
    name = "bad_out.shape"
    out = np.zeros(5)
    _refused(hvd, name, lambda: hvd.allreduce(np.ones(4), name=name, out=out), ValueError)


def test_out_with_wrong_dtype(hvd: Any) -> None:
    name = "bad_out.dtype"
    out = np.zeros(4, dtype=np.float32)
    _refused(
        hvd, name, lambda: hvd.allreduce(np.ones(4), name=name, out=out), (TypeError, ValueError)
    )


def test_duplicate_name_in_flight(hvd: Any) -> None:
    """While a name is in flight, submitting it again fails at the call.

    The last rank holds back its first submission until the others tried the duplicate, so
    the first request is provably still in flight on every other rank.
    """
    rank, size = hvd.rank(), hvd.size()
    if size < 2:
        pytest.skip("needs a second rank to hold the first request in flight")
    name = "dup.in_flight"
    seed = seed_for("dup")
    x = make_input(seed, rank, (4,), "int32")
    first, refused = None, None
    try:
        if rank < size - 1:
            first = hvd.allreduce_async(x, name=name, op=hvd.Sum)
            try:
                hvd.allreduce_async(x.copy(), name=name, op=hvd.Sum)
            except ValueError as exc:
                refused = exc
    finally:
        timed_barrier("duplicate submissions tried")
    if rank < size - 1:
        assert refused is not None, "a duplicate name in flight was accepted"
        assert name in str(refused), str(refused)
    if first is None:
        first = hvd.allreduce_async(x, name=name, op=hvd.Sum)
    want = reference_allreduce(all_inputs(seed, size, (4,), "int32"), "Sum")
    assert_equal_result(first.wait(timeout=20), want, "the first submission")


def _read_only(shape: tuple[int, ...]) -> np.ndarray:
    array = np.ones(shape)
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("call", ["allreduce_", "out=", "broadcast_"])
def test_read_only_output_is_refused_at_the_call(
    hvd: Any, restart: Callable[..., Any], call: str
) -> None:
    """A result that cannot be written must fail at the call, not in the background thread.

    ``restart`` gives this test its own engine, so a failure here cannot take the rest down.
    """
    restart()
    name = f"read_only.{call}"
    calls: dict[str, Callable[[], Any]] = {
        "allreduce_": lambda: hvd.allreduce_(_read_only((3,)), name=name, op=hvd.Sum),
        "out=": lambda: hvd.allreduce(np.ones(3), name=name, op=hvd.Sum, out=_read_only((3,))),
        "broadcast_": lambda: hvd.broadcast_(_read_only((3,)), 0, name=name),
    }
    _refused(hvd, name, calls[call], (TypeError, ValueError))


@pytest.mark.parametrize("order", [">", "<"])
def test_byte_order_native_reduced_other_refused(hvd: Any, order: str) -> None:
    """The native byte order is reduced; the other one is refused at the call, naming the
    tensor and the fix, and nothing is lost."""
    rank, size = hvd.rank(), hvd.size()
    name = f"byte_order.{order}"
    seed = seed_for("byte_order")
    x = make_input(seed, rank, (4,), "float64").astype(f"{order}f8")
    if not x.dtype.isnative:
        with pytest.raises(TypeError, match=r"byte order.*newbyteorder") as info:
            hvd.allreduce(x, name=name, op=hvd.Sum)
        assert name in str(info.value)
        _check_still_works(hvd, name)
        return
    got = hvd.allreduce(x, name=name, op=hvd.Sum)
    assert got.dtype == x.dtype
    want = reference_allreduce(all_inputs(seed, size, (4,), "float64"), "Sum")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", ["sum", "length", "negative"])
def test_bad_alltoall_splits(hvd: Any, case: str) -> None:
    size = hvd.size()
    rows = {"sum": size + 1, "length": size, "negative": 0}[case]
    splits = {
        "sum": [1] * size,
        "length": [1] * (size + 1),
        "negative": [-1] + [0] * (size - 2) + [1] if size > 1 else [-1],
    }[case]
    name = f"bad_splits.{case}"
    x = np.ones((rows, 2))
    _refused(hvd, name, lambda: hvd.alltoall(x, splits=splits, name=name), ValueError)


def test_grouped_call_with_one_bad_part_sends_nothing(hvd: Any) -> None:
    """A bad last part fails the whole grouped call before its good parts are sent."""
    name = "bad_group"
    parts = [np.ones(1), np.ones(2), np.array(["x", "y"])]
    with pytest.raises(TypeError, match=name):
        hvd.grouped_allreduce(parts, name=name, op=hvd.Sum)
    _check_group_still_works(hvd, name, parts=3)
