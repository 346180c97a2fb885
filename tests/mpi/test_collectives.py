"""grouped_allreduce, allgather, broadcast, alltoall, reducescatter and barrier."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from mpi_util import (
    all_inputs,
    assert_equal_result,
    bcast_text,
    make_input,
    reference_allreduce,
    seed_for,
    timed_barrier,
)

GROUP_SHAPES = [(3,), (2, 5), (1,), (4, 1, 2)]


def _group_inputs(seed: int, rank: int, dtype: str) -> list[np.ndarray]:
    return [make_input(seed + i, rank, shape, dtype) for i, shape in enumerate(GROUP_SHAPES)]


def _group_reference(seed: int, size: int, dtype: str, op: str) -> list[np.ndarray]:
    return [
        reference_allreduce(all_inputs(seed + i, size, shape, dtype), op)
        for i, shape in enumerate(GROUP_SHAPES)
    ]


@pytest.mark.parametrize(("dtype", "op"), [("float32", "Average"), ("int16", "Sum")])
def test_grouped_allreduce(hvd: Any, dtype: str, op: str) -> None:
    """Mixed shapes; the results come back in the order of the inputs."""
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("grouped", dtype)
    want = _group_reference(seed, size, dtype, op)
    got = hvd.grouped_allreduce(
        _group_inputs(seed, rank, dtype), name=f"grouped.{dtype}", op=getattr(hvd, op)
    )
    assert isinstance(got, list) and len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_equal_result(g, w, f"grouped_allreduce part {i}")
    handle = hvd.grouped_allreduce_async(
        _group_inputs(seed, rank, dtype), name=f"grouped_async.{dtype}", op=getattr(hvd, op)
    )
    for i, (g, w) in enumerate(zip(handle.wait(), want, strict=True)):
        assert_equal_result(g, w, f"grouped_allreduce_async part {i}")


def test_grouped_allreduce_in_place_with_scaling(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("grouped_inplace")
    tensors = _group_inputs(seed, rank, "float64")
    result = hvd.grouped_allreduce_(
        tensors, name="grouped_inplace", op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0
    )
    assert len(result) == len(tensors)
    assert all(r is t for r, t in zip(result, tensors, strict=True))
    want = [2.0 * w for w in _group_reference(seed, size, "float64", "Sum")]
    for i, (t, w) in enumerate(zip(tensors, want, strict=True)):
        assert_equal_result(t, w, f"grouped_allreduce_ part {i}")
    more = _group_inputs(seed, rank, "float64")
    done = hvd.grouped_allreduce_async_(
        more, name="grouped_inplace_async", op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0
    ).wait()
    assert all(r is t for r, t in zip(done, more, strict=True))
    for i, (t, w) in enumerate(zip(more, want, strict=True)):
        assert_equal_result(t, w, f"grouped_allreduce_async_ part {i}")


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int32", "float16", "float64", "complex64"])
@pytest.mark.parametrize("trailing", [(), (2, 3)])
def test_allgather_rows_differ_per_rank(hvd: Any, dtype: str, trailing: tuple[int, ...]) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("allgather", dtype, trailing)
    rows = [r + 1 for r in range(size)]
    x = make_input(seed, rank, (rows[rank], *trailing), dtype)
    want = np.concatenate([make_input(seed, r, (rows[r], *trailing), dtype) for r in range(size)])
    assert_equal_result(hvd.allgather(x, name=f"allgather.{dtype}.{len(trailing)}"), want)
    handle = hvd.allgather_async(x, name=f"allgather_async.{dtype}.{len(trailing)}")
    assert_equal_result(handle.wait(), want)


def test_allgather_with_a_rank_contributing_no_rows(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("allgather_empty")
    # Rank r contributes r rows: rank 0 none at all.
    x = make_input(seed, rank, (rank, 3), "int64")
    want = np.concatenate([make_input(seed, r, (r, 3), "int64") for r in range(size)])
    assert_equal_result(hvd.allgather(x, name="allgather_empty"), want)


@pytest.mark.parametrize("dtype", ["int8", "float32", "complex128", "bool"])
def test_broadcast_from_every_root(hvd: Any, dtype: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    for root in range(size):
        seed = seed_for("broadcast", dtype, root)
        x = make_input(seed, rank, (4, 3), dtype)
        before = x.copy()
        want = make_input(seed, root, (4, 3), dtype)
        got = hvd.broadcast(x, root, name=f"broadcast.{dtype}.{root}")
        assert_equal_result(got, want, f"broadcast from root {root}")
        np.testing.assert_array_equal(x, before, err_msg="broadcast modified its input")
        handle = hvd.broadcast_async(x, root_rank=root, name=f"broadcast_async.{dtype}.{root}")
        assert_equal_result(handle.wait(), want, f"broadcast_async from root {root}")


@pytest.mark.parametrize("dtype", ["uint64", "float64"])
def test_broadcast_in_place_from_every_root(hvd: Any, dtype: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    for root in range(size):
        seed = seed_for("broadcast_", dtype, root)
        want = make_input(seed, root, (2, 2, 2), dtype)
        x = make_input(seed, rank, (2, 2, 2), dtype)
        assert hvd.broadcast_(x, root, name=f"broadcast_.{dtype}.{root}") is x
        assert_equal_result(x, want, f"broadcast_ from root {root}")
        y = make_input(seed, rank, (2, 2, 2), dtype)
        handle = hvd.broadcast_async_(y, root, name=f"broadcast_async_.{dtype}.{root}")
        assert handle.wait() is y
        assert_equal_result(y, want, f"broadcast_async_ from root {root}")


def _alltoall_reference(
    seed: int, size: int, dest: int, splits: list[list[int]], trailing: tuple[int, ...]
) -> np.ndarray:
    """What rank ``dest`` receives: from each source in rank order, that source's chunk."""
    parts = []
    for src in range(size):
        x = make_input(seed, src, (sum(splits[src]), *trailing), "int32")
        start = sum(splits[src][:dest])
        parts.append(x[start : start + splits[src][dest]])
    return np.concatenate(parts)


