"""``stream=`` of another device than the tensor's is refused at the call, naming the tensor,
both devices and the fix (on the GPU machine: tests/gpu/test_gpu_bad_input.py, where a second
GPU is visible). Here the check itself, with objects shaped like CuPy and torch streams."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hvdlite._submit import _check_stream
from hvdlite._vocab.messages import Kind


def test_cupy_like_stream_of_another_device() -> None:
    with pytest.raises(ValueError, match=r"allreduce of tensor 'g\.w': stream= is a stream of "
                                         r"device 1, the tensor is on device 0; pass a stream "
                                         r"of the tensor's device"):
        _check_stream(SimpleNamespace(device_id=1), 0, Kind.ALLREDUCE, "g.w")


def test_torch_like_stream_of_another_device() -> None:
    stream = SimpleNamespace(device=SimpleNamespace(index=2))
    with pytest.raises(ValueError, match="stream of device 2, the tensor is on device 3"):
        _check_stream(stream, 3, Kind.BROADCAST, "x")


def test_same_device_or_unknown_passes() -> None:
    _check_stream(SimpleNamespace(device_id=0), 0, Kind.ALLREDUCE, "a")
    _check_stream(SimpleNamespace(device=SimpleNamespace(index=1)), 1, Kind.ALLGATHER, "b")
    _check_stream(object(), 0, Kind.ALLREDUCE, "c")  # nothing to compare: CUDA decides
