"""The control plane without MPI: coordinator table, mismatch checks, response cache, wire form.

Every scenario drives :class:`CoordinatorTable` the way rank 0's cycle does: one ``add`` per
rank that had something to say (in rank order), then one ``pop_ready``.
"""

from __future__ import annotations

import pickle
import random
from collections import OrderedDict
from dataclasses import replace as _replace_fields
from typing import Any

import pytest

from hvdlite._control.negotiation import (
    CoordinatorTable,
    ResponseCache,
    StallReport,
    build_response,
    mismatch_message,
)
from hvdlite._ops import ReduceOp
from hvdlite._vocab.messages import (
    Kind,
    Request,
    Response,
    pack_request,
    pack_response,
    unpack_request,
    unpack_response,
)


def replace(obj: Any, **kw: Any) -> Any:
    """A copy with ``kw`` changed: requests are named tuples, responses dataclasses."""
    if isinstance(obj, tuple):
        return obj._replace(**kw)
    return _replace_fields(obj, **kw)


def allreduce(name: str, **kw: Any) -> Request:
    """A float32 allreduce request of shape (4,) unless ``kw`` says otherwise."""
    base = Request(name, Kind.ALLREDUCE, "float32", (4,), "cpu", int(ReduceOp.SUM))
    return base._replace(**kw)


def join(name: str = "join.noname.0") -> Request:
    return Request(name, Kind.JOIN)


def names(responses: list[Response]) -> list[str]:
    return [r.name for r in responses]


# -- readiness and order ------------------------------------------------------------------


def test_ready_only_when_every_rank_submitted() -> None:
    table = CoordinatorTable(3)
    table.add(0, [allreduce("a")], now=0.0)
    table.add(2, [allreduce("a")], now=0.0)
    assert table.pop_ready() == []
    table.add(1, [allreduce("a")], now=0.0)
    (resp,) = table.pop_ready()
    assert (resp.name, resp.kind, resp.dtype, resp.shape, resp.error) == (
        "a", Kind.ALLREDUCE, "float32", (4,), "")
    assert resp.joined == ()
    assert table.pop_ready() == []  # popped once only
    assert table.stalled(0.0, now=100.0) == []


def test_ready_counts_joined_ranks_once_each() -> None:
    """Eight ranks, 3 and 5 joined: a tensor is ready when the six others submitted it, not
    one rank sooner; a joined rank whose request is in the table too is counted once, so the
    tensor still waits for every rank that neither submitted nor joined."""
    table = CoordinatorTable(8)
    table.add(3, [join()], now=0.0)
    table.add(5, [join()], now=0.0)
    for rank in (0, 1, 2, 4, 6):
        table.add(rank, [allreduce("a")], now=0.0)
    assert table.pop_ready() == []
    table.add(7, [allreduce("a")], now=0.0)
    (resp,) = table.pop_ready()
    assert (resp.name, resp.error, resp.joined) == ("a", "", (3, 5))
    for rank in (3, 0, 1, 2, 4, 6):
        table.add(rank, [allreduce("b")], now=0.0)
    assert table.pop_ready() == []  # 5 joined, 3 submitted: rank 7 is still missing
    table.add(7, [allreduce("b")], now=0.0)
    (resp,) = table.pop_ready()
    assert (resp.name, resp.error, resp.joined) == ("b", "", (5,))


def test_single_rank_is_ready_at_once() -> None:
    table = CoordinatorTable(1)
    table.add(0, [allreduce("b"), allreduce("a")], now=0.0)
    assert names(table.pop_ready()) == ["b", "a"]


def test_order_follows_the_submission_that_completed_each_tensor() -> None:
    table = CoordinatorTable(2)
    table.add(0, [allreduce(n) for n in "abc"], now=0.0)
    table.add(1, [allreduce(n) for n in "cab"], now=0.0)
    assert names(table.pop_ready()) == ["c", "a", "b"]


def test_order_ties_broken_by_rank_then_submission_order() -> None:
    table = CoordinatorTable(3)
    table.add(2, [allreduce("a"), allreduce("b")], now=0.0)
    table.add(0, [allreduce(n) for n in "bca"], now=0.0)
    # Rank 1 completes a and b in its own order; c still waits on rank 2.
    table.add(1, [allreduce(n) for n in "acb"], now=0.0)
    table.add(2, [allreduce("c")], now=0.0)
    assert names(table.pop_ready()) == ["a", "b", "c"]


