"""Elastic ``hvdliterun`` end to end on one host: a rank SIGKILLed mid-step, a discovery script
that drops a slot and adds it back, and ``--reset-limit``. The job is
``tests/launcher/elastic_train.py``; every check is against its exact one-process replay."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from jobs_util import clean_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
import elastic_train  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(150)]

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(Path(__file__).resolve().parent / "elastic_train.py")
JOB_TIMEOUT_S = 120
RECOVERY_LIMIT_S = 30.0
TOTAL_COMMITS = elastic_train.EPOCHS * elastic_train.N_SAMPLES // elastic_train.GLOBAL_BATCH


def hvdliterun(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hvdlite.run", *args, "--", sys.executable, TRAIN],
        env=clean_env(**env), cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=JOB_TIMEOUT_S, check=False)


def events(out: str) -> list[dict[str, Any]]:
    """The ``ELASTIC {...}`` records (ranks share stdout: several may share a line)."""
    decoder = json.JSONDecoder()
    found, at = [], out.find("ELASTIC {")
    while at >= 0:
        record, end = decoder.raw_decode(out, at + len("ELASTIC "))
        found.append(record)
        at = out.find("ELASTIC {", end)
    return found


def check_job(out: str) -> dict[str, Any]:
    """Assert what every elastic run must show; returns facts for the test's own checks.

    Worlds start from the newest commit that any rank of the world before got past (no
    committed work lost) and at most one beyond it; every rank of a world starts from the
    same state, equal to the replay of the commits before it at the sizes they ran at; each
    epoch's committed steps saw every sample exactly once; the job ends at the replay's last
    state on every rank.
    """
    ev = events(out)
    worlds = sorted({e["gen"] for e in ev})
    assert worlds == list(range(len(worlds))), f"worlds {worlds}"
    restored = {g: [e for e in ev if e["gen"] == g and e["kind"] == "restored"]
                for g in worlds}
    size_of: dict[int, int] = {}  # commit -> world size it was taken at
    steps: dict[int, list[dict[str, Any]]] = {}  # commit -> its step records (all ranks)
    for g in worlds:
        starts = restored[g]
        size = starts[0]["size"]
        assert sorted(e["rank"] for e in starts) == list(range(size)), f"world {g}: {starts}"
        base = starts[0]["commit"]
        assert {e["commit"] for e in starts} == {base}, f"world {g} ranks disagree: {starts}"
        if g > 0:
            before = [e for e in ev if e["gen"] == g - 1]
            acked = max((e["commit"] for e in before if e["kind"] == "committed"), default=0)
            tried = max((e["commit"] for e in before if e["kind"] == "step"), default=0)
            assert acked <= base <= tried, f"world {g} restored commit {base}: acked {acked}, " \
                f"last step {tried}"
        for c in [c for c in size_of if c > base]:  # redone in this world
            del size_of[c], steps[c]
        for e in ev:
            if e["gen"] == g and e["kind"] == "step":
                size_of[e["commit"]] = e["size"]
                steps.setdefault(e["commit"], []).append(e)
    assert sorted(size_of) == list(range(1, TOTAL_COMMITS + 1)), sorted(size_of)
    initial = restored[0][0]["initial"]
    ref = elastic_train.replay([size_of[c] for c in sorted(size_of)], initial)
    for g in worlds:
        for e in restored[g]:
            want = ref[e["commit"] - 1] if e["commit"] else restored[0][0]["digest"]
            assert e["digest"] == want, f"world {g} rank {e['rank']} restored {e}, want {want}"
            assert e["initial"] == initial
    seen: dict[int, list[int]] = defaultdict(list)
    for c, records in steps.items():
        assert len(records) == size_of[c], f"commit {c}: {records}"
        for e in records:
            assert e["digest"] == ref[c - 1], f"commit {c} rank {e['rank']}: {e}"
            assert e["lr"] == e["size"], f"reset callback not run: {e}"
            seen[e["epoch"]] += e["samples"]
    for epoch in range(elastic_train.EPOCHS):
        assert sorted(seen[epoch]) == list(range(elastic_train.N_SAMPLES)), \
            f"epoch {epoch}: {sorted(seen[epoch])}"
    done = [e for e in ev if e["kind"] == "done"]
    last = worlds[-1]
    assert sorted(e["rank"] for e in done) == list(range(restored[last][0]["size"]))
    assert {e["digest"] for e in done} == {ref[-1]}
    return {"events": ev, "sizes": [restored[g][0]["size"] for g in worlds],
            "restored": {g: restored[g][0] for g in worlds}}


def test_killed_rank_goes_on_at_three_from_last_commit() -> None:
    # Rank 2 SIGKILLs itself in the middle of the step that would be commit 4 (before its
    # allreduce): the job goes on at 3 ranks from commit 3.
    res = hvdliterun("-np", "4", "--min-np", "2", ELASTIC_KILL="0:4:2")
    assert res.returncode == 0, res.stdout + res.stderr
    facts = check_job(res.stdout)
    assert facts["sizes"] == [4, 3], facts["sizes"]
    assert facts["restored"][1]["commit"] == 3
    assert "rank 2 (host" in res.stderr and "failed with signal 9 (SIGKILL)" in res.stderr
    killed = next(e for e in facts["events"] if e["kind"] == "killing")
    recovery = facts["restored"][1]["time"] - killed["time"]
    print(f"recovery after SIGKILL: {recovery:.1f} s")
    assert recovery < RECOVERY_LIMIT_S


def test_discovery_drops_a_slot_and_adds_it_back(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:4\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    res = hvdliterun("-np", "4", "--min-np", "3", "--max-np", "4",
                     "--host-discovery-script", str(script), "--elastic-timeout", "60",
                     ELASTIC_HOSTS="0:3:localhost:3;1:1:localhost:4",
                     ELASTIC_HOSTS_FILE=str(hosts), ELASTIC_STEP_S="0.3")
    assert res.returncode == 0, res.stdout + res.stderr
    facts = check_job(res.stdout)
    assert facts["sizes"] == [4, 3, 4], facts["sizes"]
    assert res.stderr.count("asking the ranks to reset") == 2, res.stderr
    # The slot that came back joined within --elastic-timeout of the script listing it.
    grown = facts["restored"][2]["time"]
    listed = next(e["time"] for e in facts["events"]
                  if e["gen"] == 1 and e["kind"] == "committed" and e["rank"] == 0)
    print(f"added slot joined after {grown - listed:.1f} s")
    assert grown - listed < 60


def test_reset_limit_ends_the_job_with_a_clear_message() -> None:
    res = hvdliterun("-np", "2", "--min-np", "1", "--reset-limit", "1",
                     ELASTIC_KILL="0:2:1,1:3:0")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "world 1: 1 ranks" in res.stderr
    assert "the number of resets reached --reset-limit 1" in res.stderr, res.stderr
    assert "rank 0 (host" in res.stderr.splitlines()[-1], res.stderr
    assert not [e for e in events(res.stdout) if e["kind"] == "done"]


@pytest.mark.parametrize("args, message", [
    (["-np", "2", "--min-np", "3"], "--min-np must be between 1 and -np"),
    (["-np", "2", "--min-np", "1", "--max-np", "1"], "--max-np must be >= -np"),
    (["-np", "2", "--min-np", "1", "--reset-limit", "-1"], "--reset-limit must be >= 0"),
    (["-np", "2", "--host-discovery-script", "/bin/true", "--elastic-timeout", "0"],
     "--elastic-timeout must be > 0"),
])
def test_bad_elastic_flags(args: list[str], message: str) -> None:
    res = hvdliterun(*args)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_too_few_slots_ends_after_elastic_timeout(tmp_path: Path) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    res = hvdliterun("-np", "2", "--host-discovery-script", str(script),
                     "--elastic-timeout", "2")
    assert res.returncode == 1
    assert "not enough slots: 2 needed" in res.stderr and "--elastic-timeout 2 s" in \
        res.stderr, res.stderr
