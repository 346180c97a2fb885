"""The CUDA IPC schedule transport's pure parts (``hvdlite/_backends/schedule_ipc.py``): what it
takes, how a buffer is shared out, where its ranks may sit, and the flags protocol of ranks
that share a GPU, played out on every interleaving of the ranks' streams a random walk finds.
Its launches need a GPU: tests/torch/test_gpu_ipc_schedule.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hvdlite._backends.schedule_ipc import (
    REDUCED,
    WRITTEN,
    launch_plan,
    meeting,
    placement_why,
    shares,
    why_not,
)
from hvdlite._gpu.semaphores import NO_BINDINGS, SUPPORTED
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


def test_placement_wants_one_host_and_memops_where_ranks_share_a_gpu() -> None:
    one = [{"host": "a", "gpu": "0000:01:00.0"}, {"host": "a", "gpu": "0000:02:00.0"}]
    assert placement_why(one) == ""
    two_hosts = [{"host": "a", "gpu": "0000:01:00.0"}, {"host": "b", "gpu": "0000:01:00.0"}]
    assert "on 2 hosts (a, b)" in placement_why(two_hosts)
    shared = [{"host": "a", "gpu": "0000:01:00.0", "memops": SUPPORTED},
              {"host": "a", "gpu": "0000:01:00.0", "memops": SUPPORTED}]
    assert placement_why(shared) == ""  # their waits: stream memory operations
    shared[1]["memops"] = NO_BINDINGS
    why = placement_why(shared)
    assert "share a GPU" in why and "rank 1" in why and "cuda-python" in why, why


def _ranges(copies: list[tuple[int, int, int]], side: int) -> list[tuple[int, int]]:
    return [(c[side], c[side] + c[2]) for c in copies]


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("count", [1, 5, 64, 1001])
def test_launch_plans_sum_every_buffer_and_never_write_what_a_peer_reads(size: int,
                                                                         count: int) -> None:
    """Every rank's plan for one slot, carried out on NumPy memory standing in for the
    ranks' buffers (one address space: the plan's arithmetic, not CUDA's): after the pulls,
    the reduces and the gathers, in the protocol's phases, every buffer holds the sum; and a
    rank never writes bytes a peer may read in the same phase (its reduce writes only its own
    share, which no peer pulls; its gathers write only shares no peer reads from it then)."""
    isz = 4
    stride = -(-(-(-count // size) * isz) // 16) * 16 + 16
    buf_bytes = -(-count * isz // 16) * 16 + 16
    bases = [4096 + r * buf_bytes for r in range(size)]
    scratch = [bases[-1] + buf_bytes + r * size * stride for r in range(size)]
    memory = np.zeros(scratch[-1] + size * stride, dtype=np.uint8)
    view = memory.view(np.uint8)
    rng = np.random.default_rng(count * 31 + size)
    data = [rng.integers(-1000, 1000, size=count).astype(np.float32) for _ in range(size)]
    for r in range(size):
        view[bases[r]:bases[r] + count * isz] = data[r].view(np.uint8)
    plans = [launch_plan(r, count, isz, bases, scratch[r], stride) for r in range(size)]

    def floats(at: int, n: int) -> np.ndarray:
        return view[at:at + n * isz].view(np.float32)

    def run(copies: list[tuple[int, int, int]]) -> None:
        for dst, src, n in copies:
            view[dst:dst + n] = view[src:src + n].copy()

    for p in plans:  # WRITTEN passed: every rank pulls
        run(p.pulls)
    for r, p in enumerate(plans):  # a rank's reduce may run while slower peers still pull
        mine = [(p.out, p.out + p.count * isz)] if p.count else []
        assert not any(_overlap(mine, _ranges(q.pulls, 1)) for q in plans), r
        if p.count:
            floats(p.out, p.count)[:] = sum(floats(a, p.count).astype(np.float64)
                                            for a in p.inputs).astype(np.float32)
    for r, p in enumerate(plans):  # REDUCED passed: every rank gathers
        assert not any(_overlap(_ranges(p.gathers, 0), _ranges(q.gathers, 1))
                       for q in plans), r
        run(p.gathers)
    want = np.sum(np.stack(data).astype(np.float64), axis=0).astype(np.float32)
    for r in range(size):
        assert np.array_equal(floats(bases[r], count), want), r


def _play(size: int, slots: int, steps: int, seed: int) -> None:
    """Every rank's stream as the transport enqueues it where ranks share a GPU: per step, per
    slot in order, the three meetings (``meeting``), each rank's work between them standing in
    as a no-op. A random walk runs one stream's next operation at a time (a wait only once its
    flag is 1). Each flag remembers which launch of its writer set it: a wait must consume the
    signal of its own launch, a reset must clear only signals of its own launch (never a
    peer's next one), and every stream must finish (no deadlock)."""
    rng = random.Random(seed)
    programs = []
    for me in range(size):
        ops = []
        for launch in range(steps * slots):
            slot = launch % slots
            for kind in range(3):
                ops += [(launch, *op) for op in meeting(kind, slot, slots, me, size)]
        programs.append(ops)
    flags = [[(0, -1)] * (3 * slots * size) for _ in range(size)]  # (value, writer's launch)
    at = [0] * size
    while any(a < len(p) for a, p in zip(at, programs, strict=True)):
        ready = []
        for me in range(size):
            if at[me] == len(programs[me]):
                continue
            _, what, rank, flag = programs[me][at[me]]
            if what != "wait" or flags[rank][flag][0] == 1:
                ready.append(me)
        assert ready, f"deadlock at {at} (size {size}, slots {slots}, seed {seed})"
        me = rng.choice(ready)
        launch, what, rank, flag = programs[me][at[me]]
        at[me] += 1
        if what == "signal":
            assert flags[rank][flag][0] == 0, ("a signal over an unconsumed one", me, flag)
            flags[rank][flag] = (1, launch)
        elif what == "wait":
            assert flags[rank][flag][1] == launch, ("consumed another launch's signal", me)
        else:
            for f in range(flag, flag + size):
                value, writer = flags[me][f]
                assert value == 0 or writer == launch, ("reset a later signal", me, f, writer)
                flags[me][f] = (0, -1)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("slots", [1, 3])
def test_flags_of_ranks_sharing_a_gpu_never_lose_or_reuse_a_signal(size: int,
                                                                   slots: int) -> None:
    for seed in range(40):
        _play(size, slots, steps=3, seed=seed)


def test_a_meeting_signals_every_peer_then_waits_for_each_then_resets() -> None:
    ops = meeting(REDUCED, 2, 4, 1, 3)
    base = (REDUCED * 4 + 2) * 3
    assert ops == [("signal", 0, base + 1), ("signal", 2, base + 1), ("wait", 1, base),
                   ("wait", 1, base + 2), ("reset", 1, base)]
    assert meeting(WRITTEN, 0, 1, 0, 1) == [("reset", 0, 0)]  # one rank: nothing to meet
