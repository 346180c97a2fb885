"""Compiled models whose gradient buckets overlap backward: one compile, split at bucket
boundaries.

``torch.compile`` of a whole model runs its backward as one autograd operation, so every
gradient hook fires when the whole backward has ended and a ``DistributedOptimizer``'s buckets
overlap nothing. :func:`compile_split` compiles the model whole (one dynamo frame, one set of
guards) but cuts the traced graph into pieces of about ``bucket_cap_mb`` of parameters each,
counted from the graph's end (the order backward reaches them), and compiles each piece with the
chosen backend. Each piece's backward is then an autograd operation of its own: its parameters'
gradients are final, and their hooks fire, while the earlier pieces' backward still runs, so the
optimizer's buckets (formed after the first step in the order backward made the gradients
ready, with the same cap) start during backward::

    model = hvd.compile_split(model, bucket_cap_mb=25)       # as torch.compile(model) takes
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The cut is torch's own, the one dynamo makes for ``DistributedDataParallel`` modules
(``torch._dynamo.backends.distributed.DDPOptimizer``), here driven by hvdlite's bucket cap, so a
model needs no DDP wrapper. Where dynamo breaks the graph (``TORCH_LOGS=graph_breaks``), each
frame is cut on its own; a piece its backend fails to compile runs eagerly, as torch does.
Against :func:`~hvdlite.torch.compile_regions`, the model is compiled once, whatever its
structure, and the pieces follow bytes rather than blocks. It is meant for a captured step
(``make_graphed_step``). Run eagerly, a host-bound step is slower split than compiled
whole, for the pieces themselves: about 0.6 ms of host time each (ViT-B/16 at 17 pieces,
1.50x the whole compile on one H200, with no hvdlite; docs/captured-step.md). Eagerly, use
:func:`~hvdlite.torch.compile_overlap`, which starts the buckets inside one compiled graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hvdlite.torch._buckets import mib_bytes

__all__ = ["compile_split", "split_backend"]


def split_backend(bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float | None = None,
                  backend: str | Any = "inductor", mode: str | None = None,
                  options: dict[str, Any] | None = None, dynamic: bool | None = None) -> Any:
    """A dynamo backend (``torch.compile(model, backend=...)``) that cuts each traced graph
    into pieces of about ``bucket_cap_mb`` MiB of parameters each (counted from the graph's
    end; a piece closes at the first parameter that reaches the cap) and compiles every piece
    with ``backend`` (a name ``torch.compile`` knows, or a compiler function); ``mode`` and
    ``options`` as ``torch.compile`` takes them, for the inductor backend only.
    ``first_bucket_cap_mb``: the cap of the piece counted first, the one backward finishes
    first (default: ``bucket_cap_mb``). The default lines the pieces up with the optimizer's
    buckets: those close before a parameter would pass the cap, the pieces at the first
    that reaches it, so (counting the same parameters in the same order) bucket ``k`` is
    complete once piece ``k``'s backward has run. A smaller first piece pays only with a
    first bucket as small (``groups=``).

    Not collective; thread-safe as ``torch.compile`` is. ``ValueError`` for a cap that is not
    a positive number, a first cap above the cap, or ``mode``/``options`` with another
    backend; ``RuntimeError`` if this torch has no graph splitter."""
    cap = mib_bytes("bucket_cap_mb", bucket_cap_mb)
    first = mib_bytes("first_bucket_cap_mb", first_bucket_cap_mb) \
        if first_bucket_cap_mb is not None else cap
    if first > cap:
        raise ValueError(f"compile_split: first_bucket_cap_mb ({first_bucket_cap_mb}) must "
                         f"not exceed bucket_cap_mb ({bucket_cap_mb})")
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except ImportError as exc:
        raise RuntimeError("compile_split needs torch's graph splitter "
                           "(torch._dynamo.backends.distributed.DDPOptimizer, torch >= 2.1); "
                           "use hvd.compile_regions instead") from exc
    return DDPOptimizer(bucket_bytes_cap=cap, backend_compile_fn=_compiler(
        backend, mode, options, dynamic), first_bucket_cap=first).compile_fn


def compile_split(model: nn.Module, bucket_cap_mb: float = 25.0,
                  first_bucket_cap_mb: float | None = None, *, backend: str | Any = "inductor",
                  mode: str | None = None, options: dict[str, Any] | None = None,
                  dynamic: bool | None = None, fullgraph: bool = False) -> nn.Module:
    """``torch.compile(model, ...)`` with the traced graph cut at bucket boundaries
    (:func:`split_backend`), so that a ``DistributedOptimizer``'s buckets start during the
    compiled backward. Give the optimizer the same ``bucket_cap_mb`` (its default, 25, is
    this one's). ``backend``, ``mode``, ``options``, ``dynamic`` and ``fullgraph`` are
    ``torch.compile``'s. Returns the compiled module (``model`` is not changed), which
    compiles lazily at its first call, like ``torch.compile``'s; call it on every rank alike.
    Errors as :func:`split_backend`'s, and ``TypeError`` if ``model`` is not a module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_split: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    compiler = split_backend(bucket_cap_mb, first_bucket_cap_mb, backend, mode, options,
                             dynamic)
    compiled = torch.compile(model, backend=compiler, dynamic=dynamic, fullgraph=fullgraph)
    assert isinstance(compiled, nn.Module)  # torch.compile of a module is its OptimizedModule
    return compiled


def _compiler(backend: str | Any, mode: str | None, options: dict[str, Any] | None,
              dynamic: bool | None) -> Any:
    """The compiler function each piece goes through: ``backend`` resolved as torch.compile
    resolves it, with ``mode`` and ``options`` applied as it applies them to inductor."""
    if backend == "inductor":
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is not None:  # what torch.compile builds for mode= and options=
            return wrapper(mode, options, dynamic)
        if mode is not None or options:
            raise RuntimeError("compile_split: this torch cannot pass mode= or options= to "
                               "inductor per piece; leave them out")
    elif mode is not None or options:
        raise ValueError(f"compile_split: mode= and options= are for the inductor backend, "
                         f"got backend={backend!r}")
    if callable(backend):
        return backend
    from torch._dynamo import lookup_backend

    return lookup_backend(backend)