def test_alltoall_equal_splits(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("alltoall_equal")
    splits = [[2] * size for _ in range(size)]
    x = make_input(seed, rank, (2 * size, 3), "int32")
    want = _alltoall_reference(seed, size, rank, splits, (3,))
    assert_equal_result(hvd.alltoall(x, name="alltoall_equal"), want)


def test_alltoall_custom_splits(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("alltoall_custom")
    # Rank s sends (s + d) % 3 rows to rank d: uneven, and sometimes none.
    splits = [[(s + d) % 3 for d in range(size)] for s in range(size)]
    x = make_input(seed, rank, (sum(splits[rank]), 2), "int32")
    want = _alltoall_reference(seed, size, rank, splits, (2,))
    got = hvd.alltoall(x, splits=splits[rank], name="alltoall_custom")
    assert_equal_result(got, want)
    handle = hvd.alltoall_async(x, splits=np.array(splits[rank]), name="alltoall_custom_async")
    assert_equal_result(handle.wait(), want)


@pytest.mark.parametrize(("dtype", "op"), [("float32", "Average"), ("int64", "Sum"),
                                           ("int32", "Max"), ("float64", "Min")])  # fmt: skip
def test_reducescatter_even(hvd: Any, dtype: str, op: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("reducescatter", dtype, op)
    shape = (2 * size, 3)
    full = reference_allreduce(all_inputs(seed, size, shape, dtype), op)
    x = make_input(seed, rank, shape, dtype)
    got = hvd.reducescatter(x, name=f"reducescatter.{dtype}.{op}", op=getattr(hvd, op))
    assert_equal_result(got, full[2 * rank : 2 * rank + 2], f"reducescatter {op}")
    handle = hvd.reducescatter_async(
        x, name=f"reducescatter_async.{dtype}.{op}", op=getattr(hvd, op)
    )
    assert_equal_result(handle.wait(), full[2 * rank : 2 * rank + 2])


def test_reducescatter_default_op_is_average(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("reducescatter_default")
    full = reference_allreduce(all_inputs(seed, size, (size, 4), "float64"), "Average")
    got = hvd.reducescatter(make_input(seed, rank, (size, 4), "float64"), name="rs_default")
    assert_equal_result(got, full[rank : rank + 1])


def test_reducescatter_uneven_rows_cover_the_full_result(hvd: Any) -> None:
    """With dim 0 not divisible by the size, the lower ranks get one row more (the documented
    split), and the slices tile the reduction in rank order."""
    rank, size = hvd.rank(), hvd.size()
    seed = seed_for("reducescatter_uneven")
    shape = (2 * size + 1, 2)
    full = reference_allreduce(all_inputs(seed, size, shape, "int32"), "Sum")
    mine = hvd.reducescatter(make_input(seed, rank, shape, "int32"), name="rs_uneven", op=hvd.Sum)
    base, extra = divmod(shape[0], size)
    rows = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(rows[:rank])
    assert_equal_result(mine, full[start : start + rows[rank]])


def _shared_dir() -> Path:
    """A directory every rank of this job can see (rank 0 makes it, tells the others)."""
    path = tempfile.mkdtemp(prefix="hvdlite-barrier-") if MPI.COMM_WORLD.Get_rank() == 0 else None
    return Path(bcast_text(path, "sharing the barrier test directory"))


@pytest.mark.parametrize("use_async", [False, True])
def test_barrier_waits_for_every_rank(hvd: Any, use_async: bool) -> None:
    """Each rank leaves a marker before the barrier (late ranks later); after it, all exist."""
    rank, size = hvd.rank(), hvd.size()
    shared = _shared_dir()
    time.sleep(0.05 * rank)
    (shared / f"rank{rank}").write_text("here")
    try:
        if use_async:
            hvd.barrier_async().wait(timeout=20)
        else:
            hvd.barrier()
        present = sorted(p.name for p in shared.iterdir())
    finally:
        timed_barrier("barrier test cleanup")
        if rank == 0:
            shutil.rmtree(shared)
    assert present == sorted(f"rank{r}" for r in range(size))