def test_order_across_cycles() -> None:
    table = CoordinatorTable(2)
    table.add(0, [allreduce(n) for n in "xyz"], now=0.0)
    table.add(1, [allreduce("z")], now=0.0)
    assert names(table.pop_ready()) == ["z"]
    table.add(1, [allreduce("y"), allreduce("w")], now=1.0)
    table.add(0, [allreduce("w")], now=1.0)
    assert names(table.pop_ready()) == ["y", "w"]
    table.add(1, [allreduce("x")], now=2.0)
    assert names(table.pop_ready()) == ["x"]


# -- mismatches -----------------------------------------------------------------------------


def _mismatch(reqs: dict[int, Request], size: int | None = None) -> Response:
    table = CoordinatorTable(size if size is not None else len(reqs))
    for rank in sorted(reqs):
        table.add(rank, [reqs[rank]], now=0.0)
    (resp,) = table.pop_ready()
    return resp


@pytest.mark.parametrize(
    ("field", "values", "label", "shown"),
    [
        ("dtype", ("float32", "float64"), "dtype", ("float32", "float64")),
        ("shape", ((4,), (2, 2)), "shape", ("(4,)", "(2, 2)")),
        ("op", (int(ReduceOp.SUM), int(ReduceOp.MAX)), "reduce op", ("Sum", "Max")),
        ("prescale", (1.0, 0.5), "prescale_factor", ("1.0", "0.5")),
        ("postscale", (2.0, 1.0), "postscale_factor", ("2.0", "1.0")),
        ("device", ("cpu", "cuda"), "device", ("cpu", "cuda")),
    ],
)
def test_allreduce_mismatch_names_tensor_field_and_each_rank(
    field: str, values: tuple[object, object], label: str, shown: tuple[str, str]
) -> None:
    resp = _mismatch({0: allreduce("grad.w", **{field: values[0]}),
                      1: allreduce("grad.w", **{field: values[1]})})
    assert resp.name == "grad.w"
    assert resp.error.startswith(f"tensor 'grad.w': {label} differs across ranks: ")
    assert f"rank 0 sent {shown[0]}; rank 1 sent {shown[1]}" in resp.error
    assert resp.sizes == ()


def test_mismatch_groups_ranks_with_equal_values() -> None:
    reqs = {r: allreduce("t", dtype="float64" if r == 1 else "float32") for r in range(4)}
    resp = _mismatch(reqs)
    assert resp.error == ("tensor 't': dtype differs across ranks: ranks 0,2,3 sent float32; "
                          "rank 1 sent float64; cast to one dtype on every rank")


def test_root_mismatch() -> None:
    reqs = {r: Request("bc", Kind.BROADCAST, "int32", (3,), root=r % 2) for r in range(3)}
    resp = _mismatch(reqs)
    assert resp.error == ("tensor 'bc': root rank differs across ranks: ranks 0,2 sent 0; "
                          "rank 1 sent 1; pass the same root_rank on every rank")


def test_collective_kind_mismatch() -> None:
    resp = _mismatch({0: allreduce("k"),
                      1: Request("k", Kind.BROADCAST, "float32", (4,), root=0)})
    assert resp.error.startswith("tensor 'k': collective differs across ranks: ")
    assert "rank 0 sent allreduce; rank 1 sent broadcast" in resp.error


def test_broadcast_ignores_op_and_scale_but_checks_shape() -> None:
    same = {0: Request("b", Kind.BROADCAST, "int8", (2,), root=1, op=0),
            1: Request("b", Kind.BROADCAST, "int8", (2,), root=1, op=3, prescale=7.0)}
    assert mismatch_message("b", same) == ""
    other = {0: same[0], 1: replace(same[1], shape=(3,))}
    assert "shape differs across ranks: rank 0 sent (2,); rank 1 sent (3,)" in (
        mismatch_message("b", other))


def test_reducescatter_checks_op_and_shape() -> None:
    base = Request("rs", Kind.REDUCESCATTER, "float32", (4, 2), op=int(ReduceOp.SUM))
    assert "reduce op differs across ranks: rank 0 sent Sum; rank 1 sent Min" in (
        mismatch_message("rs", {0: base, 1: replace(base, op=int(ReduceOp.MIN))}))
    assert "shape differs" in mismatch_message("rs", {0: base, 1: replace(base, shape=(2, 4))})


