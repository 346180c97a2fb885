"""A model compiled whole whose backward accumulates the gradients and starts the buckets itself
(``hvdlite/torch/overlap.py``, ``hvdlite/torch/_accumulate.py``): on CPU torch with the
``aot_eager`` backend (the same aten operations as eager) and once with inductor. Step timings
need a GPU per rank (scripts/gpu/bench_t1.py); this checks the mechanism and the results."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_regions import Net, _batch, paired_nets, train_alike
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch_util import n_rank_path

import hvdlite
from hvdlite.torch import _accumulate

# One block of Net(width=16): 16 x 16 + 16 float32 = 1088 bytes; a cap of two blocks.
_CAP_MB = 2 * 1088 / 2**20


def _twins(hvd: Any, eager: nn.Module, net: nn.Module, tag: str, momentum: float = 0.0,
           **extra: Any) -> list[Any]:
    """A DistributedOptimizer (SGD, the N-rank path even at one rank) for the eager model and
    one for its twin, their allreduces named apart under ``tag``; ``extra``: its keywords."""
    opts = []
    for model, which in ((eager, "e"), (net, "c")):
        with n_rank_path():
            opts.append(hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                named_parameters=[(f"{tag}.{which}.{n}", p)
                                  for n, p in model.named_parameters()], **extra))
    return opts


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test compiles its own models: past torch's recompile limit for Net's code (8),
    dynamo would run the rest eagerly, and nothing here would be compiled."""
    torch._dynamo.reset()


def _fired_before_input_grad(model: nn.Module, params: list[torch.Tensor],
                             steps: int = 2) -> list[int]:
    """Per step: how many of ``params``' hvdlite hooks ran before the input's gradient came
    out of the backward (with a compiled model: before its backward operation ended)."""
    fired: list[int] = []
    handles = [_accumulate.hook(p, lambda _p: fired.append(1)) for p in params]
    counts = []
    try:
        for step in range(steps):
            fired.clear()
            for p in params:
                p.grad = None
            x = _batch(step, 0).requires_grad_()
            seen: list[int] = []
            x.register_hook(lambda _g: seen.append(len(fired)))  # noqa: B023
            model(x).square().mean().backward()
            counts.append(seen[0])
            assert len(fired) == len(params)  # each once, however it ran
    finally:
        for h in handles:
            h.remove()
    return counts


class _Ops(TorchDispatchMode):
    """The aten (and hvdlite) operators run under it, by name, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_overlap_compile_runs_hooks_during_backward(hvd: Any) -> None:
    """Compiled whole by torch.compile, every hook runs once the backward operation has
    ended (at most one before the input's gradient comes out); by compile_overlap every hook
    runs inside it, one call per bucket placed among the backward's matrix products (the
    later layers' buckets before the earlier layers' products), and the gradients are
    eager's."""
    torch.manual_seed(0)
    whole = Net(depth=6)
    n = len(list(whole.parameters()))
    counts = _fired_before_input_grad(torch.compile(whole, backend="aot_eager"),
                                      list(whole.parameters()))
    assert all(c <= 1 for c in counts), counts
    net = Net(depth=6)
    eager = Net(depth=6)
    eager.load_state_dict(net.state_dict())
    compiled = hvd.compile_overlap(net, bucket_cap_mb=_CAP_MB, backend="aot_eager")
    assert _fired_before_input_grad(compiled, list(net.parameters())) == [n, n]
    for p in net.parameters():
        p.grad = None
    # hvdlite hooks on the parameters and an input that needs a gradient, as the graph was
    # compiled for (a parameter without them is left to autograd at a recompile)
    handles = [_accumulate.hook(p, lambda _p: None) for p in net.parameters()]
    loss = compiled(_batch(1, 0).requires_grad_()).square().mean()
    ops = _Ops()
    with ops:
        loss.backward()
    for h in handles:
        h.remove()
    calls = [i for i, name in enumerate(ops.names) if name == "accumulate_grads"]
    products = [i for i, name in enumerate(ops.names) if name == "mm"]
    assert len(calls) == 4, " ".join(ops.names)  # 16 parameters of 1088 bytes per 2
    assert calls[0] < products[-1] and calls[-1] > products[-1], ops.names
    eager(_batch(1, 0)).square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), net.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("backend", ["aot_eager",
                                     pytest.param("inductor", marks=pytest.mark.timeout(180))])
