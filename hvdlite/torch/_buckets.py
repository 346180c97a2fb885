"""``DistributedOptimizer``'s gradient buckets: which parameters are reduced together, and
the optional persistent buffers their gradients live in.

A bucket is reduced by one grouped in-place allreduce once every member's gradient is ready
(one request instead of one per parameter). Without ``groups=`` the buckets are formed
automatically: parameters in reverse registration order (roughly the order backward produces
their gradients), one (device, dtype) per bucket, up to a byte cap. With
``gradient_as_bucket_view`` each bucket owns one flat buffer and every member's ``.grad`` is a
view of it, consecutive and in order: autograd accumulates straight into the buffer and the
core reduces it in place, with no copy in or out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvdlite._torchref import bucket_arrays, numpy_dtype

__all__ = ["Bucket", "auto_buckets"]


class Bucket:
    """The parameters reduced together (``params``, in order) under ``name``; ``ready``
    counts members whose gradient is ready this step. With a buffer: ``views[i]`` is
    member ``i``'s gradient view and ``arrays[i]`` the core's array over the same memory."""

    __slots__ = ("params", "name", "ready", "buffer", "views", "arrays", "fused", "direct",
                 "staging", "staged")

    def __init__(self, params: Sequence[torch.Tensor], name: str) -> None:
        self.params = tuple(params)
        self.name = name
        self.ready = 0
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.arrays: list[Any] = []
        # Without views: small members are copied (one torch call) into ``staging``, reduced
        # there by one call whose array the core sees every step (its lane), and copied back.
        self.fused: list[torch.Tensor] = []
        self.direct: list[torch.Tensor] = []
        self.staging: torch.Tensor | None = None
        self.staged: list[torch.Tensor] = []

    def viewable(self) -> bool:
        """Whether the members can share one flat buffer (one dtype NumPy can hold, one
        device, dense)."""
        first = self.params[0]
        return numpy_dtype(first.dtype) is not None and all(
            p.dtype == first.dtype and p.device == first.device and p.layout is torch.strided
            for p in self.params)

    def make_views(self) -> None:
        """Allocate the flat buffer and point every member's ``.grad`` at its view (keeping
        an existing gradient's values; zeros where there was none)."""
        first = self.params[0]
        total = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        for p in self.params:
            n = p.numel()
            self.views.append(self.buffer[offset:offset + n].view(p.shape))
            offset += n
        self.arrays = bucket_arrays(self.buffer, [tuple(p.shape) for p in self.params])
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is not None and not p.grad.is_sparse:
                view.copy_(p.grad)
            p.grad = view

    def make_staging(self, direct_bytes: int) -> None:
        """Split the members: those under ``direct_bytes`` share one persistent staging
        buffer (``staged`` are their views of it); larger ones are reduced where they are."""
        self.fused = [p for p in self.params if p.numel() * p.element_size() < direct_bytes]
        self.direct = [p for p in self.params if p.numel() * p.element_size() >= direct_bytes]
        if len(self.fused) < 2:
            self.direct, self.fused = list(self.params), []
            return
        first = self.fused[0]
        total = sum(p.numel() for p in self.fused)
        self.staging = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.staged, offset = [], 0
        for p in self.fused:
            n = p.numel()
            self.staged.append(self.staging[offset:offset + n].view(p.shape))
            offset += n

    def realias(self) -> bool:
        """Make every member's ``.grad`` its view again (a user may have replaced it or set
        it to None; autograd replaces it under ``create_graph``): copy a dense replacement
        in, zero a missing one. False if a member's gradient is sparse (no view for it)."""
        for p, view in zip(self.params, self.views, strict=True):
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            elif grad.is_sparse:
                return False
            elif grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
                view.copy_(grad)
            p.grad = view
        return True


def auto_buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """``params`` (in registration order) split into buckets: reverse order, one (device,
    dtype) per bucket, each at most ``cap_bytes`` (a larger parameter is a bucket alone)."""
    buckets: list[list[torch.Tensor]] = []
    open_: dict[tuple[Any, Any], tuple[list[torch.Tensor], int]] = {}
    for p in reversed(list(params)):
        key = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        members, size = open_.get(key, ([], 0))
        if members and size + nbytes > cap_bytes:
            buckets.append(members)
            members, size = [], 0
        members.append(p)
        open_[key] = (members, size + nbytes)
    buckets.extend(members for members, _ in open_.values() if members)
    return buckets
