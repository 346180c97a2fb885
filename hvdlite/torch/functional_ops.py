"""The synchronous collectives of ``hvdlite.torch``, differentiable with Horovod's rules.

Gradients (what ``backward()`` sends to the input), as Horovod defines them:

- allreduce: the output's gradient allreduced with the same op and scale factors;
- allgather: the gradient averaged over ranks, then this rank's rows;
- broadcast: the gradient averaged over ranks on the root, zero elsewhere;
- alltoall: the gradient sent back with an alltoall of the received splits;
- reducescatter: the gradients of every rank's part gathered (times ``size()`` for Sum), with
  the scale factors applied.

With ``process_set=``, "ranks" are the set's members: the backward collectives run on the same
set, averages divide by its size and rows are taken at this rank's place in the set.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

import hvdlite
from hvdlite._ops import ReduceOp
from hvdlite.torch import mpi_ops
from hvdlite.torch.basics import Average, Sum, resolve_op
from hvdlite.torch.compression import Compression, Compressor
from hvdlite.torch.process_sets import global_process_set, resolve

__all__ = [
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "alltoall", "reducescatter", "grouped_reducescatter",
]

_DIFF = torch.autograd.Function
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _zeros_for_none(grads: Sequence[Any], like: Sequence[tuple[Any, ...]]) -> list[torch.Tensor]:
    """The gradients, zeros where autograd passed None (``like``: each input's shape, dtype
    and device)."""
    return [torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
            for g, (shape, dtype, device) in zip(grads, like, strict=True)]


def _own(out: torch.Tensor) -> torch.Tensor:
    """A forward's result as autograd may keep it: a new tensor over the same memory. The
    route hands out recycled result tensors (``_vocab/plans.py``); autograd writes its graph
    into the tensor object it gets, which a later call, differentiable or not, would hand out
    again with that stale graph attached."""
    return out.detach()


class _Allreduce(_DIFF):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: Any, pre: float,
                post: float, process_set: Any) -> torch.Tensor:
        ctx.args = (op, pre, post, process_set)
        return _own(mpi_ops._allreduce([tensor], name, op, pre, post, False, False, "allreduce",
                                       process_set, True))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        out = mpi_ops._allreduce([grad.contiguous()], None, op, pre, post, False, False,
                                    "allreduce (backward)", ps, True)
        return out, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``process_set`` (default: all) and return the
    result (a new tensor; differentiable).

    ``op``: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``; ``average`` is
    Horovod's deprecated flag. ``compression`` compresses before and restores after the
    reduction. The input's scaled by ``prescale_factor`` before and the result by
    ``postscale_factor`` after. ``TypeError``/``ValueError`` for bad arguments,
    ``HorovodInternalError`` if the collective fails.
    """
    if op is None and average is None:
        op = Average
    elif average is not None or type(op) is not ReduceOp:
        op = resolve_op(op, average, "allreduce")
    if compression is Compression.none and not (isinstance(tensor, torch.Tensor)
                                                and tensor.requires_grad
                                                and torch.is_grad_enabled()):
        # Nothing to differentiate: skip autograd's Function machinery (a few torch calls).
        return mpi_ops.allreduce_one(tensor, name, op, prescale_factor, postscale_factor,
                                     process_set, False, "allreduce", True)
    mpi_ops.check_tensor(tensor, "allreduce")
    compressed, cctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, cctx)


