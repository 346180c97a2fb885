"""Fusion planning (which responses share a bucket) and the persistent fusion buffers."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from hvdlite._ops import ReduceOp
from hvdlite._vocab.fusion import FusionBuffers, nbytes, plan_buckets
from hvdlite._vocab.messages import Kind, Response


def ar(name: str, count: int = 8, dtype: str = "float32", **kw: Any) -> Response:
    """An allreduce response of ``count`` elements (32 bytes by default)."""
    base = Response(name, Kind.ALLREDUCE, dtype, (count,), "cpu", int(ReduceOp.SUM), -1, 1.0, 1.0)
    return replace(base, **kw)


def plan(responses: list[Response], threshold: int) -> list[list[str]]:
    return [[r.name for r in bucket] for bucket in plan_buckets(responses, threshold)]


def test_nbytes() -> None:
    assert nbytes(ar("a", 8)) == 32
    assert nbytes(replace(ar("b"), shape=(3, 5), dtype="complex128")) == 240
    assert nbytes(replace(ar("c"), shape=())) == 4
    assert nbytes(replace(ar("d"), shape=(0, 7))) == 0


def test_threshold_is_inclusive() -> None:
    # 32-byte tensors, 64-byte threshold: exactly two per bucket.
    assert plan([ar(n) for n in "abcde"], 64) == [["a", "b"], ["c", "d"], ["e"]]
    assert plan([ar(n) for n in "abcde"], 63) == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert plan([ar("a", 16), ar("b", 1)], 64) == [["a"], ["b"]]  # 64 bytes fills it
    assert plan([ar("a", 15), ar("b", 1)], 64) == [["a", "b"]]


def test_tensor_over_threshold_is_alone() -> None:
    out = plan([ar("a"), ar("big", 17), ar("b"), ar("c")], 64)
    assert out == [["a", "b"], ["big"], ["c"]]


def test_threshold_zero_disables_fusion() -> None:
    assert plan([ar("a"), ar("b"), ar("e1", 0), ar("e2", 0)], 0) == [
        ["a"], ["b"], ["e1"], ["e2"]]
    assert plan([ar("e1", 0), ar("e2", 0)], 1) == [["e1", "e2"]]


@pytest.mark.parametrize(("field", "value"), [
    ("dtype", "float64"),
    ("device", "cuda"),
    ("op", int(ReduceOp.MAX)),
    ("prescale", 0.5),
    ("postscale", 2.0),
])
def test_only_equal_fusion_keys_share_a_bucket(field: str, value: Any) -> None:
    other = replace(ar("x"), **{field: value})
    assert plan([ar("a"), other, ar("b"), replace(other, name="y")], 1024) == [
        ["a", "b"], ["x", "y"]]


def test_shape_and_group_do_not_split_buckets() -> None:
    out = plan([ar("a"), replace(ar("b"), shape=(2, 2), group="g"), ar("c", 3)], 1024)
    assert out == [["a", "b", "c"]]


def test_error_responses_are_alone() -> None:
    bad = replace(ar("bad"), error="tensor 'bad': dtype differs")
    assert plan([ar("a"), bad, ar("b"), replace(bad, name="bad2")], 1024) == [
        ["a", "b"], ["bad"], ["bad2"]]


@pytest.mark.parametrize("kind", [k for k in Kind if k is not Kind.ALLREDUCE])
def test_other_collectives_are_alone(kind: Kind) -> None:
    x, y = replace(ar("x"), kind=kind), replace(ar("y"), kind=kind)
    assert plan([x, ar("a"), y, ar("b")], 1024) == [["x"], ["a", "b"], ["y"]]


def test_buckets_ordered_by_first_member() -> None:
    f64 = [replace(ar(f"d{i}"), dtype="float64") for i in range(3)]  # 64 bytes each
    responses = [f64[0], ar("a"), ar("b"), ar("c"), f64[1], f64[2], ar("e")]
    assert plan(responses, 96) == [["d0"], ["a", "b", "c"], ["d1"], ["d2"], ["e"]]


def test_plan_is_deterministic_and_keeps_every_response_once() -> None:
    rng = random.Random(7)
    dtypes = ["float32", "float64", "int32"]
    responses = [
        replace(ar(f"t{i}", rng.randrange(0, 40), rng.choice(dtypes)),
                op=int(rng.choice([ReduceOp.SUM, ReduceOp.AVERAGE])),
                kind=rng.choice([Kind.ALLREDUCE, Kind.ALLREDUCE, Kind.ALLGATHER]))
        for i in range(200)
    ]
    first = plan_buckets(responses, 128)
    assert plan_buckets(list(responses), 128) == first
    flat = [r.name for bucket in first for r in bucket]
    assert sorted(flat) == sorted(r.name for r in responses)
    for bucket in first:
        assert len({r.fusion_key() for r in bucket}) == 1
        if len(bucket) > 1:
            assert bucket[0].kind is Kind.ALLREDUCE
            assert sum(nbytes(r) for r in bucket) <= 128
    firsts = [responses.index(bucket[0]) for bucket in first]
    assert firsts == sorted(firsts)
    for bucket in first:  # members keep their relative order
        idx = [responses.index(r) for r in bucket]
        assert idx == sorted(idx)


# -- buffers --------------------------------------------------------------------------------


class CountingAlloc:
    """Allocator that records every call; returns zeroed uint8 buffers."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, device: str, nbytes: int) -> np.ndarray:
        self.calls.append((device, nbytes))
        return np.zeros(nbytes, np.uint8)


