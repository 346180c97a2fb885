"""Run a benchmark (``python immediate_reasons.py bench_g3 [args]``) with the immediate path's
preconditions tallied: why a blocking call was (or was not) run on the calling thread."""

from __future__ import annotations

import importlib
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import hvdlite._steady as steady
from hvdlite._control import immediate

REASONS: Counter[str] = Counter()
SECONDS: Counter[str] = Counter()
_ORIG = immediate.run_now


def _why(engine: Any, channel: Any, request: Any, work: Any) -> str:
    d, neg = engine.driver, channel.negotiator
    if d.cycle_lock.locked():
        return "cycle lock held"
    if not d.quiet(channel):
        return (f"not quiet: queue {len(engine._queue)}, pending {len(channel.entries)}, "
                f"traced {engine.tracer.on}")
    if not neg.idle():
        held = [k for k in ("_unready", "_uncached", "_invalid", "_hits") if getattr(neg, k)]
        return f"negotiator busy: {held} join {neg._join} announce {neg.announce_now}"
    slot, same = neg.cache.lookup(request)
    if not same:
        return f"cache: slot {slot}, cached request differs"
    resp = neg.cache.response(slot)
    backend = channel.backends.get(resp.device)
    if backend is None:
        return "no backend yet"
    if work(resp, backend) is None:
        return f"declined by the call ({request.name})"
    return "other"


def run_now(engine: Any, channel: Any, request: Any, nbytes: int, work: Any,
            make_entry: Any) -> Any:
    why = _why(engine, channel, request, work)
    t0 = time.perf_counter()
    value = _ORIG(engine, channel, request, nbytes, work, make_entry)
    key = ("immediate" if value is immediate.DONE
           else why + (" -> missed" if value is immediate.MISS else " -> adopted"))
    REASONS[key] += 1
    SECONDS[key] += time.perf_counter() - t0
    return value


_ORIG_CYCLE = immediate._cycle


def _timed_cycle(engine: Any, channel: Any, name: str, slot: int, nbytes: int, step: Any,
                 make_entry: Any) -> Any:
    def timed_step() -> object:
        t = time.perf_counter()
        try:
            return step()
        finally:
            SECONDS["  of which the data step"] += time.perf_counter() - t
            REASONS["  of which the data step"] += 1

    backend = channel.backends.get("cuda")
    built = backend.fused.plans_built if backend is not None else 0
    t0 = time.perf_counter()
    try:
        return _ORIG_CYCLE(engine, channel, name, slot, nbytes, timed_step, make_entry)
    finally:
        SECONDS["  cycle (round + data step)"] += time.perf_counter() - t0
        REASONS["  cycle (round + data step)"] += 1
        if backend is not None and backend.fused.plans_built != built:
            REASONS["  of which rebuilt its member plan"] += 1


def main() -> None:
    steady.run_now = run_now  # type: ignore[assignment]
    immediate._cycle = _timed_cycle  # type: ignore[assignment]
    name, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    try:
        importlib.import_module(name).main()
    finally:
        print("immediate path:", {k: f"{n} calls, {SECONDS[k] / n * 1e6:.0f} us each"
                                  if SECONDS[k] else f"{n} calls" for k, n in REASONS.items()},
              flush=True)


if __name__ == "__main__":
    main()
