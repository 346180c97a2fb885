"""hvdliterun on a head node of its own (host 3), its ranks on hosts 1 and 2: a host killed
is named alone. The MPI launcher on the head node tears the job down on the surviving host
(its proxy there kills the rank wrappers) as soon as it loses host 2; those wrappers' guards
tell the launcher that host 1 still answers, so it is not reported lost with host 2."""

from __future__ import annotations

import sys
import time

import pytest
from cluster import Cluster
from jobs_util import REPO
from mh_util import HERE, KILLED_BOUND_S, ended_within, rank_env, survivors_traces, verdict_line

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]


def test_host_killed_is_named_alone_from_a_head_node(three_hosts: Cluster) -> None:
    c = three_hosts
    n1, n2 = c.host(1).name, c.host(2).name
    out = c.shared / "head-node-kill"
    out.mkdir()
    marker = out / "running"
    args = [sys.executable, "-m", "hvdlite.run", "-np", "4", "-H", f"{n1}:2,{n2}:2", "--tcp",
            "--timeline", str(out / "trace.{rank}.json"), "--", sys.executable,
            str(HERE / "mh_forever.py"), str(marker)]
    proc = c.popen(3, args, env=rank_env(), cwd=str(REPO))
    end = time.monotonic() + 90
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            pytest.fail(f"the job did not get going: rc={proc.returncode}\n"
                        f"{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    try:
        c.kill(2)
        rc, err, seconds = ended_within(proc, KILLED_BOUND_S)
    finally:
        c.revive(2)
    verdict = verdict_line(err)
    print(f"host killed (head node): hvdliterun ended {seconds:.1f} s later; {verdict}")
    assert rc == 1, err[-3000:]
    assert verdict.startswith(f"hvdliterun: host {n2} (ranks 2, 3) lost: its connection to "
                              "hvdliterun closed without an exit report; the job of 4 ranks "
                              "was ended"), err[-3000:]
    assert n1 not in verdict, verdict  # host 1's wrappers were the MPI launcher's teardown
    assert seconds < KILLED_BOUND_S, (seconds, err[-3000:])
    survivors_traces(out, [0, 1], err)
