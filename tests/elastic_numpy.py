"""A NumPy elastic job (``hvdlite.elastic.ObjectState``, no torch) for the elastic tests that
need worlds to start quickly. Each step allreduces integers that depend on the rank, the world
size and the step, and commits; ``expected(sizes)`` is the exact total after steps taken at
those world sizes. Prints ``ELASTIC {json}`` records (``restored``, ``done``); the
environment's ``ELASTIC_KILL`` ("gen:step:rank,...") makes that rank SIGKILL itself in that
world before the allreduce of that step."""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

STEPS = 12


def expected(sizes: list[int]) -> list[int]:
    """The total after step s (1, 2, ...) ran at ``sizes[s - 1]`` ranks."""
    return [sum(sizes), sum(n * (n + 1) // 2 for n in sizes),
            sum(n * s for s, n in enumerate(sizes, start=1))]


def main() -> None:
    import hvdlite as hvd
    import hvdlite.elastic as elastic

    hvd.init()
    gen = int(os.environ.get("HVDLITE_ELASTIC_GENERATION", "0"))
    kills = {}
    for item in filter(None, os.environ.get("ELASTIC_KILL", "").split(",")):
        g, step, rank = map(int, item.split(":"))
        kills[(g, step)] = rank
    state = elastic.ObjectState(step=0, total=np.zeros(3, dtype=np.int64), sizes=[])

    def say(kind: str) -> None:
        print("ELASTIC " + json.dumps({"kind": kind, "gen": gen, "rank": hvd.rank(),
                                       "size": hvd.size(), "step": state.step,
                                       "total": state.total.tolist(), "sizes": state.sizes}),
              flush=True)

    @elastic.run
    def train(state: elastic.ObjectState) -> None:
        say("restored")
        while state.step < STEPS:
            if kills.get((gen, state.step + 1)) == hvd.rank():
                os.kill(os.getpid(), signal.SIGKILL)
            mine = np.array([1, hvd.rank() + 1, state.step + 1], dtype=np.int64)
            state.total = state.total + hvd.allreduce(mine, op=hvd.Sum, name="contrib")
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            state.commit()

    train(state)
    say("done")


if __name__ == "__main__":
    sys.exit(main())
