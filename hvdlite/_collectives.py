"""The public collectives. Every one follows one template:

validate the arguments, resolve the tensor (framework, device, stream), look up its dtype,
build the request and its output, and submit to the engine. The ``*_async`` forms return a
:class:`~hvdlite.Handle`; the plain forms wait on it.

``stream=`` (device tensors only): the stream whose work produces the input; default the
framework's current stream (CuPy's, or torch's for torch tensors). hvdlite records a READY event
there and orders its own stream after it, so the caller never synchronises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hvdlite._engine import default_engine
from hvdlite._handles import Handle
from hvdlite._ops import Average, ReduceOp
from hvdlite._submit import _as_list, _submit
from hvdlite._vocab.messages import Kind

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "barrier",
    "barrier_async",
    "join",
    "poll",
    "synchronize",
]


# -- allreduce ---------------------------------------------------------------------------
def allreduce_async(
    tensor: Any,
    name: str | None = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    out: Any = None,
    stream: Any = None,
    process_set: Any = None,
) -> Handle:
    """Start reducing ``tensor`` across all ranks; return a :class:`Handle` at once.

    ``op`` is one of ``Sum``, ``Average``, ``Min``, ``Max``, ``Product``. The input is
    multiplied by ``prescale_factor`` before and the result by ``postscale_factor`` after the
    reduction (integers: in float64, truncated toward zero). The result is a new array (or
    ``out``), of the input's framework, device, shape and dtype; a later call of the same name
    may hand the same array out again, but only once nothing of the caller's (the array, a
    view of it, the handle) refers to it any more. Every rank must submit the
    same ``name`` (or make the same sequence of unnamed calls) with the same shape, dtype, op
    and factors; otherwise the handle raises :class:`MismatchError` on every rank.

    Non-blocking and thread-safe. Raises ``TypeError``/``ValueError`` for bad arguments (dtype
    or op not supported, non-contiguous input, a name already in flight, bad ``out``) and
    :class:`NotInitializedError` before :func:`init`. Do not modify ``tensor`` until done.
    """
    return _submit(
        Kind.ALLREDUCE,
        [tensor],
        name,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        outs=[out],
        stream=stream,
        process_set=process_set,
    )


def allreduce(
    tensor: Any,
    name: str | None = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    out: Any = None,
    stream: Any = None,
    process_set: Any = None,
) -> Any:
    """Blocking :func:`allreduce_async`: returns the reduced array."""
    return _submit(
        Kind.ALLREDUCE,
        [tensor],
        name,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        outs=[out],
        stream=stream,
        process_set=process_set,
        block=True,
    )


def allreduce_async_(
    tensor: Any,
    name: str | None = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Handle:
    """In-place :func:`allreduce_async`: the result is written into ``tensor``."""
    return _submit(
        Kind.ALLREDUCE,
        [tensor],
        name,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        inplace=True,
        stream=stream,
        process_set=process_set,
    )


def allreduce_(
    tensor: Any,
    name: str | None = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Any:
    """Blocking in-place allreduce; returns ``tensor``."""
    return _submit(
        Kind.ALLREDUCE,
        [tensor],
        name,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        inplace=True,
        stream=stream,
        process_set=process_set,
        block=True,
    )


def grouped_allreduce_async(
    tensors: Sequence[Any],
    name: str | None = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Handle:
    """Allreduce a list of tensors as one unit under ``name``: one request, one cache entry,
    one bucket, never split by the fusion threshold (its results are views of one new buffer,
    reduced in place there; on the GPU members of ``fusion_direct_bytes`` or more are not
    copied when the call is in place). The handle's result is the list of results, in input
    order. Same rules as :func:`allreduce_async` for each member; the tensors may differ in
    shape and dtype but must share one device."""
    return _submit(
        Kind.ALLREDUCE,
        _as_list(tensors, name),
        name,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        group=True,
        stream=stream,
        process_set=process_set,
    )


def grouped_allreduce(
    tensors: Sequence[Any],
    name: str | None = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> list[Any]:
    """Blocking :func:`grouped_allreduce_async`: returns the list of reduced arrays."""
    return _submit(
        Kind.ALLREDUCE,
        _as_list(tensors, name),
        name,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        group=True,
        stream=stream,
        process_set=process_set,
        block=True,
    )


def grouped_allreduce_async_(
    tensors: Sequence[Any],
    name: str | None = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Handle:
    """In-place :func:`grouped_allreduce_async`."""
    return _submit(
        Kind.ALLREDUCE,
        _as_list(tensors, name),
        name,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        group=True,
        inplace=True,
        stream=stream,
        process_set=process_set,
    )


def grouped_allreduce_(
    tensors: Sequence[Any],
    name: str | None = None,
    op: ReduceOp = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> list[Any]:
    """Blocking in-place grouped allreduce; returns the list of (updated) tensors."""
    return _submit(
        Kind.ALLREDUCE,
        _as_list(tensors, name),
        name,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        group=True,
        inplace=True,
        stream=stream,
        process_set=process_set,
        block=True,
    )


# -- the other collectives ----------------------------------------------------------------
def allgather_async(
    tensor: Any, name: str | None = None, *, stream: Any = None, process_set: Any = None
) -> Handle:
    """Start gathering ``tensor`` from every rank, concatenated along dim 0 in rank order.

    Dim 0 may differ per rank; the other dimensions, the dtype and the device must agree
    (else :class:`MismatchError` on every rank). Non-blocking, thread-safe."""
    return _submit(Kind.ALLGATHER, [tensor], name, stream=stream, process_set=process_set)


def allgather(
    tensor: Any, name: str | None = None, *, stream: Any = None, process_set: Any = None
) -> Any:
    """Blocking :func:`allgather_async`."""
    return _submit(
        Kind.ALLGATHER, [tensor], name, stream=stream, process_set=process_set, block=True
    )


def broadcast_async(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` to every rank; the result is a new array.

    Shape, dtype and root must agree across ranks. ``ValueError`` for a root outside
    ``[0, size)``. Non-blocking, thread-safe."""
    return _submit(
        Kind.BROADCAST, [tensor], name, root=root_rank, stream=stream, process_set=process_set
    )


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Any:
    """Blocking :func:`broadcast_async`."""
    return _submit(
        Kind.BROADCAST,
        [tensor],
        name,
        root=root_rank,
        stream=stream,
        process_set=process_set,
        block=True,
    )


