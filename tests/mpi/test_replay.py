"""The steady state and its replay (``_vocab/plans.py``, ``_control/immediate.py``): exact
results while a step repeats, and whenever it stops repeating.

Each test runs a few identical steps (so the lanes, the cached responses and the plans are in
place), then changes one thing (a shape, an address, a tensor left out, a new name in the
middle of a step) and checks every result of every step against the NumPy reference of all
ranks' inputs. Results handed out earlier must survive later steps (they are recycled only
once nothing but hvdlite refers to them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi_util import all_inputs, assert_equal_result, make_input, reference_allreduce, seed_for

from hvdlite._engine import default_engine

SHAPES = [(3,), (4, 5), (1,), (7, 2)]


def _group(tag: str, step: int, rank: int, shapes: list[tuple[int, ...]],
           dtype: str = "int32") -> list[np.ndarray]:
    return [make_input(seed_for(tag, step, i), rank, s, dtype) for i, s in enumerate(shapes)]


def _want(tag: str, step: int, size: int, shapes: list[tuple[int, ...]],
          dtype: str = "int32", op: str = "Sum") -> list[np.ndarray]:
    return [reference_allreduce(all_inputs(seed_for(tag, step, i), size, s, dtype), op)
            for i, s in enumerate(shapes)]


def _check_group(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_equal_result(g, w, f"{what} member {i}")


def test_grouped_steps_with_a_changed_shape_address_and_member(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    # The same objects every step (a training loop's gradients), refilled in place.
    grads = _group("rp.g", 0, rank, SHAPES)
    kept = []
    for step in range(4):
        for g, fresh in zip(grads, _group("rp.g", step, rank, SHAPES), strict=True):
            g[...] = fresh
        got = hvd.grouped_allreduce(grads, name="rp.g", op=hvd.Sum)
        kept.append((step, got))  # results held across later steps must not change
    shapes = [(3,), (4, 6), (1,), (7, 2)]  # member 1 changes shape
    got = hvd.grouped_allreduce(_group("rp.g", 10, rank, shapes), name="rp.g", op=hvd.Sum)
    _check_group(got, _want("rp.g", 10, size, shapes), "changed shape")
    got = hvd.grouped_allreduce(_group("rp.g", 11, rank, shapes), name="rp.g", op=hvd.Sum)
    _check_group(got, _want("rp.g", 11, size, shapes), "new addresses")
    got = hvd.grouped_allreduce(_group("rp.g", 12, rank, shapes[:3]), name="rp.g", op=hvd.Sum)
    _check_group(got, _want("rp.g", 12, size, shapes[:3]), "a member left out")
    for step, old in kept:
        _check_group(old, _want("rp.g", step, size, SHAPES), f"kept step {step}")


def test_in_place_grouped_on_one_buffer_and_on_separate_tensors(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    sizes = [int(np.prod(s)) for s in SHAPES]
    flat = np.empty(sum(sizes), np.int64)  # the caller-owned bucket layout
    views, offset = [], 0
    for s, n in zip(SHAPES, sizes, strict=True):
        views.append(flat[offset:offset + n].reshape(s))
        offset += n
    apart = [np.empty(s, np.int64) for s in SHAPES]
    for step in range(3):
        for target in (views, apart):
            for v, fresh in zip(target, _group("rp.ip", step, rank, SHAPES, "int64"),
                                strict=True):
                v[...] = fresh
        got = hvd.grouped_allreduce_(views, name="rp.ip.views", op=hvd.Sum)
        assert all(g is v for g, v in zip(got, views, strict=True))
        _check_group(views, _want("rp.ip", step, size, SHAPES, "int64"), f"views step {step}")
        hvd.grouped_allreduce_(apart, name="rp.ip.apart", op=hvd.Sum)
        _check_group(apart, _want("rp.ip", step, size, SHAPES, "int64"), f"apart step {step}")


def test_single_tensor_steps_with_a_new_name_in_the_middle(hvd: Any) -> None:
    rank, size = hvd.rank(), hvd.size()
    x = make_input(seed_for("rp.s", 0), rank, (5,), "float64")
    held = []
    for step in range(6):
        x[...] = make_input(seed_for("rp.s", step), rank, (5,), "float64")
        if step == 3:  # a tensor this step never had, between two repeats
            extra = make_input(seed_for("rp.extra"), rank, (2, 2), "int32")
            got = hvd.allreduce(extra, name="rp.extra", op=hvd.Max)
            assert_equal_result(got, reference_allreduce(
                all_inputs(seed_for("rp.extra"), size, (2, 2), "int32"), "Max"))
        held.append((step, hvd.allreduce(x, name="rp.s", op=hvd.Average)))
    for step, got in held:  # each step's result is its own array, unchanged by later steps
        want = reference_allreduce(all_inputs(seed_for("rp.s", step), size, (5,), "float64"),
                                   "Average")
        assert_equal_result(got, want, f"step {step}")
    assert len({id(g) for _, g in held}) == len(held)


def test_result_arrays_are_reused_only_once_released(hvd: Any) -> None:
    """A result the caller dropped is filled again; one still held (or a view of it) never."""
    rank, size = hvd.rank(), hvd.size()
    x = make_input(seed_for("rp.r"), rank, (4,), "int32")
    want = reference_allreduce(all_inputs(seed_for("rp.r"), size, (4,), "int32"), "Sum")
    first = hvd.allreduce(x, name="rp.r", op=hvd.Sum)
    view = first[1:]  # keeps ``first`` busy though ``first`` itself is dropped below
    first_id = id(first)
    del first
    second = hvd.allreduce(x, name="rp.r", op=hvd.Sum)
    assert id(second) != first_id
    assert_equal_result(view, want[1:])
    del view, second
    third = hvd.allreduce(x, name="rp.r", op=hvd.Sum)
    fourth = hvd.allreduce(x, name="rp.r", op=hvd.Sum)
    assert third is not fourth
    for got in (third, fourth):
        assert_equal_result(got, want)


def test_blocking_and_async_forms_mix_across_ranks(hvd: Any) -> None:
    """Even ranks take the immediate path (blocking calls), odd ranks the general one
    (asynchronous calls, and a second tensor in flight): the same rounds pair up."""
    rank, size = hvd.rank(), hvd.size()
    for step in range(5):
        x = make_input(seed_for("rp.mix", step), rank, (6,), "int64")
        want = reference_allreduce(all_inputs(seed_for("rp.mix", step), size, (6,), "int64"),
                                   "Sum")
        if rank % 2 == 0:
            got = hvd.allreduce(x, name="rp.mix", op=hvd.Sum)
            other = hvd.allreduce(x, name="rp.mix2", op=hvd.Sum)
        else:
            h2 = hvd.allreduce_async(x, name="rp.mix2", op=hvd.Sum)
            got = hvd.allreduce_async(x, name="rp.mix", op=hvd.Sum).wait(timeout=20)
            other = h2.wait(timeout=20)
        assert_equal_result(got, want, f"step {step}")
        assert_equal_result(other, want, f"step {step} second tensor")


def test_grouped_call_is_one_request_and_one_bucket(hvd: Any) -> None:
    rank = hvd.rank()
    stats = default_engine().tracer.stats
    tensors = _group("rp.one", 0, rank, SHAPES * 10)
    hvd.grouped_allreduce(tensors, name="rp.one", op=hvd.Sum)  # negotiated in full once
    before = stats.snapshot()
    for _ in range(3):
        hvd.grouped_allreduce(tensors, name="rp.one", op=hvd.Sum)
    after = stats.snapshot()
    fusion = after["fusion"]["buckets"] - before["fusion"]["buckets"]
    tensors = after["fusion"]["tensors"] - before["fusion"]["tensors"]
    hits = after["cache"]["hits"] - before["cache"]["hits"]
    assert (fusion, tensors, hits) == (3, 3, 3)  # one bucket, one entry, one cache bit each


def test_blocking_calls_from_two_threads(hvd: Any) -> None:
    """Two threads per rank make repeated blocking calls of their own names (so each may take
    the immediate path, and the ranks' rounds disagree whenever the threads interleave
    differently): every result exact, no hang."""
    import threading

    rank, size = hvd.rank(), hvd.size()
    errors: list[BaseException] = []

    def worker(tag: str) -> None:
        try:
            for step in range(30):
                x = make_input(seed_for(tag, step), rank, (3,), "int32")
                got = hvd.allreduce(x, name=tag, op=hvd.Sum)
                want = reference_allreduce(
                    all_inputs(seed_for(tag, step), size, (3,), "int32"), "Sum")
                assert_equal_result(got, want, f"{tag} step {step}")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"rp.thread.{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
