"""Allreduce of torch tensors by Horovod's rules, with no torch work per call in the steady state.

Per call, the steady state costs a few dictionary lookups above the NumPy/CuPy API:

- what depends only on (dtype, op, factors, process set) is a cached :class:`Plan`: the
  core's op and factors (``Average`` is a ``Sum`` with ``postscale / set size``, so joined
  ranks count in the divisor and integers truncate toward zero, as Horovod), whether the
  scaling must happen in torch (bfloat16; float16 with a factor float16 cannot hold), and the
  checked process set;
- the core gets the tensor's NumPy/CuPy view, cached per tensor (:mod:`hvdlite._torchref`),
  so a repeated call meets the core's steady-state lane for that array; CUDA tensors name
  torch's current stream (a CuPy stream object cached per torch stream);
- the handle hands back the caller's own tensor (in place), or an output tensor kept per
  input that the core wrote into (``out=``) and that is handed out again only once nothing
  refers to it (:class:`Outputs`).

bfloat16 (which NumPy cannot hold) and float16 with an inexact factor take the general path:
scaled in float32 in torch, reduced by the core with factors of 1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

import hvdlite
from hvdlite._engine import default_engine
from hvdlite._ops import ReduceOp
from hvdlite._torchref import _views, array_of, stream_of, to_torch
from hvdlite.errors import HvdliteError, NotInitializedError
from hvdlite.torch._handles import FreshHandle, Handle, InPlaceHandle
from hvdlite.torch.errors import InvalidArgumentError, NotInitializedValueError
from hvdlite.torch.process_sets import resolve

__all__ = ["Plan", "plan_for", "allreduce_async", "allreduce_now", "scale", "check_tensor",
           "invalid"]

_LOW = (torch.float16, torch.bfloat16)
_HALF_MAX = 65504.0
_MAX_PLANS = 4096  # factors that change every step (a schedule) must not grow it forever


class Plan(NamedTuple):
    """A reduction's checked facts for one (dtype, op, factors, process set)."""

    engine: Any  # the engine it was checked against (a restart invalidates it)
    set_id: int | None  # the process set's id when checked (removal invalidates it)
    process_set: Any  # keeps the set object alive while its id() keys the cache
    core_set: Any  # what the core takes as process_set= (None: the global set)
    size: int  # the set's size
    op: ReduceOp  # the core's op
    pre: float
    post: float
    in_torch: bool  # scale in torch (float32), reduce with factors of 1
    ordered: bool  # asynchronous completion: a CUDA result's stream must be ordered after it


_plans: dict[tuple[Any, ...], Plan] = {}


def invalid(exc: ValueError) -> BaseException:
    """A core argument ``ValueError`` as Horovod's flavour (:class:`InvalidArgumentError`,
    both a ``ValueError`` and a ``RuntimeError``); hvdlite's own errors unchanged."""
    if isinstance(exc, (InvalidArgumentError, HvdliteError)):
        return exc
    return InvalidArgumentError(str(exc))


