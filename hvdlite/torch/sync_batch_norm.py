"""``SyncBatchNorm``: batch normalization with statistics over the global batch.

In training, each rank sums its batch per channel; two differentiable ``Sum`` allreduces give
the global mean and then the global (biased) variance, so the forward output equals torch's
``BatchNorm`` on the concatenated batch, and autograd (through the allreduces' backward)
gives each rank the gradient of the summed loss of every rank, as Horovod's does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.modules.batchnorm import _BatchNorm

import hvdlite
from hvdlite.torch.basics import Sum
from hvdlite.torch.functional_ops import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` that normalizes over every rank's batch.

    Same arguments as torch's batch norm (``num_features``, ``eps``, ``momentum``, ``affine``,
    ``track_running_stats``). Inputs of shape ``(N, C, *)`` with ``N*prod(*) >= 1`` per rank
    (at least two elements per channel globally). In eval mode, or with a single rank, it is
    torch's batch norm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-d input (N, C, ...), got "
                             f"{input.dim()}-d")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got {input.shape[1]} "
                             "channels")

    def _factor(self) -> float:
        if not (self.training and self.track_running_stats):
            return 0.0 if self.momentum is None else float(self.momentum)
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return float(self.momentum)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with the global batch's statistics (training) or the running
        statistics (eval)."""
        self._check_input_dim(input)
        factor = self._factor()
        use_batch = self.training or not self.track_running_stats
        if not use_batch or hvdlite.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch, factor, self.eps)
        return self._sync_forward(input, factor)

    def _sync_forward(self, input: torch.Tensor, factor: float) -> torch.Tensor:
        dtype = input.dtype
        x = input.float() if dtype in (torch.float16, torch.bfloat16) else input
        c = self.num_features
        dims = [0, *range(2, x.dim())]
        shape = [1, c] + [1] * (x.dim() - 2)
        local_count = x.numel() // c
        stats = torch.cat([x.sum(dims), x.new_full((1,), float(local_count))])
        stats = allreduce(stats, op=Sum)
        total = stats[c]
        mean = stats[:c] / total
        centered = x - mean.view(shape)
        var = allreduce((centered * centered).sum(dims), op=Sum) / total
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.view(shape).to(y.dtype)
        if self.bias is not None:
            y = y + self.bias.view(shape).to(y.dtype)
        if self.track_running_stats and self.running_mean is not None:
            assert self.running_var is not None
            n = float(total.item())
            with torch.no_grad():
                unbiased = var.detach() * (n / max(n - 1.0, 1.0))
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                       alpha=factor)
        return y.to(dtype)
