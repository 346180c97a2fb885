"""hvdlite.torch on process sets: every collective on a set, exact against references built from
the members' inputs; DistributedOptimizer on a set (members equal one process training on the
members' concatenated batch, non-members train alone); add/remove; non-member errors.

Runs in the 2-rank torch job (sets [1] and [0]) and alone in a 4-rank job (sets [1, 3] and
[0, 2]: a set of 2 of 4 ranks that does not hold rank 0). The module restarts hvdlite.torch with
both sets registered at init and dynamic process sets on, and restarts it plainly at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch_util import make, reduce_ref

OPS = ["Sum", "Average", "Min", "Max", "Product"]
STEPS = 20
BATCH = 8


@pytest.fixture(scope="module")
def sets(hvd: Any) -> Iterator[tuple[Any, Any]]:
    """(odds, evens): registered at init as ids 1 and 2, built from unsorted rank lists."""
    n = hvd.size()
    if n < 2:
        pytest.skip("process sets other than the global one need 2 ranks")
    odds = hvd.ProcessSet(sorted(range(1, n, 2), reverse=True))
    evens = hvd.ProcessSet(sorted(range(0, n, 2), reverse=True))
    hvd.shutdown()
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    try:
        hvd.init(process_sets=[odds, evens])
    finally:
        del os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"]
    yield odds, evens
    hvd.shutdown()
    hvd.init()


def _mine(hvd: Any, sets: tuple[Any, Any]) -> tuple[Any, Any]:
    """(this rank's set, the other set)."""
    odds, evens = sets
    return (odds, evens) if hvd.rank() % 2 else (evens, odds)


def test_objects_follow_horovod(hvd: Any, sets: tuple[Any, Any]) -> None:
    from mpi4py import MPI

    import hvdlite

    n, me = hvd.size(), hvd.rank()
    odds, evens = sets
    assert odds.ranks == list(range(1, n, 2)) and evens.ranks == list(range(0, n, 2))  # sorted
    assert (odds.process_set_id, evens.process_set_id) == (1, 2)
    mine, other = _mine(hvd, sets)
    assert mine.included() and not other.included()
    assert mine.rank() == mine.ranks.index(me) and mine.size() == len(mine.ranks)
    assert other.size() == len(other.ranks)
    with pytest.raises(ValueError, match="not part of"):
        other.rank()
    gps = hvd.global_process_set
    assert isinstance(gps, hvd.ProcessSet) and isinstance(odds, hvdlite.ProcessSet)
    assert (gps.process_set_id, gps.ranks, gps.size(), gps.rank()) == (0, list(range(n)), n, me)
    fresh = hvd.ProcessSet([0])
    assert fresh.process_set_id is None and fresh.size() is None and fresh.rank() is None
    assert "process_set_id=None" in str(fresh)
    with pytest.raises(ValueError):
        hvd.ProcessSet(["a"])
    with pytest.raises(ValueError):
        hvd.ProcessSet([1, 1])
    by_comm = hvd.ProcessSet(MPI.COMM_WORLD)
    assert by_comm.mpi_comm is MPI.COMM_WORLD and by_comm.ranks == list(range(n))
    # init() while running: sets are matched to the registered ones; bad lists are refused.
    again = hvd.ProcessSet(list(odds.ranks))
    hvd.init(process_sets=[again])
    assert again.process_set_id == odds.process_set_id
    with pytest.raises(ValueError, match="duplicate"):
        hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet([0])])
    with pytest.raises(ValueError):
        hvd.init(process_sets="static")
    with pytest.raises(TypeError):
        hvd.init(process_sets=[[0]])


