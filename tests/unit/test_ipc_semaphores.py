"""The pure logic of the CUDA IPC transport's device semaphores (``_gpu/semaphores.py``,
``_gpu/fences.py``, ``_gpu/mapping.py``): epoch arithmetic and its wrap, the release value,
the inbox layout, the protocol every rank agrees on, the bounded peer mappings, and the flag
protocol's ordering checked on a model of streams (every interleaving the scheduler below
draws, ranks using two streams each, epochs across the 32-bit wrap).

The device itself is exercised by tests/gpu/test_gpu_ipc*.py on a GPU.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import numpy as np
import pytest

from hvdlite._gpu import semaphores as sem
from hvdlite._gpu.fences import FlagFences
from hvdlite._gpu.mapping import PeerMappings


def test_step_epoch_alternates_slots_and_counts_uses_per_slot() -> None:
    got = [sem.step_epoch(k, 2) for k in range(6)]
    assert got == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    assert sem.step_epoch(7, 3) == (1, 3)
    assert sem.step_epoch(2 * (sem.MOD - 1), 2) == (0, 0)  # the wrap: epoch 2**32 is 0
    with pytest.raises(ValueError, match="slots >= 1"):
        sem.step_epoch(1, 0)


def test_cyclic_geq_is_the_drivers_int32_rule() -> None:
    rng = np.random.default_rng(3)
    pairs = rng.integers(0, sem.MOD, size=(2000, 2), dtype=np.uint64)
    edge = [(0, 0), (1, 0), (0, 1), (0, sem.MOD - 1), (sem.MOD - 1, 0), (1 << 31, 0),
            ((1 << 31) - 1, 0), (5, (1 << 31) + 6)]
    for flag, value in [*map(tuple, pairs.tolist()), *edge]:
        diff = np.array([flag], np.uint32) - np.array([value], np.uint32)  # wraps, as in C
        want = bool(diff.view(np.int32)[0] >= 0)  # (int32_t)(*addr - value) >= 0
        assert sem.cyclic_geq(flag, value) == want, (flag, value)
    assert sem.cyclic_geq(0, sem.MOD - 1)  # just past the wrap is ahead
    assert not sem.cyclic_geq(sem.MOD - 1, 0)


@pytest.mark.parametrize("epoch", [0, 1, 5, (1 << 31) - 1, 1 << 31, sem.MOD - 2, sem.MOD - 1])
def test_release_value_passes_every_recent_epoch(epoch: int) -> None:
    value = sem.release_value(epoch)
    for back in range(0, 8):
        assert sem.cyclic_geq(value, (epoch - back) % sem.MOD), (epoch, back)
    # and it stays clear of the horizon: a few more epochs enqueued later still pass
    assert sem.cyclic_geq(value, (epoch + 1000) % sem.MOD)


def test_inbox_layout_is_dense_and_checked() -> None:
    slots, size = 2, 4
    seen = {sem.flag_index(k, s, p, slots, size) for k in (sem.WRITTEN, sem.READ)
            for s in range(slots) for p in range(size)}
    assert seen == set(range(2 * slots * size))
    with pytest.raises(ValueError, match="no flag"):
        sem.flag_index(sem.READ, 2, 0, slots, size)


def test_the_protocol_is_flags_only_if_every_rank_can() -> None:
    assert sem.choose_protocol([sem.SUPPORTED] * 3)[0] == "flags"
    mode, why = sem.choose_protocol([sem.SUPPORTED, sem.NO_BINDINGS, sem.PROBE_FAILED])
    assert mode == "events"
    assert "rank 1 (and 1 more rank(s))" in why and "cuda-bindings" in why
    mode, why = sem.choose_protocol([sem.FORCED_EVENTS, sem.FORCED_EVENTS])
    assert mode == "events" and "asked for" in why


def test_no_cuda_python_means_the_event_protocol() -> None:
    if importlib.util.find_spec("cuda") is not None and \
            importlib.util.find_spec("cuda.bindings") is not None:
        pytest.skip("cuda-python is installed here")
    assert sem.memops_support(None, 0) == sem.NO_BINDINGS


def test_a_bad_protocol_name_is_a_clear_error() -> None:
    from hvdlite._gpu.ipc import IpcCommunicator

    with pytest.raises(ValueError, match=r"protocol must be one of \('auto', 'flags', "
                                         r"'events'\), got 'fast'"):
        IpcCommunicator(None, None, None, 0, 1024, lambda r: None,  # type: ignore[arg-type]
                        protocol="fast")


# -- peer mappings ---------------------------------------------------------------------------
class _Driver:
    """Stands for cudaIpcOpenMemHandle / cudaIpcCloseMemHandle: hands out distinct bases."""

    def __init__(self) -> None:
        self.open: dict[int, bytes] = {}
        self.closed: list[bytes] = []
        self._next = 1 << 20

    def map(self, handle: bytes) -> int:
        assert handle not in self.open.values(), "a handle opened twice in one process"
        self._next += 1 << 20
        self.open[self._next] = handle
        return self._next

    def unmap(self, base: int) -> None:
        self.closed.append(self.open.pop(base))


def test_a_handle_is_opened_once_and_offsets_are_kept() -> None:
    drv = _Driver()
    maps = PeerMappings(drv.map, drv.unmap, capacity=4)
    a0 = maps.get(1, b"A", 0)
    a1 = maps.get(1, b"A", 4096)
    assert a1 - a0 == 4096 and maps.opens == 1 and len(maps) == 1
    maps.get(2, b"B", 16, pinned=True)
    assert maps.opens == 2
    with pytest.raises(ValueError, match="offset"):
        maps.get(1, b"A", -1)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        PeerMappings(drv.map, drv.unmap, capacity=0)


def test_unpinned_mappings_are_bounded_and_pinned_ones_stay() -> None:
    drv = _Driver()
    maps = PeerMappings(drv.map, drv.unmap, capacity=2)
    slot = maps.get(0, b"slots", 256, pinned=True)
    for h in (b"x", b"y", b"z"):  # x is the least recently used when z comes
        maps.get(1, h)
    assert drv.closed == [b"x"] and len(maps) == 3
    maps.get(1, b"y")  # y becomes the newest: w pushes z out
    maps.get(1, b"w")
    assert drv.closed == [b"x", b"z"]
    maps.get(1, b"x")  # opened again
    assert maps.opens == 6 and drv.closed == [b"x", b"z", b"y"]
    assert maps.get(0, b"slots", 256, pinned=True) == slot  # never evicted
    maps.close_all()
    assert not drv.open and len(maps) == 0


# -- the flag protocol on a model of streams -------------------------------------------------
class _Streams:
    """A model of what FlagFences enqueues: per stream, its operations in order; a wait is
    runnable once the flag passes the driver's cyclic GEQ. Slot contents are tracked by step
    number, so a read of a slot not yet written, or a write over a slot a rank has not
    finished reading, is caught."""

    def __init__(self, rank: int, size: int, world: dict[str, Any]) -> None:
        self.rank, self.size, self.world = rank, size, world

    def signal(self, stream: tuple[int, int], to: int, kind: int, slot: int,
               epoch: int) -> None:
        self.world["ops"][stream].append(("signal", (to, kind, slot, self.rank), epoch))

    def wait(self, stream: tuple[int, int], kind: int, slot: int, peer: int,
             epoch: int) -> None:
        self.world["ops"][stream].append(("wait", (self.rank, kind, slot, peer), epoch))


def _simulate(size: int, steps: int, start: int, seed: int) -> None:
    rng = random.Random(seed)
    slots = 2
    ops: dict[tuple[int, int], list[tuple[str, Any, Any]]] = {
        (r, s): [] for r in range(size) for s in range(2)}
    world: dict[str, Any] = {"ops": ops}
    # The state before step ``start``: every flag holds its slot's epoch before it, every
    # slot was written and read by everyone at the step before.
    flags: dict[tuple[int, int, int, int], int] = {}
    for s in range(slots):
        before = start - slots + s if start - slots + s >= 0 else None
        prev = 0 if before is None else sem.step_epoch(before, slots)[1]
        for owner in range(size):
            for kind in (sem.WRITTEN, sem.READ):
                for peer in range(size):
                    flags[owner, kind, s, peer] = prev
    content = {(r, s): None for r in range(size) for s in range(slots)}
    done_reads = {(q, p, s): None for q in range(size) for p in range(size)
                  for s in range(slots)}
    fences = [FlagFences(_Streams(r, size, world)) for r in range(size)]  # type: ignore[arg-type]
    for k in range(start, start + steps):
        slot, epoch = sem.step_epoch(k, slots)
        for r, f in enumerate(fences):
            st = (r, rng.randrange(2))  # each rank picks either of its streams per step
            f.before_write(st, slot, epoch, k < slots)
            ops[st].append(("write", slot, k))
            f.after_write(st, slot, epoch)
            ops[st].append(("read", slot, k))
            f.after_read(st, slot, epoch)
    pos = dict.fromkeys(ops, 0)
    while True:
        runnable = []
        for st, lst in ops.items():
            if pos[st] < len(lst):
                op, key, val = lst[pos[st]]
                if op != "wait" or sem.cyclic_geq(flags[key], val):
                    runnable.append(st)
        if not runnable:
            break
        st = rng.choice(runnable)
        op, key, val = ops[st][pos[st]]
        pos[st] += 1
        r = st[0]
        if op == "signal":
            flags[key] = val
        elif op == "write":
            prev = None if val - slots < start else val - slots
            for q in range(size):  # every rank finished reading this slot's last use
                assert done_reads[q, r, key] == prev, f"rank {r} overwrote a slot rank {q} " \
                    f"had not read (step {val})"
            content[r, key] = val
        elif op == "read":
            for p in range(size):
                assert content[p, key] == val, f"rank {r} read rank {p}'s slot too early"
                done_reads[r, p, key] = val
    left = {st: len(lst) - pos[st] for st, lst in ops.items() if pos[st] < len(lst)}
    assert not left, f"deadlock: operations left per stream {left}"


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_flag_protocol_orders_every_interleaving(size: int, seed: int) -> None:
    _simulate(size, steps=12, start=0, seed=seed)


@pytest.mark.parametrize("seed", range(4))
def test_flag_protocol_across_the_epoch_wrap(seed: int) -> None:
    _simulate(3, steps=10, start=2 * (sem.MOD - 3), seed=seed)


# -- the one-shot kernel's step (a GPU per rank): which steps take it, and what it computes ------
def _reduced(nbytes: int, dtype: str = "float32") -> Any:
    from hvdlite._gpu.ipc import _ALL, _Piece, _Pull

    return _Piece(_ALL, nbytes, 0x1000, [_Pull(0x2000, reduce=(np.dtype(dtype), 0))],
                  np.dtype(dtype).itemsize)


def test_only_one_small_reduced_piece_takes_the_one_shot_kernel() -> None:
    from hvdlite._gpu.ipc import _ALL, _Piece, _Pull, oneshot_pull

    small, big = _reduced(256), _reduced(1 << 20)
    assert oneshot_pull([small], 64 * 1024) == (small, small.pulls[0])
    assert oneshot_pull([big], 64 * 1024) is None  # over the limit
    assert oneshot_pull([small], 0) is None  # off (ranks that share a GPU)
    assert oneshot_pull([small, _reduced(256)], 64 * 1024) is None  # a group: two pieces
    staged_only = _Piece(_ALL, 256, 0x1000, [], 4)  # a reduce's other ranks
    assert oneshot_pull([staged_only], 64 * 1024) is None
    copied = _Piece(1, 256, 0x1000, [_Pull(0x2000, 1)])  # a broadcast: a copy, not a reduce
    assert oneshot_pull([copied], 64 * 1024) is None
    assert oneshot_pull([_reduced(0)], 64 * 1024) is None


@pytest.mark.parametrize("op", ["sum", "avg", "prod", "max", "min"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_one_shot_source_keeps_the_flag_protocol(op: str, ranks: int) -> None:
    # The kernel's flags are the memop step's (flag_index's layout; WRITTEN to the peers, READ
    # to every rank, each at the step's epoch), and it reduces in rank order (the same bits on
    # every rank). What it computes on a GPU is tests/gpu/test_gpu_ipc.py's.
    from hvdlite._gpu.kernels import oneshot_source

    name, code = oneshot_source(op, ranks, 2, "float16" if op == "max" else "float32")
    assert name in code and f"hvd_oneshot_{op}_{ranks}_2_" in name
    assert f"(((kind) * 2 + (slot)) * {ranks} + (peer))" in code  # sem.flag_index's layout
    for i in range(ranks):
        assert f"a{i} = " in code
    assert code.index("a0 = ") < code.index(f"a{ranks - 1} = ")
    assert "st_release(FLAG(inboxes[r], 0, slot, me), epoch)" in code  # WRITTEN to peers
    assert "st_release(FLAG(inboxes[r], 1, slot, me), epoch)" in code  # READ to every rank
    assert "await_flag(FLAG(mine, 1, slot, r), epoch - 1u)" in code  # READ of the last use
    assert ("/ (" in code) == (op == "avg")
    for k in (sem.WRITTEN, sem.READ):
        assert sem.flag_index(k, 1, ranks - 1, 2, ranks) == (k * 2 + 1) * ranks + ranks - 1


# -- the two-shot allreduce (4+ ranks, large calls): its pieces, run on a model of the steps -----
def _run_model(phases_of: list[list[list[Any]]], mem: list[np.ndarray]) -> None:
    """Each phase as one step (the memop step's order: every push, then every pull), on every
    rank's memory (``mem[r]``: bytes; addresses are offsets into it)."""
    from hvdlite._gpu.ipc import _ALL

    size = len(mem)
    for phase in range(len(phases_of[0])):
        pieces = [phases_of[r][phase] for r in range(size)]
        staged: dict[tuple[int, int], np.ndarray] = {}
        for r in range(size):
            for i, p in enumerate(pieces[r]):
                if p.nbytes and (p.pusher == _ALL or p.pusher == r):
                    staged[r, i] = mem[r][p.src:p.src + p.nbytes].copy()
        for me in range(size):
            for i, p in enumerate(pieces[me]):
                for pull in p.pulls:
                    if pull.reduce is None:
                        got = staged[pull.src, i]
                    else:
                        dt = pull.reduce[0]
                        got = sum(staged[r, i].view(dt) for r in range(size)).astype(dt)
                        got = got.view(np.uint8)
                    mem[me][pull.dst:pull.dst + p.nbytes] = got


@pytest.mark.parametrize("size", [4, 5, 8])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", ["int32", "float64"])
def test_two_shot_allreduce_sums_every_rank_input(size: int, in_place: bool, dtype: str) -> None:
    from hvdlite._gpu.ipc import two_shot_phases

    dt = np.dtype(dtype)
    count = 1001  # not a multiple of any size: uneven parts
    send, recv = 0, 0 if in_place else count * dt.itemsize
    rng = np.random.default_rng(size)
    inputs = [rng.integers(-1000, 1000, count).astype(dt) for _ in range(size)]
    mem = []
    for r in range(size):
        m = np.zeros(2 * count * dt.itemsize, dtype=np.uint8)
        m[send:send + count * dt.itemsize] = inputs[r].view(np.uint8)
        mem.append(m)
    phases = [two_shot_phases(send, recv, count, dt, 0, r, size) for r in range(size)]
    assert all(len(p) == 2 for p in phases)
    _run_model(phases, mem)
    want = sum(inputs).astype(dt)
    for r in range(size):
        got = mem[r][recv:recv + count * dt.itemsize].view(dt)
        np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")


def test_two_shot_parts_cover_the_buffer_once() -> None:
    from hvdlite._gpu.ipc import two_shot_phases

    dt = np.dtype("float32")
    scatter, gather = two_shot_phases(0, 4096, 3, dt, 0, 1, 4)  # fewer elements than ranks
    assert [p.nbytes for p in scatter] == [0, 4, 4, 4]
    assert sum(p.nbytes for p in gather) == 12
    assert [len(p.pulls) for p in scatter] == [0, 1, 0, 0]  # rank 1 reduces part 1 only
    assert [len(p.pulls) for p in gather] == [1, 0, 1, 1]  # and copies the others' parts
