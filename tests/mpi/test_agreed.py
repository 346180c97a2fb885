"""Agreed schedules through the runtime API (``hvdlite/_runtime_api.py``) on host buffers: the
MPI transport of the schedule contract, at 1, 2 and 4 ranks.

Every result is checked exactly against NumPy from every rank's inputs (``mpi_util``); the
failure cases (slots out of turn, ranks that open different slots) raise on every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mpi_util import make_input

from hvdlite import _runtime_api as runtime
from hvdlite._ops import ReduceOp


def _slots() -> list[runtime.Slot]:
    return [runtime.Slot("w.grad", 1000, "float32", int(ReduceOp.AVERAGE)),
            runtime.Slot("steps", 7, "int64", int(ReduceOp.SUM)),
            runtime.Slot("b.grad", 33, "float64", int(ReduceOp.MAX), 2.0, 0.5),
            runtime.Slot("scaled", 64, "float64", int(ReduceOp.AVERAGE), 0.5, 4.0)]


def _expected(seed: int, size: int, slot: runtime.Slot) -> np.ndarray:
    ins = [make_input(seed, r, (slot.count,), slot.dtype) * slot.pre for r in range(size)]
    if slot.op == ReduceOp.MAX:
        out = np.max(ins, axis=0)
    else:
        out = np.sum(ins, axis=0)
        if slot.op == ReduceOp.AVERAGE:
            out = out / size
    return (out * slot.post).astype(slot.dtype)


def test_host_schedule_reduces_exactly_round_after_round(hvd: Any) -> None:
    slots = _slots()
    arrays = [np.zeros(s.count, dtype=s.dtype) for s in slots]
    schedule, why = runtime.open_schedule(
        "test.host", slots, [(a.ctypes.data, a.size) for a in arrays], -1)
    assert schedule is not None, why
    assert why == "" and schedule.device_id == -1
    for step in range(5):
        for i, (s, a) in enumerate(zip(slots, arrays, strict=True)):
            a[:] = make_input(100 * step + i, hvd.rank(), (s.count,), s.dtype)
        for i in range(len(slots)):
            schedule.launch(i)
        for i, s in enumerate(slots):
            schedule.wait(i)
            np.testing.assert_array_equal(arrays[i], _expected(100 * step + i, hvd.size(), s),
                                          err_msg=f"step {step} slot {s.name}")
    assert schedule.launches == 5 * len(slots)
    assert not schedule.pending()


def test_slots_past_the_eager_size_complete_together_and_scale_once(hvd: Any) -> None:
    # 160 KB slots move by rendezvous; a wait (and a launch) tests every slot in flight, so
    # waiting for the last slot first completes the others on the way: each slot's factor
    # (average, post) must still be applied exactly once, by whichever look saw it complete.
    slots = [runtime.Slot(f"big{i}", 20000, "float64",
                          int(ReduceOp.AVERAGE if i % 2 else ReduceOp.SUM), 1.0, 0.5 * (i + 1))
             for i in range(6)]
    arrays = [np.zeros(s.count, dtype=s.dtype) for s in slots]
    schedule, why = runtime.open_schedule(
        "test.big", slots, [(a.ctypes.data, a.size) for a in arrays], -1)
    assert schedule is not None, why
    for step in range(3):
        for i, (s, a) in enumerate(zip(slots, arrays, strict=True)):
            a[:] = make_input(300 * step + i, hvd.rank(), (s.count,), s.dtype)
        for i in range(len(slots)):
            schedule.launch(i)
        for i in reversed(range(len(slots))):
            schedule.wait(i)
        for i, s in enumerate(slots):
            np.testing.assert_array_equal(arrays[i], _expected(300 * step + i, hvd.size(), s),
                                          err_msg=f"step {step} slot {s.name}")
    assert not schedule.pending()


def test_a_slot_out_of_turn_raises_before_anything_is_enqueued(hvd: Any) -> None:
    slots = _slots()[:2]
    arrays = [np.zeros(s.count, dtype=s.dtype) for s in slots]
    schedule, why = runtime.open_schedule(
        "test.turn", slots, [(a.ctypes.data, a.size) for a in arrays], -1)
    assert schedule is not None, why
    with pytest.raises(hvd.MismatchError, match=r"slot 1 \('steps'\) launched out of turn, "
                                                r"slot 0 expected"):
        schedule.launch(1)
    for i, s in enumerate(slots):  # nothing was enqueued: the schedule goes on in order
        arrays[i][:] = make_input(7 + i, hvd.rank(), (s.count,), s.dtype)
        schedule.launch(i)
    for i, s in enumerate(slots):
        schedule.wait(i)
        np.testing.assert_array_equal(arrays[i], _expected(7 + i, hvd.size(), s))


def test_ranks_that_open_different_slots_raise_mismatch_on_every_rank(hvd: Any) -> None:
    if hvd.size() == 1:
        pytest.skip("needs 2 ranks")
    slots = _slots()[:2]
    if hvd.rank() == 1:
        slots[1] = runtime.Slot("steps", 8, "int64", int(ReduceOp.SUM))
    arrays = [np.zeros(s.count, dtype=s.dtype) for s in slots]
    with pytest.raises(hvd.MismatchError, match=r"rank 1: entry 1 'steps': count 8, expected 7"):
        runtime.open_schedule("test.differ", slots, [(a.ctypes.data, a.size) for a in arrays],
                              -1)


def test_a_rank_that_cannot_makes_every_rank_fall_back_with_its_reason(hvd: Any) -> None:
    slots = _slots()[:1]
    arrays = [np.zeros(s.count, dtype=s.dtype) for s in slots]
    last = hvd.size() - 1
    usable = "the test says so" if hvd.rank() == last else ""
    schedule, why = runtime.open_schedule(
        "test.fallback", slots, [(a.ctypes.data, a.size) for a in arrays], -1, 0, usable)
    assert schedule is None
    assert why == f"rank {last}: the test says so"


def test_one_agreement_names_the_differing_rank_and_its_fix(hvd: Any) -> None:
    mine = {"buckets": ["a", "b"], "launches": 2 if hvd.rank() == 0 else 3}
    if hvd.size() == 1:
        assert runtime.check_agreed("test.agree", mine, "fix it") == [mine]
        return
    with pytest.raises(hvd.MismatchError,
                       match=r"test.agree: the ranks differ \(rank 1: launches 3, expected 2 "
                             r"\(as rank 0 has it\).*\); fix it"):
        runtime.check_agreed("test.agree", mine, "fix it")
