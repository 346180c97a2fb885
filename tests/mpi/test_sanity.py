"""The job itself: the expected number of ranks, MPI working, every rank on the same tests."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI


def test_world_size_matches_launcher(comm: MPI.Intracomm) -> None:
    expected = os.environ.get("HVDLITE_EXPECTED_SIZE")
    if expected is None:
        pytest.skip("not launched by tests/test_mpi_jobs.py (HVDLITE_EXPECTED_SIZE unset)")
    assert comm.Get_size() == int(expected)


def test_mpi4py_allreduce_of_ranks(comm: MPI.Intracomm) -> None:
    send = np.array([comm.Get_rank() + 1], dtype=np.int64)
    recv = np.zeros_like(send)
    comm.Allreduce(send, recv, op=MPI.SUM)
    size = comm.Get_size()
    assert int(recv[0]) == size * (size + 1) // 2


def test_mpi_thread_level_allows_background_thread() -> None:
    # hvdlite's background thread calls MPI while the test thread runs barriers.
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
