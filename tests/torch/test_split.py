"""A model compiled whole with its traced graph cut at bucket boundaries
(``hvdlite/torch/split.py``): on CPU torch with the ``aot_eager`` backend (the same aten
operations as eager, no code generation). Step timings need a GPU per rank
(scripts/gpu/bench_t1.py); this checks the mechanism and the results."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_regions import Net, _batch, paired_nets, train_alike

# One block of Net(width=16): 16 x 16 + 16 float32 = 1088 bytes; a cap of two blocks.
_CAP_MB = 2 * 1088 / 2**20
_FIRST_MB = 1088 / 2**20


def _fired_before_input_grad(model: Any, steps: int = 2) -> list[int]:
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
    eager, twin, opts, passes, amp, tag = paired_nets(hvd, setting, "split", _CAP_MB)
    compiled = hvd.compile_split(twin, bucket_cap_mb=_CAP_MB, backend="aot_eager")
    train_alike(hvd, eager, compiled, twin, opts, passes, amp, f"split.{tag}")


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
