"""A model compiled whole with its traced graph cut at bucket boundaries
(``hvdlite/torch/split.py``): on CPU torch with the ``aot_eager`` backend (the same aten
operations as eager, no code generation). Step timings need a GPU per rank
(scripts/gpu/bench_t1.py); this checks the mechanism and the results."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_regions import Net, _batch
from torch import nn
from torch_util import n_rank_path

# One block of Net(width=16): 16 x 16 + 16 float32 = 1088 bytes; a cap of two blocks.
_CAP_MB = 2 * 1088 / 2**20
_FIRST_MB = 1088 / 2**20


def _fired_before_input_grad(model: nn.Module, steps: int = 2) -> list[int]:
    """Per step: how many parameters' post-accumulate hooks fired before the input's
    gradient was computed (the input's gradient is backward's last result)."""
    fired: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda _p: fired.append(1))
             for p in model.parameters()]
    counts = []
    try:
        for step in range(steps):
            fired.clear()
            x = _batch(step, 0).requires_grad_()
            seen: list[int] = []
            x.register_hook(lambda _g: seen.append(len(fired)))  # noqa: B023
            model(x).square().mean().backward()
            counts.append(seen[0])
    finally:
        for h in hooks:
            h.remove()
    return counts


def test_split_compile_finishes_gradients_during_backward(hvd: Any) -> None:
    """Compiled whole, every parameter's gradient comes out of one backward operation, at
    its end (at most one hook ran before the input's gradient); compiled split at a cap of
    two blocks, the later pieces' gradients are final (their hooks ran) while the earlier
    pieces' backward has not run yet, as in eager."""
    torch.manual_seed(0)
    n = len(list(Net(depth=6).parameters()))
    whole = _fired_before_input_grad(torch.compile(Net(depth=6), backend="aot_eager"))
    split = _fired_before_input_grad(hvd.compile_split(
        Net(depth=6), bucket_cap_mb=_CAP_MB, first_bucket_cap_mb=_FIRST_MB,
        backend="aot_eager"))
    assert all(c <= 1 for c in whole), whole
    assert all(n // 2 <= c < n for c in split), (split, n)


@pytest.mark.parametrize("setting", ["plain", "backward_passes_per_step", "fp16 compression",
                                     "bf16 autocast"])
def test_split_compile_trains_as_eager(hvd: Any, setting: str) -> None:
    """Compiled split with the optimizer's buckets at the same cap (alone, with 2 backward
    passes per step, fp16 compression, or bf16 autocast): after 5 steps on every rank's own
    batches the parameters equal those of the same hvdlite settings on the eager model, and
    are the same on every rank."""
    torch.manual_seed(2)
    eager = Net(depth=6)
    compiled_net = Net(depth=6)
    compiled_net.load_state_dict(eager.state_dict())
    compiled = hvd.compile_split(compiled_net, bucket_cap_mb=_CAP_MB, backend="aot_eager")
    passes = 2 if setting == "backward_passes_per_step" else 1
    extra: dict[str, Any] = ({"backward_passes_per_step": 2} if passes == 2
                             else {"compression": hvd.Compression.fp16}
                             if setting == "fp16 compression" else {})
    amp = setting == "bf16 autocast"
    tag = setting.split()[0]

    def optimizer(model: nn.Module, which: str) -> Any:
        with n_rank_path():
            return hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=[(f"split.{tag}.{which}.{n}", p)
                                  for n, p in model.named_parameters()],
                bucket_cap_mb=_CAP_MB, **extra)

    opts = [optimizer(eager, "eager"), optimizer(compiled_net, "compiled")]
    start = [p.detach().clone() for p in eager.parameters()]
    for step in range(5):
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            for k in range(passes):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = model(_batch(passes * step + k, hvd.rank())).float().square().mean()
                loss.backward()
            opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(start, eager.parameters(), strict=True))
    for (name, a), b in zip(eager.named_parameters(), compiled_net.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    flat = torch.cat([p.detach().reshape(1, -1) for p in compiled_net.parameters()], dim=1)
    everyone = hvd.allgather(flat, name=f"split.{tag}.params")
    assert all(torch.equal(everyone[0], row) for row in everyone)


def test_split_compile_rejects_bad_arguments(hvd: Any) -> None:
    net = Net()
    with pytest.raises(TypeError, match="must be a torch.nn.Module, got function"):
        hvd.compile_split(lambda x: x)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number, got 0"):
        hvd.compile_split(net, bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"first_bucket_cap_mb \(2\) must not exceed "
                                         r"bucket_cap_mb \(1\)"):
        hvd.compile_split(net, bucket_cap_mb=1, first_bucket_cap_mb=2)
    with pytest.raises(ValueError, match="mode= and options= are for the inductor backend, "
                                         "got backend='aot_eager'"):
        hvd.compile_split(net, backend="aot_eager", mode="max-autotune-no-cudagraphs")
