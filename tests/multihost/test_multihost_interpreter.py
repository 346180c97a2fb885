"""The ranks' ``python3`` across hosts is the caller's (issue 42): ``hvdliterun -np 2 -H
a:1,b:1 -- python3 ...`` runs, on both hosts, the interpreter that ``command -v python3``
finds where hvdliterun starts, with the caller's PATH as it is; under MPICH's Hydra and under
Open MPI (started by its absolute path), with a virtual environment ahead of the system's
Python on PATH and the reverse (tests/path_setups.py)."""

from __future__ import annotations

import pytest
from cluster import Cluster
from mh_util import hvdliterun
from path_setups import LAUNCHERS, RANK_CODE, SETUPS, command_v, launcher_args, rank_answers
from path_setups import unavailable as no_setups

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("setup", ["venv_first", "system_first"])
def test_ranks_on_every_host_run_the_callers_python3(cluster: Cluster, launcher: str,
                                                     setup: str) -> None:
    args, why = launcher_args(launcher)
    if why is not None or (why := no_setups()) is not None:
        pytest.skip(why)
    path = SETUPS[setup]
    n1, n2 = (h.name for h in cluster.hosts)
    ran = hvdliterun(cluster, "-np", "2", "-H", f"{n1}:1,{n2}:1", "--tcp", *args, "--",
                     "python3", "-c", RANK_CODE, PATH=path)
    assert ran.rc == 0, f"rc={ran.rc}\nstdout:\n{ran.out[-3000:]}\nstderr:\n{ran.err[-3000:]}"
    expected = command_v("python3", path)
    assert sorted(rank_answers(ran.out)) == [(expected, path, n1), (expected, path, n2)], ran.out
