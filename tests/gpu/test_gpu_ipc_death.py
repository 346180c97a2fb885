"""A rank that dies or raises while its peers stream collectives through CUDA IPC: every
survivor ends within 15 s, the rank named, no traceback from hvdlite's code.

Real ``hvdliterun`` jobs of 2 ranks on one GPU (so they share it: IPC). Run it outside any MPI
launcher (it launches its own jobs): ``python3 -m pytest tests/gpu/test_gpu_ipc_death.py``.
"""

from __future__ import annotations

import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jobs_util import clean_env, run_group, under_mpi_launcher

cupy = pytest.importorskip("cupy")
if cupy.cuda.runtime.getDeviceCount() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)
if under_mpi_launcher():
    pytest.skip("launches its own jobs: run it outside mpirun", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

HVDLITE_FRAME = re.compile(r'File "[^"]*/hvdlite/')

_STREAM = """
import os, signal, sys, time
import cupy
import hvdlite as hvd
from hvdlite._api import default_engine
hvd.init()
cupy.cuda.Device(hvd.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
xs = [cupy.full(4096 * (k + 1), 1.0, cupy.float32) for k in range(8)]
hvd.allreduce(xs[0], name="warm-up")
assert default_engine().global_channel.backends["cuda"].transport == "ipc"
for i in range(1_000_000):
    if hvd.rank() == 1 and i == 300:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        {how}
    handles = [hvd.allreduce_async(x, name=f"t{{k}}", op=hvd.Sum) for k, x in enumerate(xs)]
    for h in handles:
        h.wait()
"""

HOW = {
    "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
    "raise": "raise RuntimeError('user code failed on rank 1')",
}


@pytest.mark.parametrize("how", list(HOW))
def test_a_rank_gone_mid_stream_ends_the_job(tmp_path: Path, how: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_STREAM.format(how=HOW[how])), encoding="utf-8")
    stamp = tmp_path / "gone"
    code, out = run_group([sys.executable, "-m", "hvdlite.run", "-np", "2", "--",
                           sys.executable, str(script), str(stamp)], clean_env(), 90.0)
    ended = time.time()
    assert code is not None and code != 0, out
    assert stamp.exists(), f"rank 1 never reached the failure point:\n{out}"
    took = ended - float(stamp.read_text())
    print(f"{how}: the job ended {took:.1f} s after rank 1 went", flush=True)
    assert took < 15, f"the job took {took:.1f} s to end after rank 1 went:\n{out}"
    assert "rank 1" in out, out
    if how == "SIGKILL":  # (a raising rank prints its own traceback, as Python does)
        assert not HVDLITE_FRAME.search(out), f"a traceback through hvdlite's code:\n{out}"
    else:
        assert "user code failed on rank 1" in out, out
