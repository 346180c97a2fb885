"""Horovod's elastic integration scenarios (``test/integration/elastic_common.py``), driven
through ``hvdliterun``: hosts added and removed at 1 and 2 slots, one worker failing by an
exception or a kill (with a discovery script, and with fixed ``-H`` hosts), every worker
failing, both hosts blacklisted, the reset limit at 1 and 2, and a host back from its
blacklist cool-down. Each scenario writes a discovery script that reads the job's log (one
line per epoch) the way Horovod's template does, runs the job, and checks the logged records
with Horovod's expectations.

Shared by ``tests/launcher/test_elastic_scenarios.py`` (the NumPy job
``tests/elastic_epochs.py``) and ``scripts/horovod_elastic_scenarios.py`` (Horovod's own
``elastic_torch_main.py`` through a ``horovod.torch`` shim).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs_util import clean_env

# Horovod mocks its discovery interval to 0.01 s; a shell script ten times a second is
# enough here and spares a loaded 2-core box.
DISCOVERY_INTERVAL_S = 0.1
ALL_FAILED = "one or more processes exited with non-zero status"
RESET_LIMIT = "number of resets during elastic job exceeded limit: {}"
LOSS_BOUND_S = 15.0  # a job that lost every worker ends within this (issue 33)


@dataclass
class Scenario:
    """One run: Horovod's ``_run`` arguments and what to check."""

    name: str
    discovery: list[tuple[int | None, list[str]]] | None = None
    hosts: str | None = None
    exits: dict[str, list[int]] = field(default_factory=dict)
    exit_mode: str = "exception"
    np: int = 2
    min_np: int = 2
    max_np: int = 4
    reset_limit: int | None = None
    cooldown: tuple[int, int] | None = None
    epoch_wait: float | None = None
    epochs: int | None = None
    check: Callable[[Result], None] | None = None


@dataclass
class Result:
    """What a run left: exit status, output, the logged records, how long it took."""

    code: int | None
    out: str
    records: list[dict[str, Any]]
    took_s: float
    failed_at: float | None = None  # wall time of the first failure, from the log's mtime

    def expect(self, index: int, **values: Any) -> None:
        record = self.records[index]
        wrong = {k: (record.get(k), v) for k, v in values.items() if record.get(k) != v}
        assert not wrong, f"record {index}: (got, expected) {wrong}; records {self.records}"


def _discovery_script(path: Path, logfile: Path,
                      schedule: list[tuple[int | None, list[str]]]) -> None:
    lines = ["#!/bin/sh", f"epoch=$(cat {logfile} 2>/dev/null | wc -l)", 'case "$epoch" in']
    for epoch, hosts in schedule:
        lines.append(f"  {'*' if epoch is None else epoch})")
        lines += [f"    echo {h}" for h in hosts]
        lines.append("    ;;")
    lines.append("esac")
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)


def command(s: Scenario, workdir: Path, job: list[str]) -> tuple[list[str], Path]:
    """The ``hvdliterun`` command for ``s`` (``job``: the training command) and its log."""
    logfile = workdir / f"{s.name}.log"
    args = ["-np", str(s.np), "--min-np", str(s.min_np),
            "--discovery-interval-s", str(DISCOVERY_INTERVAL_S), "--timeout", "150"]
    schedule = s.discovery or [(None, (s.hosts or "").split(","))]
    if s.hosts is not None:
        args += ["-H", s.hosts]
    else:
        script = workdir / f"{s.name}.discover.sh"
        _discovery_script(script, logfile, schedule)
        args += ["--host-discovery-script", str(script), "--max-np", str(s.max_np)]
    if s.reset_limit is not None:
        args += ["--reset-limit", str(s.reset_limit)]
    if s.cooldown is not None:
        args += ["--blacklist-cooldown-range", *map(str, s.cooldown)]
    cmd = [sys.executable, "-m", "hvdlite.run", *args, "--", *job, "--logfile", str(logfile)]
    if s.discovery:
        cmd += ["--discovery-schedule", json.dumps(s.discovery)]
    if s.epoch_wait:
        cmd += ["--epoch-wait", json.dumps(s.epoch_wait)]
    if s.epochs:
        cmd += ["--epochs", json.dumps(s.epochs)]
    if s.exits:
        cmd += ["--exit-schedule", json.dumps(s.exits), "--exit-mode", s.exit_mode]
    return cmd, logfile


def run(s: Scenario, workdir: Path, job: list[str], env: dict[str, str],
        timeout_s: float = 170.0) -> Result:
    """Run scenario ``s`` through ``hvdliterun``; the job's records and exit."""
    cmd, logfile = command(s, workdir, job)
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    took = time.monotonic() - start
    records = []
    if logfile.exists():
        records = [json.loads(line) for line in logfile.read_text().splitlines() if line]
    return Result(proc.returncode, proc.stdout + proc.stderr, records, took)


