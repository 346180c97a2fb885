"""hvdlite's cost model for control rounds and small collectives, 8 to 1,024 ranks.

The model and its terms are explained in docs/architecture.md ("Cost at scale"). In short,
MPICH runs hvdlite's small collectives as binomial or recursive-doubling trees: ``ceil(log2
P)`` steps. With ranks placed host by host (``ppn`` per host), the first ``log2(ppn)`` steps
stay inside a host (shared memory: ``alpha_shm``, ``beta_shm``) and the rest cross the network
(``alpha_net``, ``beta_net``). On top of MPI, hvdlite pays Python time: ``c_call`` per blocking
call, ``c_tensor`` per tensor of a cached step, and ``c_req`` per request the coordinator (rank
0) decodes and matches in an uncached round (it gets every rank's requests: P x N of them);
and ``w_net`` per collective that crosses hosts (its waits are polled, with naps).

- cached step, N tensors fused into one bucket: one BAND allreduce of the cache's bit vector
  (8 x ``words`` bytes) + one allreduce of the fused data (4N bytes) + N x ``c_tensor``.
- uncached round: the bit-vector allreduce, a gather of the request sizes and an ``Igatherv``
  of the pickled requests to rank 0 (``r`` bytes each), a broadcast of the response size and of
  the pickled responses (``r`` bytes each), rank 0's P x N x ``c_req``, then the data.

Importing this module has no side effects. scripts/bench_multihost.py calibrates the constants
on a measured run and prints the predictions beside the measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Constants", "Prediction", "c6_latency", "cached_step", "table", "uncached_round"]


@dataclass(frozen=True)
class Constants:
    """Per-message latency (s), per-byte time (s/B) by link class, and hvdlite's Python costs
    (s). ``w_net``: what a collective that crosses hosts costs hvdlite beyond the wire (its
    waits are polled with naps, and the peer's answer comes later); ``words``: uint64 words of
    the cache's bit vector; ``r``: bytes of one pickled request or response."""

    alpha_shm: float
    beta_shm: float
    alpha_net: float
    beta_net: float
    c_call: float
    c_tensor: float
    c_req: float
    w_net: float = 0.0  # per collective that crosses hosts: the polled wait's extra
    words: int = 17
    r: int = 90


@dataclass(frozen=True)
class Prediction:
    seconds: float
    messages_per_rank: int  # sent by a non-root rank (an allreduce step sends one)
    bytes_per_rank: int
    root_messages: int  # rank 0's sends plus receives
    root_bytes: int  # rank 0's bytes received plus sent
    root_python_s: float  # rank 0's Python work beyond a non-root rank's
    latency_terms: str  # the alpha terms, e.g. "2a_shm + 1a_net"


def _steps(p: int, ppn: int) -> tuple[int, int]:
    """(steps inside a host, steps across hosts) of a tree over ``p`` ranks."""
    total = math.ceil(math.log2(p)) if p > 1 else 0
    inside = min(total, math.ceil(math.log2(min(ppn, p)))) if ppn > 1 else 0
    return inside, total - inside


def _tree(k: Constants, p: int, ppn: int, nbytes: float) -> float:
    """One tree collective whose every step moves ``nbytes``."""
    inside, across = _steps(p, ppn)
    return (inside * (k.alpha_shm + nbytes * k.beta_shm)
            + across * (k.alpha_net + nbytes * k.beta_net))


def _gather(k: Constants, p: int, ppn: int, each: float) -> float:
    """Binomial gather of ``each`` bytes per rank: step i carries 2^i ranks' data."""
    inside, across = _steps(p, ppn)
    t = 0.0
    for i in range(inside + across):
        a, b = (k.alpha_shm, k.beta_shm) if i < inside else (k.alpha_net, k.beta_net)
        t += a + (2 ** i) * each * b
    return t


def _waits(k: Constants, p: int, ppn: int, collectives: int) -> float:
    return collectives * k.w_net if _steps(p, ppn)[1] else 0.0


def _terms(p: int, ppn: int, times: int) -> str:
    inside, across = _steps(p, ppn)
    return f"{times * inside}a_shm + {times * across}a_net"


def c6_latency(k: Constants, p: int, ppn: int) -> Prediction:
    """One blocking 4-byte allreduce: the control round, the data allreduce, ``c_call``."""
    steps = sum(_steps(p, ppn))
    seconds = (k.c_call + _tree(k, p, ppn, 8 * k.words) + _tree(k, p, ppn, 4)
               + _waits(k, p, ppn, 2))
    return Prediction(seconds, 2 * steps, (8 * k.words + 4) * steps, 4 * steps,
                      2 * (8 * k.words + 4) * steps, 0.0, _terms(p, ppn, 2))


def cached_step(k: Constants, p: int, ppn: int, n: int) -> Prediction:
    """A cached step of ``n`` 4-byte tensors fused into one bucket."""
    steps = sum(_steps(p, ppn))
    data = 4 * n
    seconds = (n * k.c_tensor + _tree(k, p, ppn, 8 * k.words) + _tree(k, p, ppn, data)
               + _waits(k, p, ppn, 2))
    per_rank = (8 * k.words + data) * steps
    return Prediction(seconds, 2 * steps, per_rank, 4 * steps, 2 * per_rank, 0.0,
                      _terms(p, ppn, 2))


def uncached_round(k: Constants, p: int, ppn: int, n: int) -> Prediction:
    """An uncached round of ``n`` new 4-byte tensors (every rank sends all ``n`` requests)."""
    steps = sum(_steps(p, ppn))
    req = n * k.r
    root_python = p * n * k.c_req
    seconds = (n * k.c_tensor + _tree(k, p, ppn, 8 * k.words) + _gather(k, p, ppn, 8)
               + _gather(k, p, ppn, req) + _tree(k, p, ppn, 8) + _tree(k, p, ppn, req)
               + root_python + _tree(k, p, ppn, 4 * n) + _waits(k, p, ppn, 6))
    per_rank = 8 * k.words * steps + 8 + req + 8 + req + 4 * n * steps
    root_bytes = (2 * 8 * k.words * steps + (p - 1) * (8 + req) + steps * (8 + req)
                  + 2 * 4 * n * steps)
    return Prediction(seconds, 2 * steps + 2 + 2 + 0, per_rank, 8 * steps, root_bytes,
                      root_python, _terms(p, ppn, 6))


def table(k: Constants, ppn: int = 8, n: int = 100,
          sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)) -> str:
    """The model's predictions for ``sizes`` ranks, ``ppn`` per host, ``n`` tensors."""
    head = (f"| ranks | hosts | C6 4 B call | cached step (N={n}) | uncached round (N={n}) | "
            "msgs/rank cached, uncached | rank 0 bytes uncached | rank 0 Python uncached | "
            "alpha terms cached, uncached |")
    lines = [head, "|" + "---|" * 9]
    for p in sizes:
        c6 = c6_latency(k, p, ppn)
        cs = cached_step(k, p, ppn, n)
        ur = uncached_round(k, p, ppn, n)
        lines.append(
            f"| {p} | {math.ceil(p / ppn)} | {c6.seconds * 1e6:.0f} us | "
            f"{cs.seconds * 1e6:.0f} us | {ur.seconds * 1e3:.2f} ms | "
            f"{cs.messages_per_rank}, {ur.messages_per_rank} | {ur.root_bytes / 1024:.0f} KiB | "
            f"{ur.root_python_s * 1e3:.2f} ms | {cs.latency_terms}; {ur.latency_terms} |")
    return "\n".join(lines)
