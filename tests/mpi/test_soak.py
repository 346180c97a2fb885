"""Random-order soak: every collective, every rank in its own submission and wait order.

Each step draws (from a seed shared by all ranks) a mix of collectives: allreduce with every op
(Average included) and scale factors, plain / in-place / ``out=``; grouped allreduce, plain and
in-place; allgather with a different dim 0 per rank (zero rows included); broadcast, plain and
in-place, from a root that changes per step; alltoall with per-rank splits (zero included) or
the default equal split; reducescatter with every op and uneven dim 0; a barrier; and in about
half the steps one blocking allreduce in the middle of the asynchronous ones. Dtypes, shapes and
ops change per step under the same names, so the response cache sees hits, invalidations and
new names. Every rank then submits the step's collectives in its own random order (seeded per
rank and step) and waits for them in another one, mixing ``wait()``, ``wait(timeout=)``,
``synchronize`` and ``poll``. Inputs derive from ``(seed, rank, step)``, so every rank computes
every result with NumPy from all ranks' inputs; values are small integers (also for floats and
complex), so results are compared exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
from soak_util import HOST, SOAK_TIMEOUT_S, STEPS, run_soak


@pytest.mark.timeout(SOAK_TIMEOUT_S, func_only=True)
def test_random_order_soak(hvd: Any) -> None:
    """Every collective, per-rank submission and wait orders, results exact, for STEPS[size]
    steps; the total count and time are printed (run with -s to see them)."""
    run_soak(hvd, STEPS.get(hvd.size(), 40), HOST)
