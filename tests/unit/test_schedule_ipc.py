"""The CUDA IPC schedule transport's pure parts (``hvdlite/_backends/schedule_ipc.py``): what it
takes, how a buffer is shared out, where its ranks may sit. Its launches need a GPU per rank:
tests/torch/test_gpu_ipc_schedule.py."""

from __future__ import annotations

import numpy as np
import pytest

from hvdlite._backends.schedule_ipc import placement_why, shares, why_not
from hvdlite._ops import ReduceOp
from hvdlite._vocab.agreed import Slot


def _slot(dtype: str = "float32", op: ReduceOp = ReduceOp.AVERAGE, pre: float = 1.0,
          post: float = 1.0) -> Slot:
    return Slot("grad.0", 10, dtype, int(op), pre, post)


def test_why_not_names_what_it_cannot_reduce() -> None:
    assert why_not([_slot(), _slot("float16", ReduceOp.SUM), _slot("int64", ReduceOp.MAX)]) == ""
    assert "bfloat16 has no CUDA IPC reduce kernel" in why_not([_slot("bfloat16")])
    assert "bool" in why_not([_slot("bool", ReduceOp.SUM)])
    assert "ADASUM" in why_not([_slot(op=ReduceOp.ADASUM)])
    assert "scale factors (pre 0.5, post 1.0)" in why_not([_slot(pre=0.5)])


@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 17, 1000, 4099])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_shares_cover_the_buffer_once_on_16_byte_boundaries(count: int, itemsize: int,
                                                            size: int) -> None:
    parts = shares(count, itemsize, size)
    assert len(parts) == size
    covered = np.zeros(count, dtype=np.int64)
    for first, n in parts:
        assert n >= 0 and (first * itemsize) % 16 == 0 or n == 0
        covered[first:first + n] += 1
    assert (covered == 1).all()
    starts = [first for first, n in parts if n]
    assert starts == sorted(starts)  # rank order


def test_placement_wants_one_host_and_a_gpu_per_rank() -> None:
    one = [{"host": "a", "gpu": "0000:01:00.0"}, {"host": "a", "gpu": "0000:02:00.0"}]
    assert placement_why(one) == ""
    two_hosts = [{"host": "a", "gpu": "0000:01:00.0"}, {"host": "b", "gpu": "0000:01:00.0"}]
    assert "on 2 hosts (a, b)" in placement_why(two_hosts)
    shared = [{"host": "a", "gpu": "0000:01:00.0"}, {"host": "a", "gpu": "0000:01:00.0"}]
    assert "ranks 0 and 1 share GPU 0000:01:00.0" in placement_why(shared)
