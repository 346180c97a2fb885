"""The NCCL watchdog's local half: when the engine fails for good (a peer failed, a stall shut
the job down), device work still in flight is failed and the NCCL communicators are aborted, so
a thread waiting on that work raises instead of waiting for a rank that will never come.

The whole of it (a rank killed inside an NCCL collective, the survivor ending within 15 s) needs
a GPU per rank: it runs in the two-GPU issue's script. Here, at 1 rank, the failure is injected
into the engine (``Engine._finish``, the path a peer's failure notice takes).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from hvdlite._api import default_engine  # noqa: E402
from hvdlite.errors import HvdliteError  # noqa: E402


def test_fatal_failure_fails_device_work_and_aborts_nccl(hvd: Any, restart: Any) -> None:
    if hvd.size() != 1:
        pytest.skip("injects a failure into one rank's engine: 1 rank only")
    restart(async_completion=False)
    x = cupy.ones(1 << 27, cupy.float32)  # 512 MiB: still running when the failure lands
    hvd.allreduce(cupy.ones(4, cupy.float32), name="wd.warm", op=hvd.Sum)
    backend = default_engine().global_channel.backends["cuda"]
    assert any(kind == "nccl" for kind, _ in backend._made)
    h = hvd.allreduce_async(x, name="wd.big", op=hvd.Sum)
    while not h._resolved:  # enqueued on the device (sync completion: not yet complete)
        time.sleep(1e-4)
    default_engine().scheduler.stop(HvdliteError("rank 1 failed, so this rank stopped too: test"))
    with pytest.raises(HvdliteError, match=r"'wd.big'.*rank 1 failed"):
        h.wait()
    assert not any(kind == "nccl" for kind, _ in backend._made), "NCCL not aborted"
    with pytest.raises(HvdliteError, match="rank 1 failed"):  # sticky
        hvd.allreduce(cupy.ones(2, cupy.float32), name="wd.after")
    restart()
    got = hvd.allreduce(cupy.ones(3, cupy.float32), name="wd.fresh", op=hvd.Sum)
    assert float(got.sum()) == 3.0
