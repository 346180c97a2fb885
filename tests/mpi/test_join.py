"""join: ranks that run out of work join; the others go on reducing without them."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi_util import (
    all_inputs,
    allgather_ints,
    assert_equal_result,
    make_input,
    reference_allreduce,
    seed_for,
)

# (dtype, op) of the tensors every remaining rank reduces at each step.
STEP_TENSORS = [("int32", "Sum"), ("float32", "Max"), ("int16", "Min"), ("float64", "Average")]


def _step(hvd: Any, step: int) -> list[tuple[str, str, Any]]:
    rank = hvd.rank()
    handles = []
    for dtype, op in STEP_TENSORS:
        x = make_input(seed_for("join", step, dtype), rank, (5,), dtype)
        name = f"join.{step}.{dtype}.{op}"
        handles.append((dtype, op, hvd.allreduce_async(x, name=name, op=getattr(hvd, op))))
    return handles


def test_join_uneven_steps(hvd: Any) -> None:
    """Rank r joins after r steps; step i is reduced over the ranks above i only."""
    rank, size = hvd.rank(), hvd.size()
    for step in range(rank):
        contributors = list(range(step + 1, size))
        for dtype, op, handle in _step(hvd, step):
            inputs = [
                make_input(seed_for("join", step, dtype), r, (5,), dtype) for r in contributors
            ]
            want = reference_allreduce(inputs, op, count=size)  # Horovod: Average over all
            assert_equal_result(handle.wait(), want, f"step {step} {op} over ranks {contributors}")
    assert hvd.join() == size - 1
    # After the join everybody contributes again.
    seed = seed_for("after_join")
    got = hvd.allreduce(make_input(seed, rank, (4,), "int64"), name="after_join", op=hvd.Sum)
    assert_equal_result(got, reference_allreduce(all_inputs(seed, size, (4,), "int64"), "Sum"))


def test_join_without_work_agrees_on_last_rank(hvd: Any) -> None:
    size = hvd.size()
    last = hvd.join()
    assert 0 <= last < size
    assert allgather_ints(last, "comparing join results") == [last] * size
    x = np.full(3, hvd.rank() + 1, dtype=np.int32)
    assert_equal_result(
        hvd.allreduce(x, name="after_plain_join", op=hvd.Sum),
        np.full(3, size * (size + 1) // 2, dtype=np.int32),
    )


def test_join_while_tensors_are_cached(hvd: Any) -> None:
    """Cached names keep reducing correctly when ranks join part way through."""
    rank, size = hvd.rank(), hvd.size()
    warm = 3  # every rank first runs these steps, so the names are in the response cache
    for step in range(warm + rank):
        contributors = list(range(size)) if step < warm else list(range(step - warm + 1, size))
        seed = seed_for("join_cached", step)
        x = make_input(seed, rank, (6,), "int64")
        got = hvd.allreduce(x, name="join_cached", op=hvd.Sum)
        want = reference_allreduce(
            [make_input(seed, r, (6,), "int64") for r in contributors], "Sum"
        )
        assert_equal_result(got, want, f"step {step} over ranks {contributors}")
    assert hvd.join() == size - 1
    seed = seed_for("join_cached_after")
    got = hvd.allreduce(make_input(seed, rank, (6,), "int64"), name="join_cached", op=hvd.Sum)
    assert_equal_result(got, reference_allreduce(all_inputs(seed, size, (6,), "int64"), "Sum"))
