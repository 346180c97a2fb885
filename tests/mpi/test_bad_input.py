"""The bad-input matrix: every misuse fails loudly, names the tensor and the fix, and the
engine goes on working.

Two kinds of misuse:

* Local (every rank makes the same bad call, so nobody is left waiting): a ``TypeError`` or
  ``ValueError`` at the call, whose message names the tensor (where the call has a valid name)
  and says what to do. ``tests/mpi/test_errors.py`` already covers some cells (object and str
  dtypes on allreduce, a strided allreduce/allgather, root -1/size on broadcast and
  broadcast_async_, bad splits by sum/length/sign, out= of wrong shape/dtype on allreduce,
  read-only allreduce_/out=/broadcast_, a duplicate allreduce in flight); this matrix fills in
  the other collectives, forms and values around them.
* Cross-rank (the ranks disagree): ``MismatchError`` on every rank, naming the tensor, every
  rank's value and the fix. ``test_errors.py`` covers allreduce shape/dtype/op/prescale/
  postscale, a broadcast root and grouped shapes/sizes; this matrix covers the same fields on
  the other collectives and forms, a different value on every rank, and the in-place tensors
  left untouched.

After every case a correct allreduce under the same name, and allgather and broadcast under
fresh names, must give exact results. Writing this matrix found four engine bugs (argument
checks cached by value, alltoall splits converted before validation, grouped calls not named,
the request memo growing with unnamed calls); their cases now pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
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

WAIT_S = 30.0

needs_two = pytest.mark.skipif(
    "__import__('mpi4py.MPI').MPI.COMM_WORLD.Get_size() < 2",
    reason="needs at least two ranks",
)


def _still_works(hvd: Any, name: str) -> None:
    """Correct collectives right after the error: an allreduce under the failed name, an
    allgather and a broadcast under fresh ones, each exact."""
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("still_works", name)
    got = hvd.allreduce(make_input(seed, rank, (3,), "int32"), name=name, op=hvd.Sum)
    assert_equal_result(got, reference_allreduce(all_inputs(seed, size, (3,), "int32"), "Sum"),
                        f"allreduce of {name!r} after the error")
    rows = [make_input(seed, r, (r + 1, 2), "int16") for r in range(size)]
    got = hvd.allgather(rows[rank], name=f"{name}.after.ag")
    assert_equal_result(got, np.concatenate(rows), f"allgather after the error in {name!r}")
    got = hvd.broadcast(make_input(seed, rank, (2,), "float32"), size - 1, name=f"{name}.after.bc")
    assert_equal_result(got, make_input(seed, size - 1, (2,), "float32"),
                        f"broadcast after the error in {name!r}")


# --- local misuse -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Misuse:
    """One bad call: ``call(hvd, name)`` must raise ``error`` whose message matches ``fix``
    (and contains ``name``, unless ``names_tensor`` is False: the name itself is the error)."""

    call: Callable[[Any, str], Any]
    error: type[Exception] | tuple[type[Exception], ...]
    fix: str
    names_tensor: bool = True


def _read_only(shape: tuple[int, ...] = (3,), dtype: str = "float64") -> np.ndarray:
    array = np.ones(shape, dtype)
    array.flags.writeable = False
    return array


def _strided() -> np.ndarray:
    return np.arange(24.0).reshape(4, 6)[:, ::2]


def _rows(hvd: Any, per_rank: int = 1) -> np.ndarray:
    """A (size * per_rank, 2) float64 input (splits/reducescatter friendly)."""
    return np.ones((hvd.size() * per_rank, 2))


def _negative_splits(hvd: Any) -> list[int]:
    """size entries summing to 2 * size with a -1 first: [-1, 2 * size + 1, 0, ...]."""
    return [-1] if hvd.size() == 1 else [-1, 2 * hvd.size() + 1] + [0] * (hvd.size() - 2)


def _bad_splits_float(hvd: Any) -> list[float]:
    """size entries summing to size once truncated toward zero: [1.5, 1, 1, ...]."""
    return [1.5] + [1] * (hvd.size() - 1)


DATETIME = np.array(["2024-01-01", "2024-06-12"], dtype="datetime64[D]")
TIMEDELTA = np.array([1, 2], dtype="timedelta64[s]")
OBJECTS = np.array([1, "a"], dtype=object)

_DTYPE = r"dtype \S+ is not supported; expected one of bool, int8"
_CONTIGUOUS = r"not C-contiguous; pass np\.ascontiguousarray\(x\)"
_WRITABLE = r"read-only; pass a writable array"
_OP = r"op must be a hvdlite\.ReduceOp \(Sum, Average, \.\.\.\)"
_OP_FOR_DTYPE = r"op \w+ is not defined for dtype \w+; use one of"
_ROOT = r"root_rank must be an int in \[0, \d+\)"
_SPLITS = r"splits must be \d+ non-negative ints summing to dim 0"
_ZERO_D = r"needs at least one dimension, got a 0-d tensor; reshape it to \(1,\)"
_OUT = r"out= must match the input; expected"
_TENSOR = r"expected a numpy\.ndarray, cupy\.ndarray or torch\.Tensor"
_NAME = r"name must be a str or None"
_GROUP = r"non-empty list of tensors"
_FACTOR = r"must be a real number"

LOCAL: dict[str, Any] = {
    # unsupported dtype (object/str allreduce: test_errors.py)
    "dtype.datetime.allreduce": Misuse(
        lambda h, n: h.allreduce(DATETIME, name=n), TypeError, _DTYPE),
    "dtype.timedelta.allgather": Misuse(
        lambda h, n: h.allgather(TIMEDELTA, name=n), TypeError, _DTYPE),
    "dtype.object.broadcast": Misuse(
        lambda h, n: h.broadcast(OBJECTS, 0, name=n), TypeError, _DTYPE),
    "dtype.datetime.broadcast_async_": Misuse(
        lambda h, n: h.broadcast_async_(DATETIME.copy(), 0, name=n), TypeError, _DTYPE),
    "dtype.object.alltoall": Misuse(
        lambda h, n: h.alltoall(np.array([None] * h.size(), dtype=object), name=n),
        TypeError, _DTYPE),
    "dtype.str.reducescatter": Misuse(
        lambda h, n: h.reducescatter(np.array(["a"] * h.size()), name=n), TypeError, _DTYPE),
    "dtype.datetime.grouped_part": Misuse(
        lambda h, n: h.grouped_allreduce([np.ones(2), DATETIME], name=n), TypeError, _DTYPE),
    "dtype.not_a_tensor.list": Misuse(
        lambda h, n: h.allreduce([1.0, 2.0], name=n), TypeError, _TENSOR),
    "dtype.not_a_tensor.scalar": Misuse(
        lambda h, n: h.allgather_async(3.0, name=n), TypeError, _TENSOR),
    # non-contiguous (strided allreduce/allgather: test_errors.py)
    "contiguous.broadcast_fortran": Misuse(
        lambda h, n: h.broadcast(np.asfortranarray(np.ones((3, 2))), 0, name=n),
        ValueError, _CONTIGUOUS),
    "contiguous.alltoall": Misuse(
        lambda h, n: h.alltoall(np.ones((2 * h.size(), 4))[:, ::2], name=n),
        ValueError, _CONTIGUOUS),
    "contiguous.reducescatter": Misuse(
        lambda h, n: h.reducescatter(np.ones((h.size(), 6))[:, ::3], name=n),
        ValueError, _CONTIGUOUS),
    "contiguous.allreduce_": Misuse(
        lambda h, n: h.allreduce_(_strided(), name=n), ValueError, _CONTIGUOUS),
    "contiguous.grouped_part": Misuse(
        lambda h, n: h.grouped_allreduce_async([np.ones(3), _strided()], name=n),
        ValueError, _CONTIGUOUS),
    "contiguous.out": Misuse(
        lambda h, n: h.allreduce(np.ones(3), name=n, out=np.zeros(6)[::2]),
        ValueError, _CONTIGUOUS),
    # read-only in-place (allreduce_, out=, broadcast_: test_errors.py)
    "read_only.allreduce_async_": Misuse(
        lambda h, n: h.allreduce_async_(_read_only(), name=n), ValueError, _WRITABLE),
    "read_only.broadcast_async_": Misuse(
        lambda h, n: h.broadcast_async_(_read_only((2, 2), "int32"), 0, name=n),
        ValueError, _WRITABLE),
    "read_only.grouped_allreduce_": Misuse(
        lambda h, n: h.grouped_allreduce_([np.ones(2), _read_only()], name=n),
        ValueError, _WRITABLE),
    "read_only.grouped_allreduce_async_": Misuse(
        lambda h, n: h.grouped_allreduce_async_([_read_only()], name=n), ValueError, _WRITABLE),
    "read_only.out_async": Misuse(
        lambda h, n: h.allreduce_async(np.ones(3), name=n, out=_read_only()),
        ValueError, _WRITABLE),
    # bad op
    "op.str": Misuse(lambda h, n: h.allreduce(np.ones(3), name=n, op="sum"), TypeError, _OP),
    "op.int": Misuse(lambda h, n: h.allreduce(np.ones(3), name=n, op=7), TypeError, _OP),
    "op.none": Misuse(lambda h, n: h.allreduce_async(np.ones(3), name=n, op=None), TypeError, _OP),
    "op.unhashable": Misuse(lambda h, n: h.allreduce(np.ones(3), name=n, op=[1]), TypeError, _OP),
    "op.reducescatter": Misuse(
        lambda h, n: h.reducescatter(_rows(h), name=n, op="Average"), TypeError, _OP),
    "op.grouped": Misuse(
        lambda h, n: h.grouped_allreduce([np.ones(2)], name=n, op=np.add), TypeError, _OP),
    # op not defined for the dtype
    "op_for_dtype.average_bool": Misuse(
        lambda h, n: h.allreduce(np.ones(3, bool), name=n), TypeError, _OP_FOR_DTYPE),
    "op_for_dtype.average_bool.allreduce_": Misuse(
        lambda h, n: h.allreduce_(np.ones(3, bool), name=n, op=h.Average),
        TypeError, _OP_FOR_DTYPE),
    "op_for_dtype.average_bool.reducescatter": Misuse(
        lambda h, n: h.reducescatter(np.ones(h.size(), bool), name=n), TypeError, _OP_FOR_DTYPE),
    "op_for_dtype.average_bool.grouped": Misuse(
        lambda h, n: h.grouped_allreduce([np.ones(1, bool)], name=n), TypeError, _OP_FOR_DTYPE),
    "op_for_dtype.min_complex": Misuse(
        lambda h, n: h.allreduce(np.ones(3, complex), name=n, op=h.Min),
        TypeError, _OP_FOR_DTYPE),
    "op_for_dtype.max_complex.reducescatter": Misuse(
        lambda h, n: h.reducescatter(np.ones(h.size(), np.complex64), name=n, op=h.Max),
        TypeError, _OP_FOR_DTYPE),
    # bad root (-1/size on broadcast and broadcast_async_: test_errors.py)
    "root.negative.broadcast_": Misuse(
        lambda h, n: h.broadcast_(np.ones(3), -1, name=n), ValueError, _ROOT),
    "root.size.broadcast_async": Misuse(
        lambda h, n: h.broadcast_async(np.ones(3), h.size(), name=n), ValueError, _ROOT),
    "root.str": Misuse(lambda h, n: h.broadcast(np.ones(3), "0", name=n), ValueError, _ROOT),
    "root.float": Misuse(lambda h, n: h.broadcast(np.ones(3), 0.0, name=n), ValueError, _ROOT),
    "root.none": Misuse(lambda h, n: h.broadcast(np.ones(3), None, name=n), ValueError, _ROOT),
    "root.bool": Misuse(lambda h, n: h.broadcast_(np.ones(3), False, name=n), ValueError, _ROOT),
    # bad splits (sum/length/negative on the blocking call: test_errors.py)
    "splits.length.async": Misuse(
        lambda h, n: h.alltoall_async(_rows(h), splits=[1] * (h.size() + 1), name=n),
        ValueError, _SPLITS),
    "splits.negative.async": Misuse(
        lambda h, n: h.alltoall_async(_rows(h, 2), splits=_negative_splits(h), name=n),
        ValueError, _SPLITS),
    "splits.sum.ndarray": Misuse(
        lambda h, n: h.alltoall(_rows(h), splits=np.full(h.size(), 2), name=n),
        ValueError, _SPLITS),
    "splits.empty": Misuse(
        lambda h, n: h.alltoall(_rows(h), splits=[], name=n), ValueError, _SPLITS),
    "splits.str": Misuse(
        lambda h, n: h.alltoall(_rows(h), splits=["a"] * h.size(), name=n),
        (TypeError, ValueError), r"splits"),
    "splits.float": Misuse(
        lambda h, n: h.alltoall(_rows(h), splits=_bad_splits_float(h), name=n),
        (TypeError, ValueError), r"splits"),
    "splits.scalar": Misuse(
        lambda h, n: h.alltoall(_rows(h), splits=h.size(), name=n),
        (TypeError, ValueError), r"splits"),
    # 0-d tensors where dim 0 matters
    "zero_d.allgather": Misuse(
        lambda h, n: h.allgather(np.array(1.0), name=n), ValueError, _ZERO_D),
    "zero_d.allgather_async": Misuse(
        lambda h, n: h.allgather_async(np.array(1, np.int32), name=n), ValueError, _ZERO_D),
    "zero_d.alltoall": Misuse(lambda h, n: h.alltoall(np.array(1.0), name=n), ValueError, _ZERO_D),
    "zero_d.alltoall_splits": Misuse(
        lambda h, n: h.alltoall_async(np.array(1.0), splits=[0] * h.size(), name=n),
        ValueError, _ZERO_D),
    "zero_d.reducescatter": Misuse(
        lambda h, n: h.reducescatter(np.array(1.0), name=n, op=h.Sum), ValueError, _ZERO_D),
    # out= (wrong shape/dtype on the blocking allreduce: test_errors.py)
    "out.shape.async": Misuse(
        lambda h, n: h.allreduce_async(np.ones(3), name=n, out=np.zeros(4)), ValueError, _OUT),
    "out.ndim": Misuse(
        lambda h, n: h.allreduce(np.ones(3), name=n, out=np.zeros((1, 3))), ValueError, _OUT),
    "out.dtype.int_for_float": Misuse(
        lambda h, n: h.allreduce(np.ones(3), name=n, out=np.zeros(3, np.int64)),
        ValueError, _OUT),
    "out.not_a_tensor": Misuse(
        lambda h, n: h.allreduce(np.ones(3), name=n, out=[0.0, 0.0, 0.0]), TypeError, _TENSOR),
    # name not a str
    "name.int.allreduce": Misuse(
        lambda h, n: h.allreduce(np.ones(3), name=5), TypeError, _NAME, names_tensor=False),
    "name.bytes.allgather": Misuse(
        lambda h, n: h.allgather(np.ones(3), name=n.encode()), TypeError, _NAME, False),
    "name.tuple.broadcast_async": Misuse(
        lambda h, n: h.broadcast_async(np.ones(3), 0, name=(n,)), TypeError, _NAME, False),
    "name.int.barrier_async": Misuse(
        lambda h, n: h.barrier_async(name=7), TypeError, _NAME, False),
    "name.bytes.grouped": Misuse(
        lambda h, n: h.grouped_allreduce([np.ones(2)], name=n.encode()), TypeError, _NAME, False),
    # grouped call with an empty list or no list
    "group.empty": Misuse(lambda h, n: h.grouped_allreduce([], name=n), TypeError, _GROUP),
    "group.empty_tuple.async_": Misuse(
        lambda h, n: h.grouped_allreduce_async_((), name=n), TypeError, _GROUP),
    "group.single_tensor": Misuse(
        lambda h, n: h.grouped_allreduce_async(np.ones(3), name=n), TypeError, _GROUP),
    "group.generator": Misuse(
        lambda h, n: h.grouped_allreduce_((np.ones(1) for _ in range(2)), name=n),
        TypeError, _GROUP),
    "group.empty.unnamed": Misuse(
        lambda h, n: h.grouped_allreduce([]), TypeError, _GROUP, names_tensor=False),
    # scale factors of the wrong type (True, NumPy scalars: test_argument_check_does_not_depend_...)
    "scale.prescale_str": Misuse(
        lambda h, n: h.allreduce(np.ones(3), name=n, prescale_factor="2"), TypeError, _FACTOR),
    "scale.postscale_none": Misuse(
        lambda h, n: h.allreduce_async(np.ones(3), name=n, postscale_factor=None),
        TypeError, _FACTOR),
    "scale.postscale_complex": Misuse(
        lambda h, n: h.allreduce(np.ones(3), name=n, op=h.Sum, postscale_factor=2j),
        TypeError, _FACTOR),
    "scale.prescale_list.grouped": Misuse(
        lambda h, n: h.grouped_allreduce([np.ones(2)], name=n, prescale_factor=[2.0]),
        TypeError, _FACTOR),
    "scale.bool_tensor": Misuse(
        lambda h, n: h.allreduce(np.ones(3, bool), name=n, op=h.Max, prescale_factor=2.0),
        TypeError, r"cannot scale a bool tensor; cast it first"),
}


def _case_params() -> list[Any]:
    params = []
    for case_id, case in LOCAL.items():
        if isinstance(case, Misuse):
            params.append(pytest.param(case, id=case_id))
        else:  # already a pytest.param with marks
            params.append(pytest.param(*case.values, marks=case.marks, id=case_id))
    return params


@pytest.mark.parametrize("case", _case_params())
def test_local_misuse(hvd: Any, case: Misuse, request: pytest.FixtureRequest) -> None:
    """Every rank makes the same bad call: it raises at the call (a handle is never
    returned), naming the tensor and the fix; then correct collectives still work."""
    name = f"bad.{request.node.callspec.id}"
    try:
        result = case.call(hvd, name)
    except case.error as exc:
        message = str(exc)
    else:
        if isinstance(result, hvd.Handle):  # never leave an accepted call in flight
            result.wait(timeout=WAIT_S)
        pytest.fail(f"the call was accepted (returned {result!r})")
    finally:
        timed_barrier(f"bad call {name} made")
    assert re.search(case.fix, message), f"no fix ({case.fix!r}) in: {message}"
    if case.names_tensor:
        assert name in message, f"{name!r} not named in: {message}"
    _still_works(hvd, name)


# bad argument, the equal valid one, whether the bad one must be refused (else: only the same
# answer both times is required)
HISTORY: dict[str, tuple[dict[str, Any], dict[str, Any], bool]] = {
    "op=1": ({"op": 1}, {"op": "Sum"}, True),
    "postscale=True": ({"postscale_factor": True}, {"postscale_factor": 1.0}, True),
    "postscale=np.float32": ({"postscale_factor": np.float32(3.0)}, {"postscale_factor": 3.0},
                             False),
    "prescale=np.int64": ({"prescale_factor": np.int64(7)}, {"prescale_factor": 7.0}, False),
}


@pytest.mark.parametrize("case", list(HISTORY))
def test_argument_check_does_not_depend_on_earlier_calls(hvd: Any, case: str) -> None:
    """The same argument gets the same answer before and after an equal valid one was used;
    an op that is no ReduceOp and a bool factor are refused both times (the checks say so)."""
    rank, size = hvd.rank(), hvd.size()
    bad, good, must_refuse = HISTORY[case]
    name = f"bad.history.{case}"
    seed = seed_for(name)
    base = {"op": "Product", "prescale_factor": 5.0, "postscale_factor": 1.0} | good
    x = make_input(seed, rank, (3,), "uint16", 0, 1)

    def call(**override: Any) -> Any:
        kwargs = base | override
        op = kwargs.pop("op")
        return hvd.allreduce(x, name=name, op=getattr(hvd, op) if isinstance(op, str) else op,
                             **kwargs)

    def outcome() -> str:
        try:
            call(**bad)
        except TypeError as exc:
            assert name in str(exc) and re.search(f"{_FACTOR}|{_OP}", str(exc)), str(exc)
            return "TypeError"
        return "accepted"

    before = outcome()
    timed_barrier(f"{name}: first try")
    want = reference_allreduce(all_inputs(seed, size, (3,), "uint16", 0, 1), base["op"],
                               base["prescale_factor"], base["postscale_factor"])
    assert_equal_result(call(), want, f"{name}: the call with {good}")
    after = outcome()
    timed_barrier(f"{name}: second try")
    _still_works(hvd, name)
    assert before == after, f"{bad}: {before} at first, {after} after {good} was used"
    if must_refuse:
        assert after == "TypeError", f"{bad} was accepted"


# --- a duplicate name in flight ----------------------------------------------------------------


DUPLICATES: dict[str, tuple[Callable[[Any, str, int], Any], Callable[[Any, str], Any], str]] = {
    # first (kept in flight), second (refused), the name the refusal must give
    "allgather_then_allreduce": (
        lambda h, n, r: h.allgather_async(np.full((r + 1, 2), r, np.int32), name=n),
        lambda h, n: h.allreduce_async(np.ones(2), name=n),
        "{n}",
    ),
    "grouped_then_allreduce": (
        lambda h, n, r: h.grouped_allreduce_async(
            [np.full(2, r, np.int32) for _ in range(2)], name=n, op=h.Sum),
        lambda h, n: h.allreduce_async(np.ones(2), name=n),
        "{n}",
    ),
    "allreduce_then_grouped": (
        lambda h, n, r: h.allreduce_async(np.full(2, r, np.int32), name=n, op=h.Sum),
        lambda h, n: h.grouped_allreduce_async([np.ones(1), np.ones(1)], name=n),
        "{n}",
    ),
    "broadcast_async__then_broadcast_async_": (
        lambda h, n, r: h.broadcast_async_(np.full(3, r, np.int32), 0, name=n),
        lambda h, n: h.broadcast_async_(np.zeros(3, np.int32), 0, name=n),
        "{n}",
    ),
    "reducescatter_then_barrier": (
        lambda h, n, r: h.reducescatter_async(np.full((h.size(), 1), r, np.int32), name=n,
                                              op=h.Sum),
        lambda h, n: h.barrier_async(name=n),
        "{n}",
    ),
}


@needs_two
@pytest.mark.parametrize("case", list(DUPLICATES))
def test_duplicate_name_in_flight(hvd: Any, case: str) -> None:
    """A second collective under a name (a grouped call's included) still in flight fails at
    the call, naming it and the fix; the first one completes correctly.

    The last rank holds its first submission back until the others tried the duplicate, so
    the first is provably still in flight on them (the plain allreduce case: test_errors.py).
    """
    rank, size = hvd.rank(), hvd.size()
    first_call, second_call, clash = DUPLICATES[case]
    name = f"bad.dup.{case}"
    first, refused = None, None
    try:
        if rank < size - 1:
            first = first_call(hvd, name, rank)
            try:
                late = second_call(hvd, name)
            except ValueError as exc:
                refused = exc
            else:
                late.wait(timeout=WAIT_S)
    finally:
        timed_barrier(f"{name}: duplicates tried")
    if first is None:
        first = first_call(hvd, name, rank)
    result = first.wait(timeout=WAIT_S)
    if rank < size - 1:
        assert refused is not None, "a duplicate name in flight was accepted"
        message = str(refused)
        assert clash.format(n=name) in message, message
        assert "wait for it first or pass a different name=" in message, message
    total = sum(range(size))
    if case == "allgather_then_allreduce":
        want = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)])
        assert_equal_result(result, want)
    elif case == "grouped_then_allreduce":
        for part in result:
            assert_equal_result(part, np.full(2, total, np.int32))
    elif case == "allreduce_then_grouped":
        assert_equal_result(result, np.full(2, total, np.int32))
    elif case.startswith("broadcast"):
        assert_equal_result(result, np.zeros(3, np.int32))
    else:  # reducescatter of (size, 1): one row each
        assert_equal_result(result, np.full((1, 1), total, np.int32))
    _still_works(hvd, name)


# --- cross-rank mismatches ---------------------------------------------------------------------

DTYPE_PER_RANK = ["float32", "float64", "int32", "int64"]
OP_PER_RANK = ["Sum", "Max", "Min", "Product"]


Kept = tuple[np.ndarray, np.ndarray] | None  # an in-place tensor and a copy of it from before


@dataclass(frozen=True)
class Mismatch:
    """``submit(hvd, name, rank)`` returns a handle and, for in-place forms, the tensor with a
    copy of its contents (it must stay untouched); ``value(rank, size)`` is the text the
    message must show for that rank's value of the field ``label``."""

    submit: Callable[[Any, str, int], tuple[Any, Kept]]
    label: str
    value: Callable[[int, int], str]
    fix: str


def _in_place(call: Callable[..., Any], tensor: np.ndarray, *args: Any,
              **kwargs: Any) -> tuple[Any, Kept]:
    before = tensor.copy()
    return call(tensor, *args, **kwargs), (tensor, before)


def _plain(handle: Any) -> tuple[Any, Kept]:
    return handle, None


_SAME_SHAPE = "pass tensors of the same shape on every rank"
_SAME_DTYPE = "cast to one dtype on every rank"
_SAME_OP = "pass the same reduce op on every rank"

MISMATCHES: dict[str, Mismatch] = {
    "shape.broadcast": Mismatch(
        lambda h, n, r: _plain(h.broadcast_async(np.ones(r + 1), 0, name=n)),
        "shape", lambda r, s: f"({r + 1},)", _SAME_SHAPE),
    "shape.reducescatter": Mismatch(
        lambda h, n, r: _plain(h.reducescatter_async(np.ones((h.size(), r + 1)), name=n)),
        "shape", lambda r, s: f"({s}, {r + 1})", _SAME_SHAPE),
    "shape.alltoall_trailing": Mismatch(
        lambda h, n, r: _plain(h.alltoall_async(np.ones((h.size(), r + 1)), name=n)),
        "shape after dim 0", lambda r, s: f"({r + 1},)", "on every rank"),
    "shape.allreduce_async_": Mismatch(
        lambda h, n, r: _in_place(h.allreduce_async_, np.full((r + 1, 2), 7.0), name=n),
        "shape", lambda r, s: f"({r + 1}, 2)", _SAME_SHAPE),
    "dtype.allgather": Mismatch(
        lambda h, n, r: _plain(h.allgather_async(np.ones((r + 1, 2), DTYPE_PER_RANK[r]), name=n)),
        "dtype", lambda r, s: DTYPE_PER_RANK[r], _SAME_DTYPE),
    "dtype.broadcast_async_": Mismatch(
        lambda h, n, r: _in_place(h.broadcast_async_, np.full(3, 5 + r, DTYPE_PER_RANK[r]), 0,
                                  name=n),
        "dtype", lambda r, s: DTYPE_PER_RANK[r], _SAME_DTYPE),
    "dtype.alltoall": Mismatch(
        lambda h, n, r: _plain(h.alltoall_async(np.ones(h.size(), DTYPE_PER_RANK[r]), name=n)),
        "dtype", lambda r, s: DTYPE_PER_RANK[r], _SAME_DTYPE),
    "dtype.reducescatter": Mismatch(
        lambda h, n, r: _plain(h.reducescatter_async(np.ones(h.size(), DTYPE_PER_RANK[r]),
                                                     name=n, op=h.Sum)),
        "dtype", lambda r, s: DTYPE_PER_RANK[r], _SAME_DTYPE),
    "dtype.grouped_part": Mismatch(
        lambda h, n, r: _plain(h.grouped_allreduce_async(
            [np.ones(2), np.ones(2, DTYPE_PER_RANK[r])], name=n)),
        "dtype", lambda r, s: DTYPE_PER_RANK[r], _SAME_DTYPE),
    "op.reducescatter": Mismatch(
        lambda h, n, r: _plain(h.reducescatter_async(np.ones(h.size()), name=n,
                                                     op=getattr(h, OP_PER_RANK[r]))),
        "reduce op", lambda r, s: OP_PER_RANK[r], _SAME_OP),
    "op.grouped_allreduce_async_": Mismatch(
        lambda h, n, r: _in_place(lambda t, **kw: h.grouped_allreduce_async_([t], **kw),
                                  np.full(2, 3.0 + r), name=n, op=getattr(h, OP_PER_RANK[r])),
        "reduce op", lambda r, s: OP_PER_RANK[r], _SAME_OP),
    "root.each_rank_its_own.broadcast_async_": Mismatch(
        lambda h, n, r: _in_place(h.broadcast_async_, np.full(4, r + 10, np.int64), r, name=n),
        "root rank", lambda r, s: str(r), "pass the same root_rank on every rank"),
    "prescale.grouped": Mismatch(
        lambda h, n, r: _plain(h.grouped_allreduce_async(
            [np.ones(2), np.ones(3)], name=n, op=h.Sum, prescale_factor=1.0 + r)),
        "prescale_factor", lambda r, s: str(1.0 + r),
        "pass the same prescale_factor on every rank"),
    "prescale.allreduce_async_": Mismatch(
        lambda h, n, r: _in_place(h.allreduce_async_, np.full(3, 4.0 + r), name=n, op=h.Sum,
                                  prescale_factor=0.5 * (r + 1)),
        "prescale_factor", lambda r, s: str(0.5 * (r + 1)),
        "pass the same prescale_factor on every rank"),
    "collective.allreduce_vs_allgather": Mismatch(
        lambda h, n, r: _plain(h.allreduce_async(np.ones(2), name=n) if r == 0
                               else h.allgather_async(np.ones(2), name=n)),
        "collective", lambda r, s: "allreduce" if r == 0 else "allgather",
        "use a tensor name for one collective only"),
}


@needs_two
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_cross_rank_mismatch(hvd: Any, case: str) -> None:
    """Each rank passes its own value: MismatchError (an HvdliteError) on every rank, naming
    the tensor, the field, every rank's value and the fix; in-place tensors are left as they
    were; then correct collectives work, under the same name too."""
    rank, size = hvd.rank(), hvd.size()
    spec = MISMATCHES[case]
    name = f"bad.mismatch.{case}"
    handle, kept = spec.submit(hvd, name, rank)
    with pytest.raises(hvd.MismatchError) as info:
        handle.wait(timeout=WAIT_S)
    assert isinstance(info.value, hvd.HvdliteError)
    message = str(info.value)
    # A grouped call's message names the member ("<name>.<i>").
    assert re.search(rf"tensor '{re.escape(name)}(\.\d+)?'", message), message
    assert f"{spec.label} differs across ranks" in message, message
    for r in range(size):
        value = spec.value(r, size)
        # Ranks that sent the same value are listed together ("ranks 1,2,3 sent ...").
        pattern = rf"\branks? [\d,]*\b{r}\b[\d,]* sent {re.escape(value)};"
        assert re.search(pattern, message), f"rank {r}'s value {value!r} not in: {message}"
    assert spec.fix in message, f"no fix ({spec.fix!r}) in: {message}"
    if kept is not None:
        tensor, before = kept
        np.testing.assert_array_equal(tensor, before, err_msg="a failed in-place call wrote")
    _still_works(hvd, name)