def test_allreduce_every_form_on_a_set(hvd: Any, sets: tuple[Any, Any]) -> None:
    me = hvd.rank()
    ps, _ = _mine(hvd, sets)
    members = ps.ranks
    for d, dtype in enumerate((torch.int32, torch.float16, torch.bfloat16, torch.float64)):
        for o, op in enumerate(OPS):
            ins = {r: make(100 + 10 * d + o, r, (5,), dtype) for r in members}
            got = hvd.allreduce(ins[me], op=getattr(hvd, op), process_set=ps)
            assert torch.equal(got, reduce_ref([ins[r] for r in members], op)), (dtype, op)
    ins = {r: make(150, r, (3, 2), torch.float32) for r in members}
    want = reduce_ref([ins[r] for r in members], "Average", 0.5, 3.0)
    assert torch.equal(hvd.allreduce(ins[me], prescale_factor=0.5, postscale_factor=3.0,
                                     process_set=ps), want)
    avg = reduce_ref([ins[r] for r in members], "Average")  # divides by the set's size
    assert torch.equal(hvd.synchronize(hvd.allreduce_async(ins[me], process_set=ps)), avg)
    t = ins[me].clone()
    assert hvd.allreduce_(t, process_set=ps) is t and torch.equal(t, avg)
    t = ins[me].clone()
    hvd.synchronize(hvd.allreduce_async_(t, name="ps.ar_", process_set=ps))
    assert torch.equal(t, avg)
    more = {r: make(151, r, (4,), torch.float64) for r in members}
    want2 = [avg, reduce_ref([more[r] for r in members], "Average")]
    assert all(torch.equal(a, b) for a, b in zip(
        hvd.grouped_allreduce([ins[me], more[me]], process_set=ps), want2, strict=True))
    got = hvd.synchronize(hvd.grouped_allreduce_async([ins[me], more[me]], process_set=ps))
    assert all(torch.equal(a, b) for a, b in zip(got, want2, strict=True))
    ts = [ins[me].clone(), more[me].clone()]
    hvd.grouped_allreduce_(ts, process_set=ps)
    assert all(torch.equal(a, b) for a, b in zip(ts, want2, strict=True))
    ts = [ins[me].clone(), more[me].clone()]
    hvd.synchronize(hvd.grouped_allreduce_async_(ts, process_set=ps))
    assert all(torch.equal(a, b) for a, b in zip(ts, want2, strict=True))


def test_allgather_broadcast_alltoall_reducescatter_on_a_set(hvd: Any,
                                                            sets: tuple[Any, Any]) -> None:
    me = hvd.rank()
    ps, _ = _mine(hvd, sets)
    members, k, m = ps.ranks, ps.rank(), ps.size()
    # allgather: set-rank order, uneven dim 0, bfloat16 included
    for dtype in (torch.int64, torch.bfloat16):
        ins = {r: make(200, r, (i + 1, 2), dtype) for i, r in enumerate(members)}
        want = torch.cat([ins[r] for r in members])
        assert torch.equal(hvd.allgather(ins[me], process_set=ps), want)
        assert torch.equal(hvd.synchronize(hvd.allgather_async(ins[me], process_set=ps)), want)
        got = hvd.grouped_allgather([ins[me], ins[me][:1]], process_set=ps)
        assert torch.equal(got[0], want)
        assert torch.equal(got[1], torch.cat([ins[r][:1] for r in members]))
        got = hvd.synchronize(hvd.grouped_allgather_async([ins[me]], process_set=ps))
        assert torch.equal(got[0], want)
    # broadcast: roots are global ranks of the set
    for root in members:
        ins = {r: make(210 + root, r, (4,), torch.float32) for r in members}
        assert torch.equal(hvd.broadcast(ins[me], root, process_set=ps), ins[root])
        assert torch.equal(hvd.synchronize(hvd.broadcast_async(ins[me], root, process_set=ps)),
                           ins[root])
        t = ins[me].clone()
        assert hvd.broadcast_(t, root, process_set=ps) is t and torch.equal(t, ins[root])
        t = ins[me].clone()
        hvd.synchronize(hvd.broadcast_async_(t, root, process_set=ps))
        assert torch.equal(t, ins[root])
    # alltoall with splits of the set's size: member i sends i + j + 1 rows to member j
    splits = {i: [i + j + 1 for j in range(m)] for i in range(m)}
    ins = {r: make(220, r, (sum(splits[i]), 3), torch.float32) for i, r in enumerate(members)}
    parts = [ins[r][sum(splits[i][:k]):sum(splits[i][:k + 1])] for i, r in enumerate(members)]
    out, recv = hvd.alltoall(ins[me], torch.tensor(splits[k], dtype=torch.int32), process_set=ps)
    assert torch.equal(out, torch.cat(parts))
    assert recv.tolist() == [splits[i][k] for i in range(m)]
    even = {r: make(221, r, (2 * m, 1), torch.int32) for r in members}
    want = torch.cat([even[r][2 * k:2 * k + 2] for r in members])
    assert torch.equal(hvd.alltoall(even[me], process_set=ps), want)
    out, recv = hvd.synchronize(hvd.alltoall_async(even[me], process_set=ps))
    assert torch.equal(out, want) and recv.tolist() == [2] * m
    # reducescatter: 2m + 1 rows, the set's first member gets one more
    rows = [3 if i == 0 else 2 for i in range(m)]
    start = sum(rows[:k])
    for op in ("Sum", "Average"):
        ins = {r: make(230, r, (2 * m + 1, 2), torch.float64) for r in members}
        full = reduce_ref([ins[r] for r in members], op)
        want = full[start:start + rows[k]]
        got = hvd.reducescatter(ins[me], op=getattr(hvd, op), process_set=ps)
        assert torch.equal(got, want), op
        got = hvd.synchronize(hvd.reducescatter_async(ins[me], op=getattr(hvd, op),
                                                      process_set=ps))
        assert torch.equal(got, want), op
        got = hvd.grouped_reducescatter([ins[me]], op=getattr(hvd, op), process_set=ps)
        assert torch.equal(got[0], want), op
        got = hvd.synchronize(hvd.grouped_reducescatter_async([ins[me]], op=getattr(hvd, op),
                                                              process_set=ps))
        assert torch.equal(got[0], want), op