def test_allgather_dim0_may_differ_trailing_dims_may_not() -> None:
    ok = {0: Request("g", Kind.ALLGATHER, "int64", (2, 3)),
          1: Request("g", Kind.ALLGATHER, "int64", (5, 3)),
          2: Request("g", Kind.ALLGATHER, "int64", (0, 3))}
    resp = _mismatch(ok)
    assert resp.error == ""
    assert resp.sizes == (2, 5, 0)
    bad = dict(ok)
    bad[1] = Request("g", Kind.ALLGATHER, "int64", (5, 4))
    resp = _mismatch(bad)
    assert resp.error.startswith("tensor 'g': shape after dim 0 differs across ranks: ")
    assert "ranks 0,2 sent (3,); rank 1 sent (4,)" in resp.error
    assert resp.sizes == ()
    rank_changed = dict(ok)
    rank_changed[2] = Request("g", Kind.ALLGATHER, "int64", (2,))
    assert "rank 2 sent ()" in _mismatch(rank_changed).error


def test_alltoall_sizes_flatten_split_vectors_in_rank_order() -> None:
    reqs = {0: Request("a2a", Kind.ALLTOALL, "float32", (3, 2), splits=(1, 2)),
            1: Request("a2a", Kind.ALLTOALL, "float32", (5, 2), splits=(5, 0))}
    resp = _mismatch(reqs)
    assert resp.error == ""
    assert resp.sizes == (1, 2, 5, 0)
    reqs[1] = replace(reqs[1], shape=(5, 3))
    assert "shape after dim 0 differs" in _mismatch(reqs).error


def test_group_size_mismatch() -> None:
    reqs = {0: allreduce("g.0", group="g", group_size=2),
            1: allreduce("g.0", group="g", group_size=3)}
    assert _mismatch(reqs).error == (
        "tensor 'g.0': grouped call sizes differ across ranks: rank 0 grouped 2 tensors; "
        "rank 1 grouped 3 tensors; pass the same number of tensors on every rank")


def test_build_response_copies_parameters() -> None:
    req = allreduce("p", op=int(ReduceOp.AVERAGE), prescale=0.5, postscale=3.0, group="G")
    resp = build_response("p", {0: req, 1: req}, 2, ())
    assert resp == Response("p", Kind.ALLREDUCE, "float32", (4,), "cpu", int(ReduceOp.AVERAGE),
                            -1, 0.5, 3.0, group="G")


# -- join -----------------------------------------------------------------------------------


def test_joined_rank_makes_other_ranks_tensors_ready() -> None:
    table = CoordinatorTable(3)
    table.add(0, [allreduce("a")], now=0.0)
    table.add(2, [allreduce("a")], now=0.0)
    assert table.pop_ready() == []
    table.add(1, [join()], now=1.0)
    assert table.joined() == (1,)
    (resp,) = table.pop_ready()
    assert (resp.name, resp.error, resp.joined) == ("a", "", (1,))
    # While rank 1 stays joined, two ranks are enough.
    table.add(2, [allreduce("b")], now=2.0)
    table.add(0, [allreduce("b")], now=2.0)
    (resp,) = table.pop_ready()
    assert (resp.name, resp.joined) == ("b", (1,))


def test_a_joined_rank_that_submits_again_does_not_make_a_tensor_ready_twice() -> None:
    """A rank whose join() wait was abandoned (an alarm, a test's timeout) stays joined and
    may submit again: a tensor the joined ranks already made ready must come out once, not
    once more for the joined rank's own request (the background thread raised a KeyError on
    the second, at 3 ranks)."""
    table = CoordinatorTable(3)
    table.add(1, [join()], now=0.0)
    table.add(2, [join()], now=0.0)
    table.add(0, [allreduce("x")], now=1.0)  # ranks 1 and 2 stand in: ready at once
    table.add(1, [allreduce("x")], now=1.0)  # rank 1, still joined, submits it too
    (resp,) = table.pop_ready()
    assert (resp.name, resp.error) == ("x", "")
    assert table.pop_ready() == []


def test_join_response_when_all_joined_then_joined_set_resets() -> None:
    table = CoordinatorTable(3)
    table.add(2, [join()], now=0.0)
    table.add(0, [join()], now=0.0)
    assert table.pop_ready() == []
    assert table.joined() == (2, 0)
    table.add(1, [join()], now=1.0)
    (resp,) = table.pop_ready()
    assert (resp.kind, resp.last_joined, resp.error, resp.joined) == (Kind.JOIN, 1, "", ())
    assert table.joined() == ()
    # Nobody is joined any more: one rank's tensor waits for the others again.
    table.add(0, [allreduce("after")], now=2.0)
    assert table.pop_ready() == []


