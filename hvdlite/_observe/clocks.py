"""Clock offsets between hosts, measured at init, for timelines merged across hosts.

Every timeline stamps events with its process's ``time.perf_counter`` (``CLOCK_MONOTONIC``):
shared by the processes of one host, unrelated between hosts. :func:`offset_to_root_us` gives
each rank rank 0's clock minus its own, per host: the first rank of each host (its leader)
exchanges ``rounds`` ping-pongs with rank 0 (Cristian's method: rank 0 notes ``t1``, the
leader answers with its clock ``t``, rank 0 notes ``t4``; the offset is ``(t1 + t4) / 2 - t``,
wrong by at most half the round trip, and the round with the shortest round trip wins, so a
round delayed by the scheduler does not count); the leader hands the result to its host's
ranks. Across hosts over TCP that is good to tens of microseconds; on one host every offset is
0. Collective over ``comm``; O(hosts x rounds) messages at rank 0, at init only.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["offset_to_root_us"]

ROUNDS = 8
_TAG = 0x4856  # on the engine's own communicator duplicate, at init: nothing else in flight


def _now_us() -> float:
    return time.perf_counter_ns() / 1e3


def _measure(leaders: Any, rounds: int) -> float:
    """On the leaders' communicator (rank 0 first): rank 0's clock minus this leader's."""
    me = leaders.Get_rank()
    if me != 0:
        for _ in range(rounds):
            leaders.recv(source=0, tag=_TAG)
            leaders.send(_now_us(), dest=0, tag=_TAG)
        return float(leaders.recv(source=0, tag=_TAG))
    for peer in range(1, leaders.Get_size()):
        best_rtt, best = float("inf"), 0.0
        for _ in range(rounds):
            t1 = _now_us()
            leaders.send(None, dest=peer, tag=_TAG)
            theirs = leaders.recv(source=peer, tag=_TAG)
            t4 = _now_us()
            if t4 - t1 < best_rtt:
                best_rtt, best = t4 - t1, (t1 + t4) / 2 - theirs
        leaders.send(best, dest=peer, tag=_TAG)
    return 0.0


def offset_to_root_us(comm: Any, rounds: int = ROUNDS) -> float:
    """Rank 0's timeline clock minus this rank's, in microseconds (collective over ``comm``).

    Rank 0 gets 0.0; ranks on rank 0's host get 0.0 too (one clock per host)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    is_leader = local.Get_rank() == 0
    leaders = comm.Split(0 if is_leader else MPI.UNDEFINED, key=rank)
    offset = 0.0
    try:
        if is_leader:
            offset = _measure(leaders, rounds)
        offset = float(local.bcast(offset, root=0))
    finally:
        if leaders != MPI.COMM_NULL:
            leaders.Free()
        local.Free()
    return offset
