"""A collective on a process set while a rank outside the set calls ``hvdlite.shutdown()``.

Reproduction: 2 ranks, set [0] registered at init; rank 0 calls ``allgather`` on the set at
once while rank 1 calls ``shutdown()``. Expected: rank 0 gets its result or a ShutdownError
(what happens when rank 0 starts its call a few milliseconds later), and both ranks exit.
It used to hang: a cycle drained the set's tensor from the queue, the global round found the
stop, and the tensor, in neither the queue nor its set's pending table yet, was never failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jobs_util import clean_env, mpiexec, run_group

SCRIPT = '''
import numpy as np
import hvdlite

first = hvdlite.ProcessSet([0])
hvdlite.init(process_sets=[first])
if hvdlite.rank() == 1:
    hvdlite.shutdown()
else:
    try:
        print("rank 0 got", hvdlite.allgather(np.ones(1), process_set=first), flush=True)
    except hvdlite.HvdliteError as exc:
        print("rank 0 raised", type(exc).__name__, flush=True)
    hvdlite.shutdown()
print("done", flush=True)
'''


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_set_collective_while_a_non_member_shuts_down(tmp_path: Path) -> None:
    script = tmp_path / "race.py"
    script.write_text(SCRIPT)
    rc, out = run_group([mpiexec(), "-n", "2", sys.executable, str(script)],
                        clean_env(OMP_NUM_THREADS="1"), 15)
    assert rc == 0 and out.count("done") == 2, f"rc={rc}:\n{out[-3000:]}"