def test_allgather_with_joined_rank_is_an_error() -> None:
    """As in Horovod, only allreduce runs while ranks have joined."""
    table = CoordinatorTable(3)
    table.add(1, [join()], now=0.0)
    table.add(0, [Request("ag", Kind.ALLGATHER, "int32", (3, 2))], now=0.0)
    table.add(2, [Request("ag", Kind.ALLGATHER, "int32", (5, 2))], now=0.0)
    (resp,) = table.pop_ready()
    assert resp.error.startswith("tensor 'ag': allgather cannot run while ranks [1] have "
                                 "joined; only allreduce can")
    assert resp.sizes == ()


def test_broadcast_from_joined_root_is_an_error() -> None:
    table = CoordinatorTable(2)
    table.add(1, [join()], now=0.0)
    table.add(0, [Request("bc", Kind.BROADCAST, "float32", (2,), root=1)], now=0.0)
    (resp,) = table.pop_ready()
    assert resp.error.startswith("tensor 'bc': broadcast cannot run while ranks [1] have "
                                 "joined")
    table.add(0, [Request("bc2", Kind.BROADCAST, "float32", (2,), root=0)], now=0.0)
    (resp,) = table.pop_ready()  # any root: Horovod refuses broadcast while ranks are joined
    assert resp.error.startswith("tensor 'bc2': broadcast cannot run while ranks [1]")


def test_alltoall_with_joined_rank_is_an_error() -> None:
    table = CoordinatorTable(3)
    table.add(2, [join()], now=0.0)
    for rank in (0, 1):
        table.add(rank, [Request("a2a", Kind.ALLTOALL, "int8", (3,), splits=(1, 1, 1))],
                  now=0.0)
    (resp,) = table.pop_ready()
    assert resp.error.startswith("tensor 'a2a': alltoall cannot run while ranks [2] have "
                                 "joined")
    assert resp.sizes == ()


# Regression: the JOIN used to be answered first and clear the joined set, so the tensor ran
# after it with joined=() and Average divided by the full size (rank 1: x=4 -> got 2).
def test_tensor_made_ready_by_the_last_join_runs_before_the_join() -> None:
    table = CoordinatorTable(2)
    table.add(1, [allreduce("x", op=int(ReduceOp.AVERAGE)), join()], now=0.0)
    table.add(0, [join()], now=1.0)
    out = table.pop_ready()
    assert names(out) == ["x", "join.noname.0"]
    assert out[0].joined == (0,)
    assert out[1].last_joined == 0


# -- grouped calls --------------------------------------------------------------------------


def _unit(name: str, shapes: tuple[tuple[int, ...], ...], dtype: Any = "float32") -> Request:
    return Request(name, Kind.ALLREDUCE, dtype, shapes, group=name, group_size=len(shapes))


def test_grouped_call_is_one_response_and_fails_whole_naming_the_member() -> None:
    table = CoordinatorTable(2)
    unit = _unit("g", ((4,), (2, 3), (1,)))
    table.add(0, [unit], now=0.0)
    table.add(1, [unit._replace(dtype=("float32", "float64", "float32"))], now=0.0)
    (resp,) = table.pop_ready()
    assert resp.name == "g" and resp.error.startswith(
        "tensor 'g' (member 1 of the grouped call): dtype differs across ranks: rank 0 sent "
        "float32; rank 1 sent float64")
    assert table.stalled(0.0, now=1.0) == []  # nothing of it is left waiting


def test_grouped_call_ready_once_every_rank_sent_it() -> None:
    table = CoordinatorTable(2)
    unit = _unit("g", ((4,), (2, 3)))
    table.add(0, [unit], now=0.0)
    assert table.pop_ready() == []
    table.add(1, [unit], now=0.0)
    (resp,) = table.pop_ready()
    assert (resp.name, resp.error, resp.shape) == ("g", "", ((4,), (2, 3)))


# -- stalls ---------------------------------------------------------------------------------


def test_stalled_reports_submitted_missing_and_wait() -> None:
    table = CoordinatorTable(4)
    table.add(0, [allreduce("old")], now=10.0)
    table.add(2, [allreduce("old"), Request("new", Kind.ALLGATHER, "int8", (2, 2))], now=15.0)
    table.add(3, [join()], now=16.0)
    assert table.stalled(11.0, now=20.0) == []
    reports = table.stalled(6.0, now=20.0)
    assert reports == [StallReport("old", "allreduce", "float32", (4,), (0, 2), (1,), 10.0)]
    assert [r.name for r in table.stalled(5.0, now=20.0)] == ["old", "new"]  # inclusive
    reports = table.stalled(0.0, now=20.0)
    assert [(r.name, r.submitted, r.missing, r.waited_s) for r in reports] == [
        ("old", (0, 2), (1,), 10.0),
        ("new", (2,), (0, 1), 5.0),
        ("join.noname.0", (3,), (0, 1, 2), 4.0),
    ]


