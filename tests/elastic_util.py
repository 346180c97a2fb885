"""Checks of the elastic training job ``tests/elastic_train.py`` from its output, shared by
tests/launcher/test_elastic.py (one host) and tests/multihost/test_elastic_multihost.py."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import elastic_train

TRAIN = str(Path(__file__).resolve().parent / "elastic_train.py")
RECOVERY_LIMIT_S = 30.0
TOTAL_COMMITS = elastic_train.EPOCHS * elastic_train.N_SAMPLES // elastic_train.GLOBAL_BATCH


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
