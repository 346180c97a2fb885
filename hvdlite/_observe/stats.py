"""Running statistics behind ``hvdlite.stats()``: cheap enough to leave on.

Every ``record_*`` call takes one lock and updates a few integers; latencies go into a
fixed-size ring per op (the last ``window`` samples), from which ``snapshot`` computes
percentiles by the nearest-rank method. No numpy on the hot path.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

__all__ = ["Stats", "percentile"]


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least ``q`` % of values <= it."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class _OpStats:
    __slots__ = ("count", "nbytes", "total_s", "ring", "pos")

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0
        self.total_s = 0.0
        self.ring: list[float] = []
        self.pos = 0


# How calls met the steady state (see docs/architecture.md, "The steady state"): calls that
# repeated their lane, calls that did not, calls that ran on the immediate path, result sets
# newly allocated (the rest were recycled). Plain increments under the GIL: counts, not locks.
_STEADY = ("lane_hits", "lane_misses", "immediate", "results_allocated")


class Stats:
    """Thread-safe counters the engine feeds; ``snapshot()`` returns a plain dict."""

    def __init__(self, window: int = 4096) -> None:
        if window < 1:
            raise ValueError(f"stats window must be >= 1, got {window}")
        self.window = window
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded so far."""
        with self._lock:
            self._ops: dict[str, _OpStats] = {}
            self._neg_count = 0
            self._neg_total = 0.0
            self._neg_max = 0.0
            self._buckets = 0
            self._bucket_tensors = 0
            self._payload = 0
            self._buffer = 0
            self._fill_sum = 0.0
            self._hits = 0
            self._misses = 0
            self.steady: dict[str, int] = dict.fromkeys(_STEADY, 0)
            self._captures = 0
            self._replays = 0
            self._since = time.monotonic()

    def record_op(self, op: str, nbytes: int, latency_s: float) -> None:
        """One finished collective: its op name, payload bytes and submit-to-done latency."""
        self.record_ops(op, [(nbytes, latency_s)])

    def record_ops(self, op: str, done: list[tuple[int, float]]) -> None:
        """Several finished collectives of one op: ``(payload bytes, latency)`` each."""
        with self._lock:
            st = self._ops.get(op)
            if st is None:
                st = self._ops[op] = _OpStats()
            for nbytes, latency_s in done:
                st.count += 1
                st.nbytes += nbytes
                st.total_s += latency_s
                if len(st.ring) < self.window:
                    st.ring.append(latency_s)
                else:
                    st.ring[st.pos] = latency_s
                    st.pos = (st.pos + 1) % self.window

    # The three below are called only by the thread that holds the engine's cycle lock (one
    # writer at a time), so they skip this object's lock: a snapshot taken meanwhile may see
    # one round's figures half recorded, never lose them.
    def record_negotiation(self, seconds: float) -> None:
        """Time one tensor (or one round) spent in negotiation."""
        self._neg_count += 1
        self._neg_total += seconds
        if seconds > self._neg_max:
            self._neg_max = seconds

    def record_bucket(self, n_tensors: int, payload_bytes: int, buffer_bytes: int) -> None:
        """One executed bucket: tensors in it, their bytes, and the buffer size they could fill
        (the fusion threshold, or the bucket's own size when it went unfused)."""
        self._buckets += 1
        self._bucket_tensors += n_tensors
        self._payload += payload_bytes
        self._buffer += buffer_bytes
        self._fill_sum += payload_bytes / buffer_bytes if buffer_bytes > 0 else 1.0

    def record_cache(self, hits: int, misses: int) -> None:
        """Response-cache outcomes of one negotiation round."""
        if hits or misses:
            self._hits += hits
            self._misses += misses

    def record_capture(self) -> None:
        """One training step captured as a CUDA graph."""
        with self._lock:
            self._captures += 1

    def record_replay(self) -> None:
        """One replay of a captured step (the replaying thread; no lock: one writer)."""
        self._replays += 1

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of every figure (percentiles over the last ``window`` samples)."""
        with self._lock:
            ops = {name: (st.count, st.nbytes, st.total_s, list(st.ring))
                   for name, st in self._ops.items()}
            neg = (self._neg_count, self._neg_total, self._neg_max)
            fusion = (self._buckets, self._bucket_tensors, self._payload, self._buffer,
                      self._fill_sum)
            hits, misses, since = self._hits, self._misses, self._since
            steady = dict(self.steady)
            graphs = {"captures": self._captures, "replays": self._replays}
        return {
            "elapsed_s": time.monotonic() - since,
            "ops": {name: _op_summary(*vals) for name, vals in sorted(ops.items())},
            "negotiation": {"count": neg[0], "total_s": neg[1], "max_s": neg[2],
                            "mean_s": neg[1] / neg[0] if neg[0] else None},
            "fusion": _fusion_summary(*fusion),
            "cache": {"hits": hits, "misses": misses,
                      "hit_rate": hits / (hits + misses) if hits + misses else None},
            "steady_state": steady,
            "graphs": graphs,
        }


def _op_summary(count: int, nbytes: int, total_s: float, ring: list[float]) -> dict[str, Any]:
    ring.sort()
    return {"count": count, "bytes": nbytes, "latency_total_s": total_s,
            "latency_mean_s": total_s / count if count else None,
            "latency_p50_s": percentile(ring, 50), "latency_p99_s": percentile(ring, 99),
            "latency_samples": len(ring)}


def _fusion_summary(buckets: int, tensors: int, payload: int, buffer: int,
                    fill_sum: float) -> dict[str, Any]:
    return {"buckets": buckets, "tensors": tensors, "payload_bytes": payload,
            "buffer_bytes": buffer,
            "efficiency": payload / buffer if buffer else None,
            "mean_fill": fill_sum / buckets if buckets else None,
            "mean_tensors_per_bucket": tensors / buckets if buckets else None}
