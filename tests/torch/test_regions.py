"""Regional compilation (``hvdlite/torch/regions.py``): a compiled model whose gradient
buckets can start during backward, on CPU torch with the ``aot_eager`` backend (the same aten
operations as eager, no code generation: seconds, not minutes). Step timings need a GPU per
rank (scripts/gpu/bench_t1.py); this checks the mechanism and the results."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch_util import n_rank_path


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def setting_knobs(hvd: Any, setting: str) -> tuple[int, dict[str, Any], bool]:
    """(backward passes per step, the optimizer's extra arguments, bf16 autocast) for one of
    issue 39's compositions: "backward_passes_per_step", "fp16 compression", "bf16 autocast"
    (anything else: none)."""
    passes = 2 if setting == "backward_passes_per_step" else 1
    extra: dict[str, Any] = ({"backward_passes_per_step": 2} if passes == 2
                             else {"compression": hvd.Compression.fp16}
                             if setting == "fp16 compression" else {})
    return passes, extra, setting == "bf16 autocast"


def paired_nets(hvd: Any, setting: str, prefix: str, cap_mb: float
                ) -> tuple[nn.Module, nn.Module, list[Any], int, bool, str]:
    """An eager Net(depth=6) and its twin with the same weights (to be compiled), each with a
    DistributedOptimizer of ``setting``'s knobs (:func:`setting_knobs`) at bucket cap
    ``cap_mb``: (eager, twin, their optimizers, passes, bf16 autocast, the setting's tag)."""
    torch.manual_seed(2)
    eager = Net(depth=6)
    twin = Net(depth=6)
    twin.load_state_dict(eager.state_dict())
    passes, extra, amp = setting_knobs(hvd, setting)
    tag = setting.split()[0]

    def optimizer(model: nn.Module, which: str) -> Any:
        with n_rank_path():
            return hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=[(f"{prefix}.{tag}.{which}.{n}", p)
                                  for n, p in model.named_parameters()],
                bucket_cap_mb=cap_mb, **extra)

    return eager, twin, [optimizer(eager, "eager"), optimizer(twin, "compiled")], passes, amp, \
        tag


def train_alike(hvd: Any, eager: nn.Module, compiled: nn.Module, params: nn.Module,
                opts: list[Any], passes: int, amp: bool, tag: str, steps: int = 5) -> None:
    """``steps`` steps of the eager model and the compiled one (``params``: the module that
    holds its parameters), each with its optimizer of ``opts``, on every rank's own batches;
    then the parameters moved, equal the eager model's, and are the same on every rank
    (gathered under ``tag``)."""
    start = [p.detach().clone() for p in eager.parameters()]
    for step in range(steps):
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            for k in range(passes):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = model(_batch(passes * step + k, hvd.rank())).float().square().mean()
                loss.backward()
            opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(start, eager.parameters(), strict=True))
    for (name, a), b in zip(eager.named_parameters(), params.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    flat = torch.cat([p.detach().reshape(1, -1) for p in params.parameters()], dim=1)
    everyone = hvd.allgather(flat, name=f"{tag}.params")
    assert all(torch.equal(everyone[0], row) for row in everyone)


def test_find_regions_takes_the_repeated_blocks() -> None:
    net = Net()
    assert find(net) == list(net.blocks)
    flat = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert find(flat) == [flat[0], flat[2]]


def find(model: nn.Module) -> list[nn.Module]:
    import hvdlite.torch as hvd

    return hvd.find_regions(model)


def test_region_groups_follow_backward_and_the_cap(hvd: Any) -> None:
    net = Net(width=16, depth=5)
    # each block: 16 x 16 + 16 floats = 1088 B; a cap of 2.5 blocks merges pairs inside
    groups = hvd.region_groups(net, list(net.blocks), bucket_cap_mb=2.5 * 1088 / 2**20)
    blocks = [list(b.parameters()) for b in net.blocks]
    assert [[id(p) for p in g] for g in groups] == [
        [id(p) for p in ps] for ps in (blocks[4], blocks[3] + blocks[2], blocks[1], blocks[0],
                                       list(net.embed.parameters())
                                       + list(net.head.parameters()))]
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        hvd.region_groups(net, list(net.blocks), bucket_cap_mb=0)


def test_a_region_tied_to_a_module_outside_waits_in_the_last_group(hvd: Any) -> None:
    """A head given as a region whose weight is the embedding's (a language model's tied
    head): the tied weight's gradient is final only after the embedding's backward, at the
    end, so it goes to the last group with the embedding, not to the head's early bucket;
    the head's own bias stays in its group."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 16)
            self.blocks = nn.ModuleList(Block(16) for _ in range(3))
            self.head = nn.Linear(16, 10)
            self.head.weight = self.embed.weight

    net = Tied()
    groups = hvd.region_groups(net, [*net.blocks, net.head])
    ids = [[id(p) for p in g] for g in groups]
    assert ids[0] == [id(net.head.bias)]
    assert ids[-1] == [id(net.embed.weight)]
    assert list(map(len, ids)) == [1, 4, 2, 1]  # the head; blocks 2 and 1; block 0; tied
    assert sum(map(len, ids)) == len(list(net.parameters()))  # each parameter once


def test_compile_regions_refuses_foreign_or_nested_regions(hvd: Any) -> None:
    net = Net()
    with pytest.raises(ValueError, match="region 0 is not a submodule"):
        hvd.compile_regions(net, [nn.Linear(2, 2)], backend="aot_eager")
    with pytest.raises(ValueError, match="region 1 shares parameters"):
        hvd.compile_regions(net, [net.blocks, net.blocks[0]], backend="aot_eager")


def test_compile_regions_warns_of_a_per_forward_cache(hvd: Any) -> None:
    """A model configured the Hugging Face way with its key/value cache on (GPT-2's default)
    is warned of: the cache defeats the shared compiled code of its blocks. Off, no warning."""
    import types
    import warnings

    net = Net()
    net.config = types.SimpleNamespace(use_cache=True)
    with pytest.warns(UserWarning, match=r"use_cache is True.*use_cache = False"):
        hvd.compile_regions(net, backend="aot_eager")
    net = Net()
    net.config = types.SimpleNamespace(use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd.compile_regions(net, backend="aot_eager")


def test_regional_buckets_are_final_during_backward_and_train_as_eager(hvd: Any) -> None:
    """Compiled by regions, the last block's bucket is complete while the first block's
    backward has not run yet (its gradient is still None), so its allreduce can start there;
    after 10 steps the parameters equal those of the same hvdlite step on the eager model."""
    torch.manual_seed(0)
    eager = Net()
    compiled = Net()
    compiled.load_state_dict(eager.state_dict())
    regions = hvd.compile_regions(compiled, backend="aot_eager")
    assert regions == list(compiled.blocks)
    seen: list[bool] = []
    last = list(compiled.blocks[-1].parameters())[-1]
    last.register_post_accumulate_grad_hook(
        lambda _p: seen.append(compiled.blocks[0].lin.weight.grad is None))

    def optimizer(model: Net, tag: str) -> Any:
        with n_rank_path():
            return hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
                groups=hvd.region_groups(model, list(model.blocks)))

    opts = [optimizer(eager, "regions.eager"), optimizer(compiled, "regions.compiled")]
    for step in range(10):
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            model(_batch(step, hvd.rank())).square().mean().backward()
            opt.step()
    assert seen and all(seen), seen
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("setting", ["backward_passes_per_step", "fp16 compression",
                                     "bf16 autocast"])
def test_regional_buckets_compose_with_accumulation_and_compression(hvd: Any,
                                                                    setting: str) -> None:
    """Issue 39's compositions: compiled by regions with gradient accumulation (2 backward
    passes per step), fp16 compression or bf16 autocast (the forward under it, on the CPU),
    the parameters after 5 steps equal those of the same hvdlite settings on the eager model
    (every rank's batch differs, so a bucket reduced too early, twice or not at all would
    show)."""
    torch.manual_seed(1)
    eager = Net()
    compiled = Net()
    compiled.load_state_dict(eager.state_dict())
    hvd.compile_regions(compiled, backend="aot_eager")
    passes, extra, amp = setting_knobs(hvd, setting)

    def optimizer(model: Net, tag: str) -> Any:
        with n_rank_path():
            return hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
                groups=hvd.region_groups(model, list(model.blocks)), **extra)

    tag = setting.split()[0]
    opts = [optimizer(eager, f"compose.{tag}.eager"),
            optimizer(compiled, f"compose.{tag}.compiled")]
    train_alike(hvd, eager, compiled, compiled, opts, passes, amp, f"compose.{tag}")


def test_compiled_autograd_runs_the_hooks_eagerly_and_trains_as_eager(hvd: Any) -> None:
    """Under compiled autograd (torch.compile traces the backward with its hooks) the
    optimizer's hooks are opaque to dynamo, so each runs eagerly where backward reaches it
    (tracing into the runtime used to fail deep inside dynamo); 4 steps of the whole model
    compiled, backward compiled too, give the parameters of 4 steps with backward eager,
    exactly. A model of two blocks: each hook is a graph break of the traced backward, so
    its compile time grows with the parameters. (Their layouts differ after the first step:
    the model compiled whole hands autograd every gradient at once, in forward order, while
    the traced backward reaches the parameters in backward order.)"""
    from torch._dynamo import compiled_autograd

    def train(traced: bool, tag: str) -> tuple[torch.Tensor, Any]:
        torch.manual_seed(0)
        net = Net(depth=2)
        with n_rank_path():
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(net.parameters(), lr=0.1),
                named_parameters=[(f"{tag}.{n}", p) for n, p in net.named_parameters()],
                bucket_cap_mb=700 / 2**20)
        model = torch.compile(net, backend="aot_eager")
        for step in range(4):
            opt.zero_grad()
            loss = model(_batch(step, hvd.rank())).square().mean()
            if traced:
                with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                    loss.backward()
            else:
                loss.backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), opt

    want, eager = train(False, "ca_eager")
    got, traced = train(True, "ca_traced")
    assert torch.equal(got, want), float((got - want).abs().max())
    assert len(traced.bucket_names) > 1 and len(eager.bucket_names) > 1
    assert traced.bucket_names[0].endswith("head.bias.bucket0"), traced.bucket_names