# -- response cache -------------------------------------------------------------------------


def _resp(name: str, **kw: Any) -> Response:
    return replace(build_response(name, {0: allreduce(name)}, 1, ()), **kw)


def test_cache_capacity_zero_never_stores() -> None:
    cache = ResponseCache(0)
    cache.put(_resp("a"), allreduce("a"))
    assert len(cache) == 0
    assert cache.lookup(allreduce("a")) == (-1, False)
    assert cache.occupied() == []


def test_cache_tells_every_name_that_leaves() -> None:
    """``forget`` hears each name the cache lets go, with the request it was cached for:
    pushed out when full (least recently used), invalidated, never one that is replaced."""
    gone: list[tuple[str, Any]] = []
    cache = ResponseCache(2, lambda name, req: gone.append((name, req)))
    a, b, c = allreduce("a"), allreduce("b"), allreduce("c")
    cache.put(_resp("a"), a)
    cache.put(_resp("b"), b)
    cache.take(cache.lookup(a)[0])  # a used last: b is the oldest
    assert cache.put(_resp("c"), c) >= 0
    assert gone == [("b", b)]
    cache.put(_resp("c", shape=(5,)), replace(c, shape=(5,)))  # replaced: not gone
    assert gone == [("b", b)]
    cache.evict(cache.lookup(a)[0])
    assert gone == [("b", b), ("a", a)] and len(cache) == 1


def test_cache_put_lookup_match() -> None:
    cache = ResponseCache(4)
    req = allreduce("a")
    cache.put(_resp("a"), req)
    slot, same = cache.lookup(req)
    assert slot >= 0 and same
    assert cache.response(slot) == _resp("a")
    assert cache.lookup(replace(req, shape=(5,))) == (slot, False)
    assert cache.lookup(replace(req, op=int(ReduceOp.MIN))) == (slot, False)
    assert cache.lookup(allreduce("b")) == (-1, False)
    assert len(cache) == 1
    assert cache.occupied() == [slot]


def test_cache_none_request_never_matches() -> None:
    cache = ResponseCache(2)
    cache.put(_resp("a"), None)
    slot, same = cache.lookup(allreduce("a"))
    assert slot >= 0 and not same
    assert cache.response(slot).name == "a"


@pytest.mark.parametrize("resp", [
    _resp("err", error="tensor 'err': dtype differs"),
    _resp("j", kind=Kind.JOIN),
    _resp("bar", kind=Kind.BARRIER),
    _resp("jn", joined=(1,)),
])
def test_cache_refuses_uncacheable_responses(resp: Response) -> None:
    cache = ResponseCache(4)
    cache.put(resp, allreduce(resp.name))
    assert len(cache) == 0
    assert cache.lookup(allreduce(resp.name)) == (-1, False)


def test_cache_lru_eviction_respects_touch() -> None:
    cache = ResponseCache(3)
    for n in "abc":
        cache.put(_resp(n), allreduce(n))
    slot_a = cache.lookup(allreduce("a"))[0]
    cache.take(slot_a)  # a is now the most recently used: b is the oldest
    cache.put(_resp("d"), allreduce("d"))
    assert cache.lookup(allreduce("b")) == (-1, False)
    assert all(cache.lookup(allreduce(n))[1] for n in "acd")
    cache.put(_resp("e"), allreduce("e"))  # c is the oldest now
    assert cache.lookup(allreduce("c")) == (-1, False)
    assert sorted(cache.response(s).name for s in cache.occupied()) == ["a", "d", "e"]


def test_cache_reput_refreshes_recency_and_response() -> None:
    cache = ResponseCache(2)
    cache.put(_resp("a"), allreduce("a"))
    cache.put(_resp("b"), allreduce("b"))
    cache.put(_resp("a", shape=(8,)), allreduce("a", shape=(8,)))
    assert len(cache) == 2
    cache.put(_resp("c"), allreduce("c"))  # b is the oldest
    assert cache.lookup(allreduce("b")) == (-1, False)
    slot, same = cache.lookup(allreduce("a", shape=(8,)))
    assert same and cache.response(slot).shape == (8,)


