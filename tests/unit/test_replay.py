"""The replay records on their own (``hvdlite/_vocab/plans.py``): when a call repeats its
lane, when result arrays may be handed out again, when tensors form one span, and how a
bucket's members are split into direct and fused ones."""

from __future__ import annotations

from typing import Any

import numpy as np

from hvdlite._ops import Sum
from hvdlite._vocab.messages import Kind, Request
from hvdlite._vocab.plans import Lane, MemberPlan, Results, span_of


def _params(op: Any = Sum, prescale: Any = 1.0, group: bool = False) -> tuple[Any, ...]:
    return (Kind.ALLREDUCE, op, type(op), prescale, type(prescale), 1.0, float, -1, int, False,
            group, None)


def _lane(array: np.ndarray, params: tuple[Any, ...] | None = None) -> Lane:
    return Lane(Request("t", Kind.ALLREDUCE), params or _params(), array, -1, "numpy", None,
                lambda: Results(None, [np.empty(array.shape, array.dtype)]))


def test_single_lane_matches_only_the_same_layout_and_parameters() -> None:
    x = np.zeros((2, 3), np.float32)
    lane = _lane(x)
    assert lane.matches(np.ones((2, 3), np.float32), _params())
    assert not lane.matches(np.ones((3, 2), np.float32), _params())  # a changed shape
    assert not lane.matches(np.ones((2, 3), np.float64), _params())  # a changed dtype
    assert not lane.matches(np.ones((2, 6), np.float32)[:, ::2], _params())  # strided
    assert not lane.matches(np.ones((2, 3), np.float32), _params(prescale=2.0))
    # 1 == Sum and True == 1.0, but neither passes for the other.
    assert not lane.matches(x, _params(op=1))
    assert not lane.matches(x, _params(prescale=True))


def test_group_lane_matches_the_same_objects_of_the_same_shapes() -> None:
    xs = [np.zeros(3, np.int32), np.zeros((2, 2), np.int32)]
    lane = _lane(xs[0], _params(group=True))
    lane.inputs, lane.shapes = tuple(xs), tuple(x.shape for x in xs)
    assert lane.matches_group(xs, _params(group=True))
    assert not lane.matches_group([xs[0], xs[1].copy()], _params(group=True))  # an address
    assert not lane.matches_group(xs[:1], _params(group=True))  # a member left out
    xs[1].shape = (4,)  # the same object, reshaped in place
    assert not lane.matches_group(xs, _params(group=True))


def test_results_are_reused_only_when_nothing_else_refers_to_them() -> None:
    x = np.zeros(4, np.float32)
    lane = _lane(x)
    first = lane.result()
    assert first is not None
    out = first.views[0]
    assert lane.result() is not first  # ``out`` still refers to it
    del out
    assert lane.result() is first
    view = first.views[0][1:]  # a view of a result keeps it busy
    assert lane.result() is not first
    del view
    assert lane.result() is first


def test_grouped_results_share_one_buffer_and_a_view_of_it_keeps_it_busy() -> None:
    shapes = [(2,), (3, 2)]

    def make() -> Results:
        flat = np.empty(8, np.float64)
        return Results(flat, [flat[:2].reshape(2), flat[2:].reshape(3, 2)])

    lane = Lane(Request("g", Kind.ALLREDUCE), _params(group=True), np.zeros(2), -1, "numpy",
                None, make)
    lane.shapes = tuple(shapes)
    res = lane.result()
    assert res is not None
    assert lane.result() is res  # nothing outside refers to it
    whole = res.flat[:]  # a view of the flat buffer itself
    assert lane.result() is not res
    del whole
    assert lane.result() is res


def test_span_of_consecutive_views_and_not_of_scattered_ones() -> None:
    flat = np.arange(10, dtype=np.int64)
    views = [flat[0:3], flat[3:7].reshape(2, 2), flat[7:10]]
    span = span_of(views, "numpy")
    assert span is not None and span.size == 10
    span[:] = -1
    assert all((v == -1).all() for v in views)  # the span is the views' memory
    assert span_of([flat[0:3], flat[4:7]], "numpy") is None  # a gap
    assert span_of([flat[3:6], flat[0:3]], "numpy") is None  # out of order
    assert span_of([np.zeros(2, np.int64), np.zeros(2, np.int64)], "numpy") is None


def test_member_plan_splits_large_members_off_and_packs_the_rest() -> None:
    plan = MemberPlan([10, 5000, 20, 3], itemsize=4, direct_bytes=4096)
    assert plan.direct == [1]
    assert plan.fused == [0, 2, 3]
    assert plan.offsets == [0, 10, 30, 33] and plan.total == 33
    alone = MemberPlan([10, 5000], itemsize=4, direct_bytes=4096)
    assert alone.direct == [0, 1] and alone.fused == []  # one small member needs no staging
