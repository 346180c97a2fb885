"""The one route of every collective call (``hvdlite/_collectives.py`` holds the public
functions over it), top to bottom in :func:`_submit`:

1. the plan: the name's lane (``_vocab/plans.py``) if the call repeats it (same layout,
   same parameters: a few comparisons, ``Lane.bind``), else a new one built by the template
   (validate the arguments, resolve the tensor, its dtype and device, build the request and
   the output: :func:`_build`), kept as the name's lane;
2. a repeated blocking allreduce with nothing else pending leaves here: its round and its
   collective run on the calling thread (``_control/immediate.py``);
3. every other call leaves here: one entry (a grouped call is one) on the engine's queue,
   negotiated and run by a cycle.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvdlite._adasum import check_size
from hvdlite._control.channel import Channel
from hvdlite._control.immediate import DONE, MISS, prepare, run_now
from hvdlite._engine import Engine, default_engine
from hvdlite._handles import Handle
from hvdlite._lru import Bounded
from hvdlite._ops import Average, DType, ReduceOp, check_device_dtype, check_op, lookup_dtype
from hvdlite._sets import set_id_of
from hvdlite._tensors import TensorRef, identity, wrap
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.messages import SPECS, Kind, Request
from hvdlite._vocab.plans import Call, Lane, Results, span_of

__all__ = ["_submit", "_as_list"]

# Array types a lane matches on: cupy.ndarray joins once CuPy is imported (see _lane_types).
_LANE_TYPES: tuple[type, ...] = (np.ndarray,)


def _check_name(name: object) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}")


def _what(kind: Kind, name: str) -> str:
    """How errors name the call (built only when an error is raised)."""
    return f"{kind.name.lower()} of tensor {name!r}"


def _check_factor(value: object, label: str, row: DType, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: {label} must be a real number, got {value!r}")
    if row.kind == "bool" and value != 1.0:
        raise TypeError(f"{what}: {label} cannot scale a bool tensor; cast it first")
    return float(value)


def _writable(arr: Any, what: str, label: str) -> None:
    flags = getattr(arr, "flags", None)
    if flags is not None and not getattr(flags, "writeable", True):
        raise ValueError(f"{what}: {label} is read-only; pass a writable array (e.g. a copy)")


def _output(kind: Kind, ref: TensorRef, out: Any, inplace: bool, name: str) -> Any:
    """The output array of an in-place or ``out=`` call, checked (the caller's)."""
    src = ref.array
    if inplace:
        if not getattr(src.flags, "writeable", True):  # CuPy arrays have no such flag
            _writable(src, _what(kind, name), "the in-place tensor")
        return src
    what = _what(kind, name)
    oref = wrap(out, f"{what} (out=)")
    arr = oref.array
    if arr.shape != src.shape or arr.dtype != src.dtype or oref.device != ref.device:
        raise ValueError(
            f"{what}: out= must match the input; expected {src.dtype}{list(src.shape)} on "
            f"{ref.device}, got {arr.dtype}{list(arr.shape)} on {oref.device}"
        )
    _writable(arr, what, "out=")
    return arr


# Horovod's Average of device float32/float64 with factors of 1 over a power-of-two set size
# stays the core's Average: NCCL averages inside the collective, with no scaling kernel after
# it, and a single tensor keeps the direct and immediate paths (``_control/immediate.py``),
# which take no factors. 1/size is a power of two, so premultiplying by it, as NCCL does for
# floats, gives Horovod's sum times 1/size bit for bit, except where a value is subnormal or
# the sum overflows (Horovod: inf). float16 stays a Sum (its subnormals are common).
_DEVICE_AVERAGE = frozenset({"float32", "float64"})

# Checks that depend only on (dtype, device kind, collective, op, factors), done once per key
# per process: a call that misses its lane still validates by one dict lookup. Bounded: a
# schedule may change a factor every step.
_checked: Bounded[tuple[Any, ...], tuple[int, float, float]] = Bounded(256)


def _submit(
    kind: Kind,
    tensors: Sequence[Any],
    name: str | None,
    *,
    op: ReduceOp = Average,
    root: int = -1,
    prescale: float = 1.0,
    postscale: float = 1.0,
    splits: Sequence[int] | None = None,
    outs: Sequence[Any] | None = None,
    inplace: bool = False,
    group: bool = False,
    stream: Any = None,
    block: bool = False,
    process_set: Any = None,
    horovod: bool = False,
    array: Any = None,
) -> Any:
    """The one template: validate, resolve the process set, the tensor and its stream, look
    up the dtype, build request and output, submit; returns the handle. ``block`` (the
    blocking forms) returns the result instead: the caller waits at once and runs the cycle
    itself, so the background thread is not woken (and a repeated allreduce with nothing else
    pending takes the immediate path, ``_control/immediate.py``). ``horovod``: Horovod's
    reduction rules (``hvdlite.torch``): ``Average`` is a ``Sum`` with ``postscale / set
    size``, so integer averages truncate toward zero, and bool tensors refuse it. ``array``:
    a viewed framework's cached array of its single tensor, already checked at its edge
    (``hvdlite/_torchref.py``'s ``edge``), used where the name's lane is that framework's."""
    engine = default_engine()  # a stopped engine refuses the call at submission (or its round)
    if engine.scheduler.capture_thread is not None:  # refused before anything is allocated
        engine.scheduler.check_usable()
    channel = (
        engine.global_channel if process_set is None else engine.channel_for(set_id_of(process_set))
    )
    if op is ReduceOp.ADASUM:
        check_size(channel.size, kind.name.lower() if name is None else _what(kind, name))
    if not tensors:  # barrier, join: nothing to move, only an agreement
        _check_name(name)
        base = name if name is not None else engine.auto_name(kind.name.lower(), channel.id)
        handle = Handle(base)
        engine.scheduler.submit(Entry(Request(base, kind), None, None, handle), not block, channel)
        return handle.wait() if block else handle
    # The parameters with their types: 1 == Sum and True == 1.0 compare equal, and must not
    # pass for each other on a lane.
    params = (kind, op, type(op), prescale, type(prescale), postscale, type(postscale), root,
              type(root), inplace, group, stream, horovod)
    out = outs[0] if outs is not None else None
    # 1. The call's plan: its name's lane, if the call repeats it ...
    lane = channel.lanes.get(name) if name is not None and splits is None else None
    call = None
    if lane is not None:
        steady = engine.tracer.stats.steady
        made = lane.allocated
        view = lane.view  # a viewed framework's edge (torch): its cached arrays, or the one
        # its frontend already looked up (``array``)
        arrays = tensors if view is None else (array,) if array is not None else view(tensors)
        call = lane.bind(arrays, tensors, out, inplace, params, engine.reclaim)
        steady["lane_misses" if call is None else "lane_hits"] += 1
        steady["results_allocated"] += lane.allocated - made
        # 2. ... which a blocking allreduce with nothing else pending runs on this thread.
        if call is not None and block and kind is Kind.ALLREDUCE:
            done = run_now(engine, channel, lane, call, stream)
            if done is DONE:
                steady["immediate"] += 1
                return call.value(lane)
            if done is not MISS:
                return done.wait()  # the round agreed on more: the call was queued
    if lane is None or call is None:
        # ... or a new plan, built by the template (and kept as the name's lane).
        lane, call = _build(engine, channel, kind, tensors, name, op, root, prescale,
                            postscale, splits, out, inplace, group, stream, params, horovod)
    # 3. Everything else: the queue, negotiated and run by a cycle.
    entry = call.entry(lane)
    prepare(engine, entry, lane.framework, stream)
    engine.scheduler.submit(entry, not block, channel)
    return entry.handle.wait() if block else entry.handle


def _build(engine: Engine, channel: Channel, kind: Kind, tensors: Sequence[Any],
           name: str | None, op: ReduceOp, root: int, prescale: float, postscale: float,
           splits: Sequence[int] | None, out: Any, inplace: bool, group: bool, stream: Any,
           params: tuple[Any, ...], horovod: bool) -> tuple[Lane, Call]:
    """The template: a new plan (lane) for the call, and the call bound to it."""
    if name is not None and type(name) is not str:
        _check_name(name)
    base = name if name is not None else engine.auto_name(kind.name.lower(), channel.id)
    size = channel.size if horovod else 0
    if group:
        lane, call, kept = _new_group(channel, kind, tensors, base, op, prescale, postscale,
                                      inplace, params, size)
    else:
        lane, call, kept = _new_single(channel, kind, tensors[0], base, op, root, prescale,
                                       postscale, splits, out, inplace, params, size)
    if stream is not None and lane.device_id >= 0:
        _check_stream(stream, lane.device_id, kind, base)
    engine.tracer.stats.steady["results_allocated"] += lane.allocated
    if kept and name is not None and splits is None:
        channel.lanes.keep(name, lane)
    return lane, call


def _check_stream(stream: Any, device_id: int, kind: Kind, name: str) -> None:
    """``ValueError`` if ``stream`` belongs to another device than the tensor (CUDA would
    refuse the READY record with a bare 'invalid resource handle')."""
    where = getattr(stream, "device_id", None)
    if where is None:  # a torch stream
        where = getattr(getattr(stream, "device", None), "index", None)
    if isinstance(where, int) and where >= 0 and where != device_id:
        raise ValueError(f"{_what(kind, name)}: stream= is a stream of device {where}, the "
                         f"tensor is on device {device_id}; pass a stream of the tensor's "
                         "device, or none (its current stream)")


# -- the template, for a call its lane cannot serve ----------------------------------------
def _validated(kind: Kind, ref: TensorRef, name: str, op: ReduceOp, prescale: float,
               postscale: float, size: int) -> tuple[DType, tuple[int, float, float]]:
    """The dtype's row and the checked (op, prescale, postscale) the request carries;
    ``size`` > 0: Horovod's rules over a set of that size (see :func:`_submit`)."""
    row = lookup_dtype(ref.array.dtype, kind, name)
    try:
        key: tuple[Any, ...] | None = (row.name, ref.device_id >= 0, kind, op, type(op),
                                       prescale, type(prescale), postscale, type(postscale),
                                       size)
        checked = _checked.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable argument: the checks below name it
        key, checked = None, None
    if checked is None:
        checked = _check_reduction(kind, row, ref.is_cuda, op, prescale, postscale,
                                   _what(kind, name), size)
        if key is not None:
            _checked.keep(key, checked)
    return row, checked


def _new_single(channel: Channel, kind: Kind, tensor: Any, name: str, op: ReduceOp,
                root: int, prescale: float, postscale: float, splits: Sequence[int] | None,
                out: Any, inplace: bool, params: tuple[Any, ...],
                size: int) -> tuple[Lane, Call, bool]:
    ref = wrap(tensor, kind, name)
    row, checked = _validated(kind, ref, name, op, prescale, postscale, size)
    fields = _fields(channel, kind, name, ref, row.name, checked, root, splits, "", 0)
    req = channel.remember(name, fields)
    to_user = None if ref.to_user is identity else ref.to_user
    lane = Lane(req, params, ref.array, ref.device_id, ref.framework, to_user,
                _result_maker(ref.array, ref.device_id) if SPECS[kind].preallocated else None)
    lane.view, lane.counts, lane.ring = ref.view, ref.counts, ref.ring
    user = None
    if inplace or out is not None:
        output = _output(kind, ref, out, inplace, name)
        user = tensor if inplace else out
    else:
        res = lane.result(keep=False)  # kept from the name's second call on
        output = res.views[0] if res is not None else None
        if res is not None and res.user is not None:
            user = res.user[0]
    # A lane matches the caller's array type: arrays hvdlite uses as they are, or a viewed
    # framework's cached views (its edge hands the lane the same array every call).
    return lane, Call(ref.array, output, None, user, ref.array.nbytes), (
        ref.view is not None or type(tensor) in _lane_types())


def _new_group(channel: Channel, kind: Kind, tensors: Sequence[Any], name: str,
               op: ReduceOp, prescale: float, postscale: float, inplace: bool,
               params: tuple[Any, ...], size: int) -> tuple[Lane, Call, bool]:
    refs = [wrap(t, kind, f"{name}.{i}") for i, t in enumerate(tensors)]
    devices = {r.device_id for r in refs}
    if len(devices) > 1:
        shown = ", ".join(sorted({r.device for r in refs}))
        raise ValueError(f"{_what(kind, name)}: a grouped call's tensors must share one device, "
                         f"got {shown}; group host and device tensors in separate calls")
    rows = []
    checked: tuple[int, float, float] = (0, 1.0, 1.0)
    for i, ref in enumerate(refs):
        row, checked = _validated(kind, ref, f"{name}.{i}", op, prescale, postscale, size)
        rows.append(row)
    first = refs[0]
    arrays = [r.array for r in refs]
    names = tuple(r.name for r in rows)
    dtype: Any = names[0] if len(set(names)) == 1 else names
    shapes = tuple(a.shape for a in arrays)
    opv, pre, post = checked
    fields = (name, kind, dtype, shapes, "cuda" if first.is_cuda else "cpu", opv, -1, pre,
              post, (), name, len(arrays))
    req = channel.remember(name, fields)
    to_user = None if first.to_user is identity else first.to_user
    lane = Lane(req, params, first.array, first.device_id, first.framework, to_user,
                _group_result_maker(arrays, first.device_id))
    lane.view, lane.counts = first.view, first.counts
    lane.shapes = shapes
    lane.request_bytes = sum(a.nbytes for a in arrays)
    # A lane matches the same member objects, so it holds them, but only for a name that
    # repeats: a name's first lane holds none (its next call comes back here).
    lane.inputs = tuple(arrays) if name in channel.lanes else ()
    lane.inplace = inplace
    if inplace:
        for i, ref in enumerate(refs):
            _output(kind, ref, None, True, f"{name}.{i}")
        lane.span = span_of(arrays, first.framework)
        call = Call(arrays, arrays, lane.span, list(tensors), lane.request_bytes)
    else:
        res = lane.result(keep=bool(lane.inputs))
        assert res is not None
        call = Call(arrays, res.views, res.flat, res.user, lane.request_bytes)
    # A lane matches the caller's own objects (or a viewed framework's cached views of them)
    # of one dtype (what matches_group compares).
    reusable = (first.view is not None or all(type(t) in _lane_types() for t in tensors)) \
        and type(dtype) is str
    return lane, call, reusable


def _lane_types() -> tuple[type, ...]:
    """Array types a lane may match on (CuPy's once CuPy has been imported by someone)."""
    global _LANE_TYPES
    if len(_LANE_TYPES) == 1:
        import sys

        cupy = sys.modules.get("cupy")
        if cupy is not None:
            _LANE_TYPES = (np.ndarray, cupy.ndarray)
    return _LANE_TYPES


def _empty(shape: Any, dtype: Any, device_id: int) -> Any:
    if device_id >= 0:
        import cupy

        with cupy.cuda.Device(device_id):
            return cupy.empty(shape, dtype=dtype)
    return np.empty(shape, dtype=dtype)


def _result_maker(array: Any, device_id: int) -> Any:
    shape, dtype = array.shape, array.dtype  # not the array: a lane must not hold the input

    def make() -> Results:
        return Results(None, [_empty(shape, dtype, device_id)])

    return make


def _group_result_maker(arrays: Sequence[Any], device_id: int) -> Any:
    """Results for a grouped call: views of one flat buffer, in member order (so the unit
    reduces in its own result buffer: no copy out), or separate arrays for mixed dtypes."""
    shapes = [a.shape for a in arrays]
    dtypes = [a.dtype for a in arrays]
    sizes = [a.size for a in arrays]

    def make() -> Results:
        if len(set(dtypes)) > 1:
            return Results(None, [_empty(s, d, device_id)
                                  for s, d in zip(shapes, dtypes, strict=True)])
        flat = _empty((sum(sizes),), dtypes[0], device_id)
        return Results(flat, _views(flat, shapes, sizes, device_id))

    return make


def _views(flat: Any, shapes: Sequence[Any], sizes: Sequence[int], device_id: int) -> list[Any]:
    views, offset = [], 0
    if device_id >= 0:
        import cupy

        mem, step, dtype = flat.data, flat.dtype.itemsize, flat.dtype
        for shape, n in zip(shapes, sizes, strict=True):
            views.append(cupy.ndarray(shape, dtype, mem + offset * step))
            offset += n
        return views
    for shape, n in zip(shapes, sizes, strict=True):
        views.append(flat[offset:offset + n].reshape(shape))
        offset += n
    return views


def _check_reduction(
    kind: Kind,
    row: DType,
    is_cuda: bool,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    what: str,
    size: int = 0,
) -> tuple[int, float, float]:
    """The checks that depend only on the dtype: op, scale factors, device support.
    ``size`` > 0: Horovod's rules (``Average`` is a ``Sum`` with ``postscale / size``; on the
    device, see ``_DEVICE_AVERAGE``)."""
    opv = 0
    reduces = SPECS[kind].reduces
    if reduces:
        if op is ReduceOp.ADASUM and kind is not Kind.ALLREDUCE:  # whatever the dtype
            raise NotImplementedError(f"{what}: op Adasum is implemented for allreduce only "
                                      "(as in Horovod); use Sum or Average here")
        if size and op is ReduceOp.AVERAGE:
            if row.kind == "bool":
                raise TypeError(f"{what}: op Average is not defined for bool tensors; use Sum "
                                "(logical or), Min or Max")
            prescale = _check_factor(prescale, "prescale_factor", row, what)
            postscale = _check_factor(postscale, "postscale_factor", row, what)
            if not (is_cuda and prescale == 1.0 and postscale == 1.0 and size & (size - 1) == 0
                    and row.name in _DEVICE_AVERAGE):
                postscale, op = postscale / size, ReduceOp.SUM
        opv = int(check_op(row, op, what))
        prescale = _check_factor(prescale, "prescale_factor", row, what)
        postscale = _check_factor(postscale, "postscale_factor", row, what)
    if is_cuda:
        check_device_dtype(row, ReduceOp(opv) if reduces else None, what)
    return opv, prescale, postscale


def _fields(
    channel: Channel,
    kind: Kind,
    name: str,
    ref: TensorRef,
    dtype: str,
    checked: tuple[int, float, float],
    root: int,
    splits: Sequence[int] | None,
    group: str,
    group_size: int,
) -> tuple[Any, ...]:
    """The request's fields, as a plain tuple (compared with the name's last request)."""
    shape = ref.array.shape
    opv, prescale, postscale = checked
    split_t: tuple[int, ...] = ()
    if kind is not Kind.ALLREDUCE:
        if kind is Kind.BROADCAST:  # a global rank; the set's own rank travels
            whole = channel.id == 0
            root = channel.ranks.index(_root(root, channel.ranks, _what(kind, name), whole))
        if SPECS[kind].needs_dim0 and not shape:
            raise ValueError(
                f"{_what(kind, name)}: needs at least one dimension, got a 0-d "
                "tensor; reshape it to (1,)"
            )
        if kind is Kind.ALLTOALL:
            split_t = _splits(splits, shape[0], channel.size, _what(kind, name))
    device = "cuda" if ref.is_cuda else "cpu"
    return (
        name,
        kind,
        dtype,
        shape,
        device,
        opv,
        root,
        prescale,
        postscale,
        split_t,
        group,
        group_size,
    )


def _root(root: object, ranks: tuple[int, ...], what: str, whole: bool) -> int:
    try:
        value = operator.index(root)  # type: ignore[arg-type]  # int or NumPy integer
    except TypeError:
        value = -1
    if isinstance(root, bool) or value not in ranks:
        if whole:
            raise ValueError(f"{what}: root_rank must be an int in [0, {len(ranks)}), got "
                             f"{root!r}")
        raise ValueError(f"{what}: root_rank must be one of the process set's ranks "
                         f"{list(ranks)}, got {root!r}")
    return value


def _splits(splits: Sequence[int] | None, rows: int, size: int, what: str) -> tuple[int, ...]:
    if splits is None:
        if rows % size:
            raise ValueError(
                f"{what}: dim 0 ({rows}) is not divisible by size ({size}); pass splits= explicitly"
            )
        return (rows // size,) * size
    try:
        out = tuple(operator.index(s) for s in splits)  # ints only: no silent 1.5 -> 1
    except TypeError:
        raise TypeError(f"{what}: splits must be a sequence of {size} ints (rows of dim 0 per "
                        f"rank), got {splits!r}") from None
    if len(out) != size or any(s < 0 for s in out) or sum(out) != rows:
        raise ValueError(
            f"{what}: splits must be {size} non-negative ints summing to dim 0 "
            f"({rows}), got {list(out)}"
        )
    return out


def _as_list(tensors: Sequence[Any], name: str | None = None) -> list[Any]:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        what = type(tensors).__name__ + (" of 0" if isinstance(tensors, (list, tuple)) else "")
        call = f"grouped_allreduce of {name!r}: " if isinstance(name, str) else ""
        raise TypeError(f"{call}expected a non-empty list of tensors, got {what}; pass a "
                        "list or tuple of arrays, e.g. [grad_a, grad_b]")
    return list(tensors)
