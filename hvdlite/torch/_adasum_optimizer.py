"""``DistributedOptimizer(op=Adasum)``: Horovod's delta optimizer.

Adasum combines *updates*, not gradients: once a parameter's gradient is ready (after
``backward_passes_per_step`` passes), the wrapped optimizer steps that parameter alone, the
change it made (the delta) is reduced with Adasum in place, asynchronously, while backward goes
on; ``step()`` then applies every reduced delta to the parameters as they were before. So the
learning-rate rules differ from Average: no averaging happens, and Horovod's guidance holds
(``docs/horovod.md``, "Adasum"): keep the single-process learning rate, and with momentum or
Adam the optimizer's state stays local to each rank.

The class is mixed into the wrapped optimizer's own class (as ``_DistributedOptimizer`` is),
so ``super().step()`` is the wrapped optimizer's step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from hvdlite.torch._accumulate import hook as accumulation_hook
from hvdlite.torch._buckets import remove_hooks
from hvdlite.torch.basics import Adasum
from hvdlite.torch.mpi_ops import allreduce_async_, synchronize

__all__ = ["_DistributedAdasumOptimizer"]


def _weak_hook(owner: weakref.ref[Any], p: torch.Tensor) -> Any:
    def hook(_param: torch.Tensor) -> None:
        opt = owner()
        if opt is not None:
            opt._gradient_ready(p)
    return hook


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, named_parameters: Any, compression: Any,
                 backward_passes_per_step: int = 1) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        self._compression = compression
        every = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
                raise ValueError("named_parameters should be a sequence of (name, parameter) "
                                 "tuples, usually model.named_parameters()")
            names = [n for n, _ in named]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError(f"parameter names in named_parameters must be unique; "
                                 f"duplicates: {', '.join(dups)}")
            unnamed = {id(p) for p in every} - {id(p) for _, p in named}
            if unnamed:
                raise ValueError(f"named_parameters was given but {len(unnamed)} parameter(s) "
                                 "of the optimizer are not named in it")
        else:
            named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(every)]
        self._names = {p: name for name, p in named}
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for p in every}
        self._start = {p: torch.zeros_like(p, requires_grad=False) for p in every}
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._requires_update: set[Any] = set()
        # Through hvdlite's accumulation hooks (``_accumulate.py``), so a model compiled by
        # compile_overlap starts each delta inside its backward too; held weakly, and removed
        # once the optimizer is collected (a hook holding it would keep it alive).
        me = weakref.ref(self)
        self._hooks: list[Any] = []
        for p in every:
            if p.requires_grad:
                p.grad = p.data.new_zeros(p.size())
                self._requires_update.add(p)
                self._hooks.append(accumulation_hook(p, _weak_hook(me, p)))
        weakref.finalize(self, remove_hooks, self._hooks).atexit = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def _delta_async(self, p: Any) -> tuple[Any, Any]:
        """Step ``p`` alone with the wrapped optimizer, turn ``p`` into the change the step
        made (the delta), and start its Adasum in place."""
        start = self._start[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            start.data.copy_(p.data)
            super(self.__class__, self).step()
            p.data.sub_(start)
        finally:
            for group, params in zip(self.param_groups, stashed, strict=True):
                group["params"] = params
        compressed, ctx = self._compression.compress(p.data)
        return allreduce_async_(compressed, name=self._names.get(p), op=Adasum), ctx

    def _gradient_ready(self, p: Any) -> None:
        """``p``'s gradient has accumulated: count the pass, and on the last one start its
        delta's Adasum."""
        if self._handles.get(p, (None, None))[0] is not None and self._delay[p] <= 0:
            raise AssertionError("gradients were computed more than backward_passes_per_step "
                                 "times before step(); raise backward_passes_per_step to "
                                 "accumulate locally")
        self._delay[p] -= 1
        self._handles[p] = self._delta_async(p) if self._delay[p] == 0 else (None, None)

    def synchronize(self) -> None:
        """Nothing to do before ``step()``: the deltas are applied there."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("skip_synchronize is not supported with op=Adasum (Horovod's "
                             "rule): step() applies the reduced updates itself")
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._delta_async(p)
        for p, (handle, ctx) in list(self._handles.items()):
            if handle is None:  # step() before the last of backward_passes_per_step
                handle, ctx = self._delta_async(p)
            delta = self._compression.decompress(synchronize(handle), ctx)
            start = self._start[p]
            start.data.add_(delta.data)
            p.data.copy_(start)
            self._delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step(): that races with the reduction")
        super(self.__class__, self).zero_grad(set_to_none)
