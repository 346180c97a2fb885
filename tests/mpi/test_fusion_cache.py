"""Fusion and the response cache: same results whichever path the engine takes.

The same mixed workload runs unfused (threshold 0), with tiny buckets (64 bytes: most tensors
alone, a few small ones together) and with everything fusable in one bucket. The cache tests
repeat named tensors for many steps with the cache on, off and nearly full, and change a
cached tensor's parameters between steps.
"""

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
)

from hvdlite._engine import default_engine

# (shape, dtype, op, prescale, postscale) of each tensor in one step of the workload.
WORKLOAD = [
    ((3,), "int8", "Sum", 1.0, 1.0),
    ((100,), "float64", "Average", 1.0, 1.0),
    ((2, 2), "float32", "Sum", 0.5, 2.0),
    ((5,), "float32", "Sum", 0.5, 2.0),
    ((7,), "float32", "Sum", 1.0, 1.0),
    ((300,), "int32", "Max", 1.0, 1.0),
    ((1,), "uint16", "Min", 1.0, 1.0),
    ((8, 4), "complex64", "Sum", 1.0, 1.0),
    ((6,), "int64", "Sum", 2.0, 1.0),
]


def _run_workload(hvd: Any, tag: str, steps: int) -> None:
    rank, size = hvd.rank(), hvd.size()
    for step in range(steps):
        handles = []
        for i, (shape, dtype, op, pre, post) in enumerate(WORKLOAD):
            x = make_input(seed_for(tag, step, i), rank, shape, dtype)
            handles.append(hvd.allreduce_async(
                x, name=f"{tag}.{i}", op=getattr(hvd, op), prescale_factor=pre,
                postscale_factor=post,
            ))  # fmt: skip
        group = [
            make_input(seed_for(tag, step, "g", j), rank, (j + 1,), "float64") for j in range(3)
        ]
        grouped = hvd.grouped_allreduce_async(group, name=f"{tag}.group", op=hvd.Sum)
        for i, ((shape, dtype, op, pre, post), handle) in enumerate(
            zip(WORKLOAD, handles, strict=True)
        ):
            inputs = all_inputs(seed_for(tag, step, i), size, shape, dtype)
            want = reference_allreduce(inputs, op, pre, post)
            assert_equal_result(handle.wait(timeout=20), want, f"{tag} step {step} tensor {i}")
        for j, got in enumerate(grouped.wait(timeout=20)):
            inputs = all_inputs(seed_for(tag, step, "g", j), size, (j + 1,), "float64")
            assert_equal_result(got, reference_allreduce(inputs, "Sum"), f"{tag} group part {j}")


@pytest.mark.parametrize("threshold", [0, 64, "1GiB"])
def test_fusion_thresholds(hvd: Any, restart: Callable[..., Any], threshold: int | str) -> None:
    restart(fusion_threshold=threshold)
    expected = threshold if isinstance(threshold, int) else 1 << 30
    assert default_engine().config.fusion_threshold == expected
    _run_workload(hvd, f"fusion{expected}", steps=3)
    fusion = hvd.stats()["fusion"]  # this engine's buckets only (restart made a new one)
    if expected == 0:
        assert fusion["buckets"] == fusion["tensors"], fusion  # nothing fused
    elif expected == 1 << 30:
        assert fusion["tensors"] > fusion["buckets"], fusion  # something fused


@pytest.mark.parametrize("capacity", [None, 0, 3])
def test_repeated_steps(hvd: Any, restart: Callable[..., Any], capacity: int | None) -> None:
    """Nine named tensors for 12 steps: cache on (default), off, and smaller than the set."""
    if capacity is not None:
        restart(cache_capacity=capacity)
    engine = default_engine()
    _run_workload(hvd, f"cache{capacity}", steps=12)
    if capacity == 0:
        assert engine.negotiator.cache_hits == 0
    elif capacity is None:
        assert engine.negotiator.cache_hits > 0, "repeated tensors never hit the response cache"


