"""Adasum on host tensors at 1, 2 and 4 ranks against a NumPy reference of the same tree:
float16/32/64, single tensors, fused buckets (per-tensor dot products), grouped calls, scale
factors, parallel and orthogonal vectors (Horovod's two properties), joined ranks, and the
errors: a set of a non-power-of-two size, integer tensors, other collectives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mpi_util import adasum_close, reference_adasum

DTYPES = ["float16", "float32", "float64"]


def _inputs(seed: int, n: int, shape: tuple[int, ...], dtype: str) -> list[np.ndarray]:
    return [np.random.default_rng([seed, r]).normal(size=shape).astype(dtype) for r in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_tensors_every_size(hvd: Any, dtype: str) -> None:
    r, n = hvd.rank(), hvd.size()
    for i, shape in enumerate([(1,), (7,), (3, 5), (1000,), (2, 3, 33)]):
        inputs = _inputs(10 + i, n, shape, dtype)
        got = hvd.allreduce(inputs[r], name=f"ada.{dtype}.{i}", op=hvd.Adasum)
        assert got.dtype == np.dtype(dtype) and got.shape == shape
        adasum_close(got, reference_adasum(inputs), dtype, f"{dtype} {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_bucket_keeps_per_tensor_dot_products(hvd: Any, dtype: str) -> None:
    """Many async calls fuse into one bucket (and one grouped call is one): each tensor's
    coefficients come from its own dot products, not the bucket's."""
    r, n = hvd.rank(), hvd.size()
    shapes = [(5,), (300,), (1,), (64, 3), (17,)]
    per = [_inputs(40 + i, n, s, dtype) for i, s in enumerate(shapes)]
    # Very different scales per tensor: bucket-wide dot products would be dominated by one.
    per = [[x * np.asarray(10.0 ** (i - 2), dtype) for x in p] for i, p in enumerate(per)]
    handles = [hvd.allreduce_async(p[r], name=f"fa.{dtype}.{i}", op=hvd.Adasum)
               for i, p in enumerate(per)]
    for i, (h, p) in enumerate(zip(handles, per, strict=True)):
        adasum_close(h.wait(), reference_adasum(p), dtype, f"async member {i}")
    got = hvd.grouped_allreduce([p[r] for p in per], name=f"ga.{dtype}", op=hvd.Adasum)
    for i, p in enumerate(per):
        adasum_close(got[i], reference_adasum(p), dtype, f"grouped member {i}")


def test_parallel_vectors_average_and_orthogonal_ones_add(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    base = np.random.default_rng(3).normal(size=4 * max(n, 2))
    scale = float(2.0 ** r)
    got = hvd.allreduce(base * scale, name="ada.parallel", op=hvd.Adasum)
    np.testing.assert_allclose(got, base * np.mean([2.0 ** q for q in range(n)]), rtol=1e-12)
    ortho = np.zeros(4 * n)
    ortho[4 * r:4 * r + 4] = r + 1.0
    got = hvd.allreduce(ortho, name="ada.ortho", op=hvd.Adasum)
    want = np.repeat(np.arange(1.0, n + 1), 4)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_scale_factors_and_in_place(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    inputs = _inputs(60, n, (50,), "float64")
    x = inputs[r].copy()
    assert hvd.allreduce_(x, name="ada.inplace", op=hvd.Adasum, prescale_factor=2.0,
                          postscale_factor=0.25) is x
    adasum_close(x, 0.25 * reference_adasum([2.0 * v for v in inputs]), "float64", "scaled")


def test_zero_vectors_are_neutral(hvd: Any) -> None:
    r, n = hvd.rank(), hvd.size()
    x = np.zeros(10) if r % 2 else np.full(10, float(r + 1))
    got = hvd.allreduce(x, name="ada.zeros", op=hvd.Adasum)
    inputs = [np.zeros(10) if q % 2 else np.full(10, float(q + 1)) for q in range(n)]
    adasum_close(got, reference_adasum(inputs), "float64", "zeros")


def test_errors(hvd: Any) -> None:
    n = hvd.size()
    with pytest.raises(TypeError, match=r"Adasum.*not defined for dtype int32"):
        hvd.allreduce(np.ones(3, np.int32), name="ada.int", op=hvd.Adasum)
    # Horovod's NotImplementedError (a RuntimeError), for every dtype (issue 26).
    for dtype in ("float64", "int32"):
        with pytest.raises(NotImplementedError, match="'ada.rs'.*Adasum.*allreduce only"):
            hvd.reducescatter(np.ones((n, 2), dtype), name="ada.rs", op=hvd.Adasum)
    if n == 4:
        ps = hvd.add_process_set([0, 1, 2])
        try:
            if hvd.rank() < 3:
                with pytest.raises(ValueError, match=r"'ada\.three'.*power-of-two.*has 3"):
                    hvd.allreduce(np.ones(2), name="ada.three", op=hvd.Adasum, process_set=ps)
        finally:
            hvd.remove_process_set(ps)
    got = hvd.allreduce(np.ones(2), name="ada.after", op=hvd.Sum)
    np.testing.assert_array_equal(got, np.full(2, float(n)))


def test_timeline_names_adasum_as_horovod(hvd: Any, restart: Any, tmp_path_factory: Any) -> None:
    """Horovod's request and response type for an Adasum allreduce is ADASUM: the timeline has
    NEGOTIATE_ADASUM, then an ADASUM span around the exchange (MPI_ADASUM_ALLREDUCE)."""
    import json
    from pathlib import Path

    from mpi4py import MPI

    base = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("ada")) if hvd.rank() == 0
                                else None)
    path = f"{base}/trace.{{rank}}.json"
    restart(timeline=path)
    hvd.allreduce(np.ones(8), name="ada.traced", op=hvd.Adasum)
    hvd.allreduce(np.ones(8), name="sum.traced", op=hvd.Sum)
    restart()
    events = json.loads(Path(path.format(rank=hvd.rank())).read_text(encoding="utf-8"))
    tracks = {e["tid"]: e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    begun = {(tracks.get(e["tid"]), e["name"]) for e in events if e.get("ph") == "B"}
    assert {("ada.traced", "NEGOTIATE_ADASUM"), ("ada.traced", "ADASUM"),
            ("ada.traced", "MPI_ADASUM_ALLREDUCE")} <= begun, sorted(begun)
    assert ("sum.traced", "NEGOTIATE_ALLREDUCE") in begun
