"""Horovod's asynchronous and in-place collectives on torch tensors, over hvdlite's engine.

Every function here returns a :class:`Handle` (``*_async``) or waits on one (in-place forms);
the differentiable synchronous forms live in :mod:`hvdlite.torch.functional_ops`.

Where hvdlite's core and Horovod differ, Horovod's behaviour is built here:

- ``Average`` is a ``Sum`` with ``postscale_factor / size()``: joined ranks count in the
  divisor and integer averages truncate toward zero. (CUDA float32/float64 with factors of 1
  over a power-of-two set: NCCL's own average, the same bits but for subnormals and an
  overflowing sum; ``hvdlite/_submit.py``, ``_DEVICE_AVERAGE``.)
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

from collections.abc import Callable, Sequence
from typing import Any

import torch

import hvdlite
from hvdlite._ops import ReduceOp
from hvdlite._submit import _submit
from hvdlite._torchref import entry_of as _entry_of
from hvdlite._torchref import stream_of
from hvdlite._vocab.messages import Kind
from hvdlite.errors import NotInitializedError
from hvdlite.torch._rules import check_tensor, factors, horovod_name, invalid, scale
from hvdlite.torch.basics import Average, InvalidArgumentError, Sum, resolve_op
from hvdlite.torch.errors import NotInitializedValueError
from hvdlite.torch.process_sets import Resolved, global_process_set, resolve

__all__ = [
    "Handle", "allreduce_async", "allreduce_async_", "allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_allreduce_",
    "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_",
    "broadcast_", "alltoall_async", "reducescatter_async", "grouped_reducescatter_async",
    "sparse_allreduce_async", "join", "barrier", "poll", "synchronize", "scale",
    "allreduce_one",
]

# dtypes NumPy cannot view: moved bit for bit as integers of the same width.
_RAW_VIEW = {torch.bfloat16: torch.int16, torch.complex32: torch.int32}
for _name, _view in (("float8_e4m3fn", torch.uint8), ("float8_e5m2", torch.uint8)):
    if hasattr(torch, _name):
        _RAW_VIEW[getattr(torch, _name)] = _view


def _core(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a hvdlite collective; its argument ``ValueError`` becomes Horovod's flavour."""
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        raise invalid(exc) from None


def _check_tensors(tensors: Any, what: str) -> list[torch.Tensor]:
    return [check_tensor(t, what) for t in _members(tensors, what)]


