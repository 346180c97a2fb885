"""Model and optimizer state helpers: broadcast_parameters, broadcast_optimizer_state,
broadcast_object, allgather_object (Horovod's ``horovod.torch.functions``)."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from typing import Any

import torch

import hvdlite
from hvdlite.torch import mpi_ops
from hvdlite.torch.process_sets import global_process_set, resolve

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: Any = global_process_set) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    ``params``: a ``state_dict()`` (or any mapping name -> tensor, broadcast in sorted name
    order), or a list / iterable of ``(name, tensor)`` pairs (``model.named_parameters()``) or
    of bare tensors (``model.parameters()``). Every rank must pass the same structure.
    ``ValueError`` for anything else. With ``process_set``, only its members call this and
    ``root_rank`` (a global rank) must be one of them; elsewhere ``ValueError``.
    """
    if isinstance(params, dict):
        items: list[tuple[Any, Any]] = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}; "
                         "pass model.state_dict() or model.named_parameters()")
    resolve(process_set, "broadcast_parameters")  # a non-member fails before any broadcast
    handles = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a "
                             "torch.Tensor")
        tname = None if name is None else f"broadcast_parameters.{name}"
        handles.append(mpi_ops.broadcast_async_(p.data, root_rank, tname, process_set))
    for h in handles:
        h.wait()


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled there, unpickled everywhere else) on every rank.

    ``obj`` may be anything picklable (tensors included); other ranks may pass ``None``.
    With ``process_set``: among its members, ``root_rank`` a global rank of the set.
    Without ``name`` the broadcasts are named ``broadcast_object.*`` on every rank (Horovod
    names them after ``type(obj)``, which differs where other ranks pass ``None``), so the
    call still matches after a collective that failed on some ranks only.
    """
    resolve(process_set, "broadcast_object")
    if name is None:
        name = "broadcast_object"
    me = hvdlite.rank()
    if me == root_rank:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
            torch.zeros(0, dtype=torch.uint8)
        size = torch.tensor([buf.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    mpi_ops.broadcast_(size, root_rank, f"{name}.sz", process_set)
    if me != root_rank:
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    mpi_ops.broadcast_(buf, root_rank, f"{name}.t", process_set)
    if me == root_rank:
        return obj
    return pickle.loads(buf.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: Any = global_process_set) -> list[Any]:
    """Return the list of every rank's ``obj`` (picklable), in rank order (the members of
    ``process_set`` only, in their order in the set, when one is given). Without ``name`` the
    gathers are named ``allgather_object.*`` on every rank (as Horovod names them after
    ``type(obj)``), so the call matches even after a collective that failed on some ranks only
    (an allgather refused while a rank had joined, say)."""
    resolve(process_set, "allgather_object")
    if name is None:
        name = "allgather_object"
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    sizes = mpi_ops.allgather_async(torch.tensor([buf.numel()], dtype=torch.int64),
                                    f"{name}.sz", process_set).wait()
    gathered = mpi_ops.allgather_async(buf, f"{name}.t", process_set).wait()
    out, offset = [], 0
    raw = gathered.numpy().tobytes()
    for n in sizes.tolist():
        out.append(pickle.loads(io.BytesIO(raw[offset:offset + n]).read()))
        offset += n
    return out


def _param_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: Any = global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters equal ``root_rank``'s, in place.

    Works for every ``torch.optim`` optimizer (and a ``DistributedOptimizer`` around one):
    the param groups' options (learning rate, betas, ...), scalar state (copied with its Python
    type) and tensor state (broadcast in place, created where a rank has none yet, e.g. a
    fresh optimizer next to a restored checkpoint). Unlike Horovod no dummy ``step()`` is taken
    to create state: a rank with no state receives the root's, and when the root has none
    only the options are copied. As Horovod's preparation for that step, on a rank whose
    optimizer has no state yet every parameter that requires a gradient and has none gets a
    zero gradient (sparse for ``SparseAdam``); existing gradients are kept.
    ``ValueError`` if the ranks' param groups differ in layout.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    resolve(process_set, "broadcast_optimizer_state")
    params = _param_order(optimizer)
    if not any(optimizer.state.get(p) for p in params):
        sparse = isinstance(optimizer, torch.optim.SparseAdam)
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)
    layout = [len(g["params"]) for g in optimizer.param_groups]
    meta: dict[str, Any] | None = None
    if hvdlite.rank() == root_rank:
        meta = {"layout": layout,
                "options": [{k: v for k, v in g.items() if k != "params"}
                            for g in optimizer.param_groups],
                "state": {}}
        for i, p in enumerate(params):
            st = optimizer.state.get(p)
            if not st:
                continue
            entry: dict[str, tuple[Any, ...]] = {}
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    entry[key] = ("tensor", tuple(value.shape), value.dtype,
                                  value.device.type == "cpu" and p.device.type != "cpu")
                else:
                    entry[key] = ("value", value)
            meta["state"][i] = entry
    meta = broadcast_object(meta, root_rank, "broadcast_optimizer_state.meta", process_set)
    if meta["layout"] != layout:
        raise ValueError(f"broadcast_optimizer_state: param groups differ from rank "
                         f"{root_rank}'s: {layout} parameters per group here, "
                         f"{meta['layout']} there")
    for group, options in zip(optimizer.param_groups, meta["options"], strict=True):
        group.update(options)
    handles = []
    for i, entry in sorted(meta["state"].items()):
        p = params[i]
        st = optimizer.state[p]
        for key, spec in entry.items():
            if spec[0] == "value":
                st[key] = spec[1]
                continue
            _, shape, dtype, on_cpu = spec
            t = st.get(key)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                t = torch.zeros(shape, dtype=dtype, device="cpu" if on_cpu else p.device)
                st[key] = t
            handles.append(mpi_ops.broadcast_async_(
                t, root_rank, f"broadcast_optimizer_state.{i}.{key}", process_set))
    for h in handles:
        h.wait()