def test_cache_evict_frees_the_slot() -> None:
    cache = ResponseCache(2)
    cache.put(_resp("a"), allreduce("a"))
    cache.put(_resp("b"), allreduce("b"))
    slot_a = cache.lookup(allreduce("a"))[0]
    cache.evict(slot_a)
    assert cache.lookup(allreduce("a")) == (-1, False)
    assert len(cache) == 1
    cache.evict(slot_a)  # evicting an empty slot is a no-op
    cache.put(_resp("c"), allreduce("c"))
    assert cache.lookup(allreduce("c")) == (slot_a, True)
    assert cache.lookup(allreduce("b"))[1]  # nothing else had to go


def _drive(cache: ResponseCache, model: OrderedDict[str, None], rng: random.Random) -> None:
    """One random put/touch/evict, applied to ``cache`` and to a plain LRU model."""
    action = rng.choice(["put", "put", "touch", "evict"])
    name = f"t{rng.randrange(12)}"
    if action == "put":
        cache.put(_resp(name), allreduce(name))
        model.pop(name, None)
        model[name] = None
        if len(model) > cache.capacity:
            model.popitem(last=False)
        return
    slot = cache.lookup(allreduce(name))[0]
    if slot < 0:
        return
    if action == "touch":
        cache.take(slot)
        model.move_to_end(name)
    else:
        cache.evict(slot)
        del model[name]


def test_cache_identical_sequences_give_identical_slots() -> None:
    caches = (ResponseCache(5), ResponseCache(5))
    models: tuple[OrderedDict[str, None], OrderedDict[str, None]] = (OrderedDict(), OrderedDict())
    for cache, model in zip(caches, models, strict=True):
        rng = random.Random(1234)
        for _ in range(400):
            _drive(cache, model, rng)
            assert sorted(cache.response(s).name for s in cache.occupied()) == sorted(model)
    slots = [{s: c.response(s).name for s in c.occupied()} for c in caches]
    assert slots[0] == slots[1]
    assert len(slots[0]) == 5


# -- wire form ------------------------------------------------------------------------------


REQUESTS = [
    allreduce("a", op=int(ReduceOp.AVERAGE), prescale=0.25, postscale=4.0, group="g",
              group_size=2),
    Request("b", Kind.ALLTOALL, "complex128", (6, 2, 1), "cuda", splits=(1, 2, 3)),
    Request("c", Kind.BROADCAST, "bool", (), root=3),
    Request("d", Kind.JOIN),
]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: r.name)
def test_request_round_trip(req: Request) -> None:
    packed = pack_request(req)
    assert type(packed) is tuple
    back = unpack_request(pickle.loads(pickle.dumps(packed)))
    assert back == req
    assert type(back.kind) is Kind


RESPONSES = [
    replace(_resp("a"), sizes=(1, 2, 3), group="g", joined=(2, 0)),
    Response("b", Kind.ALLGATHER, "int16", (3, 4), "cpu", 0, -1, 1.0, 1.0, sizes=(3, 0, 1),
             error="tensor 'b': oops"),
    Response("j", Kind.JOIN, "uint8", (), "cpu", 0, -1, 1.0, 1.0, last_joined=3),
]


@pytest.mark.parametrize("resp", RESPONSES, ids=lambda r: r.name)
def test_response_round_trip(resp: Response) -> None:
    back = unpack_response(pickle.loads(pickle.dumps(pack_response(resp))))
    assert back == resp
    assert type(back.kind) is Kind


def test_every_collective_is_one_spec_row() -> None:
    """The collective table covers every kind; the agreement-only rows carry their result."""
    from hvdlite._vocab.messages import SPECS

    assert set(SPECS) == set(Kind)
    assert {k for k, s in SPECS.items() if s.result is not None} == {Kind.BARRIER, Kind.JOIN}
    assert {k for k, s in SPECS.items() if s.reduces} == {Kind.ALLREDUCE, Kind.REDUCESCATTER}
    assert {k for k, s in SPECS.items() if s.fusable} == {Kind.ALLREDUCE}
    joined = replace(_resp("j"), kind=Kind.JOIN, last_joined=3)
    assert SPECS[Kind.JOIN].result(joined) == 3  # type: ignore[misc]
    assert SPECS[Kind.BARRIER].result(joined) is None  # type: ignore[misc]
    for spec in SPECS.values():  # every row names the fields the ranks must agree on
        assert spec.checks and spec.checks[0] == ("kind", "collective")
