"""``make_graphed_step``'s arguments, checked before anything is captured (CPU: the checks that
need no GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def test_bad_arguments_are_refused_at_the_call(hvd: Any) -> None:
    with pytest.raises(TypeError, match="debug_dump must be a path .*got int"):
        hvd.make_graphed_step(lambda x: None, torch.zeros(1), debug_dump=3)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 2, got 1"):
        hvd.make_graphed_step(lambda x: None, torch.zeros(1), warmup_steps=1)
    with pytest.raises(TypeError, match="optimizer must be a hvdlite.torch.DistributedOptimizer"):
        hvd.make_graphed_step(lambda x: None, torch.zeros(1), optimizer=object())
    with pytest.raises(TypeError, match="static input 0 must be a CUDA tensor, got cpu"):
        hvd.make_graphed_step(lambda x: None, torch.zeros(1))
    with pytest.raises(TypeError, match="rehearse must be a bool, got int"):
        hvd.make_graphed_step(lambda x: None, torch.zeros(1), rehearse=1)
