"""``SyncBatchNorm``: batch normalization with statistics over the global batch.

In training, each rank computes its batch's per-channel count, mean and squared deviations
in one fused pass; one allgather of them gives the global mean and (biased) variance, so the
forward output equals torch's ``BatchNorm`` on the concatenated batch (normalised by torch's
fused kernel). The backward pass gives each rank the gradient of the summed loss of every rank,
as Horovod's does: one fused reduction pass, one allreduce of two per-channel sums.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.modules.batchnorm import _BatchNorm

import hvdlite
from hvdlite.torch import mpi_ops
from hvdlite.torch.basics import Sum
from hvdlite.torch.mpi_ops import allgather_async


def allgather(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dim 0 (not differentiable)."""
    return allgather_async(t).wait()

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
        y, mean, var, total = _SyncBN.apply(x.contiguous(), self.weight, self.bias, self.eps)
        if self.track_running_stats and self.running_mean is not None:
            assert self.running_var is not None
            with torch.no_grad():
                unbiased = var * (total / max(total - 1.0, 1.0))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                       alpha=factor)
        return y.to(dtype)


def _global_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(mean, biased variance, element count per channel) over every rank's ``x``: each
    rank's count, mean and sum of squared deviations (one fused pass), gathered and merged
    (Chan et al.'s parallel variance), in float64."""
    dims = [0, *range(2, x.dim())]
    c = x.shape[1]
    n = x.numel() // c
    if n:
        var, mean = torch.var_mean(x, dims, correction=0)
    else:
        var = mean = torch.zeros(c, dtype=x.dtype, device=x.device)
    mine = torch.cat([mean.double(), (var.double() * n), mean.new_full((1,), n).double()])
    rows = allgather(mine.unsqueeze(0))  # (size, 2C+1)
    counts = rows[:, 2 * c:2 * c + 1]
    total = float(counts.sum())
    means, m2s = rows[:, :c], rows[:, c:2 * c]
    g_mean = (means * counts).sum(0) / total
    g_m2 = (m2s + counts * (means - g_mean) ** 2).sum(0)
    return g_mean.to(x.dtype), (g_m2 / total).to(x.dtype), total


class _SyncBN(torch.autograd.Function):
    """Batch norm with global statistics: forward one statistics pass plus torch's fused
    normalization; backward one fused reduction pass (``native_batch_norm_backward``), one
    ``Sum`` allreduce of the two per-channel sums, and one affine pass for the input's
    gradient. Weight and bias gradients are this rank's contributions (as autograd through
    the allreduces gives them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float) -> Any:
        mean, var, total = _global_stats(x)
        y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var, total

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dy = dy.contiguous()
        c = x.shape[1]
        # grad_weight_local = sum(dy * xhat), grad_bias_local = sum(dy), one fused pass.
        _, gw, gb = torch.ops.aten.native_batch_norm_backward(
            dy, x, torch.ones(c, dtype=x.dtype, device=x.device), None, None, mean, invstd,
            True, 0.0, [False, True, True])
        sums = mpi_ops._allreduce([torch.cat([gw, gb])], None, Sum, 1.0, 1.0, False,
                                     False, "SyncBatchNorm (backward)", None, True)
        total = ctx.total
        w = weight if weight is not None else torch.ones_like(mean)
        shape = [1, c] + [1] * (x.dim() - 2)
        a = w * invstd
        b = -a * invstd * sums[:c] / total
        k = -a * sums[c:] / total - b * mean
        dx = torch.addcmul(torch.addcmul(k.view(shape), b.view(shape), x), a.view(shape), dy)
        return (dx, gw if weight is not None else None, gb if ctx.needs_input_grad[2] else None,
                None)
