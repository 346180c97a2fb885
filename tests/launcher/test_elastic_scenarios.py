"""Horovod's elastic integration scenarios (``elastic_common.py``: hosts added and removed at
1 and 2 slots, one worker failing by an exception and by a kill, with a discovery script and
with fixed hosts, every worker failing, reset limits 1 and 2), plus both hosts blacklisted and
a host back from its cool-down, driven through ``hvdliterun`` with the NumPy job
``tests/elastic_epochs.py`` and checked with Horovod's expectations
(``tests/elastic_scenarios.py``). Two host names of this machine (``localhost``,
``127.0.0.1``) stand for two hosts, as in Horovod's test."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import elastic_scenarios as es
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(200)]

JOB = [sys.executable, str(Path(__file__).resolve().parents[1] / "elastic_epochs.py")]


@pytest.mark.parametrize("scenario", es.SCENARIOS + es.EXTRA, ids=lambda s: s.name)
def test_horovod_elastic_scenario(scenario: es.Scenario, tmp_path: Path) -> None:
    result = es.run(scenario, tmp_path, JOB, es.env_for())
    print(f"{scenario.name}: exit {result.code} after {result.took_s:.1f} s")
    assert scenario.check is not None
    scenario.check(result)
    assert "BAD TERMINATION" not in result.out, result.out  # MPICH's banner: not for a reset
    # Nor Hydra's teardown lines (a kill-reset printed "[proxy:1@vm] ...: assert (!closed)
    # failed" and three more before hvdlite/launcher/worldout.py).
    assert not re.search(r"^\[(mpiexec|proxy:[^@]*)@", result.out, re.M), result.out
    if scenario.name.startswith("all_"):
        assert result.took_s < es.LOSS_BOUND_S, f"took {result.took_s:.1f} s: {result.out}"
