"""A torch gradient's walk through hvdlite's modules, as a profile hook records it.

One steady-state ``DistributedOptimizer`` step of a one-bucket model (after five warm-up
steps), on rank 0: every call from one hvdlite module into another, in order, per thread,
consecutive repeats of one call (a polling loop) shown once, then how many times each module
was entered. docs/architecture.md, "A torch gradient's walk", quotes it.

    mpiexec -n 2 python scripts/walk_torch.py
"""

from __future__ import annotations

import collections
import sys
import threading
from types import FrameType
from typing import Any

import torch

import hvdlite.torch as hvd

_ROOT = "/hvdlite/"


def _module(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    path = frame.f_code.co_filename
    at = path.rfind(_ROOT)
    return None if at < 0 else path[at + 1:]


def main() -> None:
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.ones(2, 4)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    for _ in range(5):
        step()
    walks: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)

    def hook(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        mod = _module(frame)
        caller = _module(frame.f_back)
        if mod is not None and caller != mod:
            walk = walks[threading.current_thread().name]
            call = (caller or "(user)", mod, frame.f_code.co_name)
            if not walk or walk[-1] != call:
                walk.append(call)

    threading.setprofile(hook)
    sys.setprofile(hook)
    step()
    sys.setprofile(None)
    threading.setprofile(None)
    if hvd.rank() == 0:
        for thread, walk in walks.items():
            print(f"thread {thread}:")
            for caller, mod, fn in walk:
                print(f"  {caller} -> {mod}:{fn}")
            counts = collections.Counter(mod for _, mod, _ in walk)
            print("  entries per module:", dict(counts))
    hvd.shutdown()


if __name__ == "__main__":
    main()