def test_gradients_are_written_where_they_live(hvd: Any, monkeypatch: Any,
                                               backend: str) -> None:
    """The backward graph writes each claimed gradient where it is to live (here the
    parameters' homes, views of one flat buffer, as a bucket's are): a matrix product by
    ``mm_into``, every other gradient by a ``copy_`` the compiler folds into the kernel that
    computes it; none is an output of the graph. After a backward each ``.grad`` *is* its
    home (no copy), equal to eager's gradient; a second backward adds into it."""
    from torch import fx

    from hvdlite.torch import overlap

    seen: list[fx.GraphModule] = []
    real = overlap._insert_calls

    def spy(bw: fx.GraphModule, *args: Any) -> Any:
        work = real(bw, *args)
        if work is not None:
            seen.append(work[0])
        return work

    monkeypatch.setattr(overlap, "_insert_calls", spy)
    torch.manual_seed(5)
    net, eager = Net(depth=4), Net(depth=4)
    eager.load_state_dict(net.state_dict())
    params = list(net.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    homes, at = [], 0
    for p in params:
        homes.append(flat[at:at + p.numel()].view_as(p))
        at += p.numel()
    handles = [_accumulate.hook(p, lambda _p: None, home=lambda h=h: h)
               for p, h in zip(params, homes, strict=True)]
    compiled = hvd.compile_overlap(net, bucket_cap_mb=_CAP_MB, backend=backend)
    x = _batch(2, 0)
    try:
        compiled(x).square().mean().backward()
        assert all(p.grad is h for p, h in zip(params, homes, strict=True))
        eager(x).square().mean().backward()
        for (name, a), b in zip(eager.named_parameters(), params, strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
        compiled(x).square().mean().backward()  # into the .grad there is
        assert all(p.grad is h for p, h in zip(params, homes, strict=True))
        for (name, a), b in zip(eager.named_parameters(), params, strict=True):
            torch.testing.assert_close(b.grad, 2 * a.grad, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == 1, seen
    graph = seen[0].graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    targets = [n.target for n in graph.nodes]
    mm_into = overlap._ops()[1]
    weights = sum(1 for p in params if p.dim() == 2)
    assert targets.count(mm_into) == weights, targets
    assert not any(isinstance(o, fx.Node) and o.name.startswith("hvdlite_grad")
                   for o in out.args[0])
    outputs = [o for o in out.args[0] if o is not None]
    assert len(outputs) <= 1, outputs  # at most the input's gradient


def test_overlap_keeps_other_hooks_where_autograd_runs_them(hvd: Any) -> None:
    """A parameter with a gradient hook of its own (``register_hook``: it must see the
    gradient before it accumulates) is left to autograd; a post-accumulate hook of someone
    else's still runs, at the end, and sees the accumulated gradient."""
    torch.manual_seed(1)
    net = Net(depth=4)
    params = list(net.parameters())
    seen_pre: list[float] = []
    params[0].register_hook(lambda g: seen_pre.append(float(g.abs().sum())))
    seen_post: list[bool] = []
    params[-1].register_post_accumulate_grad_hook(
        lambda p: seen_post.append(p.grad is not None and bool(p.grad.abs().sum() > 0)))
    ours: list[int] = []
    handles = [_accumulate.hook(p, lambda _p: ours.append(1)) for p in params]
    try:
        compiled = hvd.compile_overlap(net, bucket_cap_mb=_CAP_MB, backend="aot_eager")
        for step in range(2):
            ours.clear()
            compiled(_batch(step, 0)).square().mean().backward()
            assert len(ours) == len(params)
        assert len(seen_pre) == 2 and all(v > 0 for v in seen_pre)
        assert seen_post == [True, True]
        assert not _accumulate.claimable(params[0], None)
        assert _accumulate._OWNED[params[1]].claimed
    finally:
        for h in handles:
            h.remove()


# Inductor's first compile on a machine with a cold cache builds C++ (it ran past the usual 60 s
# once on the GPU machine, run 152): these get three minutes.
@pytest.mark.parametrize("setting", ["plain", "backward_passes_per_step", "fp16 compression",
                                     "bf16 autocast",
                                     pytest.param("inductor", marks=pytest.mark.timeout(180)),
                                     pytest.param("max-autotune",
                                                  marks=pytest.mark.timeout(180))])
def test_overlap_compile_trains_as_eager(hvd: Any, setting: str) -> None:
    """compile_overlap with the optimizer's buckets at the same cap (alone, with 2 backward
    passes per step, fp16 compression, bf16 autocast, the inductor backend, or inductor's
    max-autotune-no-cudagraphs mode): after 5 steps
    on every rank's own batches the parameters equal those of the same hvdlite settings on
    the eager model, and are the same on every rank."""
    eager, twin, opts, passes, amp, tag = paired_nets(hvd, setting, "overlap", _CAP_MB)
    inductor = setting in ("inductor", "max-autotune")
    compiled = hvd.compile_overlap(
        twin, bucket_cap_mb=_CAP_MB, backend="inductor" if inductor else "aot_eager",
        mode="max-autotune-no-cudagraphs" if setting == "max-autotune" else None)
    train_alike(hvd, eager, compiled, twin, opts, passes, amp, f"overlap.{tag}")


def test_accumulate_routes_hooks_and_gradients() -> None:
    """Without a compiler: a claimed parameter's hooks leave autograd and run from
    ``accumulate`` (removed ones not at all); ``targets`` names where a backward is to write
    each gradient (the home, where there is one and no ``.grad`` yet; else a new tensor), and
    ``accumulate`` makes the written tensor the ``.grad`` (no copy) or adds it into the
    ``.grad`` there is; an unclaimed parameter's hooks run where autograd runs them."""
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    home = torch.full((3,), -1.0)
    calls: list[str] = []
    _accumulate.hook(a, lambda _p: calls.append("a"), home=lambda: home)
    gone = _accumulate.hook(a, lambda _p: calls.append("gone"))
    _accumulate.hook(b, lambda _p: calls.append("b"))
    gone.remove()
    (a.sum() + b.sum()).backward()
    assert sorted(calls) == ["a", "b"]
    a.grad = b.grad = None
    _accumulate.claim([a, b], "frame")
    calls.clear()
    (a.sum() + b.sum()).backward()  # autograd accumulates; our hooks no longer run there
    assert calls == []
    assert a.grad is not None and torch.equal(a.grad, torch.ones(3))
    a.grad = b.grad = None
    key = _accumulate.new_group([a, b])
    into = _accumulate.targets(key)
    assert into[0] is home and into[1] is not home and into[1].shape == (2,)
    into[0].fill_(2.0)
    into[1].fill_(3.0)
    _accumulate.accumulate(key, into)
    assert a.grad is home and b.grad is into[1]  # no copy
    assert torch.equal(home, torch.full((3,), 2.0)) and torch.equal(b.grad, torch.full((2,), 3.0))
    again = _accumulate.targets(key)  # both have a .grad now: new tensors, added
    assert again[0] is not home and again[1] is not into[1]
    again[0].fill_(1.0)
    again[1].fill_(1.0)
    _accumulate.accumulate(key, again)
    assert a.grad is home and torch.equal(home, torch.full((3,), 3.0))
    assert torch.equal(b.grad, torch.full((2,), 4.0))
    assert calls == ["a", "b", "a", "b"]
    with pytest.raises(RuntimeError, match="no longer exists"):
        _accumulate.accumulate(key + 10**6, [])
    flat = torch.zeros(4)
    c = nn.Parameter(torch.ones(3))
    _accumulate.hook(c, lambda _p: None, home=lambda: flat[1:])  # 4 bytes past a boundary
    _accumulate.claim([c], "frame")
    (written,) = _accumulate.targets(_accumulate.new_group([c]))
    assert written.data_ptr() != flat[1:].data_ptr() and written.data_ptr() % 16 == 0


def test_targets_follow_homes_made_anew_and_gradients_kept() -> None:
    """A group whose every member takes its home gets the same homes back each step with no
    call per member (``_accumulate._Group.views``), until a bucket's views are made anew
    (its homes then name new tensors) or a member has a ``.grad`` (``zero_grad`` to zeros:
    new tensors, added); each step's result equals the general path's."""
    def bucket() -> list[torch.Tensor]:  # a flat buffer's views, as Bucket.make_views
        flat = torch.zeros(8)
        return [flat[:4], flat[4:]]

    views = [bucket()]
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    order: list[str] = []
    _accumulate.hook(a, lambda _p: order.append("a"), home=lambda: views[0][0])
    _accumulate.hook(b, lambda _p: order.append("b"), home=lambda: views[0][1])
    _accumulate.claim([a, b], "frame")
    key = _accumulate.new_group([a, b])

    def step(fresh: bool) -> list[torch.Tensor]:
        if fresh:
            a.grad = b.grad = None
        into = _accumulate.targets(key)
        for t in into:
            t.fill_(1.0)  # the graph writes each gradient
        _accumulate.accumulate(key, into)
        return into

    first = step(True)
    assert first == views[0] and a.grad is views[0][0] and b.grad is views[0][1]
    assert step(True) is first  # the kept homes, no call per member
    old, views[0] = views[0], bucket()  # the bucket's views made anew
    moved = step(True)
    assert moved is not first and moved == views[0] and a.grad is views[0][0]
    added = step(False)  # every member has a .grad: new tensors, added into it
    assert all(t is not v for t, v in zip(added, views[0], strict=True))
    assert a.grad is views[0][0] and torch.equal(torch.cat(views[0]), torch.full((8,), 2.0))
    assert torch.equal(torch.cat(old), torch.ones(8)) and order == ["a", "b"] * 4


def test_accumulator_nodes_are_kept_per_stream(monkeypatch: Any) -> None:
    """The bookkeeping of the nodes a group keeps (``_accumulate._resolved``), with the
    backward's stream given (on CUDA it is the current stream: tests/torch/test_gpu_graphs.py
    runs steps on other streams and captures them): kept on one stream; the backward that
    finds another keeps none, however often it asks (``targets`` and ``accumulate`` both do:
    its graph's nodes may be the old stream's); the next backward keeps new ones; and a
    capture on another stream than the last backward's is refused, naming the fix."""
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))]
    for p in params:
        _accumulate.hook(p, lambda _p: None)
    key = _accumulate.new_group(params)
    stream, capturing, task = [7], [False], [1]
    monkeypatch.setattr(_accumulate, "_stream_of_backward", lambda _key: stream[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch._C, "_current_graph_task_id", lambda: task[0])
    kept = _accumulate._members(key)
    assert _accumulate._members(key) is kept and _accumulate._resolved[key] == (7, kept, -1)
    stream[0], task[0] = 9, 2
    moved = _accumulate._members(key)
    assert moved is not kept and _accumulate._resolved[key] == (9, None, 2)
    also = _accumulate._members(key)  # the same backward asks again
    assert also is not moved and _accumulate._resolved[key] == (9, None, 2)
    task[0] = 3
    again = _accumulate._members(key)
    assert _accumulate._members(key) is again and _accumulate._resolved[key] == (9, again, -1)
    stream[0], capturing[0] = 11, True
    with pytest.raises(hvdlite.HvdliteError, match=r"captured on another CUDA stream.*"
                                                   r"torch\.cuda\.graph\(g, stream=s\)"):
        _accumulate._members(key)


def test_overlap_compile_rejects_bad_arguments(hvd: Any) -> None:
    net = Net()
    with pytest.raises(TypeError, match="must be a torch.nn.Module, got function"):
        hvd.compile_overlap(lambda x: x)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number, got 0"):
        hvd.compile_overlap(net, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="last_bucket_cap_mb must be a positive number or "
                                         "None, got -1"):
        hvd.compile_overlap(net, last_bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="backend must be one of inductor, aot_eager, got "
                                         "'eager'"):
        hvd.compile_overlap(net, backend="eager")
    with pytest.raises(ValueError, match="mode= and options= are for the inductor backend, "
                                         "got backend='aot_eager'"):
        hvd.compile_overlap(net, backend="aot_eager", mode="max-autotune-no-cudagraphs")


def test_overlap_compile_without_optimizer_hooks_says_so(hvd: Any) -> None:
    """A model compiled by compile_overlap whose parameters have no optimizer hooks at its
    first call (the optimizer made later) trains as torch.compile would, and past one rank a
    warning says why its buckets start after the backward."""
    from hvdlite.torch import overlap

    overlap._warned = False
    net = Net(depth=2)
    compiled = hvd.compile_overlap(net, backend="aot_eager")
    if hvd.size() > 1:
        with pytest.warns(UserWarning, match="create the optimizer before the model's first "
                                             "call"):
            compiled(_batch(0, 0)).square().mean().backward()
    else:
        compiled(_batch(0, 0)).square().mean().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_a_backward_that_fails_to_compile_with_the_calls_compiles_without(hvd: Any) -> None:
    """Where the compiler refuses the backward graph with hvdlite's calls in it (here a
    compiler function that fails on any graph holding one), a warning says so and the graph
    is compiled as it was: nothing claimed, the hooks run where autograd runs them, and the
    gradients are eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from hvdlite.torch import overlap

    def refusing(graph: torch.fx.GraphModule, _extra: Any) -> Any:
        if any(n.target in overlap._ops() for n in graph.graph.nodes):
            raise RuntimeError("this compiler takes no hvdlite calls")
        return make_boxed_func(graph.forward)

    torch.manual_seed(3)
    net, eager = Net(depth=2), Net(depth=2)
    eager.load_state_dict(net.state_dict())
    fired: list[int] = []
    handles = [_accumulate.hook(p, lambda _p: fired.append(1)) for p in net.parameters()]

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        params = [t if isinstance(t, nn.Parameter) else None for t in inputs]
        return aot_autograd(
            fw_compiler=lambda g, _i: make_boxed_func(g.forward),
            bw_compiler=lambda g, _i: overlap._compile_backward(g, params, (1 << 20, 0),
                                                               "refusing", refusing))(
            gm, inputs)

    try:
        compiled = torch.compile(net, backend=backend)
        with pytest.warns(UserWarning, match="did not compile with hvdlite's calls "
                                             r"\(RuntimeError: this compiler takes no"):
            compiled(_batch(0, 0)).square().mean().backward()
        assert len(fired) == len(list(net.parameters()))
        assert not any(_accumulate._OWNED[p].claimed for p in net.parameters())
    finally:
        for h in handles:
            h.remove()
    eager(_batch(0, 0)).square().mean().backward()
    for a, b in zip(eager.parameters(), net.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)


class _TiedAcrossBreak(nn.Module):
    """One linear layer used on both sides of a graph break (two compiled frames)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.shared(x))
        torch._dynamo.graph_break()
        x = torch.tanh(self.shared(self.mid(x)))
        return self.head(x)