def _added_and_removed(slots: int) -> Callable[[Result], None]:
    def check(r: Result) -> None:
        assert r.code == 0, r.out
        assert len(r.records) == 3, r.records
        r.expect(0, start_rank=0, size=slots, hostname="localhost")
        r.expect(1, start_rank=0, size=slots * 2, hostname="localhost")
        r.expect(2, start_rank=slots, size=slots, hostname="127.0.0.1", rendezvous=3)
    return check


def _one_worker_failed(r: Result) -> None:
    assert r.code == 0, r.out
    assert len(r.records) == 3, r.records
    r.expect(0, start_rank=0, size=4, rendezvous=1)
    r.expect(1, start_rank=2, size=2, rendezvous=2)
    r.expect(2, start_rank=2, size=2, rendezvous=2)


def _job_failed(message: str) -> Callable[[Result], None]:
    def check(r: Result) -> None:
        assert r.code not in (0, None), r.out
        assert message in r.out, r.out
    return check


def _all_lost_promptly(r: Result) -> None:
    _job_failed(ALL_FAILED)(r)
    # The failure comes right after the first epoch's line: the job must end within the bound
    # of it, with no wait for slots that cannot come back.
    assert r.records and len(r.records) == 1, r.records
    assert "waiting up to" not in r.out, r.out


def _reset_limit_two(r: Result) -> None:
    assert r.code == 0, r.out
    assert len(r.records) == 3, r.records


def _cooldown(r: Result) -> None:
    assert r.code == 0, r.out
    assert len(r.records) == 5, r.records
    r.expect(0, start_rank=0, size=4, rendezvous=1)
    r.expect(1, start_rank=0, size=2, rendezvous=2)
    assert "is back from its blacklist cool-down" in r.out, r.out
    back = [rec for rec in r.records[2:] if rec["size"] == 4]
    assert back, f"the host never came back: {r.records}"


TWO_HOSTS = ["localhost:2", "127.0.0.1:2"]
CHANGING = [(0, ["localhost:2"]), (1, ["localhost:2", "127.0.0.1:2"]), (None, ["127.0.0.1:2"])]

SCENARIOS: list[Scenario] = [
    Scenario("hosts_added_and_removed_2_slots",
             discovery=[(0, ["localhost:2"]), (1, ["localhost:2", "127.0.0.1:2"]),
                        (None, ["127.0.0.1:2"])], check=_added_and_removed(2)),
    Scenario("hosts_added_and_removed_1_slot", np=1, min_np=1, max_np=2,
             discovery=[(0, ["localhost:1"]), (1, ["localhost:1", "127.0.0.1:1"]),
                        (None, ["127.0.0.1:1"])], check=_added_and_removed(1)),
    Scenario("single_rank_failure_exception", discovery=[(None, TWO_HOSTS)],
             exits={"(1, 0)": [0]}, check=_one_worker_failed),
    Scenario("single_rank_failure_kill", discovery=[(None, TWO_HOSTS)],
             exits={"(1, 0)": [0]}, exit_mode="kill", check=_one_worker_failed),
    Scenario("fault_tolerance_without_scaling_exception", hosts="localhost:2,127.0.0.1:2",
             exits={"(1, 0)": [0]}, check=_one_worker_failed),
    Scenario("fault_tolerance_without_scaling_kill", hosts="localhost:2,127.0.0.1:2",
             exits={"(1, 0)": [0]}, exit_mode="kill", check=_one_worker_failed),
    Scenario("all_ranks_failure", discovery=[(None, TWO_HOSTS)],
             exits={"(1, 0)": [0, 1, 2, 3]}, check=_all_lost_promptly),
    Scenario("reset_limit_1", discovery=CHANGING, reset_limit=1,
             check=_job_failed(RESET_LIMIT.format(1))),
    Scenario("reset_limit_2", discovery=CHANGING, reset_limit=2, check=_reset_limit_two),
]
# Beyond Horovod's nine: both hosts blacklisted one after the other, and a host that returns
# from its cool-down.
EXTRA: list[Scenario] = [
    Scenario("all_hosts_blacklisted", discovery=[(None, TWO_HOSTS)],
             exits={"(1, 0)": [0, 2]}, check=_job_failed(ALL_FAILED)),
    Scenario("blacklisted_host_returns_after_cooldown", discovery=[(None, TWO_HOSTS)],
             exits={"(1, 0)": [3]}, epoch_wait=1.0, epochs=5, cooldown=(1, 2),
             check=_cooldown),
]


def env_for(extra_path: str | None = None) -> dict[str, str]:
    """The environment of a run: no stray HVDLITE_/HOROVOD_ variables, unbuffered output,
    ``extra_path`` (a shim) first on PYTHONPATH."""
    env = clean_env()
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH"))
                                            if p)
    return env