class _GroupedAllreduce(_DIFF):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: Any, pre: float, post: float,
                process_set: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, process_set)
        ctx.like = [(t.shape, t.dtype, t.device) for t in tensors]
        outs = mpi_ops._allreduce(tensors, name, op, pre, post, False, True,
                                  "grouped_allreduce", process_set, True)
        return tuple(map(_own, outs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        outs = mpi_ops._allreduce(_zeros_for_none(grads, ctx.like), None, op, pre, post,
                                     False, True, "grouped_allreduce (backward)", ps, True)
        return (None, None, None, None, None, *outs)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one unit; returns the list of results (differentiable).
    Member ``i`` is named ``f"{name}.{i}"``."""
    op = resolve_op(op, average, "grouped_allreduce")
    members = mpi_ops._members(tensors, "grouped_allreduce")
    if compression is Compression.none:
        try:
            diff = torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, members))
        except AttributeError:  # a member that is no tensor: the checks below name it
            diff = True
        if not diff:
            # Nothing to differentiate: no autograd Function, no torch call per member.
            return mpi_ops._allreduce(members, name, op, prescale_factor, postscale_factor,
                                      False, True, "grouped_allreduce", process_set, True)
    tensors = mpi_ops._check_tensors(members, "grouped_allreduce")
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs, strict=True)]


def _my_rows(dims: torch.Tensor, process_set: Any) -> int:
    r = resolve(process_set, "allgather (backward)").rank
    return int(dims[:r].sum().item()) if r else 0


class _Allgather(_DIFF):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: Any) -> torch.Tensor:
        ctx.rows = tensor.shape[0]
        ctx.process_set = process_set
        return mpi_ops._allgather([tensor], name, False, process_set).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = mpi_ops._allreduce([grad.contiguous()], None, Average, 1.0, 1.0, False, False,
                                     "allgather (backward)", ctx.process_set).wait()
        dims = mpi_ops._allgather([torch.tensor([ctx.rows], dtype=torch.int64)], None, False,
                                  ctx.process_set).wait()
        return reduced.narrow(0, _my_rows(dims, ctx.process_set), ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Concatenate the ``tensor`` of every rank of ``process_set`` (default: all) along dim 0,
    in rank order (differentiable).

    Dim 0 may differ per rank; the other dimensions and the dtype must agree."""
    tensor = mpi_ops.check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise mpi_ops.InvalidArgumentError("allgather: needs at least one dimension, got a "
                                           "0-d tensor; reshape it to (1,)")
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(_DIFF):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows = [t.shape[0] for t in tensors]
        ctx.process_set = process_set
        return tuple(mpi_ops._allgather(list(tensors), name, True, process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        grads_l = [g.contiguous() for g in grads]
        reduced = mpi_ops._allreduce(grads_l, None, Average, 1.0, 1.0, False, True,
                                     "grouped_allgather (backward)", ctx.process_set).wait()
        dims = mpi_ops._allgather([torch.tensor([ctx.rows], dtype=torch.int64)], None, False,
                                  ctx.process_set).wait()
        r = resolve(ctx.process_set, "grouped_allgather (backward)").rank
        offsets = dims[:r].sum(dim=0) if r else torch.zeros(len(ctx.rows), dtype=torch.int64)
        parts = zip(reduced, offsets.tolist(), ctx.rows, strict=True)
        return (None, None, *[g.narrow(0, int(off), rows) for g, off, rows in parts])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of the list; returns the list of results (differentiable)."""
    tensors = mpi_ops._check_tensors(tensors, "grouped_allgather")
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(_DIFF):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: Any) -> torch.Tensor:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return _own(mpi_ops._broadcast(tensor, root_rank, name, False, process_set).wait())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = mpi_ops._allreduce([grad.contiguous()], None, Average, 1.0, 1.0, False, False,
                                     "broadcast (backward)", ctx.process_set).wait()
        if hvdlite.rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank of ``process_set`` (a new tensor;
    differentiable). ``root_rank`` is a global rank; ``ValueError`` for a root outside
    ``[0, size())`` or, with a process set, outside the set."""
    return _Broadcast.apply(mpi_ops.check_tensor(tensor, "broadcast"), root_rank, name,
                            process_set)


class _Alltoall(_DIFF):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: Any) -> Any:
        output, received = mpi_ops.alltoall_async(tensor, splits, name, process_set).wait()
        ctx.received = received
        ctx.process_set = process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_dead: Any) -> tuple[Any, ...]:
        out, _ = mpi_ops.alltoall_async(grad.contiguous(), ctx.received, None,
                                        ctx.process_set).wait()
        return out, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Scatter rows of ``tensor`` (``splits[j]`` rows to rank ``j``; default equal parts) and
    gather what every rank sent here, in rank order (differentiable). Returns the output, or
    ``(output, received_splits)`` when ``splits`` is given, as Horovod does."""
    return _Alltoall.apply(mpi_ops.check_tensor(tensor, "alltoall"), splits, name, process_set)


def _rs_grad(grad: torch.Tensor, op: Any, pre: float, post: float,
             process_set: Any) -> torch.Tensor:
    n = resolve(process_set, "reducescatter (backward)").size if op is Sum else 1
    factor = pre * post * n
    return mpi_ops.scale(grad.contiguous(), factor)


class _Reducescatter(_DIFF):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: Any, process_set: Any,
                pre: float, post: float) -> torch.Tensor:
        ctx.args = (op, pre, post, process_set)
        return mpi_ops._reducescatter([tensor], name, op, pre, post, False, "reducescatter",
                                      process_set).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        out = mpi_ops._allgather([_rs_grad(grad, op, pre, post, ps)], None, False, ps).wait()
        return out, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``process_set`` (default: all) and return this
    rank's rows of dim 0 (the first ``dim0 % set size`` ranks get one row more).
    Differentiable."""
    op = resolve_op(op, None, "reducescatter")
    tensor = mpi_ops.check_tensor(tensor, "reducescatter")
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, cctx)


class _GroupedReducescatter(_DIFF):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: Any, process_set: Any, pre: float, post: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, process_set)
        return tuple(mpi_ops._reducescatter(list(tensors), name, op, pre, post, True,
                                            "grouped_reducescatter", process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        outs = mpi_ops._allgather([_rs_grad(g, op, pre, post, ps) for g in grads], None, True,
                                  ps).wait()
        return (None, None, None, None, None, *outs)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each tensor of the list; returns the list of parts (differentiable)."""
    op = resolve_op(op, None, "grouped_reducescatter")
    tensors = mpi_ops._check_tensors(tensors, "grouped_reducescatter")
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs, strict=True)]