def test_cached_name_changes_parameters(hvd: Any) -> None:
    """A cached name whose shape, dtype or op changes is renegotiated, not served stale."""
    rank, size = hvd.rank(), hvd.size()
    steps = [((3,), "float32", "Sum")] * 3 + [((5,), "float32", "Sum")] * 2
    steps += [((5,), "int32", "Sum"), ((5,), "int32", "Max"), ((3,), "float32", "Sum")]
    for step, (shape, dtype, op) in enumerate(steps):
        seed = seed_for("changing", step)
        x = make_input(seed, rank, shape, dtype)
        got = hvd.allreduce(x, name="cache.changing", op=getattr(hvd, op))
        want = reference_allreduce(all_inputs(seed, size, shape, dtype), op)
        assert_equal_result(got, want, f"step {step}: {op} {dtype}{shape}")


def test_group_larger_than_the_cache(hvd: Any, restart: Callable[..., Any]) -> None:
    """A grouped call with more parts than cache slots: some parts cached, some not."""
    restart(cache_capacity=2)
    rank, size = hvd.rank(), hvd.size()
    shapes = [(1,), (2,), (3,)]
    for step in range(4):
        seeds = [seed_for("big_group", step, j) for j in range(len(shapes))]
        parts = [
            make_input(s, rank, shape, "int32") for s, shape in zip(seeds, shapes, strict=True)
        ]
        got = hvd.grouped_allreduce_async(parts, name="big_group", op=hvd.Sum).wait(timeout=20)
        for j, (s, shape) in enumerate(zip(seeds, shapes, strict=True)):
            want = reference_allreduce(all_inputs(s, size, shape, "int32"), "Sum")
            assert_equal_result(got[j], want, f"step {step} part {j}")


def test_cached_name_then_mismatch(hvd: Any) -> None:
    """A name served from the cache, then sent with differing shapes, fails on every rank."""
    rank, size = hvd.rank(), hvd.size()
    if size < 2:
        pytest.skip("a cross-rank mismatch needs at least two ranks")
    name = "cache.then_mismatch"
    for step in range(4):
        seed = seed_for(name, step)
        got = hvd.allreduce(make_input(seed, rank, (4,), "int32"), name=name, op=hvd.Sum)
        want = reference_allreduce(all_inputs(seed, size, (4,), "int32"), "Sum")
        assert_equal_result(got, want, f"step {step}")
    with pytest.raises(hvd.MismatchError, match=name):
        hvd.allreduce_async(np.ones(4 + min(rank, 1), np.int32), name=name, op=hvd.Sum).wait(
            timeout=20
        )
    seed = seed_for(name, "after")
    got = hvd.allreduce(make_input(seed, rank, (4,), "int32"), name=name, op=hvd.Sum)
    assert_equal_result(got, reference_allreduce(all_inputs(seed, size, (4,), "int32"), "Sum"))


def test_pending_hit_whose_slot_is_evicted(hvd: Any, restart: Callable[..., Any]) -> None:
    """Rank 0 waits on X as a cache hit while Y's response takes X's only slot.

    The other ranks submit X only after Y ran twice (so Y now owns the slot on every rank);
    X must still be negotiated and complete with the right values.
    """
    restart(cache_capacity=1)
    rank, size = hvd.rank(), hvd.size()
    if size < 2:
        pytest.skip("needs a rank whose cache hit waits for the others")
    seeds = {n: seed_for("evicted_hit", n) for n in ("X0", "X", "Y0", "Y1")}
    inputs = {n: make_input(s, rank, (3,), "int32") for n, s in seeds.items()}

    def want(tag: str) -> np.ndarray:
        return reference_allreduce(all_inputs(seeds[tag], size, (3,), "int32"), "Sum")

    assert_equal_result(hvd.allreduce(inputs["X0"], name="X", op=hvd.Sum), want("X0"))
    late_x = None
    if rank == 0:
        late_x = hvd.allreduce_async(inputs["X"], name="X", op=hvd.Sum)
    for tag in ("Y0", "Y1"):
        assert_equal_result(hvd.allreduce(inputs[tag], name="Y", op=hvd.Sum), want(tag), tag)
    if late_x is None:
        late_x = hvd.allreduce_async(inputs["X"], name="X", op=hvd.Sum)
    assert_equal_result(late_x.wait(timeout=20), want("X"), "X after its slot was evicted")
