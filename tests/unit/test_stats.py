"""The Stats collector behind hvdlite.stats(): exact figures for known inputs."""

from __future__ import annotations

import math
import random
import threading

import pytest

from hvdlite._observe.stats import Stats, percentile


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    data = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(data, 50) == 50.0
    assert percentile(data, 99) == 99.0
    assert percentile(data, 100) == 100.0
    assert percentile(data, 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0


def test_empty_snapshot() -> None:
    snap = Stats().snapshot()
    assert snap["ops"] == {}
    assert snap["negotiation"] == {"count": 0, "total_s": 0.0, "max_s": 0.0, "mean_s": None}
    assert snap["fusion"]["buckets"] == 0 and snap["fusion"]["efficiency"] is None
    assert snap["cache"] == {"hits": 0, "misses": 0, "hit_rate": None}
    assert snap["elapsed_s"] >= 0


def test_ops_counts_bytes_and_latency_percentiles() -> None:
    rng = random.Random(1234)
    st = Stats()
    lat = {"allreduce": [rng.uniform(1e-5, 1e-2) for _ in range(300)],
           "allgather": [rng.uniform(1e-5, 1e-2) for _ in range(7)]}
    sizes = {op: [rng.randrange(1, 1 << 20) for _ in vals] for op, vals in lat.items()}
    for op in lat:
        for n, s in zip(sizes[op], lat[op], strict=True):
            st.record_op(op, n, s)
    ops = st.snapshot()["ops"]
    assert sorted(ops) == ["allgather", "allreduce"]
    for op, vals in lat.items():
        got = ops[op]
        assert got["count"] == len(vals)
        assert got["bytes"] == sum(sizes[op])
        assert got["latency_samples"] == len(vals)
        assert got["latency_p50_s"] == _nearest_rank(vals, 50)
        assert got["latency_p99_s"] == _nearest_rank(vals, 99)
        assert got["latency_total_s"] == pytest.approx(sum(vals))
        assert got["latency_mean_s"] == pytest.approx(sum(vals) / len(vals))


def test_latency_window_keeps_the_last_samples() -> None:
    st = Stats(window=10)
    for i in range(1, 26):  # 1..25; the window holds 16..25
        st.record_op("broadcast", 8, float(i))
    got = st.snapshot()["ops"]["broadcast"]
    assert got["count"] == 25 and got["bytes"] == 200
    assert got["latency_samples"] == 10
    assert got["latency_p50_s"] == 20.0  # nearest rank 5 of 16..25
    assert got["latency_p99_s"] == 25.0
    assert got["latency_mean_s"] == pytest.approx(13.0)  # the mean covers every sample


def test_negotiation_fusion_and_cache() -> None:
    st = Stats()
    for s in (0.5, 0.25, 1.25):
        st.record_negotiation(s)
    st.record_bucket(4, 48 << 20, 64 << 20)   # 75 % full
    st.record_bucket(1, 16 << 20, 64 << 20)   # 25 % full
    st.record_bucket(2, 100, 0)               # no buffer: counts as full
    st.record_cache(hits=6, misses=2)
    st.record_cache(hits=1, misses=1)
    snap = st.snapshot()
    assert snap["negotiation"] == {"count": 3, "total_s": 2.0, "max_s": 1.25,
                                   "mean_s": 2.0 / 3}
    fus = snap["fusion"]
    assert fus["buckets"] == 3 and fus["tensors"] == 7
    assert fus["payload_bytes"] == (64 << 20) + 100 and fus["buffer_bytes"] == 128 << 20
    assert fus["efficiency"] == ((64 << 20) + 100) / (128 << 20)
    assert fus["mean_fill"] == pytest.approx((0.75 + 0.25 + 1.0) / 3)
    assert fus["mean_tensors_per_bucket"] == pytest.approx(7 / 3)
    assert snap["cache"] == {"hits": 7, "misses": 3, "hit_rate": 0.7}


def test_reset_and_snapshot_is_a_copy() -> None:
    st = Stats()
    st.record_op("allreduce", 4, 1.0)
    snap = st.snapshot()
    st.record_op("allreduce", 4, 2.0)
    assert snap["ops"]["allreduce"]["count"] == 1
    st.reset()
    assert st.snapshot()["ops"] == {}


def test_concurrent_recording_loses_nothing() -> None:
    st = Stats(window=64)
    n_threads, per = 4, 2000

    def work(k: int) -> None:
        for i in range(per):
            st.record_op("allreduce", k + 1, 0.001)
            st.record_cache(1, 0)
            if i % 2:
                st.record_bucket(1, 10, 20)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = st.snapshot()
    assert snap["ops"]["allreduce"]["count"] == n_threads * per
    assert snap["ops"]["allreduce"]["bytes"] == per * sum(range(1, n_threads + 1))
    assert snap["ops"]["allreduce"]["latency_samples"] == 64
    assert snap["cache"]["hits"] == n_threads * per
    assert snap["fusion"]["buckets"] == n_threads * per // 2


def test_bad_window() -> None:
    with pytest.raises(ValueError, match="window"):
        Stats(window=0)