def broadcast_async_(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Handle:
    """In-place :func:`broadcast_async`: non-root ranks receive into ``tensor``."""
    return _submit(
        Kind.BROADCAST,
        [tensor],
        name,
        root=root_rank,
        inplace=True,
        stream=stream,
        process_set=process_set,
    )


def broadcast_(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Any:
    """Blocking in-place broadcast; returns ``tensor``."""
    return _submit(
        Kind.BROADCAST,
        [tensor],
        name,
        root=root_rank,
        inplace=True,
        stream=stream,
        process_set=process_set,
        block=True,
    )


def alltoall_async(
    tensor: Any,
    splits: Sequence[int] | None = None,
    name: str | None = None,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Handle:
    """Start an all-to-all: rows ``splits[j]`` of dim 0 go to rank ``j`` (default: equal
    parts); the result concatenates what every rank sent here, in rank order. Not allowed
    while ranks have joined. Non-blocking, thread-safe."""
    return _submit(
        Kind.ALLTOALL, [tensor], name, splits=splits, stream=stream, process_set=process_set
    )


def alltoall(
    tensor: Any,
    splits: Sequence[int] | None = None,
    name: str | None = None,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Any:
    """Blocking :func:`alltoall_async`."""
    return _submit(
        Kind.ALLTOALL,
        [tensor],
        name,
        splits=splits,
        stream=stream,
        process_set=process_set,
        block=True,
    )


def reducescatter_async(
    tensor: Any,
    name: str | None = None,
    op: ReduceOp = Average,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Handle:
    """Start reducing ``tensor`` across ranks and keep this rank's part of dim 0.

    Rank ``r`` gets rows ``[start_r, start_r + n_r)`` where the ``n_r`` differ by at most one
    and the lower ranks get the extra rows. Non-blocking, thread-safe."""
    return _submit(
        Kind.REDUCESCATTER, [tensor], name, op=op, stream=stream, process_set=process_set
    )


def reducescatter(
    tensor: Any,
    name: str | None = None,
    op: ReduceOp = Average,
    *,
    stream: Any = None,
    process_set: Any = None,
) -> Any:
    """Blocking :func:`reducescatter_async`."""
    return _submit(
        Kind.REDUCESCATTER,
        [tensor],
        name,
        op=op,
        stream=stream,
        process_set=process_set,
        block=True,
    )


def barrier_async(name: str | None = None, *, process_set: Any = None) -> Handle:
    """A handle that completes once every rank of ``process_set`` (default: all) has reached
    this barrier (in agreed order with the set's other collectives); ranks outside the set
    are not waited for."""
    return _submit(Kind.BARRIER, [], name, process_set=process_set)


def barrier(*, process_set: Any = None) -> None:
    """Block until every rank of ``process_set`` (default: all) has called :func:`barrier`."""
    _submit(Kind.BARRIER, [], None, block=True, process_set=process_set)


def join() -> int:
    """Declare that this rank has no more data for this epoch; block until every rank has.

    While joined, this rank takes part in the other ranks' allreduces without data, as in
    Horovod: it contributes the op's identity (zeros for Sum and Average, and Average divides
    by the whole set, joined ranks included). Allgather, broadcast, alltoall and reducescatter
    fail with :class:`MismatchError` on every rank while any rank has joined. Blocking; the
    global set only. Returns the rank that joined last.
    """
    return int(_submit(Kind.JOIN, [], default_engine().auto_name("join"), block=True))


def poll(handle: Handle) -> bool:
    """True if ``handle`` has completed. Never blocks."""
    return handle.poll()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result (raises its error)."""
    return handle.wait()
