"""The steady state on the device: grouped calls as one unit, the caller-owned bucket layout
reduced in place with no copy kernel, recycled results that survive while held, and the
immediate path of a repeated blocking call; exact against every rank's inputs, in both
completion modes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from gpu_util import reinit  # noqa: E402
from mpi_util import all_inputs, make_input, reference_allreduce, seed_for  # noqa: E402

from hvdlite._engine import default_engine  # noqa: E402

SHAPES = [(3,), (64, 5), (1,), (7, 2), (1000,)]
MODES = {"sync": {}, "async": {"async_completion": True}}


@pytest.fixture(scope="module", params=list(MODES))
def mode(request: pytest.FixtureRequest, hvd: Any) -> Iterator[str]:
    with reinit(hvd, **MODES[request.param]):
        yield request.param


def _inputs(tag: str, step: int, rank: int) -> list[np.ndarray]:
    return [make_input(seed_for(tag, step, i), rank, s, "int32") for i, s in enumerate(SHAPES)]


def _wants(tag: str, step: int, size: int) -> list[np.ndarray]:
    return [reference_allreduce(all_inputs(seed_for(tag, step, i), size, s, "int32"), "Sum")
            for i, s in enumerate(SHAPES)]


def _check(got: list[Any], want: list[np.ndarray], what: str) -> None:
    cupy.cuda.get_current_stream().synchronize()
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(cupy.asnumpy(g), w, err_msg=f"{what} member {i}")


def _fused() -> Any:
    return default_engine().global_channel.backends["cuda"].fused


def test_bucket_views_reduced_in_place_without_a_copy(hvd: Any, mode: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    sizes = [int(np.prod(s)) for s in SHAPES]
    flat = cupy.empty(sum(sizes), cupy.int32)  # the caller-owned layout: views end to end
    views, offset = [], 0
    for s, n in zip(SHAPES, sizes, strict=True):
        views.append(flat[offset:offset + n].reshape(s))
        offset += n
    for step in range(4):
        for v, host in zip(views, _inputs("gss.v", step, rank), strict=True):
            v.set(host)
        if step == 1:
            before = _fused().copy_kernels  # from here on: replayed, in place
        got = hvd.grouped_allreduce_(views, name=f"gss.v.{mode}", op=hvd.Sum)
        assert all(g is v for g, v in zip(got, views, strict=True))
        _check(views, _wants("gss.v", step, size), f"step {step}")
    assert _fused().copy_kernels == before, "the bucket views were copied"


def test_grouped_results_recycled_only_once_released(hvd: Any, mode: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    grads = [cupy.asarray(a) for a in _inputs("gss.r", 0, rank)]
    held = []
    for step in range(5):
        for g, host in zip(grads, _inputs("gss.r", step, rank), strict=True):
            g.set(host)
        out = hvd.grouped_allreduce(grads, name=f"gss.r.{mode}", op=hvd.Sum)
        if step % 2 == 0:
            held.append((step, out))  # kept: must never be overwritten by later steps
    for step, out in held:
        _check(out, _wants("gss.r", step, size), f"held step {step}")


def test_repeated_blocking_allreduce(hvd: Any, mode: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    x = cupy.empty(6, cupy.int64)
    out = cupy.empty_like(x)
    for step in range(6):
        x.set(make_input(seed_for("gss.s", step), rank, (6,), "int64"))
        got = hvd.allreduce(x, name=f"gss.s.{mode}", op=hvd.Sum, out=out)
        assert got is out
        want = reference_allreduce(all_inputs(seed_for("gss.s", step), size, (6,), "int64"),
                                   "Sum")
        cupy.cuda.get_current_stream().synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(got), want, err_msg=f"step {step}")
