"""Compiled models whose gradient buckets start inside the compiled backward.

``torch.compile`` of a whole model runs its backward as one autograd operation, so every
gradient hook fires at its end and a ``DistributedOptimizer``'s buckets overlap nothing.
:func:`compile_overlap` keeps the model one graph and puts the buckets' starts inside it: in
the backward graph, where the last gradient of a bucket has been computed, the graph calls
hvdlite (a custom operator, ``hvdlite::accumulate_grads``) with that bucket's gradients. There
they are accumulated into ``.grad`` as autograd would, and the parameters' hvdlite hooks run, so
the optimizer starts the bucket's allreduce while the rest of the backward is still being
launched (``hvdlite/torch/_accumulate.py``). Autograd is handed no gradient for those
parameters, and accumulates nothing more. ::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    model = hvd.compile_overlap(model)            # as torch.compile(model) takes

Against :func:`~hvdlite.torch.compile_split`, which cuts the graph into pieces whose backward
ends one by one, nothing is cut: the model is compiled as ``torch.compile`` compiles it, and
the step pays one call into hvdlite per bucket instead of the pieces' own overhead (on a
host-bound ViT-B/16 step, about 0.6 ms of host time per piece: docs/captured-step.md).

The buckets are found in the backward graph, in the order it computes the gradients, with the
optimizer's rule and caps (give both the same ``bucket_cap_mb`` and ``last_bucket_cap_mb``;
the defaults are the optimizer's). After its first step the optimizer forms its buckets in the
order its hooks ran, which is this order, so each call starts one bucket. A parameter is left
to autograd (its bucket starts at the end, as with ``torch.compile``) if it has gradient hooks
of someone else's (``register_hook``), is not dense, is not a graph input, or is in the graphs
of two frames (a weight tied across a graph break: each frame's call adds its part, autograd
runs the hooks once). A backward graph the compiler refuses with the calls in it is compiled
without them, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

import hvdlite
from hvdlite.errors import HvdliteError
from hvdlite.torch import _accumulate
from hvdlite.torch._buckets import mib_bytes, ordered_buckets

__all__ = ["compile_overlap", "overlap_backend"]

_BACKENDS = ("inductor", "aot_eager")
_OP: Any = None
_LIBRARY: Any = None


def _op() -> Any:
    """The operator a compiled backward calls (defined at the first compile: importing
    hvdlite leaves torch's operator registry alone). Declared as writing ``grads`` (it only
    reads them) so that the graph keeps the call, which has no result, in its place among
    the gradients' producers; defined on torch's ``Library`` rather than as a
    ``custom_op`` (4 against 17 us a call on the CPU box: it runs once per bucket and step)."""
    global _OP, _LIBRARY
    if _OP is None:
        lib = torch.library.Library("hvdlite", "FRAGMENT")
        lib.define("accumulate_grads(int key, Tensor(a!)[] grads) -> ()")
        for device in ("CPU", "CUDA"):
            lib.impl("accumulate_grads", _accumulate.accumulate, device)
        lib.impl("accumulate_grads", _no_accumulation, "Meta")
        _LIBRARY, _OP = lib, torch.ops.hvdlite.accumulate_grads.default
    return _OP


def _no_accumulation(key: int, grads: list[torch.Tensor]) -> None:
    """The operator on tensors without data (a compiler's trace)."""
    return None


def overlap_backend(bucket_cap_mb: float = 25.0, last_bucket_cap_mb: float | None = 1.0,
                    backend: str = "inductor", mode: str | None = None,
                    options: dict[str, Any] | None = None, dynamic: bool | None = None) -> Any:
    """A dynamo backend (``torch.compile(model, backend=...)``) that compiles each traced
    graph with ``backend`` ("inductor", with ``mode`` and ``options`` as ``torch.compile``
    takes them, or "aot_eager") and puts the start of each gradient bucket inside its
    backward (see the module's docstring); ``bucket_cap_mb`` and ``last_bucket_cap_mb`` as
    ``DistributedOptimizer`` takes them.

    Not collective; thread-safe as ``torch.compile`` is. ``ValueError`` for a cap that is not
    a positive number, another backend, or ``mode``/``options`` with "aot_eager"."""
    caps = (mib_bytes("bucket_cap_mb", bucket_cap_mb),
            mib_bytes("last_bucket_cap_mb", last_bucket_cap_mb, optional=True))
    if backend not in _BACKENDS:
        raise ValueError(f"compile_overlap: backend must be one of {', '.join(_BACKENDS)}, "
                         f"got {backend!r}")
    if backend != "inductor" and (mode is not None or options):
        raise ValueError(f"compile_overlap: mode= and options= are for the inductor backend, "
                         f"got backend={backend!r}")
    patches = _inductor_patches(mode, options, dynamic) if backend == "inductor" else {}

    def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._functorch import config as functorch_config

        # Only the parameters are kept for the backward's compile (it may come at the first
        # backward): not the first batch.
        params = [t if isinstance(t, nn.Parameter) else None for t in example_inputs]
        frame = _frame_of(gm)
        # A cached artifact would skip the backward's compile, and with it the calls and the
        # claims (and one made by another process names its own groups): no cache here. The
        # backward is compiled with the forward, not at its first run: a parameter in two
        # frames' graphs is then found shared before any backward's call runs its hooks.
        patches_aot: dict[str, Any] = {"enable_autograd_cache": False}
        if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
            patches_aot["force_non_lazy_backward_lowering"] = True
        with functorch_config.patch(**patches_aot):
            if backend == "inductor":
                return _inductor(gm, example_inputs, patches, params, caps, frame)
            return _aot_eager(gm, example_inputs, params, caps, frame)

    return compile_graph


def compile_overlap(model: nn.Module, bucket_cap_mb: float = 25.0,
                    last_bucket_cap_mb: float | None = 1.0, *, backend: str = "inductor",
                    mode: str | None = None, options: dict[str, Any] | None = None,
                    dynamic: bool | None = None, fullgraph: bool = False) -> nn.Module:
    """``torch.compile(model, ...)`` whose backward starts each gradient bucket where its
    last gradient is computed (:func:`overlap_backend`), so that a ``DistributedOptimizer``
    created before the first forward reduces its buckets while the backward runs. Give the
    optimizer the same caps. ``mode``, ``options``, ``dynamic`` and ``fullgraph`` are
    ``torch.compile``'s. Returns the compiled module (``model`` is not changed); it compiles
    at its first call, like ``torch.compile``'s; call it on every rank alike. Errors as
    :func:`overlap_backend`'s, and ``TypeError`` if ``model`` is not a module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_overlap: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    compiled = torch.compile(model, backend=overlap_backend(
        bucket_cap_mb, last_bucket_cap_mb, backend, mode, options, dynamic),
        dynamic=dynamic, fullgraph=fullgraph)
    assert isinstance(compiled, nn.Module)  # torch.compile of a module is its OptimizedModule
    return compiled


def _inductor_patches(mode: str | None, options: dict[str, Any] | None,
                      dynamic: bool | None) -> dict[str, Any]:
    """Inductor's configuration for ``mode`` and ``options``, as ``torch.compile`` makes it."""
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    if wrapper is None:
        if mode is not None or options:
            raise RuntimeError("compile_overlap: this torch cannot pass mode= or options= to "
                               "inductor; leave them out")
        return {}
    return dict(wrapper(mode, options, dynamic).config)


def _frame_of(gm: fx.GraphModule) -> object:
    """The dynamo frame being compiled (its recompiles share it), or the graph itself."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except (ImportError, AttributeError):
        compile_id = None
    frame = getattr(compile_id, "frame_id", None)
    return ("frame", frame) if frame is not None else ("graph", id(gm))


def _inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], patches: dict[str, Any],
              params: Sequence[Any], caps: tuple[int, int], frame: object) -> Any:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        if not kwargs.get("is_backward"):
            return compile_fx_inner(graph, inputs, **kwargs)
        return _compile_backward(graph, params, caps, frame,
                                 lambda g: compile_fx_inner(g, inputs, **kwargs))

    return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], params: Sequence[Any],
               caps: tuple[int, int], frame: object) -> Any:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(graph: fx.GraphModule, _inputs: Sequence[Any]) -> Any:
        return make_boxed_func(graph.forward)

    def backward_compiler(graph: fx.GraphModule, _inputs: Sequence[Any]) -> Any:
        return _compile_backward(graph, params, caps, frame,
                                 lambda g: make_boxed_func(g.forward))

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)(
        gm, example_inputs)


def _compile_backward(bw: fx.GraphModule, params: Sequence[Any], caps: tuple[int, int],
                      frame: object, compile_fn: Callable[[fx.GraphModule], Any]) -> Any:
    """``compile_fn(bw)`` with hvdlite's calls in ``bw``, its parameters claimed once that
    compiled; if it does not compile with them, a warning and the graph as it was."""
    calls = _insert_calls(bw, params, caps, frame)
    if calls is None:
        return compile_fn(bw)
    try:
        compiled = compile_fn(bw)
    except Exception as exc:  # noqa: BLE001 - the compiler's own failure, said and bypassed
        calls.undo()
        warnings.warn(f"compile_overlap: the backward graph did not compile with hvdlite's "
                      f"calls ({type(exc).__name__}: {str(exc)[:300]}); compiled without "
                      "them, so its gradient buckets start after the backward", stacklevel=2)
        return compile_fn(bw)
    for members in calls.buckets:
        _accumulate.claim(members, frame)
    return _handing_none(compiled, calls.claimed)


def _handing_none(compiled: Any, claimed: Sequence[int]) -> Any:
    """The compiled backward ``compiled`` (called with its list of arguments) handing autograd
    None for the gradients at ``claimed``: they stay the graph's outputs, so that its own reuse
    of buffers leaves them whole while a copy stream may still read them
    (``hvdlite/torch/_accumulate.py``), and autograd accumulates nothing more."""
    def backward(args: list[Any]) -> Any:
        out = list(compiled(args))
        for i in claimed:
            out[i] = None
        return out

    backward._boxed_call = True  # type: ignore[attr-defined]  # (AOT autograd's convention)
    return backward


class _Calls:
    """The calls :func:`_insert_calls` put in a backward graph: the buckets to claim, and how
    to take the calls out again."""

    def __init__(self, bw: fx.GraphModule, buckets: list[list[torch.Tensor]],
                 claimed: list[int]) -> None:
        self.bw, self.buckets, self.claimed = bw, buckets, claimed
        self.nodes: list[fx.Node] = []

    def undo(self) -> None:
        for node in reversed(self.nodes):
            self.bw.graph.erase_node(node)
        self.bw.graph.lint()
        self.bw.recompile()


def _insert_calls(bw: fx.GraphModule, fw_inputs: Sequence[Any], caps: tuple[int, int],
                  frame: object) -> _Calls | None:
    """Put a call to the operator after each bucket's last gradient in the backward graph
    ``bw`` (its outputs: the gradients of the forward's inputs ``fw_inputs``, in order; they
    stay its outputs, and :func:`_handing_none` hands autograd None for them). None (``bw``
    untouched) if its outputs do not line up with the inputs or no parameter is claimable."""
    graph = bw.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    grads = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else None
    if grads is None or len(grads) != len(fw_inputs):
        return None
    position = {node: k for k, node in enumerate(graph.nodes)}
    found: list[tuple[int, int, torch.Tensor, fx.Node]] = []
    for i, (param, grad) in enumerate(zip(fw_inputs, grads, strict=True)):
        if not isinstance(grad, fx.Node) or not _accumulate.claimable(param, frame):
            continue
        val = grad.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.shape != param.shape \
                or val.dtype != param.dtype or val.layout is not torch.strided:
            continue
        found.append((position[grad], i, param, grad))
    if not found:
        _warn_unclaimed(fw_inputs)
        return None
    found.sort(key=lambda f: f[0])
    params = [f[2] for f in found]
    where = {id(f[2]): f for f in found}
    buckets = ordered_buckets(params, list(range(len(params))), *caps)
    calls = _Calls(bw, buckets, sorted(f[1] for f in found))
    op = _op()
    for members in buckets:
        rows = [where[id(p)] for p in members]
        last = max((r[3] for r in rows), key=position.__getitem__)
        key = _accumulate.new_group(members)
        with graph.inserting_after(last):
            calls.nodes.append(graph.call_function(op, (key, [r[3] for r in rows])))
    graph.lint()
    bw.recompile()
    return calls


def _warn_unclaimed(fw_inputs: Sequence[Any]) -> None:
    """A graph with parameters that need gradients, none with hvdlite's hooks, in a job of
    more than one rank: its buckets will start after the backward, as with torch.compile;
    say why once (the usual cause: the optimizer was made after the first forward)."""
    global _warned
    if _warned or not any(isinstance(t, nn.Parameter) and t.requires_grad for t in fw_inputs):
        return
    try:
        many = hvdlite.size() > 1
    except HvdliteError:  # not initialised: nothing to reduce yet
        return
    if many:
        _warned = True
        warnings.warn("compile_overlap: none of this graph's parameters has a "
                      "DistributedOptimizer's hooks at its compile, so its gradient buckets "
                      "start after the backward, as with torch.compile; create the optimizer "
                      "before the model's first call", stacklevel=2)


_warned = False
