"""Horovod's asynchronous and in-place collectives on torch tensors, over hvdlite's engine.

Every function here returns a :class:`Handle` (``*_async``) or waits on one (in-place forms);
the differentiable synchronous forms live in :mod:`hvdlite.torch.functional_ops`.

Where hvdlite's core and Horovod differ, Horovod's behaviour is built here:

- ``Average`` is a ``Sum`` with ``postscale_factor / size()``: joined ranks count in the
  divisor and integer averages truncate toward zero (hvdlite's core floors).
- float16 and bfloat16 are scaled in float32; bfloat16 (which NumPy cannot hold) is reduced in
  float32 and rounded once, and moved as raw 16-bit words by allgather/broadcast/alltoall.
- ``reducescatter`` takes ``prescale_factor``/``postscale_factor``; ``alltoall`` returns the
  received splits; grouped allgather/reducescatter exist.

Every collective takes ``process_set=`` (default :data:`global_process_set`): it runs among the
set's ranks on the set's own communicators, ``Average`` divides by the set's size, ranks,
roots and splits are as for the global set but with the set's size (broadcast roots stay
global ranks, as in Horovod), and a rank outside the set gets
:class:`~hvdlite.torch.InvalidArgumentError` (a ``ValueError``) at the call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

import hvdlite
from hvdlite._ops import ReduceOp
from hvdlite.torch.basics import Average, InvalidArgumentError, Sum, resolve_op
from hvdlite.torch.process_sets import Resolved, global_process_set, resolve

__all__ = [
    "Handle", "SparseHandle", "allreduce_async", "allreduce_async_", "allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_allreduce_",
    "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_",
    "broadcast_", "alltoall_async", "reducescatter_async", "grouped_reducescatter_async",
    "sparse_allreduce_async", "join", "barrier", "poll", "synchronize",
]

_LOW = (torch.float16, torch.bfloat16)
# dtypes NumPy cannot view: moved bit for bit as integers of the same width.
_RAW_VIEW = {torch.bfloat16: torch.int16, torch.complex32: torch.int32}
for _name, _view in (("float8_e4m3fn", torch.uint8), ("float8_e5m2", torch.uint8)):
    if hasattr(torch, _name):
        _RAW_VIEW[getattr(torch, _name)] = _view


class Handle:
    """The pending result of a ``hvdlite.torch`` asynchronous collective.

    Pass it to :func:`poll` / :func:`synchronize` (or call ``handle.poll()`` /
    ``handle.wait()``). The result is computed once; later waits return it again.
    """

    __slots__ = ("_parts", "_finish", "_done", "_result", "_lock")

    def __init__(self, parts: Sequence[Any], finish: Callable[[list[Any]], Any]) -> None:
        self._parts = list(parts)
        self._finish = finish
        self._done = False
        self._result: Any = None
        self._lock = threading.Lock()

    def poll(self) -> bool:
        """True once every underlying collective has completed. Never blocks."""
        return self._done or all(p.poll() for p in self._parts)

    def wait(self) -> Any:
        """Block until done and return the result (raises the collective's error)."""
        with self._lock:
            if not self._done:
                results = [p.wait() for p in self._parts]
                self._result = self._finish(results)
                self._done = True
                self._parts = []
            return self._result

    synchronize = wait


class SparseHandle:
    """The result of :func:`sparse_allreduce_async`: call it (``handle()``) to wait and get the
    reduced sparse tensor, as with Horovod; :func:`poll`/:func:`synchronize` work too."""

    __slots__ = ("_handle",)

    def __init__(self, handle: Handle) -> None:
        self._handle = handle

    def __call__(self) -> torch.Tensor:
        return self._handle.wait()

    def poll(self) -> bool:
        """True once the gathers completed."""
        return self._handle.poll()

    def wait(self) -> torch.Tensor:
        """Same as calling the handle."""
        return self._handle.wait()

    synchronize = wait


def _core(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a hvdlite collective; its argument ``ValueError`` becomes Horovod's flavour
    (:class:`InvalidArgumentError`, both a ``ValueError`` and a ``RuntimeError``)."""
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        if isinstance(exc, (InvalidArgumentError, hvdlite.HvdliteError)):
            raise
        raise InvalidArgumentError(str(exc)) from None


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not supported here; use "
                        "sparse_allreduce_async or tensor.to_dense()")
    return t


def _check_tensors(tensors: Any, what: str) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"{what}: expected a non-empty list of torch.Tensor, got "
                        f"{type(tensors).__name__}")
    return [_check_tensor(t, what) for t in tensors]


def _factor(value: Any, label: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: {label} must be a real number, got {value!r}")
    return float(value)


def scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` by Horovod's rules (a new tensor; ``t`` itself for a factor of 1):
    float16/bfloat16 multiply in float32, integers in float64 truncated toward zero."""
    if factor == 1.0:
        return t
    if t.dtype in _LOW:
        return (t.float() * factor).to(t.dtype)
    if t.dtype == torch.bool:
        raise TypeError("cannot scale a bool tensor; cast it first")
    if t.is_floating_point() or t.is_complex():
        return t * factor
    return torch.trunc(t.double() * factor).to(t.dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a same-width integer view if NumPy cannot hold its dtype."""
    view = _RAW_VIEW.get(t.dtype)
    return t if view is None else t.view(view)


def _unraw(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.view(dtype)


def _reduction_plan(tensors: list[torch.Tensor], op: ReduceOp, pre: float, post: float,
                    what: str, ps: Resolved) -> tuple[ReduceOp, float, float, bool]:
    """(core op, prescale, postscale, scale in torch) for a reduction of ``tensors`` over the
    process set ``ps`` (``Average`` divides by its size)."""
    pre = _factor(pre, "prescale_factor", what)
    post = _factor(post, "postscale_factor", what)
    if op is Average:
        if any(t.dtype == torch.bool for t in tensors):
            raise TypeError(f"{what}: op Average is not defined for bool tensors; use Sum "
                            "(logical or), Min or Max")
        op = Sum
        post = post / ps.size
    # float16: the core scales in float16 arithmetic (each product computed in float32 and
    # rounded), which equals Horovod's float32 rule when the factor itself is a float16 value
    # (1, 1/2, 1/4 ...: Average over a power-of-two size); otherwise scale here.
    exact = _exact_half(pre) and _exact_half(post)
    in_torch = any(t.dtype == torch.bfloat16 or (t.dtype == torch.float16 and not exact)
                   for t in tensors)
    return op, pre, post, in_torch


def _exact_half(factor: float) -> bool:
    return float(torch.tensor(factor, dtype=torch.float16)) == factor


def _allreduce(tensors: list[torch.Tensor], name: str | None, op: ReduceOp, pre: float,
               post: float, inplace: bool, group: bool, what: str, process_set: Any) -> Handle:
    ps = resolve(process_set, what)
    core_op, pre, post, in_torch = _reduction_plan(tensors, op, pre, post, what, ps)
    sends = tensors
    if in_torch:
        # Scale here (float32 for the 16-bit types); the core gets factors of 1 and reduces
        # private copies in place. bfloat16 travels as float32 and is rounded once at the end.
        sends = []
        for t in tensors:
            if t.dtype == torch.bfloat16:
                s = t.float()
                if pre != 1.0:
                    s.mul_(pre)
            else:
                s = scale(t, pre)
                if s is t and not inplace:
                    s = t.clone()
            sends.append(s)
        core_pre, core_post = 1.0, 1.0
    else:
        core_pre, core_post = pre, post
    core_inplace = inplace or in_torch
    fn: Callable[..., Any]
    if group:
        fn = hvdlite.grouped_allreduce_async_ if core_inplace else hvdlite.grouped_allreduce_async
        part = _core(fn, sends, name, core_op, core_pre, core_post, process_set=ps.core)
    else:
        fn = hvdlite.allreduce_async_ if core_inplace else hvdlite.allreduce_async
        part = _core(fn, sends[0], name, core_op, core_pre, core_post, process_set=ps.core)

    def finish(results: list[Any]) -> Any:
        outs = results[0] if group else [results[0]]
        final = []
        for t, r in zip(tensors, outs, strict=True):
            if in_torch:
                r = (r * post if post != 1.0 else r).to(t.dtype) if t.dtype == torch.bfloat16 \
                    else scale(r, post)
                if inplace and r is not t:
                    t.copy_(r)
                    r = t
            final.append(r)
        return final if group else final[0]

    return Handle([part], finish)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> Handle:
    """Start reducing ``tensor`` over the ranks of ``process_set`` (default: all; ``op``:
    Average by default, dividing by the set's size, Sum, Min, Max, Product); the input is not
    modified. ``average`` is Horovod's deprecated flag. Returns a
    :class:`Handle` for :func:`poll`/:func:`synchronize`. ``TypeError``/``ValueError`` for bad
    arguments, ``NotImplementedError`` for Adasum."""
    what = "allreduce_async"
    op = resolve_op(op, average, what)
    return _allreduce([_check_tensor(tensor, what)], name, op, prescale_factor, postscale_factor,
                      False, False, what, process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: the result is written into ``tensor``."""
    what = "allreduce_async_"
    op = resolve_op(op, average, what)
    return _allreduce([_check_tensor(tensor, what)], name, op, prescale_factor, postscale_factor,
                      True, False, what, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Blocking in-place allreduce; returns ``tensor``."""
    what = "allreduce_"
    op = resolve_op(op, average, what)
    return _allreduce([_check_tensor(tensor, what)], name, op, prescale_factor, postscale_factor,
                      True, False, what, process_set).wait()


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> Handle:
    """Start reducing a list of tensors as one unit (negotiated and fused together); the
    result is the list of reduced tensors, in order."""
    what = "grouped_allreduce_async"
    op = resolve_op(op, average, what)
    return _allreduce(_check_tensors(tensors, what), name, op, prescale_factor,
                      postscale_factor, False, True, what, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> Handle:
    """In-place :func:`grouped_allreduce_async`."""
    what = "grouped_allreduce_async_"
    op = resolve_op(op, average, what)
    return _allreduce(_check_tensors(tensors, what), name, op, prescale_factor,
                      postscale_factor, True, True, what, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Blocking in-place grouped allreduce; returns the list of (updated) tensors."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                    postscale_factor, process_set).wait()


def _member_name(name: str | None, i: int) -> str | None:
    return None if name is None else f"{name}.{i}"


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start concatenating the ``tensor`` of every rank of ``process_set`` along dim 0, in
    rank order (dim 0 may differ per rank)."""
    return _allgather([_check_tensor(tensor, "allgather_async")], name, False, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> Handle:
    """Start an allgather of each tensor in the list; the result is the list of gathered
    tensors. Member ``i`` is named ``f"{name}.{i}"``."""
    what = "grouped_allgather_async"
    return _allgather(_check_tensors(tensors, what), name, True, process_set)


def _allgather(tensors: list[torch.Tensor], name: str | None, group: bool,
               process_set: Any) -> Handle:
    ps = resolve(process_set, "allgather")
    parts = [_core(hvdlite.allgather_async, _raw(t), _member_name(name, i) if group else name,
                   process_set=ps.core)
             for i, t in enumerate(tensors)]

    def finish(results: list[Any]) -> Any:
        outs = [_unraw(r, t.dtype) for r, t in zip(results, tensors, strict=True)]
        return outs if group else outs[0]

    return Handle(parts, finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` to every rank of ``process_set`` (a new
    tensor; input kept). ``root_rank`` is a global rank, a member of the set."""
    return _broadcast(_check_tensor(tensor, "broadcast_async"), root_rank, name, False,
                      process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> Handle:
    """In-place :func:`broadcast_async`: non-root ranks receive into ``tensor``."""
    return _broadcast(_check_tensor(tensor, "broadcast_async_"), root_rank, name, True,
                      process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Blocking in-place broadcast; returns ``tensor``."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def _broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, inplace: bool,
               process_set: Any) -> Handle:
    ps = resolve(process_set, "broadcast")
    fn = hvdlite.broadcast_async_ if inplace else hvdlite.broadcast_async
    part = _core(fn, _raw(tensor), root_rank, name, process_set=ps.core)
    if inplace:
        return Handle([part], lambda _results: tensor)
    return Handle([part], lambda results: _unraw(results[0], tensor.dtype))


def _split_list(splits: Any, what: str) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.is_floating_point() or splits.is_complex():
            raise InvalidArgumentError(f"{what}: splits must be a 1-d integer tensor, got "
                                       f"{splits.dtype} of shape {list(splits.shape)}")
        return [int(s) for s in splits.tolist()]
    try:
        return [int(s) for s in splits]
    except TypeError:
        raise TypeError(f"{what}: splits must be a list or 1-d tensor of ints, got "
                        f"{type(splits).__name__}") from None


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> Handle:
    """Start an all-to-all: rows ``splits[j]`` of dim 0 go to rank ``j`` of ``process_set``
    (``len(splits)`` is the set's size; default: equal parts). :func:`synchronize` returns
    ``(output, received_splits)``: what every rank sent here, concatenated in rank order, and
    an int32 tensor of how many rows came from each."""
    what = "alltoall_async"
    tensor = _check_tensor(tensor, what)
    ps = resolve(process_set, what)
    n = ps.size
    split_list = _split_list(splits, what)
    if tensor.dim() == 0:
        raise InvalidArgumentError(f"{what}: needs at least one dimension, got a 0-d tensor")
    rows = tensor.shape[0]
    if split_list is None:
        if rows % n:
            raise InvalidArgumentError(f"{what}: dim 0 ({rows}) is not divisible by size ({n}); "
                                       "pass splits= explicitly")
        split_list = [rows // n] * n
    if len(split_list) != n or any(s < 0 for s in split_list) or sum(split_list) != rows:
        raise InvalidArgumentError(f"{what}: splits must be {n} non-negative ints summing to "
                                   f"dim 0 ({rows}), got {split_list}")
    sent = torch.tensor(split_list, dtype=torch.int32)
    counts = _core(hvdlite.alltoall_async, sent, None, None if name is None else f"{name}.splits",
                   process_set=ps.core)
    data = _core(hvdlite.alltoall_async, _raw(tensor), split_list, name, process_set=ps.core)
    split_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32

    def finish(results: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return _unraw(results[1], tensor.dtype), results[0].to(split_dtype)

    return Handle([counts, data], finish)


def _rs_one(t: torch.Tensor, name: str | None, core_op: ReduceOp, pre: float,
            ps: Resolved) -> Any:
    send = t.float() * pre if t.dtype == torch.bfloat16 else scale(t, pre)
    return _core(hvdlite.reducescatter_async, send, name, core_op, process_set=ps.core)


def _reducescatter(tensors: list[torch.Tensor], name: str | None, op: Any, pre: float,
                   post: float, group: bool, what: str, process_set: Any) -> Handle:
    ps = resolve(process_set, what)
    core_op, pre, post, _ = _reduction_plan(tensors, op, pre, post, what, ps)
    parts = [_rs_one(t, _member_name(name, i) if group else name, core_op, pre, ps)
             for i, t in enumerate(tensors)]

    def finish(results: list[Any]) -> Any:
        outs = [(r * post).to(t.dtype) if t.dtype == torch.bfloat16 else scale(r, post)
                for r, t in zip(results, tensors, strict=True)]
        return outs if group else outs[0]

    return Handle(parts, finish)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` over the ranks of ``process_set`` and keep this rank's rows
    of dim 0 (the first ``dim0 % set size`` ranks of the set get one row more)."""
    what = "reducescatter_async"
    op = resolve_op(op, None, what)
    return _reducescatter([_check_tensor(tensor, what)], name, op, prescale_factor,
                          postscale_factor, False, what, process_set)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average, process_set: Any = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter of each tensor in the list; the result is the list of parts."""
    what = "grouped_reducescatter_async"
    op = resolve_op(op, None, what)
    return _reducescatter(_check_tensors(tensors, what), name, op, prescale_factor,
                          postscale_factor, True, what, process_set)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: Any,
                           process_set: Any = global_process_set) -> SparseHandle:
    """Reduce a sparse COO tensor by gathering every rank's indices and values (Average
    divides the values by the size of ``process_set``). Returns a callable handle:
    ``handle()`` waits and returns the (uncoalesced) sparse result."""
    what = "sparse_allreduce_async"
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(f"{what}: expected a sparse COO torch.Tensor")
    op = resolve_op(op, None, what)
    if op not in (Average, Sum):
        raise TypeError(f"{what}: op must be Average or Sum, got {op!r}")
    ps = resolve(process_set, what)
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    ih = _core(hvdlite.allgather_async, indices, None if name is None else f"{name}.indices",
               process_set=ps.core)
    vh = _core(hvdlite.allgather_async, _raw(values),
               None if name is None else f"{name}.values", process_set=ps.core)
    n = ps.size

    def finish(results: list[Any]) -> torch.Tensor:
        idx, vals = results[0], _unraw(results[1], values.dtype)
        if op is Average:
            vals = vals / n
        return torch.sparse_coo_tensor(idx.t(), vals, tensor.size(), check_invariants=False)

    return SparseHandle(Handle([ih, vh], finish))


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the other ranks' allreduces with zeros until
    every rank joined. Returns the rank that joined last. ``device`` is accepted for
    Horovod compatibility (hvdlite needs no scratch tensors)."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"join: device must be an int, got {device!r}")
    return hvdlite.join()


def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank of ``process_set`` (default: all) reached the barrier; ranks
    outside the set are not waited for. ``ValueError`` on a rank outside the set."""
    _core(hvdlite.barrier, process_set=resolve(process_set, "barrier").core)


def poll(handle: Any) -> bool:
    """True if the collective behind ``handle`` has completed. Never blocks."""
    if not hasattr(handle, "poll"):
        raise TypeError(f"poll: expected a handle from a *_async call, got {handle!r}")
    return bool(handle.poll())


def synchronize(handle: Any) -> Any:
    """Wait for ``handle`` and return its result (a tensor, a list of tensors for grouped
    calls, ``(output, received_splits)`` for alltoall)."""
    if not hasattr(handle, "wait"):
        raise TypeError(f"synchronize: expected a handle from a *_async call, got {handle!r}")
    return handle.wait()
