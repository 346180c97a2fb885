"""Per-name state is bounded by ``cache_capacity`` and agreed across ranks (issue 26).

The response cache changes only at agreed points (broadcast responses, agreed bits), and the
state kept per name beside it (a name's remembered request and lane) leaves with the cache's
evictions. So whatever order each rank submits its names in, every rank's cache holds the
same names in the same slots and the same use order after every step, and each rank's lanes
are a subset of those names (a lane is a rank's own shortcut to the agreed cache: a call that
raced with its name's eviction leaves that rank without the lane, and its next call of the
name takes the full round once, so lanes need not be equal across ranks);
a name evicted and seen again is exact; capacity 0 keeps nothing; a name that never repeats
holds no result memory.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi_util import (
    all_inputs,
    allgather_ints,
    assert_equal_result,
    make_input,
    reference_allreduce,
    seed_for,
)

from hvdlite._engine import default_engine

POOL = 20  # names that come back (with a layout that sometimes changes)
CAPACITY = 8


def _state() -> tuple[list[tuple[str, int]], list[str], list[str], Any]:
    """The global channel's cache (names in use order, with slots), lanes and requests."""
    channel = default_engine().global_channel
    cache = channel.negotiator.cache
    return list(cache._by_name.items()), sorted(channel.lanes), sorted(channel.requests), \
        channel


def _agreed(what: str, value: object) -> None:
    digest = zlib.crc32(repr(value).encode())
    digests = allgather_ints(digest, what)
    assert len(set(digests)) == 1, f"{what}: ranks differ ({digests}): this rank has {value}"


def test_caches_agree_under_random_name_orders(hvd: Any, restart: Callable[..., Any]) -> None:
    restart(cache_capacity=CAPACITY)
    rank, size = hvd.rank(), hvd.size()
    shared = random.Random(seed_for("bounded-order"))
    for step in range(40):
        # The step's calls, the same on every rank: names from the pool (some with a new
        # layout: an invalidation), a grouped call, and names never seen before.
        calls: list[tuple[str, tuple[int, ...], str, bool]] = []
        for k in shared.sample(range(POOL), 6):
            shape = (k % 5 + 1,) if shared.random() < 0.8 else (k % 5 + 2, 2)
            calls.append((f"pool.{k}", shape, "int32" if k % 2 else "float64", False))
        calls.append((f"group.{step % 3}", (3,), "int64", True))
        calls += [(f"new.{step}.{j}", (j + 1,), "int16", False) for j in range(2)]
        order = list(range(len(calls)))
        random.Random(seed_for("bounded-order", rank, step)).shuffle(order)
        handles: dict[int, Any] = {}
        for i in order:
            name, shape, dtype, group = calls[i]
            if group:
                xs = [make_input(seed_for(step, name, m), rank, shape, dtype) for m in range(3)]
                handles[i] = hvd.grouped_allreduce_async(xs, name=name, op=hvd.Sum)
            else:
                x = make_input(seed_for(step, name), rank, shape, dtype)
                handles[i] = hvd.allreduce_async(x, name=name, op=hvd.Sum)
        random.Random(seed_for("bounded-wait", rank, step)).shuffle(order)
        for i in order:
            name, shape, dtype, group = calls[i]
            got = handles[i].wait(timeout=30)
            parts = range(3) if group else [None]
            for m, out in zip(parts, got if group else [got], strict=True):
                seed = seed_for(step, name, m) if group else seed_for(step, name)
                want = reference_allreduce(all_inputs(seed, size, shape, dtype), "Sum")
                assert_equal_result(out, want, f"step {step} {name} member {m}")
        cached, lanes, requests, channel = _state()
        assert len(cached) <= CAPACITY
        assert set(lanes) <= {n for n, _ in cached}, (lanes, cached)
        assert set(requests) <= {n for n, _ in cached}, (requests, cached)
        assert len(channel._plans) <= CAPACITY
        _agreed(f"step {step}: cache (names, slots, use order)", cached)