def check_tensor(t: Any, what: str) -> torch.Tensor:
    """``t`` if it is a torch tensor this layer can reduce; ``TypeError`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not supported here; use "
                        "sparse_allreduce_async or tensor.to_dense()")
    return t


def _factor(value: Any, label: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: {label} must be a real number, got {value!r}")
    return float(value)


def _exact_half(factor: float) -> bool:
    if abs(factor) > _HALF_MAX:
        return False
    return float(np.float16(factor)) == factor


def _engine(what: str) -> Any:
    try:
        return default_engine()
    except NotInitializedError as exc:
        raise NotInitializedValueError(f"{what}: {exc}; call hvd.init() first") from None


def plan_for(dtype: torch.dtype, op: ReduceOp, pre: Any, post: Any, process_set: Any,
             what: str) -> Plan:
    """The cached :class:`Plan` for reducing ``dtype`` tensors; checked (``TypeError`` for
    bad factors or ``Average`` of bool, :class:`InvalidArgumentError` for a bad set) on the
    first call of each combination and whenever the engine or the set changed."""
    engine = _engine(what)
    try:
        key: tuple[Any, ...] | None = (dtype, op, pre, type(pre), post, type(post),
                                       id(process_set))
        plan = _plans.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable factor: the checks below name it
        key, plan = None, None
    if (plan is not None and plan.engine is engine
            and plan.set_id == getattr(process_set, "process_set_id", 0)):
        return plan
    ps = resolve(process_set, what)
    core_pre = _factor(pre, "prescale_factor", what)
    core_post = _factor(post, "postscale_factor", what)
    core_op = op
    if op is ReduceOp.AVERAGE:
        if dtype == torch.bool:
            raise TypeError(f"{what}: op Average is not defined for bool tensors; use Sum "
                            "(logical or), Min or Max")
        core_op = ReduceOp.SUM
        core_post = core_post / ps.size
    # float16: the core scales in float16 arithmetic (each product computed in float32 and
    # rounded), which equals Horovod's float32 rule when the factor itself is a float16 value
    # (1, 1/2, 1/4 ...: Average over a power-of-two size); otherwise scale here.
    in_torch = dtype == torch.bfloat16 or (
        dtype == torch.float16 and not (_exact_half(core_pre) and _exact_half(core_post)))
    set_id = 0 if ps.core is None else ps.core.process_set_id
    # Unknown (a core without the knob): order the stream, which is always correct.
    ordered = bool(getattr(getattr(engine, "config", None), "async_completion", True))
    plan = Plan(engine, set_id, process_set, ps.core, ps.size, core_op, core_pre, core_post,
                in_torch, ordered)
    if key is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


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


def _array(t: torch.Tensor, what: str) -> Any:
    # An entry exists only while its tensor lives (a weakref callback drops it), so the same
    # id() is the same tensor; the rest says it still holds the memory the view covers.
    entry = _views.get(id(t))
    if (entry is not None and entry.ptr == t.data_ptr() and entry.shape == t.shape
            and entry.dtype is t.dtype and t.is_contiguous()):
        return entry.array
    return array_of(check_tensor(t, what), what)


def horovod_name(op: str, name: Any) -> Any:
    """The name the core gets for a user's ``name``: horovod.torch's ``<op>.<name>`` (its
    ``GetOpName``), so timeline rows, errors and stall reports read as Horovod's. None and
    "" stay unnamed (the core numbers them ``<op>.noname.N``, as Horovod does); a name that is
    not a str goes on for the core to refuse."""
    if type(name) is str:
        return f"{op}.{name}" if name else None
    return name


def _named(what: str, name: str | None) -> str:
    """How errors name the call: "allreduce of tensor 'grad.w'" when it has a name."""
    return what if name is None else f"{what} of tensor {name!r}"


def _fast(tensors: list[Any], op: ReduceOp, pre: Any, post: Any, group: bool, what: str,
          process_set: Any) -> tuple[Plan, Any, int] | None:
    """(plan, the core's array or list of arrays, CUDA ordinal or -1), or None when the
    call needs the general path (torch-side scaling, mixed dtypes)."""
    first = tensors[0]
    try:
        plan = _plans.get((first.dtype, op, pre, type(pre), post, type(post), id(process_set)))
        engine = default_engine()
    except (AttributeError, TypeError, NotInitializedError):
        plan = None
    if (plan is None or plan.engine is not engine
            or plan.set_id != getattr(process_set, "process_set_id", 0)):
        plan = plan_for(check_tensor(first, what).dtype, op, pre, post, process_set, what)
    if plan.in_torch:
        return None
    device = first.get_device() if first.is_cuda else -1
    if not group:
        return plan, _array(first, what), device
    dtype = first.dtype
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype is not dtype:
            return None
    return plan, [_array(t, what) for t in tensors], device


def allreduce_one(t: Any, name: str | None, op: ReduceOp, pre: Any, post: Any,
                  process_set: Any, inplace: bool, what: str, blocking: bool = False) -> Any:
    """:func:`allreduce_async` (or, ``blocking``, :func:`allreduce_now`) of one tensor: the
    per-call hot path of ``allreduce_async``, ``allreduce_``, ``allreduce`` and
    ``DistributedOptimizer``. A tensor called again with the same op, factors and process
    set reuses the checked plan kept on its cache entry: a handful of comparisons, then the
    core."""
    entry = _views.get(id(t))
    if entry is not None and process_set is not None:
        memo = entry.memo
        if (memo is not None and memo[0] is op and memo[1] is pre and memo[2] is post
                and entry.ptr == t.data_ptr() and entry.shape == t.shape
                and entry.dtype is t.dtype and t.is_contiguous()):
            plan = memo[3]
            try:
                if (plan.process_set is process_set and plan.engine is default_engine()
                        and plan.set_id == process_set.process_set_id):
                    return _one(t, entry, name, plan, inplace, blocking)
            except NotInitializedError:
                pass  # the general path below raises Horovod's flavour of it
            except ValueError as exc:
                raise invalid(exc) from None
    if blocking:
        result = allreduce_now([t], name, op, pre, post, inplace, False, what, process_set)
    else:
        result = allreduce_async([t], name, op, pre, post, inplace, False, what, process_set)
    entry = _views.get(id(t))
    if entry is not None:
        plan = _plans.get((t.dtype, op, pre, type(pre), post, type(post), id(process_set)))
        if plan is not None and not plan.in_torch:
            entry.memo = (op, pre, post, plan)
    return result


def _one(t: torch.Tensor, entry: Any, name: str | None, plan: Plan, inplace: bool,
         blocking: bool) -> Any:
    """The steady state of :func:`allreduce_one`: ``t``'s cached ``entry`` and ``plan``."""
    if type(name) is str:
        name = f"allreduce.{name}" if name else None
    if entry.device >= 0:
        return _one_cuda(t, entry, name, plan, inplace, blocking)
    core, array = plan.core_set, entry.array
    if inplace:
        if blocking:
            hvdlite.allreduce_(array, name, plan.op, plan.pre, plan.post, process_set=core)
            return t
        return InPlaceHandle(hvdlite.allreduce_async_(array, name, plan.op, plan.pre,
                                                      plan.post, process_set=core), t, None)
    out = _output(t)
    if blocking:
        hvdlite.allreduce(array, name, plan.op, plan.pre, plan.post, out=out.array,
                          process_set=core)
        return out.tensor
    return InPlaceHandle(hvdlite.allreduce_async(array, name, plan.op, plan.pre, plan.post,
                                                 out=out.array, process_set=core),
                         out.tensor, None)


def _one_cuda(t: torch.Tensor, entry: Any, name: str | None, plan: Plan, inplace: bool,
              blocking: bool) -> Any:
    name = horovod_name("allreduce", name)
    stream = stream_of(entry.device)
    order = stream if plan.ordered else None
    kw: dict[str, Any] = {"stream": stream, "process_set": plan.core_set}
    result = t
    if not inplace:
        out = _output(t)
        kw["out"], result = out.array, out.tensor
    array = entry.array
    if not blocking:
        fn = hvdlite.allreduce_async_ if inplace else hvdlite.allreduce_async
        return InPlaceHandle(fn(array, name, plan.op, plan.pre, plan.post, **kw), result, order)
    fn = hvdlite.allreduce_ if inplace else hvdlite.allreduce
    if order is not None:
        with order:
            fn(array, name, plan.op, plan.pre, plan.post, **kw)
    else:
        fn(array, name, plan.op, plan.pre, plan.post, **kw)
    return result


def allreduce_async(tensors: list[Any], name: str | None, op: ReduceOp, pre: Any, post: Any,
                    inplace: bool, group: bool, what: str, process_set: Any) -> Handle:
    """Start the allreduce of ``tensors`` (one, or a grouped call's list) and return its
    handle; ``op`` already resolved. ``TypeError``/``ValueError`` for bad arguments.

    The fast path hands the core each tensor's cached array (the core's steady-state lane
    matches on the array object) and torch's current stream for CUDA tensors; a tensor's new
    result is one of a few output tensors kept per input and handed out again once nothing
    refers to them (:class:`Outputs`), as the core recycles its own."""
    fast = _fast(tensors, op, pre, post, group, _named(what, name), process_set)
    if fast is None:
        return _general(tensors, name, op, pre, post, inplace, group, what, process_set)
    plan, arrays, device = fast
    name = horovod_name("grouped_allreduce" if group else "allreduce", name)
    stream = stream_of(device) if device >= 0 else None
    order = stream if plan.ordered else None
    kw = {"stream": stream, "process_set": plan.core_set}
    try:
        if group:
            fn = hvdlite.grouped_allreduce_async_ if inplace else hvdlite.grouped_allreduce_async
            part = fn(arrays, name, plan.op, plan.pre, plan.post, **kw)
            if inplace:
                return InPlaceHandle(part, list(tensors), order)
            return FreshHandle(part, order, True)
        if inplace:
            part = hvdlite.allreduce_async_(arrays, name, plan.op, plan.pre, plan.post, **kw)
            return InPlaceHandle(part, tensors[0], order)
        if device < 0:
            part = hvdlite.allreduce_async(arrays, name, plan.op, plan.pre, plan.post, **kw)
            return FreshHandle(part, None, False)
        out = _output(tensors[0])
        part = hvdlite.allreduce_async(arrays, name, plan.op, plan.pre, plan.post, out=out.array,
                                       **kw)
        return InPlaceHandle(part, out.tensor, order)
    except ValueError as exc:
        raise invalid(exc) from None


def allreduce_now(tensors: list[Any], name: str | None, op: ReduceOp, pre: Any, post: Any,
                  inplace: bool, group: bool, what: str, process_set: Any) -> Any:
    """Blocking :func:`allreduce_async`: the result (a tensor or list). It calls the core's
    blocking form, whose caller runs the negotiation itself (no thread hand-off); with
    asynchronous completion torch's current stream is made CuPy's for the call, so the stream
    the core orders after the collective is torch's."""
    fast = _fast(tensors, op, pre, post, group, _named(what, name), process_set)
    if fast is None or (group and fast[2] >= 0 and not inplace):
        return allreduce_async(tensors, name, op, pre, post, inplace, group, what,
                               process_set).wait()
    plan, arrays, device = fast
    name = horovod_name("grouped_allreduce" if group else "allreduce", name)
    fn: Callable[..., Any]
    if group:
        fn = hvdlite.grouped_allreduce_ if inplace else hvdlite.grouped_allreduce
    else:
        fn = hvdlite.allreduce_ if inplace else hvdlite.allreduce
    kw: dict[str, Any] = {"process_set": plan.core_set}
    result: Any = None
    if device >= 0:
        kw["stream"] = stream_of(device)
        if not inplace and not group:
            out = _output(tensors[0])
            kw["out"], result = out.array, out.tensor
    try:
        if device >= 0 and plan.ordered:
            with kw["stream"]:
                got = fn(arrays, name, plan.op, plan.pre, plan.post, **kw)
        else:
            got = fn(arrays, name, plan.op, plan.pre, plan.post, **kw)
    except ValueError as exc:
        raise invalid(exc) from None
    if inplace:
        return list(tensors) if group else tensors[0]
    if result is not None:
        return result
    return [to_torch(a) for a in got] if group else to_torch(got)


class Outputs:
    """One reusable output of an allreduce: a torch tensor and the core's array over it.

    ``refs`` are the reference counts measured when only hvdlite held them (the tensor, its
    storage's users, which views add to, and the array, which the core holds while the
    collective runs); the output is free again when the counts are back to those values, the
    way the core recycles its own results."""

    __slots__ = ("tensor", "array", "refs")

    def __init__(self, tensor: torch.Tensor, array: Any) -> None:
        self.tensor = tensor
        self.array = array
        self.refs = (0, 0, 0)

    def counts(self) -> tuple[int, int, int]:
        t = self.tensor
        return (sys.getrefcount(t), _storage_users(t.untyped_storage()._cdata),
                sys.getrefcount(self.array))


_RING = 2  # outputs kept per input: the one the caller holds and one to fill next
_storage_users: Callable[[int], int] = torch._C._storage_Use_Count


def _output(t: torch.Tensor) -> Outputs:
    """An output for ``t``: a free one of its ring, or a new one, kept in the ring only from
    ``t``'s second output on (a tensor reduced once holds no spare memory)."""
    entry = _views[id(t)]  # _fast just viewed t
    outs = entry.outs
    for out in outs or ():
        if out.counts() == out.refs:
            return out
    made = Outputs(torch.empty_like(t), None)
    made.array = array_of(made.tensor, "allreduce output")
    if outs is None:
        entry.outs = []
    elif len(outs) < _RING:
        made.refs = made.counts()
        outs.append(made)
    return made


def _general(tensors: list[Any], name: str | None, op: ReduceOp, pre: Any, post: Any,
             inplace: bool, group: bool, what: str, process_set: Any) -> Handle:
    """Mixed dtypes, bfloat16, float16 with an inexact factor: scale in torch (float32 for
    the 16-bit types); the core gets factors of 1 and reduces private copies in place.
    bfloat16 travels as float32 and is rounded once at the end."""
    tensors = [check_tensor(t, what) for t in tensors]
    plans = [plan_for(t.dtype, op, pre, post, process_set, what) for t in tensors]
    plan = plans[0]
    in_torch = any(p.in_torch for p in plans)
    core_pre, core_post = (1.0, 1.0) if in_torch else (plan.pre, plan.post)
    sends = [_send(t, plan.pre, inplace) for t in tensors] if in_torch else tensors
    core_inplace = inplace or in_torch
    name = horovod_name("grouped_allreduce" if group else "allreduce", name)
    fn: Callable[..., Any]
    try:
        if group:
            fn = hvdlite.grouped_allreduce_async_ if core_inplace else \
                hvdlite.grouped_allreduce_async
            part = fn(sends, name, plan.op, core_pre, core_post, process_set=plan.core_set)
        else:
            fn = hvdlite.allreduce_async_ if core_inplace else hvdlite.allreduce_async
            part = fn(sends[0], name, plan.op, core_pre, core_post, process_set=plan.core_set)
    except ValueError as exc:
        raise invalid(exc) from None
    post_f = plan.post

    def finish(results: list[Any]) -> Any:
        outs = results[0] if group else [results[0]]
        final = []
        for t, r in zip(tensors, outs, strict=True):
            if in_torch:
                r = _unscale(r, t.dtype, post_f)
                if inplace and r is not t:
                    t.copy_(r)
                    r = t
            final.append(r)
        return final if group else final[0]

    return Handle([part], finish)


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
