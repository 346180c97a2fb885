"""Process sets: collectives among a subset of the ranks, each set with its own negotiation.

Runs at every size of the MPI suite. Sets are built from the job's size so the assertions hold
at 1, 2 and 4 ranks; references come from every member's inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)


def _value(rank: int, k: int = 0) -> int:
    return 10 * rank + k + 1


def test_allreduce_allgather_broadcast_barrier_within_sets(hvd: Any) -> None:
    size, me = hvd.size(), hvd.rank()
    if size < 2:
        pytest.skip("needs 2 ranks (one rank's only set is the global set)")
    evens = hvd.add_process_set(list(range(0, size, 2)))
    odds = hvd.add_process_set(list(range(1, size, 2))) if size > 1 else None
    try:
        assert evens.process_set_id is not None and evens.ranks == list(range(0, size, 2))
        mine = evens if me % 2 == 0 else odds
        assert mine is not None and mine.included() and mine.rank() == mine.ranks.index(me)
        # The same name in two sets and in the global set at once: separate namespaces.
        x = np.full(3, _value(me), dtype=np.int64)
        h_set = hvd.allreduce_async(x, name="ps.x", op=hvd.Sum, process_set=mine)
        h_all = hvd.allreduce_async(x, name="ps.x", op=hvd.Sum)
        np.testing.assert_array_equal(h_set.wait(), np.full(3, sum(map(_value, mine.ranks))))
        np.testing.assert_array_equal(h_all.wait(), np.full(3, sum(map(_value, range(size)))))
        avg = hvd.allreduce(np.full(2, float(_value(me))), name="ps.avg", process_set=mine)
        np.testing.assert_array_equal(avg, np.full(2, np.mean([_value(r) for r in mine.ranks])))
        # Allgather in set-rank order, uneven first dimensions.
        rows = mine.rank() + 1
        got = hvd.allgather(np.full((rows, 2), me, np.int32), name="ps.ag", process_set=mine)
        want = np.concatenate([np.full((i + 1, 2), r, np.int32)
                               for i, r in enumerate(mine.ranks)])
        np.testing.assert_array_equal(got, want)
        # Broadcast roots are global ranks of the set.
        for root in mine.ranks:
            got = hvd.broadcast(np.full(4, _value(me), np.int64), root, name=f"ps.bc.{root}",
                                process_set=mine)
            np.testing.assert_array_equal(got, np.full(4, _value(root)))
        hvd.barrier(process_set=mine)
        # Alltoall with the set's size.
        n = mine.size()
        sent = np.arange(n, dtype=np.int64) + 100 * mine.rank()
        got = hvd.alltoall(sent, name="ps.a2a", process_set=mine)
        np.testing.assert_array_equal(got, np.array([100 * i + mine.rank() for i in range(n)]))
    finally:
        for ps in (evens, odds):
            if ps is not None:
                assert hvd.remove_process_set(ps)


def test_non_member_and_unregistered_sets_are_refused(hvd: Any) -> None:
    size, me = hvd.size(), hvd.rank()
    if size < 2:
        with pytest.raises(ValueError, match="already registered"):
            hvd.add_process_set([0])  # the same ranks as the global set
        return
    first = hvd.add_process_set([0])
    try:
        if me != 0:
            with pytest.raises(ValueError, match=r"rank \d+ is not in process set"):
                hvd.allreduce(np.ones(2), name="ps.no", process_set=first)
        else:
            np.testing.assert_array_equal(
                hvd.allreduce(np.ones(2), name="ps.solo", op=hvd.Sum, process_set=first),
                np.ones(2))
        with pytest.raises(ValueError, match="not registered"):
            hvd.allreduce(np.ones(2), name="ps.unreg", process_set=hvd.ProcessSet([0]))
        if me == 0:
            with pytest.raises(ValueError, match=r"root_rank must be one of the process set's"):
                hvd.broadcast(np.ones(2), size - 1, name="ps.badroot", process_set=first)
    finally:
        assert hvd.remove_process_set(first)
    assert not hvd.remove_process_set(first)  # already removed
    if me == 0:
        with pytest.raises(ValueError, match="not registered"):
            hvd.allreduce(np.ones(2), name="ps.gone", process_set=first)
    # The global set keeps working after all of this.
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), name="ps.after", op=hvd.Sum),
                                  np.full(2, size))


def test_sets_given_at_init(restart: Any) -> None:
    import hvdlite

    size = hvdlite.size() if hvdlite.is_initialized() else 1
    low = hvdlite.ProcessSet(list(range(max(size // 2, 1))))
    hvd = restart(process_sets=[low])
    assert low.process_set_id == 1
    me = hvd.rank()
    if low.included():
        got = hvd.allreduce(np.full(1, me + 1, np.int64), name="init.ps", op=hvd.Sum,
                            process_set=low)
        assert int(got[0]) == sum(r + 1 for r in low.ranks)
    hvd.barrier()


def test_grouped_allreduce_runs_on_its_set(hvd: Any) -> None:
    """Every grouped_allreduce form reduces over the set it names (they used to accept
    ``process_set=`` and run on the global set)."""
    size, me = hvd.size(), hvd.rank()
    if size < 2:
        pytest.skip("needs 2 ranks")
    solo = hvd.add_process_set(list(range(1, size, 2)))  # [1] or [1, 3]
    try:
        if not solo.included():
            return
        want = [np.full(2, sum(map(_value, solo.ranks)), np.int64)] * 2
        for k, fn in enumerate((hvd.grouped_allreduce, hvd.grouped_allreduce_)):
            xs = [np.full(2, _value(me), np.int64) for _ in range(2)]
            got = fn(xs, name=f"ps.grp.{k}", op=hvd.Sum, process_set=solo)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
        for k, afn in enumerate((hvd.grouped_allreduce_async, hvd.grouped_allreduce_async_)):
            xs = [np.full(2, _value(me), np.int64) for _ in range(2)]
            got = afn(xs, name=f"ps.grpa.{k}", op=hvd.Sum, process_set=solo).wait()
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
    finally:
        assert hvd.remove_process_set(solo)