def test_sparse_barrier_objects_and_state_on_a_set(hvd: Any, sets: tuple[Any, Any]) -> None:
    me = hvd.rank()
    ps, _ = _mine(hvd, sets)
    members = ps.ranks
    dense = {r: make(300, r, (6, 2), torch.float32) * (make(301, r, (6, 1), torch.int64) > 0)
             for r in members}
    got = hvd.sparse_allreduce_async(dense[me].to_sparse(), "ps.sparse", hvd.Average,
                                     process_set=ps)()
    assert torch.allclose(got.to_dense(), sum(dense[r] for r in members) / len(members))
    hvd.barrier(process_set=ps)
    root = members[-1]
    assert hvd.broadcast_object({"from": me}, root, process_set=ps) == {"from": root}
    assert hvd.allgather_object(("r", me), process_set=ps) == [("r", r) for r in members]
    torch.manual_seed(1000 + me)  # a different model and optimizer state on every rank
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (me + 1))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=root, process_set=ps)
    hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=ps)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = [opt.param_groups[0]["lr"]] + [
        v.clone() if isinstance(v, torch.Tensor) else v
        for p in model.parameters() for v in opt.state[p].values()]
    gathered = hvd.allgather_object((flat, state), process_set=ps)
    for f, s in gathered:
        assert torch.equal(f, gathered[-1][0])
        assert len(s) == len(state) and s[0] == 0.01 * (root + 1)
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(s, gathered[-1][1], strict=True))


def test_autograd_on_a_set(hvd: Any, sets: tuple[Any, Any]) -> None:
    me = hvd.rank()
    ps, _ = _mine(hvd, sets)
    members, k, m = ps.ranks, ps.rank(), ps.size()
    x = make(400, me, (3,), torch.float64).requires_grad_()
    hvd.allreduce(x, op=hvd.Sum, process_set=ps).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float(m), dtype=torch.float64))
    # allgather: the averaged gradient, this rank's rows at its place in the set
    x = make(401, me, (k + 1, 2), torch.float64).requires_grad_()
    rows = m * (m + 1) // 2
    gs = {r: make(402, r, (rows, 2), torch.float64) for r in members}
    (hvd.allgather(x, process_set=ps) * gs[me]).sum().backward()
    start = k * (k + 1) // 2
    assert torch.allclose(x.grad, (sum(gs[r] for r in members) / m)[start:start + k + 1])
    x = make(403, me, (4,), torch.float64).requires_grad_()
    hvd.broadcast(x, members[0], process_set=ps).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 1.0 if me == members[0] else 0.0,
                                          dtype=torch.float64))
    x = make(404, me, (2 * m, 3), torch.float64).requires_grad_()
    hvd.reducescatter(x, op=hvd.Sum, process_set=ps).sum().backward()
    assert torch.equal(x.grad, torch.full((2 * m, 3), float(m), dtype=torch.float64))
    x = make(405, me, (2 * m, 1), torch.float64).requires_grad_()
    hvd.alltoall(x, process_set=ps).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_non_members_get_value_errors(hvd: Any, sets: tuple[Any, Any]) -> None:
    me = hvd.rank()
    _, other = _mine(hvd, sets)
    t = torch.ones(2 * other.size(), 1)
    root = other.ranks[0]
    model = nn.Linear(2, 1)
    calls = {
        "allreduce": lambda: hvd.allreduce(t, process_set=other),
        "allreduce_async": lambda: hvd.allreduce_async(t, process_set=other),
        "allreduce_": lambda: hvd.allreduce_(t, process_set=other),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([t], process_set=other),
        "grouped_allreduce_async_": lambda: hvd.grouped_allreduce_async_([t], process_set=other),
        "allgather": lambda: hvd.allgather(t, process_set=other),
        "grouped_allgather": lambda: hvd.grouped_allgather([t], process_set=other),
        "broadcast": lambda: hvd.broadcast(t, root, process_set=other),
        "broadcast_async_": lambda: hvd.broadcast_async_(t, root, process_set=other),
        "alltoall": lambda: hvd.alltoall(t, process_set=other),
        "reducescatter": lambda: hvd.reducescatter(t, process_set=other),
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter([t], process_set=other),
        "sparse_allreduce_async": lambda: hvd.sparse_allreduce_async(
            t.to_sparse(), "ps.sp", hvd.Sum, process_set=other),
        "barrier": lambda: hvd.barrier(process_set=other),
        "broadcast_object": lambda: hvd.broadcast_object(1, root, process_set=other),
        "allgather_object": lambda: hvd.allgather_object(1, process_set=other),
        "broadcast_parameters": lambda: hvd.broadcast_parameters(model.state_dict(), root,
                                                                 process_set=other),
        "broadcast_optimizer_state": lambda: hvd.broadcast_optimizer_state(
            torch.optim.SGD(model.parameters(), lr=0.1), root, process_set=other),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match="not a member") as info:
            call()
        assert isinstance(info.value, hvd.InvalidArgumentError), what
    assert torch.equal(t, torch.ones_like(t))  # the in-place forms left it alone
    mine, _ = _mine(hvd, sets)
    with pytest.raises(ValueError, match="one of the process set's ranks"):
        hvd.broadcast(t, root, process_set=mine)  # a root outside the set
    with pytest.raises(ValueError, match="not been registered"):
        hvd.allreduce(t, process_set=hvd.ProcessSet([me]))
    with pytest.raises(TypeError):
        hvd.allreduce(t, process_set=[me])
    # the engine goes on: the global set and the rank's own set still work
    n = hvd.size()
    assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(n)))
    assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=mine),
                       torch.full((1,), float(mine.size())))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 7919 + micro * 131 + rank)
    x = torch.randn(BATCH, 6, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)


