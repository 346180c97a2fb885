"""``hvd.grouped_allreduce_init``: a repeated grouped allreduce on an agreed schedule (host
tensors: the MPI schedule transport), checked against the sum and average of every rank's
inputs computed here; values are small integers or halves, so every result is exact."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch_util import knobs

SHAPES = [(3, 4), (5,), (2, 2, 2)]


def _inputs(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return [rng.integers(-8, 9, size=s).astype(np.float32) for s in SHAPES]


def _fill(tensors: list[torch.Tensor], rank: int, step: int) -> None:
    for t, x in zip(tensors, _inputs(rank, step), strict=True):
        t.copy_(torch.from_numpy(x))


def _reference(size: int, step: int, average: bool) -> list[np.ndarray]:
    total = [np.zeros(s, np.float64) for s in SHAPES]
    for r in range(size):
        for acc, x in zip(total, _inputs(r, step), strict=True):
            acc += x
    return [(a / size if average else a).astype(np.float32) for a in total]


@pytest.mark.parametrize("average", [False, True])
def test_each_call_reduces_the_tensors_current_values_on_the_schedule(hvd: Any,
                                                                       average: bool) -> None:
    n, r = hvd.size(), hvd.rank()
    tensors = [torch.zeros(s) for s in SHAPES]
    op = hvd.Average if average else hvd.Sum
    group = hvd.grouped_allreduce_init(tensors, name=f"persist.{average}", op=op)
    assert not group.scheduled  # the first call is negotiated, then the schedule opens
    exact = average and n & (n - 1) == 0  # an average over a power of two is exact here
    for step in range(4):
        _fill(tensors, r, step)
        got = group()
        assert [tuple(g.shape) for g in got] == SHAPES
        for g, want in zip(got, _reference(n, step, average), strict=True):
            if exact or not average:
                np.testing.assert_array_equal(g.numpy(), want)
            else:
                np.testing.assert_allclose(g.numpy(), want, rtol=1e-6)
        assert group.scheduled, group.unscheduled_reason
    assert group.agreed_schedule.launches == 3  # every call after the first


def test_prescale_and_postscale_apply_as_grouped_allreduce_applies_them(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    tensors = [torch.zeros(s) for s in SHAPES]
    group = hvd.grouped_allreduce_init(tensors, name="persist.scaled", op=hvd.Sum,
                                       prescale_factor=2.0, postscale_factor=0.5)
    _fill(tensors, r, 7)
    for g, want in zip(group(), _reference(n, 7, False), strict=True):
        np.testing.assert_array_equal(g.numpy(), want)  # x 2 then x 0.5: exact


@pytest.mark.parametrize("inplace", [False, True])
def test_members_with_other_shapes_raise_mismatch_on_every_rank(hvd: Any, inplace: bool) -> None:
    """Shapes that differ across ranks raise ``MismatchError`` on every rank, naming rank 1;
    in place, the tensors are left where they were (moved only once every member agreed)."""
    shapes = [(3,), (4 + hvd.rank(),)] if hvd.size() > 1 else [(3,), (4,)]
    if hvd.size() == 1:
        pytest.skip("needs 2 ranks to differ")
    tensors = [torch.full(s, 2.0) for s in shapes]
    before = [t.data_ptr() for t in tensors]
    with pytest.raises(hvd.MismatchError, match=r"persist.mismatch.*rank 1"):
        hvd.grouped_allreduce_init(tensors, name=f"persist.mismatch.{inplace}", op=hvd.Sum,
                                   inplace=inplace)
    assert [t.data_ptr() for t in tensors] == before
    assert all(torch.equal(t, torch.full(s, 2.0)) for t, s in zip(tensors, shapes, strict=True))


def test_without_a_schedule_every_rank_takes_the_negotiated_route_alike(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    tensors = [torch.zeros(s) for s in SHAPES]
    with knobs(optimizer_schedule=False):  # read when the schedule would open: the 1st call
        group = hvd.grouped_allreduce_init(tensors, name="persist.negotiated", op=hvd.Sum)
        for step in range(3):
            _fill(tensors, r, step)
            for g, want in zip(group(), _reference(n, step, False), strict=True):
                np.testing.assert_array_equal(g.numpy(), want)
    assert not group.scheduled
    assert "optimizer_schedule knob is off" in group.unscheduled_reason


def test_start_wait_order_and_bad_arguments_are_clear_errors(hvd: Any) -> None:
    tensors = [torch.zeros(s) for s in SHAPES]
    group = hvd.grouped_allreduce_init(tensors, name="persist.order", op=hvd.Sum)
    with pytest.raises(hvd.HvdliteError, match=r"wait\(\) without start\(\)"):
        group.wait()
    group.start()
    with pytest.raises(hvd.HvdliteError, match=r"start\(\) again before wait\(\)"):
        group.start()
    group.wait()
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        hvd.grouped_allreduce_init(tensors, name="")
    with pytest.raises(ValueError, match=r"tensor 1 is torch.float64 on cpu, expected "
                                         r"torch.float32"):
        hvd.grouped_allreduce_init([torch.zeros(2), torch.zeros(2, dtype=torch.float64)],
                                   name="persist.bad")
    with pytest.raises(TypeError, match="tensor 0 must be a torch.Tensor, got list"):
        hvd.grouped_allreduce_init([[1.0]], name="persist.bad")
    with pytest.raises(ValueError, match="non-empty list or tuple"):
        hvd.grouped_allreduce_init([], name="persist.bad")


def test_inplace_reduces_the_tensors_themselves_with_no_copy(hvd: Any) -> None:
    """``inplace=True``: the tensors move into the schedule's buffer once (values kept, laid
    end to end), and every call leaves the reduced values in them (the call returns the same
    tensor objects); exact against every rank's inputs, the first call negotiated and the
    rest on the schedule."""
    n, r = hvd.size(), hvd.rank()
    tensors = [torch.full(s, 7.0) for s in SHAPES]
    group = hvd.grouped_allreduce_init(tensors, name="persist.inplace", op=hvd.Sum,
                                       inplace=True)
    assert all(torch.equal(t, torch.full(s, 7.0)) for t, s in zip(tensors, SHAPES, strict=True))
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in tensors]
    assert [t.data_ptr() for t in tensors[1:]] == ends[:-1]  # one buffer, end to end
    for step in range(4):
        _fill(tensors, r, step)
        got = group()
        assert all(g is t for g, t in zip(got, tensors, strict=True))
        for t, want in zip(tensors, _reference(n, step, False), strict=True):
            np.testing.assert_array_equal(t.numpy(), want)
        assert group.scheduled, group.unscheduled_reason
    assert group.agreed_schedule.launches == 3


def test_inplace_refuses_tensors_it_cannot_move_and_a_moved_tensor(hvd: Any) -> None:
    """What cannot live in the buffer is refused at construction (every rank alike), naming
    the tensor and the fix; a tensor given another storage afterwards is refused at the next
    call instead of being left out of the reduction silently."""
    init = hvd.grouped_allreduce_init
    with pytest.raises(ValueError, match="tensor 1 requires grad"):
        init([torch.zeros(2), torch.zeros(3, requires_grad=True)], name="p.i1", inplace=True)
    with pytest.raises(ValueError, match="tensor 0 is not"):
        init([torch.zeros(4, 4).t(), torch.zeros(2)], name="p.i2", inplace=True)
    base = torch.zeros(10)
    with pytest.raises(ValueError, match="tensors 0 and 2 overlap"):
        init([base[0:4], torch.zeros(3), base[3:6]], name="p.i3", inplace=True)
    with pytest.raises(TypeError, match="inplace must be a bool, got 1"):
        init([torch.zeros(2)], name="p.i4", inplace=1)  # type: ignore[arg-type]
    tensors = [torch.zeros(s) for s in SHAPES]
    group = init(tensors, name="persist.moved", op=hvd.Sum, inplace=True)
    group()
    tensors[2].set_(torch.zeros(SHAPES[2]))  # another storage, on every rank alike
    with pytest.raises(ValueError, match=r"tensor 2 no longer lies in the in-place buffer"):
        group()