def test_evicted_name_seen_again_is_exact(hvd: Any, restart: Callable[..., Any]) -> None:
    """Two slots, five names of different layouts in turn: every call evicts one."""
    restart(cache_capacity=2)
    rank, size = hvd.rank(), hvd.size()
    layouts = [((4,), "int32", "Sum"), ((2, 3), "float64", "Max"), ((7,), "int64", "Min"),
               ((1,), "uint8", "Sum"), ((3, 1), "float32", "Sum")]
    for round_ in range(6):
        for k, (shape, dtype, op) in enumerate(layouts):
            x = make_input(seed_for("evict", round_, k), rank, shape, dtype)
            name = f"evict.{k}"
            if (round_ + k) % 2:
                got = hvd.allreduce(x, name=name, op=getattr(hvd, op))
            else:
                got = hvd.allreduce_async(x, name=name, op=getattr(hvd, op)).wait(timeout=30)
            want = reference_allreduce(all_inputs(seed_for("evict", round_, k), size, shape,
                                                  dtype), op)
            assert_equal_result(got, want, f"round {round_} {name}")
        cached, lanes, requests, _ = _state()
        assert len(cached) <= 2 and len(lanes) <= 2 and len(requests) <= 2, (cached, lanes)


def test_capacity_zero_keeps_nothing(hvd: Any, restart: Callable[..., Any]) -> None:
    restart(cache_capacity=0)
    rank, size = hvd.rank(), hvd.size()
    for step in range(10):
        handles = [hvd.allreduce_async(make_input(seed_for("zero", step, k), rank, (k + 1,),
                                                  "int32"), name=f"zero.{k}", op=hvd.Sum)
                   for k in range(4)]
        group = hvd.grouped_allreduce(
            [make_input(seed_for("zero-g", step, m), rank, (2,), "int64") for m in range(2)],
            name="zero.group", op=hvd.Sum)
        for k, handle in enumerate(handles):
            want = reference_allreduce(all_inputs(seed_for("zero", step, k), size, (k + 1,),
                                                  "int32"), "Sum")
            assert_equal_result(handle.wait(timeout=30), want, f"step {step} zero.{k}")
        for m, got in enumerate(group):
            want = reference_allreduce(all_inputs(seed_for("zero-g", step, m), size, (2,),
                                                  "int64"), "Sum")
            assert_equal_result(got, want, f"step {step} zero.group member {m}")
    cached, lanes, requests, channel = _state()
    assert (cached, lanes, requests, len(channel._plans)) == ([], [], [], 0)


def test_names_that_never_repeat_hold_no_results(hvd: Any,
                                                 restart: Callable[..., Any]) -> None:
    """No lane keeps a result set or a grouped call's members for a name seen once; a name
    that repeats keeps its results (recycled) and members (matched by identity)."""
    restart(cache_capacity=16)
    rank, size = hvd.rank(), hvd.size()
    want = np.full(1000, sum(range(size)), np.float64)
    for i in range(100):
        x = np.full(1000, rank, np.float64)
        assert_equal_result(hvd.allreduce(x, name=f"once.{i}", op=hvd.Sum), want, f"once.{i}")
        assert_equal_result(hvd.grouped_allreduce([x, x[:10]], name=f"once.g.{i}",
                                                  op=hvd.Sum)[0], want, f"once.g.{i}")
    _, lanes, _, channel = _state()
    assert 0 < len(lanes) <= 32
    assert all(not channel.lanes[n].results and not channel.lanes[n].inputs for n in lanes)
    x = np.full(1000, rank, np.float64)
    members = [x, x[:10]]
    for _ in range(3):
        assert_equal_result(hvd.allreduce(x, name="again", op=hvd.Sum), want, "again")
        assert_equal_result(hvd.grouped_allreduce(members, name="again.g", op=hvd.Sum)[0],
                            want, "again.g")
    assert channel.lanes["again"].results and channel.lanes["again.g"].results
    assert channel.lanes["again.g"].inputs == tuple(members)
