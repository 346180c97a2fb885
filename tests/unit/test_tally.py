"""The test tallies: what tests/conftest.py writes for a pytest run (``HVDLITE_TEST_REPORT_DIR``)
and what ``scripts/gpu/tally.py`` makes of several runs. Real pytest runs of a small sample
module (a pass, a failure, a skip, a module that skips itself), one process each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

import tally  # noqa: E402

pytestmark = pytest.mark.timeout(120)

_SAMPLE = """
import os
import pytest

def test_passes():
    pass

def test_fails_where_told():
    assert os.environ.get("SAMPLE_FAIL") != "1"

def test_skips():
    if os.environ.get("SAMPLE_GPU") != "1":
        pytest.skip("needs CUDA")
"""
_MODULE_SKIP = """
import os
import pytest

if os.environ.get("SAMPLE_MODULE") != "1":
    pytest.skip("launches its own jobs: run it outside mpirun", allow_module_level=True)

def test_runs_outside():
    pass
"""


def _run(tmp_path: Path, step: str, **env: str) -> Path:
    """One pytest run of the sample with the root conftest loaded as a plugin; its tally and a
    meta.json as gpu_tests.sh writes them, in ``tmp_path/out/step``."""
    tests = tmp_path / "sample"
    tests.mkdir(exist_ok=True)
    (tests / "test_sample.py").write_text(_SAMPLE)
    (tests / "test_module_skip.py").write_text(_MODULE_SKIP)
    out = tmp_path / "out" / step
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "PMI_"))}
    full |= {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
             "HVDLITE_TEST_REPORT_DIR": str(out), **env}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p",
                           "no:cacheprovider", "--rootdir", str(tests), "-c", os.devnull,
                           str(tests)], cwd=tests, env=full, capture_output=True, text=True,
                          timeout=100, check=False)
    (out / "meta.json").write_text(json.dumps({"step": step, "ranks": "1", "async": "0",
                                               "rc": str(done.returncode)}))
    return out


def test_the_conftest_tally_counts_as_pytest_does(tmp_path: Path) -> None:
    out = _run(tmp_path, "one", SAMPLE_FAIL="1")
    record = json.loads((out / "rank0.json").read_text())
    assert (record["rank"], record["size"], record["exitstatus"]) == (0, 1, 1)
    counts = {k: record[k] for k in ("passed", "failed", "errors", "skipped")}
    assert counts == {"passed": 1, "failed": 1, "errors": 0, "skipped": 2}, record
    assert record["tests"] == {
        "test_module_skip.py": "skipped",
        "test_sample.py::test_passes": "passed",
        "test_sample.py::test_fails_where_told": "failed",
        "test_sample.py::test_skips": "skipped",
    }
    assert record["skips"] == {
        "test_module_skip.py": "launches its own jobs: run it outside mpirun",
        "test_sample.py::test_skips": "needs CUDA",
    }


def test_tally_names_failures_and_what_ran_nowhere(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    failing = _run(tmp_path, "first", SAMPLE_FAIL="1")
    assert tally.main([str(failing)]) == 1
    text = capsys.readouterr().out
    assert "FAILED test_sample.py::test_fails_where_told (first: failed)" in text, text
    assert "not run: test_sample.py::test_skips: needs CUDA" in text, text
    assert "not run: test_module_skip.py: launches its own jobs" in text, text
    assert "exit 1" in text and text.rstrip().endswith("GPU tests: FAILED"), text


def test_a_module_skipped_in_one_step_ran_if_its_tests_ran_in_another(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path, "launched")
    _run(tmp_path, "outside", SAMPLE_MODULE="1")
    assert tally.main([str(tmp_path / "out")]) == 3  # test_skips ran nowhere
    text = capsys.readouterr().out
    assert "test_module_skip.py:" not in text.split("ran in no step")[1], text
    assert "not run: test_sample.py::test_skips: needs CUDA" in text, text
    assert text.rstrip().endswith("GPU tests: INCOMPLETE"), text
    _run(tmp_path, "gpu", SAMPLE_GPU="1")  # a run where test_skips runs: every test ran
    assert tally.main([str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.rstrip().endswith("GPU tests: OK")


def test_a_rank_without_a_tally_fails_the_step(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(tmp_path, "two")
    meta = json.loads((out / "meta.json").read_text()) | {"ranks": "2"}
    (out / "meta.json").write_text(json.dumps(meta))
    assert tally.main([str(out)]) == 1
    assert "no tally from rank(s) [1]" in capsys.readouterr().out
