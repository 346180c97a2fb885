"""Fusion: which responses share a bucket (pure), and the persistent fusion buffers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvdlite._vocab.messages import SPECS, Response, is_unit

__all__ = ["nbytes", "plan_buckets", "FusionBuffers"]



_ITEMSIZE: dict[str, int] = {}


def itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = np.dtype(dtype).itemsize
    return size


def nbytes(resp: Response) -> int:
    """Payload bytes of one response (a grouped call's unit: all its members)."""
    if is_unit(resp):
        dtypes = resp.dtype
        if type(dtypes) is str:
            return sum(map(math.prod, resp.shape)) * itemsize(dtypes)
        return sum(math.prod(s) * itemsize(d) for s, d in zip(resp.shape, dtypes, strict=True))
    return math.prod(resp.shape) * itemsize(resp.dtype)


def plan_buckets(responses: Sequence[Response], threshold: int) -> list[list[Response]]:
    """Group ``responses`` into buckets; a deterministic function of its inputs.

    Every rank calls it on the same agreed list, so every rank gets the same buckets. Only
    compatible allreduces (same :meth:`Response.fusion_key`) share a bucket, whose payload stays
    within ``threshold`` bytes; a response larger than the threshold, an error response and any
    other collective is a bucket of its own, and so is a grouped call's unit (fused already).
    Buckets come out in the order of their first member.
    """
    buckets: list[list[Response]] = []
    open_by_key: dict[tuple[object, ...], tuple[list[Response], int]] = {}
    for resp in responses:
        size = nbytes(resp)
        if (not SPECS[resp.kind].fusable or resp.error or size > threshold or threshold <= 0
                or is_unit(resp)):
            buckets.append([resp])
            continue
        key = resp.fusion_key()
        current = open_by_key.get(key)
        if current is not None and current[1] + size <= threshold:
            current[0].append(resp)
            open_by_key[key] = (current[0], current[1] + size)
            continue
        bucket = [resp]
        buckets.append(bucket)
        open_by_key[key] = (bucket, size)
    return buckets


class FusionBuffers:
    """One fusion buffer per device, allocated once at the threshold size, reused forever.

    ``alloc`` makes a raw byte buffer for a device key ("cpu", "cuda:0", ...). The background
    thread is the only user, and a bucket is fully copied out before the next one is copied
    in on the same stream, so a single buffer per device suffices.
    """

    def __init__(self, threshold: int, alloc: Callable[[str, int], Any]) -> None:
        self.threshold = threshold
        self._alloc = alloc
        self._buffers: dict[str, Any] = {}

    def get(self, device: str, dtype: np.dtype, count: int) -> Any:
        """A 1-D view of ``count`` elements of ``dtype`` at the start of the device's buffer.

        A request larger than the threshold (only a lone tensor that must change precision on
        the wire gets here) gets a temporary buffer instead.
        """
        needed = count * dtype.itemsize
        if needed > self.threshold:
            return self._alloc(device, needed).view(dtype)
        buf = self._buffers.get(device)
        if buf is None:
            buf = self._buffers[device] = self._alloc(device, self.threshold)
        return buf[:needed].view(dtype)

    def release(self) -> None:
        self._buffers.clear()

    def allocated(self) -> dict[str, int]:
        return {dev: int(buf.nbytes) for dev, buf in self._buffers.items()}
