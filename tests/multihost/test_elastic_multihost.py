"""Elastic training across hosts, for real: three hosts from namespaces (cluster.py), the
discovery script lists two of them (2 slots each); host 2 is killed mid-training (every
process on it SIGKILLed at once), the job goes on at 2 ranks on host 1 from the last commit;
then the script lists host 3 and the job grows back to 4 ranks on hosts 1 and 3, which gets
the state from host 1. The same exact checks as on one host (tests/elastic_util.py). And a
listed host that cannot be reached is left out."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from pathlib import Path

import elastic_numpy
import pytest
from cluster import Cluster
from elastic_util import RECOVERY_LIMIT_S, TRAIN, check_job, events
from jobs_util import REPO, needs_torch
from mh_util import rank_env

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

JOB_TIMEOUT_S = 180
ELASTIC_TIMEOUT_S = 60


def _wait(what: str, ok: object, proc: subprocess.Popen[bytes], out: Path, err: Path,
          within: float) -> None:
    end = time.monotonic() + within
    while not ok():  # type: ignore[operator]
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            proc.wait()
            pytest.fail(f"waiting for {what}: rc={proc.returncode}\n"
                        f"{err.read_text()[-4000:]}\n{out.read_text()[-2000:]}")
        time.sleep(0.1)


@needs_torch
def test_host_killed_then_host_added(three_hosts: Cluster) -> None:
    c = three_hosts
    n1, n2, n3 = (h.name for h in c.hosts)
    listed = c.shared / "hosts"
    # One slot a host (each world of the torch job starts in seconds of imports per rank on a
    # 2-core machine); test_multihost.py's host tests lose a host of two ranks.
    listed.write_text(f"{n1}:1\n{n2}:1\n")
    script = c.shared / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    out, err = c.shared / "job.out", c.shared / "job.err"
    args = [sys.executable, "-m", "hvdlite.run", "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(script), "--network-interface", "eth0", "--tcp",
            "--elastic-timeout", str(ELASTIC_TIMEOUT_S), "--timeout", str(JOB_TIMEOUT_S - 10),
            "--", sys.executable, TRAIN]
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(c.command(1, args, cwd=str(REPO)), stdout=o, stderr=e,
                                env=rank_env(ELASTIC_STEP_S="0.3"), cwd=str(REPO))
    try:
        def committed(gen: int, at_least: int) -> bool:
            return any(ev["kind"] == "committed" and ev["gen"] == gen
                       and ev["commit"] >= at_least for ev in events(out.read_text()))

        _wait("3 commits at 2 ranks", lambda: committed(0, 3), proc, out, err, 90)
        c.kill(2)
        killed = time.time()
        _wait("training at 1 rank", lambda: committed(1, 1), proc, out, err, 60)
        listed.write_text(f"{n1}:1\n{n3}:1\n")  # host 2 is gone; host 3 comes
        added = time.time()
        try:
            proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    finally:
        c.revive(2)
    log, text = err.read_text(), out.read_text()
    assert proc.returncode == 0, log[-4000:]
    facts = check_job(text)
    assert facts["sizes"] == [2, 1, 2], (facts["sizes"], log[-4000:])
    assert f"host {n2} (rank 1) lost" in log, log[-4000:]
    assert f"world 1: 1 rank on {n1}:1" in log and f"world 2: 2 ranks on {n1}:1,{n3}:1" in log
    recovery = facts["restored"][1]["time"] - killed
    joined = facts["restored"][2]["time"] - added
    print(f"recovery after the host was killed: {recovery:.1f} s; the added host joined "
          f"after {joined:.1f} s")
    assert recovery < RECOVERY_LIMIT_S
    assert joined < ELASTIC_TIMEOUT_S


def test_unreachable_discovered_host_is_left_out(three_hosts: Cluster) -> None:
    # The script lists a host nobody has: the first world cannot start there, the host is left
    # out and the job (the NumPy one: worlds start fast) runs on host 1 alone, exactly.
    c = three_hosts
    n1 = c.hosts[0].name
    script = c.shared / "discover-ghost.sh"
    script.write_text(f"#!/bin/sh\necho {n1}:2\necho {c.ghost}:2\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    args = [sys.executable, "-m", "hvdlite.run", "-np", "2", "--min-np", "2",
            "--host-discovery-script", str(script), "--network-interface", "eth0", "--tcp",
            "--reset-limit", "2", "--timeout", str(JOB_TIMEOUT_S - 10), "--", sys.executable,
            str(REPO / "tests" / "elastic_numpy.py")]
    ran = subprocess.run(c.command(1, args, cwd=str(REPO)), capture_output=True, text=True,
                         env=rank_env(), cwd=str(REPO), timeout=JOB_TIMEOUT_S, check=False)
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert f"host(s) {c.ghost} (unreachable?); left out" in ran.stderr, ran.stderr[-4000:]
    assert f"world 1: 2 ranks on {n1}:2" in ran.stderr, ran.stderr[-4000:]
    done = [e for e in events(ran.stdout) if e["kind"] == "done"]
    sizes = [2] * elastic_numpy.STEPS
    assert sorted(e["rank"] for e in done) == [0, 1], ran.stdout[-3000:]
    assert all(e["gen"] == 1 and e["sizes"] == sizes for e in done), done
    assert all(e["total"] == elastic_numpy.expected(sizes) for e in done), done


def test_discovered_remote_hosts_reach_the_monitor_and_keep_commits_private(
        three_hosts: Cluster) -> None:
    # Issue 43: with a discovery script and neither -H nor --network-interface, the monitor
    # listened on 127.0.0.1 and the remote ranks dialled their own loopback (unsupervised);
    # and a host without the launcher's directory made it 0755, its commits 0644. Launched
    # from host 3 onto hosts 1 and 2, whose /tmp is their own.
    c = three_hosts
    n1, n2 = c.hosts[0].name, c.hosts[1].name
    script = c.shared / "discover-remote.sh"
    script.write_text(f"#!/bin/sh\necho {n1}:1\necho {n2}:1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    args = [sys.executable, "-m", "hvdlite.run", "-np", "2", "--min-np", "2",
            "--host-discovery-script", str(script), "--tcp", "--timeout",
            str(JOB_TIMEOUT_S - 10), "--", sys.executable,
            str(REPO / "tests" / "elastic_numpy.py")]
    ran = subprocess.run(c.command(3, args, cwd=str(REPO)), capture_output=True, text=True,
                         env=rank_env(), cwd=str(REPO), timeout=JOB_TIMEOUT_S, check=False)
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert "cannot reach the launcher's monitor" not in ran.stderr, ran.stderr[-4000:]
    done = [e for e in events(ran.stdout) if e["kind"] == "done"]
    assert sorted(e["rank"] for e in done) == [0, 1], ran.stdout[-3000:]
    listing = c.run(1, ["find", "/tmp", "-path", "/tmp/hvdliterun-*", "-printf", "%m %y %p\n"],
                    timeout=30)
    entries = [line.split(" ", 2) for line in listing.stdout.splitlines()]
    assert any(path.endswith(".pkl") for _, _, path in entries), listing.stdout
    assert all(mode == ("700" if kind == "d" else "600") for mode, kind, _ in entries), \
        listing.stdout