def _members(tensors: Any, what: str) -> Sequence[Any]:
    """A grouped call's list of tensors, checked as a list only: its members are checked once,
    by the allreduce route (:func:`_allreduce`: one type check per member; a sparse member is
    refused with its fix where the core views it)."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"{what}: expected a non-empty list of torch.Tensor, got "
                        f"{type(tensors).__name__}")
    return tensors


def allreduce_one(t: Any, name: str | None, op: ReduceOp, pre: Any, post: Any,
                  process_set: Any, inplace: bool, what: str, blocking: bool = False) -> Any:
    """Allreduce of one tensor by Horovod's rules: its :class:`hvdlite.Handle` (``blocking``:
    its result), the per-call path of ``allreduce_async``, ``allreduce_``, ``allreduce`` and
    ``DistributedOptimizer``; ``op`` already resolved. ``inplace``: the result is written
    into ``t``. The tensor goes the core's one route (``hvdlite/_submit.py``): its cached
    array at the edge, its name's lane, recycled result tensors, the core's handle."""
    # The tensor's cached view, checked (its memory, shape, dtype, contiguity, as
    # _torchref.views checks a grouped call's): what the call needs to know of the tensor (its
    # dtype, device and array) is read from it, not from torch again.
    seen = _entry_of(id(t)) if process_set is _GLOBAL else None
    if (seen is None or seen.ptr != t.data_ptr() or seen.shape != t.shape
            or seen.dtype is not t.dtype or not t.is_contiguous()
            or seen.dtype is _F16):  # first seen, changed, float16, bfloat16, a set
        return _allreduce([t], name, op, pre, post, inplace, False, what, process_set,
                          blocking)
    if type(name) is str:  # horovod_name, of a kept string: this is the per-call path
        name = _NAMES.get(name) or _core_name(name)
    device = seen.device_id
    try:
        return _submit(_ALLREDUCE, (t,), name, op=op, prescale=pre, postscale=post,
                       inplace=inplace, stream=stream_of(device) if device >= 0 else None,
                       block=blocking, horovod=True, array=seen.array)
    except ValueError as exc:
        raise invalid(exc) from None
    except NotInitializedError as exc:
        raise NotInitializedValueError(f"{what}: {exc}; call hvd.init() first") from None


# A user's name -> the core's (horovod_name's "allreduce.<name>"), one string per name: the
# same object every call, so the core's tables keyed by name (lanes, names in flight, the
# response cache) find it by identity, hashed once, and no string is formatted and compared
# character by character per call. Bounded: emptied when full (names made up per step).
_NAMES: dict[str, str] = {}
_MAX_NAMES = 1 << 14


def _core_name(name: str) -> str | None:
    if not name:
        return None  # unnamed: the core numbers it
    if len(_NAMES) >= _MAX_NAMES:
        _NAMES.clear()
    core = _NAMES[name] = f"allreduce.{name}"
    return core


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_F16, _BF16 = torch.float16, torch.bfloat16
_GLOBAL = global_process_set
_ALLREDUCE = Kind.ALLREDUCE
Handle = hvdlite.Handle


def _allreduce(tensors: Sequence[Any], name: str | None, op: ReduceOp, pre: Any, post: Any,
               inplace: bool, group: bool, what: str, process_set: Any,
               blocking: bool = False) -> Any:
    """Allreduce of ``tensors`` (one, or a grouped call's list): the handle, or with
    ``blocking`` the result (a tensor or list). bfloat16 and float16 with an inexact factor
    are scaled in torch (:func:`_scaled`); everything else goes straight to the core."""
    for t in tensors:
        if type(t) is not _TENSOR and type(t) is not _PARAMETER:
            check_tensor(t, what)
        dtype = t.dtype
        if dtype is _F16 or dtype is _BF16:
            return _low(list(tensors), name, op, pre, post, inplace, group, what, process_set,
                        blocking)
    return _route(tensors, name, op, pre, post, inplace, group, what, process_set, blocking)


def _route(tensors: Sequence[Any], name: str | None, op: ReduceOp, pre: Any, post: Any,
           inplace: bool, group: bool, what: str, process_set: Any, blocking: bool) -> Any:
    """The core's one route, with Horovod's rules (``horovod=True``) and torch's current
    stream for CUDA tensors."""
    core = None
    if process_set is not global_process_set and process_set is not None:
        core = resolve(process_set, what).core
    first = tensors[0]
    stream = stream_of(first.get_device()) if first.is_cuda else None
    try:
        return _submit(Kind.ALLREDUCE, tensors,
                       horovod_name("grouped_allreduce" if group else "allreduce", name),
                       op=op, prescale=pre, postscale=post, inplace=inplace, group=group,
                       stream=stream, block=blocking, process_set=core, horovod=True)
    except ValueError as exc:
        raise invalid(exc) from None
    except NotInitializedError as exc:
        raise NotInitializedValueError(f"{what}: {exc}; call hvd.init() first") from None


def _low(tensors: list[Any], name: str | None, op: ReduceOp, pre: Any, post: Any,
         inplace: bool, group: bool, what: str, process_set: Any, blocking: bool) -> Any:
    """A call with a 16-bit float member: the core's route when its factors are exact in
    float16 (the core's float16 scaling equals Horovod's float32 rule then), else scaled in
    torch (:func:`_scaled`)."""
    tensors = [check_tensor(t, what) for t in tensors]
    size = resolve(process_set, what).size
    facts = [factors(t.dtype, op, pre, post, size, what) for t in tensors]
    if any(f[3] for f in facts):
        handle = _scaled(tensors, name, facts[0], inplace, group, what, process_set)
        return handle.wait() if blocking else handle
    core_op, core_pre, core_post, _ = facts[0]
    return _route(tensors, name, core_op, core_pre, core_post, inplace, group, what,
                  process_set, blocking)


def _scaled(tensors: list[torch.Tensor], name: str | None,
            facts: tuple[ReduceOp, float, float, bool], inplace: bool, group: bool, what: str,
            process_set: Any) -> Handle:
    """bfloat16, float16 with an inexact factor: scale in torch (float32 for the 16-bit
    types); the core gets factors of 1 and reduces private copies in place. bfloat16 travels
    as float32 and is rounded once at the end."""
    core_op, pre, post, _ = facts
    sends = [_send(t, pre, inplace) for t in tensors]
    core = resolve(process_set, what).core
    name = horovod_name("grouped_allreduce" if group else "allreduce", name)
    if group:
        part = _core(hvdlite.grouped_allreduce_async_, sends, name, core_op, 1.0, 1.0,
                     process_set=core)
    else:
        part = _core(hvdlite.allreduce_async_, sends[0], name, core_op, 1.0, 1.0,
                     process_set=core)

    def finish(results: list[Any]) -> Any:
        outs = results[0] if group else [results[0]]
        final = []
        for t, r in zip(tensors, outs, strict=True):
            r = _unscale(r, t.dtype, post)
            if inplace and r is not t:
                t.copy_(r)
                r = t
            final.append(r)
        return final if group else final[0]

    return _derived([part], finish)


def _derived(parts: list[Any], finish: Callable[[list[Any]], Any]) -> Handle:
    """The caller's handle for a result made from core collectives' results (named after the
    first, whose name the core chose or checked)."""
    return Handle.derived(parts[0].name, parts, finish)


def _send(t: torch.Tensor, pre: float, inplace: bool) -> torch.Tensor:
    if t.dtype == torch.bfloat16:
        s = t.float()
        if pre != 1.0:
            s.mul_(pre)
        return s
    s = scale(t, pre)
    return t.clone() if s is t and not inplace else s


def _unscale(r: torch.Tensor, dtype: torch.dtype, post: float) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return (r * post if post != 1.0 else r).to(dtype)
    return scale(r, post)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a same-width integer view if NumPy cannot hold its dtype."""
    view = _RAW_VIEW.get(t.dtype)
    return t if view is None else t.view(view)


def _unraw(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.view(dtype)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> Handle:
    """Start reducing ``tensor`` over the ranks of ``process_set`` (default: all; ``op``:
    Average by default, dividing by the set's size, Sum, Min, Max, Product); the input is not
    modified. ``average`` is Horovod's deprecated flag. Returns a
    :class:`Handle` for :func:`poll`/:func:`synchronize`. ``TypeError``/``ValueError`` for bad
    arguments, ``NotImplementedError`` for Adasum."""
    if op is None and average is None:
        op = Average
    elif average is not None or type(op) is not ReduceOp:
        op = resolve_op(op, average, "allreduce_async")
    return allreduce_one(tensor, name, op, prescale_factor, postscale_factor, process_set,
                         False, "allreduce_async")


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: the result is written into ``tensor``."""
    if op is None and average is None:
        op = Average
    elif average is not None or type(op) is not ReduceOp:
        op = resolve_op(op, average, "allreduce_async_")
    return allreduce_one(tensor, name, op, prescale_factor, postscale_factor, process_set,
                         True, "allreduce_async_")


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Blocking in-place allreduce; returns ``tensor``."""
    if op is None and average is None:
        op = Average
    elif average is not None or type(op) is not ReduceOp:
        op = resolve_op(op, average, "allreduce_")
    return allreduce_one(tensor, name, op, prescale_factor, postscale_factor, process_set,
                         True, "allreduce_", True)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> Handle:
    """Start reducing a list of tensors as one unit (negotiated and fused together); the
    result is the list of reduced tensors, in order."""
    what = "grouped_allreduce_async"
    op = resolve_op(op, average, what)
    return _allreduce(_members(tensors, what), name, op, prescale_factor, postscale_factor,
                      False, True, what, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> Handle:
    """In-place :func:`grouped_allreduce_async`."""
    what = "grouped_allreduce_async_"
    op = resolve_op(op, average, what)
    return _allreduce(_members(tensors, what), name, op, prescale_factor, postscale_factor,
                      True, True, what, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Blocking in-place grouped allreduce; returns the list of (updated) tensors."""
    what = "grouped_allreduce_"
    op = resolve_op(op, average, what)
    return _allreduce(_members(tensors, what), name, op, prescale_factor, postscale_factor,
                      True, True, what, process_set, True)


def _member_name(op: str, name: str | None, i: int, n: int) -> str | None:
    """Member ``i`` of ``n`` of a grouped call: Horovod's ``grouped_<op>.<name>_<i+1>of<n>``."""
    if type(name) is not str or not name:
        return horovod_name(op, name)
    return f"grouped_{op}.{name}_{i + 1}of{n}"


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start concatenating the ``tensor`` of every rank of ``process_set`` along dim 0, in
    rank order (dim 0 may differ per rank)."""
    return _allgather([check_tensor(tensor, "allgather_async")], name, False, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> Handle:
    """Start an allgather of each tensor in the list; the result is the list of gathered
    tensors. Member ``i`` of ``n`` is named ``grouped_allgather.<name>_<i+1>of<n>`` (Horovod's
    name)."""
    what = "grouped_allgather_async"
    return _allgather(_check_tensors(tensors, what), name, True, process_set)


def _allgather(tensors: list[torch.Tensor], name: str | None, group: bool,
               process_set: Any) -> Handle:
    ps = resolve(process_set, "allgather")
    n = len(tensors)
    parts = [_core(hvdlite.allgather_async, _raw(t), _member_name("allgather", name, i, n)
                   if group else horovod_name("allgather", name), process_set=ps.core)
             for i, t in enumerate(tensors)]

    def finish(results: list[Any]) -> Any:
        outs = [_unraw(r, t.dtype) for r, t in zip(results, tensors, strict=True)]
        return outs if group else outs[0]

    return _derived(parts, finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` to every rank of ``process_set`` (a new
    tensor; input kept). ``root_rank`` is a global rank, a member of the set."""
    return _broadcast(check_tensor(tensor, "broadcast_async"), root_rank, name, False,
                      process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> Handle:
    """In-place :func:`broadcast_async`: non-root ranks receive into ``tensor``."""
    return _broadcast(check_tensor(tensor, "broadcast_async_"), root_rank, name, True,
                      process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Blocking in-place broadcast; returns ``tensor``."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def _broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, inplace: bool,
               process_set: Any) -> Handle:
    ps = resolve(process_set, "broadcast")
    fn = hvdlite.broadcast_async_ if inplace else hvdlite.broadcast_async
    part = _core(fn, _raw(tensor), root_rank, horovod_name("broadcast", name),
                 process_set=ps.core)
    if inplace:
        return _derived([part], lambda _results: tensor)
    return _derived([part], lambda results: _unraw(results[0], tensor.dtype))


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
    tensor = check_tensor(tensor, what)
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
    name = horovod_name("alltoall", name)
    counts = _core(hvdlite.alltoall_async, sent, None, None if name is None else f"{name}.splits",
                   process_set=ps.core)
    data = _core(hvdlite.alltoall_async, _raw(tensor), split_list, name, process_set=ps.core)
    split_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32

    def finish(results: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return _unraw(results[1], tensor.dtype), results[0].to(split_dtype)

    return _derived([counts, data], finish)


def _rs_one(t: torch.Tensor, name: str | None, core_op: ReduceOp, pre: float,
            ps: Resolved) -> Any:
    send = t.float() * pre if t.dtype == torch.bfloat16 else scale(t, pre)
    return _core(hvdlite.reducescatter_async, send, name, core_op, process_set=ps.core)


def _reducescatter(tensors: list[torch.Tensor], name: str | None, op: Any, pre: float,
                   post: float, group: bool, what: str, process_set: Any) -> Handle:
    ps = resolve(process_set, what)
    core_op, pre, post, _ = factors(tensors[0].dtype, op, pre, post, ps.size, what)
    for t in tensors[1:]:
        factors(t.dtype, op, pre, post, ps.size, what)
    n = len(tensors)
    parts = [_rs_one(t, _member_name("reducescatter", name, i, n) if group
                     else horovod_name("reducescatter", name), core_op, pre, ps)
             for i, t in enumerate(tensors)]

    def finish(results: list[Any]) -> Any:
        outs = [(r * post).to(t.dtype) if t.dtype == torch.bfloat16 else scale(r, post)
                for r, t in zip(results, tensors, strict=True)]
        return outs if group else outs[0]

    return _derived(parts, finish)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` over the ranks of ``process_set`` and keep this rank's rows
    of dim 0 (the first ``dim0 % set size`` ranks of the set get one row more)."""
    what = "reducescatter_async"
    op = resolve_op(op, None, what)
    return _reducescatter([check_tensor(tensor, what)], name, op, prescale_factor,
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
                           process_set: Any = global_process_set) -> Handle:
    """Reduce a sparse COO tensor by gathering every rank's indices and values (Average
    divides the values by the size of ``process_set``). Returns a handle that is also
    callable, as Horovod's: ``handle()`` waits and returns the (uncoalesced) sparse result."""
    what = "sparse_allreduce_async"
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(f"{what}: expected a sparse COO torch.Tensor")
    op = resolve_op(op, None, what)
    if op not in (Average, Sum):
        raise TypeError(f"{what}: op must be Average or Sum, got {op!r}")
    ps = resolve(process_set, what)
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    ih = _core(hvdlite.allgather_async, indices,
               None if name is None else horovod_name("allgather", f"{name}.indices"),
               process_set=ps.core)
    vh = _core(hvdlite.allgather_async, _raw(values),
               None if name is None else horovod_name("allgather", f"{name}.values"),
               process_set=ps.core)
    n = ps.size

    def finish(results: list[Any]) -> torch.Tensor:
        idx, vals = results[0], _unraw(results[1], values.dtype)
        if op is Average:
            vals = vals / n
        return torch.sparse_coo_tensor(idx.t(), vals, tensor.size(), check_invariants=False)

    return _derived([ih, vh], finish)


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
    if type(handle) is Handle:  # every handle hvdlite makes: no bound method made
        return handle.wait()
    try:
        wait = handle.wait
    except AttributeError:
        raise TypeError(f"synchronize: expected a handle from a *_async call, got "
                        f"{handle!r}") from None
    return wait()
