"""SyncBatchNorm equals torch's BatchNorm on the concatenated global batch: output, input and
parameter gradients, running statistics."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn


@pytest.mark.parametrize("shape", [(3, 4), (2, 4, 5, 3)], ids=["1d", "2d"])
def test_matches_batch_norm_on_global_batch(hvd: Any, shape: tuple[int, ...]) -> None:
    n, me = hvd.size(), hvd.rank()
    rows = [shape[0] + r for r in range(n)]  # uneven per-rank batches
    xs = [torch.randn(rows[r], *shape[1:], generator=torch.Generator().manual_seed(r),
                      dtype=torch.float64) * 3 + 1 for r in range(n)]
    gs = [torch.randn(rows[r], *shape[1:], generator=torch.Generator().manual_seed(50 + r),
                      dtype=torch.float64) for r in range(n)]
    sync = hvd.SyncBatchNorm(4, momentum=0.3).double()
    ref = (nn.BatchNorm1d(4, momentum=0.3) if len(shape) == 2
           else nn.BatchNorm2d(4, momentum=0.3)).double()
    with torch.no_grad():
        for m in (sync, ref):
            m.weight.copy_(torch.tensor([1.0, 2.0, -0.5, 0.3]))
            m.bias.copy_(torch.tensor([0.1, 0.0, 0.2, -1.0]))
    x = xs[me].clone().requires_grad_()
    out = sync(x)
    out.backward(gs[me])
    xr = torch.cat(xs).requires_grad_()
    out_ref = ref(xr)
    out_ref.backward(torch.cat(gs))
    start = sum(rows[:me])
    assert torch.allclose(out, out_ref[start:start + rows[me]], atol=1e-10)
    assert torch.allclose(x.grad, xr.grad[start:start + rows[me]], atol=1e-10)
    wgrad = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
    bgrad = hvd.allreduce(sync.bias.grad, op=hvd.Sum)
    assert torch.allclose(wgrad, ref.weight.grad, atol=1e-10)
    assert torch.allclose(bgrad, ref.bias.grad, atol=1e-10)
    assert torch.allclose(sync.running_mean, ref.running_mean, atol=1e-12)
    assert torch.allclose(sync.running_var, ref.running_var, atol=1e-12)
    assert int(sync.num_batches_tracked) == 1
    sync.eval()
    ref.eval()
    assert torch.allclose(sync(xs[me]), ref(xs[me]), atol=1e-12)
    with pytest.raises(ValueError):
        sync(torch.ones(3))