def test_a_parameter_in_two_compiled_frames_is_left_to_autograd(hvd: Any) -> None:
    """A weight used in two frames (a graph break between its uses) gets a gradient from
    each frame's backward: it is claimed by neither (its hooks run once, in autograd, on the
    whole gradient), while the others' buckets start inside their frames; 4 steps equal the
    eager model's with the same optimizer, alone and with 2 backward passes a step."""
    for passes in (1, 2):
        torch.manual_seed(4)
        eager, net = _TiedAcrossBreak(), _TiedAcrossBreak()
        net.load_state_dict(eager.state_dict())
        opts = _twins(hvd, eager, net, f"tied{passes}", bucket_cap_mb=300 / 2**20,
                      backward_passes_per_step=passes)
        compiled = hvd.compile_overlap(net, bucket_cap_mb=300 / 2**20, backend="aot_eager")
        for step in range(4):
            for model, opt in zip((eager, compiled), opts, strict=True):
                opt.zero_grad()
                for k in range(passes):
                    model(_batch(passes * step + k, hvd.rank())).square().mean().backward()
                opt.step()
        owned = _accumulate._OWNED
        assert owned[net.shared.weight].shared and not owned[net.shared.weight].claimed
        assert owned[net.head.weight].claimed
        for (name, a), b in zip(eager.named_parameters(), net.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
        torch._dynamo.reset()


@pytest.mark.parametrize("layout", ["staged", "groups", "dynamic shapes"])
def test_overlap_compile_trains_as_eager_in_other_layouts(hvd: Any, layout: str) -> None:
    """compile_overlap against the same optimizer on the eager model with buckets that do not
    live in views (``gradient_as_bucket_view=False``), with user groups (``groups=3``, which
    the graph's buckets do not match), and with batches of varying size (recompiles, dynamic
    shapes): after 6 steps the parameters are the eager model's, on every rank alike."""
    torch.manual_seed(5)
    eager, net = Net(depth=4), Net(depth=4)
    net.load_state_dict(eager.state_dict())
    extra: dict[str, Any] = {"gradient_as_bucket_view": False} if layout == "staged" else \
        {"groups": 3} if layout == "groups" else {}
    opts = _twins(hvd, eager, net, f"layout.{layout}", 0.5, bucket_cap_mb=_CAP_MB, **extra)
    compiled = hvd.compile_overlap(net, bucket_cap_mb=_CAP_MB, backend="aot_eager")
    rows = [4, 6, 4, 8, 5, 4] if layout == "dynamic shapes" else [4] * 6
    for step, n in enumerate(rows):
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(100 * step + hvd.rank()))
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for (name, a), b in zip(eager.named_parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    flat = torch.cat([p.detach().reshape(1, -1) for p in net.parameters()], dim=1)
    everyone = hvd.allgather(flat, name=f"layout.{layout}.params")
    assert all(torch.equal(everyone[0], row) for row in everyone)


def test_overlap_compile_with_adasum_trains_as_eager(hvd: Any) -> None:
    """The Adasum optimizer's hooks go through hvdlite's accumulation hooks too: compiled by
    compile_overlap its deltas start inside the backward (every hook before the compiled
    backward ends), and 4 steps equal the eager model's with the same optimizer."""
    if hvd.size() & (hvd.size() - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    torch.manual_seed(6)
    eager, net = Net(depth=3), Net(depth=3)
    net.load_state_dict(eager.state_dict())
    opts = _twins(hvd, eager, net, "adasum", op=hvd.Adasum)
    compiled = hvd.compile_overlap(net, backend="aot_eager")
    for step in range(4):
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            model(_batch(step, hvd.rank())).square().mean().backward()
            opt.step()
    assert all(_accumulate._OWNED[p].claimed for p in net.parameters())
    for (name, a), b in zip(eager.named_parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_autograd_grad_of_the_input_leaves_the_parameters_alone(hvd: Any) -> None:
    """``torch.autograd.grad`` of the input through a compile_overlap model (a saliency map
    taken each step before the step's own forward and ``backward()``) runs the compiled
    backward, calls included: they accumulate nothing and start no bucket, since that
    backward accumulates into no parameter. 4 steps equal the eager model's with the same
    optimizer, input gradients too."""
    torch.manual_seed(7)
    eager, net = Net(depth=3), Net(depth=3)
    net.load_state_dict(eager.state_dict())
    opts = _twins(hvd, eager, net, "saliency", bucket_cap_mb=_CAP_MB)
    compiled = hvd.compile_overlap(net, bucket_cap_mb=_CAP_MB, backend="aot_eager")
    for step in range(4):
        maps = []
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            x = _batch(step, hvd.rank()).requires_grad_()
            maps.append(torch.autograd.grad(model(x).square().mean(), x)[0])
            if model is compiled:
                assert all(p.grad is None for p in net.parameters())
            model(x).square().mean().backward()
            opt.step()
        torch.testing.assert_close(maps[1], maps[0], rtol=1e-6, atol=1e-7)
    for (name, a), b in zip(eager.named_parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


class _TinyLM(nn.Module):
    """GPT-2's shape in small: a token embedding tied to the output projection, position
    embeddings, Conv1D projections (``addmm(bias, x, weight)``, the weight ``(in, out)``), a
    layer norm; an odd vocabulary (37) and widths, so its bucket views need padding."""

    def __init__(self, vocab: int = 37, width: int = 12, ctx: int = 5) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(ctx, width)
        self.ln = nn.LayerNorm(width)
        self.c_fc = nn.Parameter(torch.randn(width, 3 * width + 1) * 0.1)
        self.b_fc = nn.Parameter(torch.zeros(3 * width + 1))
        self.c_proj = nn.Parameter(torch.randn(3 * width + 1, width) * 0.1)
        self.b_proj = nn.Parameter(torch.zeros(width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        x = self.ln(h).reshape(-1, h.shape[-1])
        x = torch.tanh(torch.addmm(self.b_fc, x, self.c_fc))
        h = h + torch.addmm(self.b_proj, x, self.c_proj).view_as(h)
        return nn.functional.linear(h, self.wte.weight)  # tied


@pytest.mark.parametrize("backend", ["aot_eager",
                                     pytest.param("inductor", marks=pytest.mark.timeout(180))])
def test_a_gpt2_shaped_model_trains_as_eager_with_gradients_in_place(hvd: Any,
                                                                     monkeypatch: Any,
                                                                     backend: str) -> None:
    """A tied embedding (its gradient the sum of the lookup's and the projection's), Conv1D
    weights (a product of a transposed input) and odd sizes: once the buckets have their
    views (after the first step), compile_overlap writes every gradient straight into its
    view (the views start on 16-byte boundaries: an odd-sized member does not push the next
    off one), and 4 steps of cross-entropy on every rank's own tokens equal the eager model's
    with the same optimizer, on every rank alike."""
    written: list[torch.Tensor] = []
    real = _accumulate.targets

    def spy(key: int) -> list[torch.Tensor]:
        out = real(key)
        written.extend(out)
        return out

    monkeypatch.setattr(_accumulate, "targets", spy)
    torch.manual_seed(8)
    eager, net = _TinyLM(), _TinyLM()
    net.load_state_dict(eager.state_dict())
    opts = _twins(hvd, eager, net, f"lm.{backend}", 0.5, bucket_cap_mb=600 / 2**20)
    compiled = hvd.compile_overlap(net, bucket_cap_mb=600 / 2**20, backend=backend)
    gen = torch.Generator().manual_seed(hvd.rank())
    for step in range(4):
        ids = torch.randint(0, 37, (3, 5), generator=gen)
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            written.clear()
            logits = model(ids)
            nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 37),
                                        ids[:, 1:].reshape(-1)).backward()
            if model is compiled and step:
                views = [v for b in opts[1]._buckets for v in b.views]
                assert len(written) == len(views) == len(list(net.parameters()))
                assert {id(t) for t in written} == {id(v) for v in views}
            opt.step()
    for (name, a), b in zip(eager.named_parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).unsqueeze(0)
    everyone = hvd.allgather(flat, name=f"lm.{backend}.params")
    assert all(torch.equal(everyone[0], row) for row in everyone)
