"""Gradient compression for allreduce (Horovod's ``hvd.Compression``).

A compressor has two static methods: ``compress(tensor) -> (tensor, ctx)`` before the
collective and ``decompress(tensor, ctx) -> tensor`` after it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class Compressor:
    """Interface: reduce the data sent by an allreduce and restore it afterwards."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and the context :meth:`decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Restore a received tensor to its original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor goes as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return ``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return ``tensor`` unchanged."""
        return tensor


class _CastCompressor(Compressor):
    wire: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Cast floating-point tensors to the wire type; others go unchanged."""
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != cls.wire:
            return tensor.to(cls.wire), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Cast back to the original dtype."""
        if ctx is not None and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Send floating-point tensors as float16 (half the bytes of float32)."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Send floating-point tensors as bfloat16 (float32's range, 8 bits of mantissa)."""

    wire = torch.bfloat16


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``,
    ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