def test_one_allocation_per_device() -> None:
    alloc = CountingAlloc()
    bufs = FusionBuffers(1024, alloc)
    a = bufs.get("cpu", np.dtype(np.float32), 10)
    b = bufs.get("cpu", np.dtype(np.int64), 128)
    c = bufs.get("cpu", np.dtype(np.complex64), 0)
    d = bufs.get("cuda:0", np.dtype(np.float64), 3)
    assert alloc.calls == [("cpu", 1024), ("cuda:0", 1024)]
    assert (a.dtype, a.shape) == (np.dtype(np.float32), (10,))
    assert (b.dtype, b.shape) == (np.dtype(np.int64), (128,))
    assert (c.dtype, c.shape) == (np.dtype(np.complex64), (0,))
    assert (d.dtype, d.shape) == (np.dtype(np.float64), (3,))
    assert np.shares_memory(a, b)  # both start at the device buffer's first byte
    a[0] = 1.5
    assert b.view(np.float32)[0] == 1.5
    assert not np.shares_memory(a, d)
    assert bufs.allocated() == {"cpu": 1024, "cuda:0": 1024}


def test_request_over_threshold_gets_a_temporary_buffer() -> None:
    alloc = CountingAlloc()
    bufs = FusionBuffers(64, alloc)
    small = bufs.get("cpu", np.dtype(np.float32), 16)  # exactly 64 bytes: the shared buffer
    big = bufs.get("cpu", np.dtype(np.float64), 9)
    big2 = bufs.get("cpu", np.dtype(np.float64), 9)
    assert alloc.calls == [("cpu", 64), ("cpu", 72), ("cpu", 72)]
    assert (big.dtype, big.shape) == (np.dtype(np.float64), (9,))
    assert not np.shares_memory(big, small)
    assert not np.shares_memory(big, big2)
    assert bufs.allocated() == {"cpu": 64}


def test_release_drops_buffers() -> None:
    alloc = CountingAlloc()
    bufs = FusionBuffers(32, alloc)
    bufs.get("cpu", np.dtype(np.uint8), 4)
    bufs.release()
    assert bufs.allocated() == {}
    bufs.get("cpu", np.dtype(np.uint8), 4)
    assert alloc.calls == [("cpu", 32), ("cpu", 32)]