def _reference(ranks: list[int], passes: int) -> torch.Tensor:
    """One process training on the concatenated batch of ``ranks``."""
    model = _model()
    opt = _sgd(model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            xs, ys = zip(*[_batch(step, micro, r) for r in ranks], strict=True)
            nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return _flat(model)


@pytest.mark.parametrize("case", ["odds", "odds-groups", "both-sets-passes-2"])
def test_optimizer_on_a_set(hvd: Any, sets: tuple[Any, Any], case: str) -> None:
    """With ``odds`` (2 of 4 ranks at 4 ranks): its members end identical and equal to one
    process on their concatenated batch; the other ranks train alone, untouched by the set.
    With both sets at once, each set trains on its own."""
    me = hvd.rank()
    ps = _mine(hvd, sets)[0] if case.startswith("both") else sets[0]
    passes = 2 if case.endswith("passes-2") else 1
    kwargs: dict[str, Any] = {"groups": 2} if case.endswith("groups") else {}
    model = _model()
    if ps.included() and me != ps.ranks[-1]:  # made equal again by the broadcast below
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, process_set=ps, **kwargs)
    if ps.included():
        hvd.broadcast_parameters(model.state_dict(), root_rank=ps.ranks[-1], process_set=ps)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            x, y = _batch(step, micro, me)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    got = _flat(model)
    if ps.included():
        gathered = hvd.allgather(got.unsqueeze(0), process_set=ps)
        assert all(torch.equal(row, gathered[0]) for row in gathered)
        expect = _reference(ps.ranks, passes)
    else:
        expect = _reference([me], passes)
    assert torch.allclose(got, expect, atol=1e-5, rtol=1e-5), (got - expect).abs().max()


def test_add_and_remove(hvd: Any, sets: tuple[Any, Any]) -> None:
    """Last in the module: removes ``odds``."""
    n, me = hvd.size(), hvd.rank()
    odds, _ = sets
    ranks = list(odds.ranks)
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(list(reversed(ranks)))  # the same ranks as odds
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(range(n))  # the global set
    assert hvd.remove_process_set(hvd.global_process_set) is False
    assert hvd.remove_process_set(hvd.ProcessSet([0])) is False  # never registered
    assert hvd.remove_process_set(odds) is True
    assert odds.process_set_id is None and odds.size() is None
    assert hvd.remove_process_set(odds) is False
    if me in ranks:
        with pytest.raises(ValueError, match="not been registered"):
            hvd.allreduce(torch.ones(1), process_set=odds)
    back = hvd.add_process_set(list(reversed(ranks)))
    assert isinstance(back, hvd.ProcessSet) and back.ranks == ranks
    assert back.process_set_id == 3 and back.size() == len(ranks)
    if me in ranks:
        got = hvd.allreduce(torch.full((2,), float(me)), op=hvd.Sum, process_set=back)
        assert torch.equal(got, torch.full((2,), float(sum(ranks))))
    if n > 2:  # a set that straddles odds and evens (at an odd size, [0, n - 1] is evens)
        pair = [n - 1, 0] if n % 2 == 0 else [n - 1, 1]
        ends = hvd.add_process_set(hvd.ProcessSet(pair))
        assert ends.process_set_id == 4 and ends.ranks == sorted(pair)
        if ends.included():
            got = hvd.allgather(torch.tensor([me]), process_set=ends)
            assert got.tolist() == sorted(pair)
        assert hvd.remove_process_set(ends)
    assert hvd.remove_process_set(back) and back.process_set_id is None
