"""Compiled models whose gradient buckets start inside the compiled backward.

``torch.compile`` of a whole model runs its backward as one autograd operation, so every
gradient hook fires at its end and a ``DistributedOptimizer``'s buckets overlap nothing.
:func:`compile_overlap` keeps the model one graph and puts the buckets' starts inside it: in
the backward graph, where the last gradient of a bucket has been computed, the graph calls
hvdlite (a custom operator, ``hvdlite::accumulate_grads``) with that bucket's gradients. There
they become (or are added into) ``.grad`` as autograd would, and the parameters' hvdlite hooks
run, so the optimizer starts the bucket's allreduce while the rest of the backward is still
being launched (``hvdlite/torch/_accumulate.py``). Autograd is handed no gradient for those
parameters, and accumulates nothing more.

Each of those gradients is written where it is to live: the graph takes, as inputs of its
own, a tensor per gradient (its bucket's view where the parameter has no ``.grad`` yet, as
after ``zero_grad()``; else a new one, added to the ``.grad`` there is), and writes the
gradient into it. A gradient that is a matrix product (a weight's) is computed into it by
``hvdlite::mm_into`` (cuBLAS writes its result there); any other is copied by ``copy_``, which
the compiler folds into the kernel that computes the gradient. So the buckets cost no copy and
the gradients no memory of the graph's own. ::

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
_MM: Any = None
_LIBRARY: Any = None


def _ops() -> tuple[Any, Any]:
    """The operators a compiled backward calls (defined at the first compile: importing
    hvdlite leaves torch's operator registry alone): ``accumulate_grads``, declared as writing
    ``into`` (it only reads them) so that the graph keeps the call, which has no result, after
    the writes to them; and ``mm_into``, a matrix product written into ``out`` (inductor takes
    no ``out=`` operator), for a gradient that is a product. Defined on torch's ``Library``
    rather than as ``custom_op`` (4 against 17 us a call on the CPU box: one per bucket and
    step)."""
    global _OP, _MM, _LIBRARY
    if _OP is None:
        lib = torch.library.Library("hvdlite", "FRAGMENT")
        lib.define("accumulate_grads(int key, Tensor(a!)[] into) -> ()")
        lib.define("mm_into(Tensor a, Tensor b, Tensor(a!) out) -> ()")
        for device in ("CPU", "CUDA"):
            lib.impl("accumulate_grads", _accumulate.accumulate, device)
            lib.impl("mm_into", _mm_into, device)
        lib.impl("accumulate_grads", _nothing, "Meta")
        lib.impl("mm_into", _nothing, "Meta")
        _LIBRARY = lib
        _OP, _MM = torch.ops.hvdlite.accumulate_grads.default, torch.ops.hvdlite.mm_into.default
    return _OP, _MM


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(a, b, out=out)


def _nothing(*_args: Any) -> None:
    """An operator on tensors without data (a compiler's trace)."""
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
                                 lambda g, extra: compile_fx_inner(g, [*inputs, *extra],
                                                                   **kwargs))

    return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], params: Sequence[Any],
               caps: tuple[int, int], frame: object) -> Any:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(graph: fx.GraphModule, _inputs: Sequence[Any]) -> Any:
        return make_boxed_func(graph.forward)

    def backward_compiler(graph: fx.GraphModule, _inputs: Sequence[Any]) -> Any:
        return _compile_backward(graph, params, caps, frame,
                                 lambda g, _extra: make_boxed_func(g.forward))

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)(
        gm, example_inputs)


def _compile_backward(bw: fx.GraphModule, params: Sequence[Any], caps: tuple[int, int],
                      frame: object, compile_fn: Callable[[fx.GraphModule, list[Any]], Any]
                      ) -> Any:
    """``compile_fn(graph, extra example inputs)`` of a copy of ``bw`` that writes the
    claimable gradients where they are to live and calls hvdlite per bucket (its parameters
    claimed once that compiled; :func:`_writing`); of ``bw`` as it is if none is claimable, or
    with a warning if the compiler refuses the copy."""
    work = _insert_calls(bw, params, caps, frame)
    if work is None:
        return compile_fn(bw, [])
    graph, groups, extra = work
    try:
        compiled = compile_fn(graph, extra)
    except Exception as exc:  # noqa: BLE001 - the compiler's own failure, said and bypassed
        warnings.warn(f"compile_overlap: the backward graph did not compile with hvdlite's "
                      f"calls ({type(exc).__name__}: {str(exc)[:300]}); compiled without "
                      "them, so its gradient buckets start after the backward", stacklevel=2)
        return compile_fn(bw, [])
    for _key, members in groups:
        _accumulate.claim(members, frame)
    return _writing(compiled, [key for key, _ in groups])


def _writing(compiled: Any, keys: Sequence[int]) -> Any:
    """The compiled backward ``compiled`` (called with its list of arguments, which it
    empties), given, after its own arguments, where each claimed gradient is to be written:
    ``_accumulate.targets`` of each group ``keys`` names, in order."""
    targets = _accumulate.targets

    def backward(args: list[Any]) -> Any:
        for key in keys:
            args.extend(targets(key))
        return compiled(args)

    backward._boxed_call = True  # type: ignore[attr-defined]  # (AOT autograd's convention)
    return backward


