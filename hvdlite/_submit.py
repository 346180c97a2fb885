"""The one template every collective follows: validate the arguments, resolve the process set,
the tensor (framework, device, stream) and its dtype, build the request and the output, and
submit to the engine. ``hvdlite/_collectives.py`` holds the public functions over it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvdlite._control.channel import Channel
from hvdlite._control.negotiation import SPECS, Kind, Request
from hvdlite._control.work import Entry
from hvdlite._engine import Engine, default_engine
from hvdlite._handles import Handle
from hvdlite._ops import Average, DType, ReduceOp, check_device_dtype, check_op, lookup_dtype
from hvdlite._sets import set_id_of
from hvdlite._tensors import TensorRef, empty_like_ref, wrap

__all__ = ["_submit", "_as_list", "_submit_set_change"]


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
    src = ref.array
    if inplace:
        if not getattr(src.flags, "writeable", True):  # CuPy arrays have no such flag
            _writable(src, _what(kind, name), "the in-place tensor")
        return src
    if out is None:
        return empty_like_ref(ref) if SPECS[kind].preallocated else None
    if type(out) is type(src) and out.shape == src.shape and out.dtype == src.dtype:
        # The steady state of out=: the same kind of array as the input, checked cheaply.
        flags = out.flags
        if type(src) is np.ndarray:
            if flags.writeable and flags.c_contiguous:
                return out
        elif (
            _module_name(out) == "cupy"
            and flags.c_contiguous
            and out.data.device_id == ref.device_id
        ):
            return out
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


def _module_name(obj: Any) -> str:
    return type(obj).__module__.split(".", 1)[0]


# Checks that depend only on (dtype, device kind, collective, op, factors), done once per key
# per process: the steady state of a training loop validates by one dict lookup.
_checked: dict[tuple[Any, ...], tuple[int, float, float]] = {}


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
    wake: bool = True,
    process_set: Any = None,
) -> Handle:
    """The one template: validate, resolve the process set, the tensor and its stream, look
    up the dtype, build request and output, submit. ``wake=False`` (the blocking forms): the
    caller waits at once and runs the cycle itself, so the background thread is not woken."""
    engine = default_engine()
    engine.check_usable()
    if name is not None and type(name) is not str:
        _check_name(name)
    channel = (
        engine.global_channel if process_set is None else engine.channel_for(set_id_of(process_set))
    )
    base = name if name is not None else engine.auto_name(kind.name.lower(), channel.id)
    handle = Handle(base, parts=max(len(tensors), 1), as_list=group)
    if not tensors:  # barrier, join: nothing to move, only an agreement
        engine.submit([Entry(Request(base, kind), None, None, handle)], handle, wake, channel)
        return handle
    entries = []
    ready: Any = None  # one READY event per call: all tensors of a call share the stream
    for i, tensor in enumerate(tensors):
        tname = f"{base}.{i}" if group else base
        ref = wrap(tensor, kind, tname)
        row = lookup_dtype(ref.array.dtype, kind, tname)
        try:
            # Types too: 1 == Sum and True == 1.0 hash alike, and must not pass as them.
            key = (row.name, ref.device_id >= 0, kind, op, type(op), prescale,
                   type(prescale), postscale, type(postscale))
            checked = _checked.get(key)
        except TypeError:  # an unhashable argument: the checks below name it
            key, checked = None, None
        if checked is None:
            checked = _check_reduction(
                kind, row, ref.is_cuda, op, prescale, postscale, _what(kind, tname)
            )
            if key is not None:
                _checked[key] = checked
        fields = _fields(
            channel,
            kind,
            tname,
            ref,
            row.name,
            checked,
            root,
            splits,
            base if group else "",
            len(tensors) if group else 0,
        )
        req = channel.remember(tname, fields)
        user_out = outs[i] if outs is not None else None
        out = (
            _output(kind, ref, user_out, inplace, tname)
            if (inplace or user_out is not None)
            else (empty_like_ref(ref) if SPECS[kind].preallocated else None)
        )
        entry = Entry(req, ref, out, handle, i, tensor if inplace else user_out)
        if ref.is_cuda:
            if ready is None:
                ready = _prepare_device(engine, ref, handle, stream)
            entry.ready = ready
        entries.append(entry)
    if ready is not None:
        handle.hold(tensors)  # CuPy has no record_stream: inputs live until DONE
        if len(entries) > 1:
            engine.gpu_runtime().context(entries[0].tensor.device_id).share(  # type: ignore
                ready, len(entries)
            )
    engine.submit(entries, handle, wake, channel)
    return handle


def _prepare_device(engine: Engine, ref: TensorRef, handle: Handle, stream: Any) -> Any:
    # Record READY on the caller's stream now: the background thread orders hvdlite's stream
    # after it (cudaStreamWaitEvent) instead of waiting for the producer on the CPU.
    runtime = engine.gpu_runtime()
    device_id = ref.device_id
    event = runtime.record_ready(ref.framework, device_id, stream)
    handle.attach_device(
        runtime.stream_waiter(ref.framework, device_id), runtime.async_completion, device_id, event
    )
    return event


def _check_reduction(
    kind: Kind,
    row: DType,
    is_cuda: bool,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    what: str,
) -> tuple[int, float, float]:
    """The checks that depend only on the dtype: op, scale factors, device support."""
    opv = 0
    reduces = SPECS[kind].reduces
    if reduces:
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


def _submit_set_change(action: int, set_id: int, ranks: tuple[int, ...]) -> int:
    """Agree a process-set change on the global set and wait until every rank applied it."""
    engine = default_engine()
    engine.check_usable()
    name = f"process_set.{'add' if action == 0 else 'remove'}.{set_id}"
    handle = Handle(name)
    req = Request(name, Kind.PROCESS_SET, shape=ranks, op=action, root=set_id)
    engine.submit([Entry(req, None, None, handle)], handle, False)
    return int(handle.wait())
