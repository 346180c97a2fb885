"""The NumPy training example and the CPU benchmarks run end to end under ``mpiexec -n 2``.

These start real two-rank jobs in subprocesses (with a timeout) and check what the jobs say
about themselves: the example's own cross-rank weight check, a benchmark's correctness checks
and JSON output, and a benchmark's refusal to report from a launch of the wrong size. Timings
are never asserted.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from jobs_util import clean_env, mpiexec, run_group

JOB_TIMEOUT_S = 150
pytestmark = pytest.mark.mpi  # starts its own jobs: ignored inside one (tests/conftest.py)


def _run_job(ranks: int, *argv: str) -> tuple[int, str]:
    """Run ``python argv...`` on ``ranks`` ranks; return (exit code, stdout+stderr)."""
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, *argv]
    rc, out = run_group(cmd, clean_env(), JOB_TIMEOUT_S)
    if rc is None:
        pytest.fail(f"{' '.join(cmd)} did not finish in {JOB_TIMEOUT_S} s:\n{out[-6000:]}")
    return rc, out


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_mlp_example_trains_and_ends_with_identical_weights() -> None:
    rc, out = _run_job(2, "examples/mlp_numpy.py")
    assert rc == 0, out[-6000:]
    ok = re.search(r"^OK: weights identical on all ranks; loss ([\d.]+) -> ([\d.]+)$", out, re.M)
    assert ok is not None, out[-6000:]
    first, last = float(ok.group(1)), float(ok.group(2))
    assert last < first
    assert out.count("OK: weights identical") == 1, "only rank 0 prints the OK line"


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_mlp_example_exits_nonzero_when_its_check_fails() -> None:
    # Three steps cannot cut the loss by 30%: the example must say so and fail, not print OK.
    rc, out = _run_job(2, "examples/mlp_numpy.py", "--steps", "3")
    assert rc == 1, out[-6000:]
    assert "FAILED: loss did not go down" in out
    assert "OK:" not in out


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_bench_c1_quick_checks_and_reports(tmp_path: Path) -> None:
    path = tmp_path / "c1.json"
    rc, out = _run_job(2, "scripts/bench_c1.py", "--np", "2", "--quick", "--json", str(path))
    assert rc == 0, out[-6000:]
    assert "REFUSED" not in out
    res = json.loads(path.read_text())
    assert res["benchmark"] == "C1"
    assert res["meta"]["ranks"] == 2
    assert res["tensors"] == 30
    variants = res["results"]
    assert len(variants) == 5
    for name, r in variants.items():
        assert r["n"] == 3, name
        assert r["median_s"] > 0, name
    assert {"target", "value", "met"} <= set(res["targets"][0])
    assert out.rstrip().splitlines()[-1].startswith("| hvdlite grouped_allreduce")


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_bench_refuses_a_launch_of_the_wrong_size(tmp_path: Path) -> None:
    path = tmp_path / "c1.json"
    rc, out = _run_job(2, "scripts/bench_c1.py", "--np", "4", "--quick", "--json", str(path))
    assert rc == 2, out[-6000:]
    assert "REFUSED: launched with 2 ranks but --np 4 was asked" in out
    assert not path.exists()


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_bench_c6_quick_checks_the_floor_and_reports_its_targets(tmp_path: Path) -> None:
    path = tmp_path / "c6.json"
    rc, out = _run_job(2, "scripts/bench_c6.py", "--np", "2", "--quick", "--json", str(path))
    assert rc == 0, out[-6000:]
    assert "REFUSED" not in out
    res = json.loads(path.read_text())
    assert res["benchmark"] == "C6"
    baselines = [
        "mpi4py Allreduce",
        "two-hop floor: SimpleQueue + Lock gate",
        "two-hop floor: Lock hand-off both ways",
    ]
    alone = [f"{b} [hvdlite not started]" for b in baselines]
    assert set(res["worst_rank"]) == {"hvdlite allreduce (sync)", *baselines, *alone}
    assert res["floor"].startswith("two-hop floor")
    assert [t["target"].split(" <= ")[1].split(" ")[0] for t in res["targets"]] == [
        "0.7x", "6.0x", "200",
    ]


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_bench_c2_quick_states_the_raw_per_tensor_target(tmp_path: Path) -> None:
    path = tmp_path / "c2.json"
    rc, out = _run_job(2, "scripts/bench_c2.py", "--np", "2", "--quick", "--json", str(path))
    assert rc == 0, out[-6000:]
    res = json.loads(path.read_text())
    first = res["targets"][0]
    assert "<= 2.0x the raw per-tensor Allreduce" in first["target"]
    big = res["results"]["16"]
    raw = min(big[k]["per_tensor_s"] for k in (
        "raw MPI Allreduce per tensor", "raw MPI Allreduce per tensor [hvdlite not started]"))
    assert first["value"] == round(big["hvdlite, cache on"]["per_tensor_s"] / raw, 3)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_bench_t4_profiles_a_variant_it_names(tmp_path: Path) -> None:
    """``--profile`` tables where a variant's host time goes (rank 0's cProfile, printed and in
    the JSON); a name that is no variant is refused before anything is reported."""
    pytest.importorskip("torch", reason="bench_t4.py times hvdlite.torch")
    path = tmp_path / "t4.json"
    wanted = "sync (1 x 4 B): hvdlite.torch allreduce"
    rc, out = _run_job(2, "scripts/bench_t4.py", "--np", "2", "--quick", "--tensors", "50",
                       "--profile", wanted, "--json", str(path))
    assert rc == 0, out[-6000:]
    assert f"profile of {wanted!r}" in out, out[-6000:]
    rows = json.loads(path.read_text())["profiles"][wanted]
    assert rows and any("mpi_ops.py" in r["function"] for r in rows), rows
    # Each row names its heaviest callers; under a built-in (a wait, a sleep) they are printed.
    assert all(isinstance(r["callers"], list) for r in rows), rows
    assert any(c["function"] and c["calls"] > 0 for r in rows for c in r["callers"]), rows
    builtins = [r for r in rows if r["function"].startswith("~:0(") and r["callers"]]
    if builtins:
        assert f"    <- {builtins[0]['callers'][0]['function']}" in out, out[-6000:]
    rc, out = _run_job(2, "scripts/bench_t4.py", "--np", "2", "--quick", "--tensors", "50",
                       "--profile", "sync (1 x 4 B): no such variant")
    assert rc == 2 and "no such variant" in out, out[-6000:]


def test_profile_names_may_hold_commas() -> None:
    """``--profile`` takes a comma-separated list of the variants' names as the tables print
    them, and a name may hold a comma itself (torch.distributed's 4 B variant): the pieces
    of a known name are joined back; an unknown name stays as given, for the refusal."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        from _benchlib import split_names
    finally:
        sys.path.pop(0)
    known = ["hvdlite.torch allreduce (4 B)",
             "torch.distributed all_reduce (4 B), then synchronize", "CuPy API allreduce (4 B)"]
    assert split_names("hvdlite.torch allreduce (4 B),torch.distributed all_reduce (4 B), "
                       "then synchronize , CuPy API allreduce (4 B)", known) == known
    assert split_names("CuPy API allreduce (4 B), nothing, ", known) == [
        "CuPy API allreduce (4 B)", "nothing"]
