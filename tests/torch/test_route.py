"""The per-call route of ``hvdlite.torch``'s allreduce: what it computes once and reuses
(the cached array view of each input tensor, the recycled result tensors and the counter made
once per result set, the grouped call without autograd), checked for exact results, for
invalidation when a tensor's memory changes, for results handed out again only once nothing
refers to them, and for tables that do not grow with steps or with distinct names.

Values are small integers or halves, so every expected result is exact at any rank count.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

import hvdlite._torchref as torchref
from hvdlite._engine import default_engine


def _total(hvd: Any, f: Any) -> float:
    return float(sum(f(r) for r in range(hvd.size())))


def _lane(name: str) -> Any:
    return default_engine().global_channel.lanes.get(name)


def _allocated() -> int:
    return default_engine().tracer.stats.steady["results_allocated"]


def test_repeated_calls_allocate_nothing_and_tables_stay_bounded(hvd: Any) -> None:
    me = hvd.rank()
    ts = [torch.full((3,), float(me + k)) for k in range(4)]
    want = [torch.full((3,), _total(hvd, lambda r, k=k: r + k)) for k in range(4)]

    def step() -> None:
        outs = [hvd.synchronize(hvd.allreduce_async(t, op=hvd.Sum, name=f"route.b{k}"))
                for k, t in enumerate(ts)]
        assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))

    for _ in range(3):
        step()
    # Earlier tests' tensors (compiled models hold cycles) must not leave the table while it
    # is watched: collect them now.
    gc.collect()
    views, made = len(torchref._views), _allocated()
    for _ in range(20):
        step()
    assert _allocated() == made  # every result tensor recycled
    assert len(torchref._views) == views
    # Distinct names on one tensor: its results live with the tensor, two sets at most.
    for i in range(50):
        out = hvd.allreduce(ts[0], op=hvd.Sum, name=f"route.many.{i}")
        assert torch.equal(out, want[0])
        del out
    ring = _lane("allreduce.route.many.49").ring
    assert ring is not None and len(ring.sets) <= 2
    assert len(torchref._views) == views


def test_a_result_is_handed_out_again_only_when_nobody_refers_to_it(hvd: Any) -> None:
    me = hvd.rank()
    t = torch.full((6,), float(me + 1))
    want = torch.full((6,), _total(hvd, lambda r: r + 1))
    first = hvd.allreduce(t, op=hvd.Sum, name="route.held")
    second = hvd.allreduce(t, op=hvd.Sum, name="route.held")  # first is held: a new one
    assert second.data_ptr() != first.data_ptr()
    ptr = second.data_ptr()
    del second
    third = hvd.allreduce(t, op=hvd.Sum, name="route.held")  # second was free again
    assert third.data_ptr() == ptr and torch.equal(third, want)
    part = third[2:4]  # a view holds the storage, not the tensor
    del third
    t.fill_(float(me + 5))
    fourth = hvd.allreduce(t, op=hvd.Sum, name="route.held")
    assert fourth.data_ptr() not in (ptr, first.data_ptr())
    assert torch.equal(part, torch.full((2,), _total(hvd, lambda r: r + 1)))
    assert torch.equal(fourth, torch.full((6,), _total(hvd, lambda r: r + 5)))
    assert torch.equal(first, want)


def test_a_result_whose_storage_was_replaced_is_never_reused(hvd: Any) -> None:
    me = hvd.rank()
    t = torch.full((4,), float(me + 1))
    hvd.allreduce(t, op=hvd.Sum, name="route.set")
    out = hvd.allreduce(t, op=hvd.Sum, name="route.set")  # the name's kept result
    out.set_(torch.full((4,), -7.0).untyped_storage(), 0, (4,))  # other memory behind it
    del out  # nothing refers to that tensor now: it must not be handed out again
    for k in range(3):
        t.fill_(float(me + k))
        got = hvd.allreduce(t, op=hvd.Sum, name="route.set")
        assert torch.equal(got, torch.full((4,), _total(hvd, lambda r, k=k: r + k)))
        del got


def test_grouped_call_reuses_its_results_and_follows_its_members_memory(hvd: Any) -> None:
    me = hvd.rank()
    shapes = [(2, 3), (5,), (1,), (4, 1)]
    ts = [torch.full(s, float(me + k)) for k, s in enumerate(shapes)]

    def check(outs: list[torch.Tensor], base: int) -> None:
        for k, (o, s) in enumerate(zip(outs, shapes, strict=True)):
            assert o.shape == s
            assert torch.equal(o, torch.full(s, _total(hvd, lambda r, k=k: r + k + base)))

    for _ in range(2):  # a name's first call keeps nothing; its second keeps its results
        outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="route.g")
        check(outs, 0)
    ids = [id(o) for o in outs]  # kept alive by the lane's result set
    ptrs = [o.data_ptr() for o in outs]
    del outs
    made = _allocated()
    for _ in range(5):
        outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="route.g")
        check(outs, 0)
        assert [id(o) for o in outs] == ids and [o.data_ptr() for o in outs] == ptrs
        del outs
    assert _allocated() == made
    # One member's memory replaced behind the same tensor object, another resized in place.
    ts[1].data = torch.full((5,), float(me + 1 + 10))
    ts[3].resize_(2, 2).fill_(float(me + 3))
    shapes[3] = (2, 2)
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="route.g")
    assert torch.equal(outs[1], torch.full((5,), _total(hvd, lambda r: r + 11)))
    assert torch.equal(outs[3], torch.full((2, 2), _total(hvd, lambda r: r + 3)))
    assert torch.equal(outs[0], torch.full((2, 3), _total(hvd, lambda r: r)))
    # A member of the results held: that set stays busy, the next call gets another.
    kept = outs[2]
    del outs
    for t in ts:
        t.fill_(float(me + 20))
    again = hvd.grouped_allreduce(ts, op=hvd.Sum, name="route.g")
    assert kept.data_ptr() not in [o.data_ptr() for o in again]
    assert torch.equal(kept, torch.full((1,), _total(hvd, lambda r: r + 2)))
    assert all(torch.equal(o, torch.full(o.shape, _total(hvd, lambda r: r + 20))) for o in again)


def test_differentiable_calls_leave_no_graph_on_recycled_results(hvd: Any) -> None:
    me = hvd.rank()
    n = hvd.size()
    x = torch.full((3,), float(me + 1), requires_grad=True)
    xs = [torch.full((2,), float(me + 1), requires_grad=True),
          torch.full((3,), float(me + 2), requires_grad=True)]
    for _ in range(3):
        y = hvd.allreduce(x, op=hvd.Sum, name="route.ag")
        y.mul_(2.0)  # the caller may write into a differentiable result
        y.sum().backward()
        ys = hvd.grouped_allreduce(xs, op=hvd.Sum, name="route.agg")
        sum(v.sum() for v in ys).backward()
        b = hvd.broadcast(x, 0, name="route.agb")
        b.sum().backward()
        del y, ys, b
        gc.collect()
    # Horovod's gradients: allreduce's is the allreduced gradient (Sum: n per element).
    # broadcast's: the average on the root, zero elsewhere.
    assert torch.equal(x.grad, torch.full((3,), 3.0 * (2.0 * n + (1.0 if me == 0 else 0.0))))
    assert all(torch.equal(v.grad, torch.full(v.shape, 3.0 * n)) for v in xs)
    with torch.no_grad():
        z = hvd.allreduce(x, op=hvd.Sum, name="route.ag")
        zs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="route.agg")
    w = hvd.synchronize(hvd.broadcast_async(x, 0, name="route.agb"))
    for out in (z, *zs, w):
        assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(z, torch.full((3,), _total(hvd, lambda r: r + 1)))
    assert torch.equal(w, torch.full((3,), 1.0))


def test_grouped_call_with_a_member_that_is_no_tensor_names_it(hvd: Any) -> None:
    import numpy as np
    import pytest

    t = torch.ones(2)
    with pytest.raises(TypeError, match="grouped_allreduce: expected a torch.Tensor, got ndarray"):
        hvd.grouped_allreduce([t, np.ones(2, np.float32)], name="route.bad")
    with pytest.raises(TypeError, match="non-empty list of torch.Tensor"):
        hvd.grouped_allreduce([], name="route.bad")
    with pytest.raises(TypeError, match="sparse"):
        hvd.grouped_allreduce_async([t, torch.ones(2).to_sparse()], name="route.bad")