def _insert_calls(bw: fx.GraphModule, fw_inputs: Sequence[Any], caps: tuple[int, int],
                  frame: object) -> tuple[fx.GraphModule, list[tuple[int, list[Any]]],
                                          list[Any]] | None:
    """A copy of the backward graph ``bw`` (its outputs: the gradients of the forward's
    inputs ``fw_inputs``, in order) where each claimable parameter's gradient is written into
    a new input of the graph, the tensor it is to live in (a gradient that is a matrix product
    by ``mm_into``, any other by ``copy_``, which the compiler fuses into the kernel that
    computes it: no copy where that is a kernel of its own), is no longer an output (None),
    and a call of ``accumulate_grads`` follows each bucket's last write. Returns (the copy,
    each bucket's group key and parameters, the new inputs' example values), or None if the
    outputs do not line up with the inputs or no parameter is claimable."""
    out = next(n for n in reversed(bw.graph.nodes) if n.op == "output")
    grads = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else None
    if grads is None or len(grads) != len(fw_inputs):
        return None
    position = {node: k for k, node in enumerate(bw.graph.nodes)}
    found: list[tuple[int, int, torch.Tensor, fx.Node]] = []
    for i, (param, grad) in enumerate(zip(fw_inputs, grads, strict=True)):
        if not isinstance(grad, fx.Node) or not _accumulate.claimable(param, frame) \
                or not param.is_contiguous():
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
    where = {id(f[2]): f for f in found}
    buckets = ordered_buckets([f[2] for f in found], list(range(len(found))), *caps)
    # The copy: nodes map one to one (``env``), metadata shared.
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    copied: Any = graph.graph_copy(bw.graph, env)  # the output's value: the gradients
    outputs = list(copied)
    new_out = graph.output(None)
    new_out.meta = dict(out.meta)
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    fake = found[0][3].meta["val"].fake_mode
    accumulate, mm_into = _ops()
    groups: list[tuple[int, list[Any]]] = []
    extra: list[Any] = []
    dead: list[fx.Node] = []
    for members in buckets:
        writes: list[tuple[int, fx.Node]] = []
        into: list[fx.Node] = []
        for param in members:
            at, i, _, old = where[id(param)]
            with graph.inserting_after(last):
                last = graph.placeholder(f"hvdlite_grad_{len(extra)}")
            with fake:
                example = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype,
                                              device=param.device)
            last.meta["val"] = example
            extra.append(example)
            into.append(last)
            grad = env[old]
            product = _product(grad)
            with graph.inserting_after(grad):
                if product is None:
                    writes.append((at, graph.call_function(torch.ops.aten.copy_.default,
                                                           (last, grad))))
                else:
                    a, b, chain = product
                    writes.append((at, graph.call_function(mm_into, (a, b, last))))
                    dead += chain
            outputs[i] = None
        after = max(writes, key=lambda w: w[0])[1]  # each write follows its gradient
        key = _accumulate.new_group(members)
        with graph.inserting_after(after):
            graph.call_function(accumulate, (key, into))
        groups.append((key, members))
    new_out.args = (type(out.args[0])(outputs),)
    visible = new_out.meta.get("user_visible_output_idxs")
    if visible is not None:  # inductor keeps the strides of these outputs: not of None
        new_out.meta["user_visible_output_idxs"] = [i for i in visible
                                                    if outputs[i] is not None]
    for node in dead:
        graph.erase_node(node)
    graph.lint()
    work = fx.GraphModule(bw, graph)
    work.meta.update(bw.meta)  # what the compiler keeps on the module (its compile's ids)
    return work, groups, extra


def _product(grad: fx.Node) -> tuple[Any, Any, list[fx.Node]] | None:
    """(a, b, the nodes that go) where ``grad`` is the product ``a @ b`` as a contiguous
    matrix: a matrix product, maybe transposed any number of times (an odd number: the product
    of the transposed factors swapped, one new transpose each), used by nothing else; else
    None (its gradient is then copied)."""
    aten = torch.ops.aten
    chain: list[fx.Node] = []
    node = grad
    while node.target is aten.t.default or (node.target is aten.permute.default
                                            and node.args[1] in ([1, 0], (1, 0))):
        if len(node.users) != (1 if chain else 0):
            return None
        chain.append(node)
        node = node.args[0]  # type: ignore[assignment]
    if node.target is not aten.mm.default or len(node.users) != (1 if chain else 0):
        return None
    chain.append(node)
    a, b = node.args[0], node.args[1]
    if len(chain) % 2 == 0:  # an odd number of transposes: (a @ b).T = b.T @ a.T
        graph = grad.graph
        with graph.inserting_before(grad):
            ta, tb = (graph.call_function(aten.t.default, (x,)) for x in (b, a))
        for new, x in ((ta, b), (tb, a)):
            new.meta["val"] = x.meta["val"].t()  # type: ignore[union-attr]
        a, b = ta, tb
    return a, b, chain


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
