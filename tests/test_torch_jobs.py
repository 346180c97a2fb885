"""Run ``tests/torch/`` (``hvdlite.torch``) as a real ``mpiexec -n 2`` job on CPU torch, the
way ``tests/test_mpi_jobs.py`` runs ``tests/mpi``, and some modules alone at 1, 3 and 4 ranks;
skipped when torch is not installed. Also runs ``scripts/gpu/bench_t1.py``'s correctness check
on 4 CPU ranks, and
checks that hvdlite works without torch and that ``hvdlite.torch`` says how to get it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from jobs_util import REPO, clean_env, mpiexec, needs_torch, run_group, run_pytest_job

TORCH_TESTS = REPO / "tests" / "torch"
JOB_TIMEOUT_S = 240
SETS_TIMEOUT_S = 150
# The skips these CPU jobs expect (any other fails the job); the terminal summary counts them.
CPU_SKIPS = {r"^needs CUDA$": "tests/torch/test_gpu_*.py: scripts/gpu/gpu_tests.sh runs them"}

@pytest.mark.mpi
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@needs_torch
def test_torch_suite_on_two_ranks(tmp_path: Path) -> None:
    """``tests/torch`` passes on both ranks of an ``mpiexec -n 2`` job."""
    run_pytest_job(2, TORCH_TESTS, tmp_path, JOB_TIMEOUT_S, CPU_SKIPS, OMP_NUM_THREADS="1")


# The modules that also run alone at other sizes, one launch per size (a launch at 4 ranks
# costs seconds of imports on a 2-core machine before the first test).
AT_ONE = [TORCH_TESTS / "test_ops.py", TORCH_TESTS / "test_optimizer_step.py"]
AT_FOUR = [*AT_ONE, TORCH_TESTS / "test_process_sets.py"]


@pytest.mark.mpi
@pytest.mark.timeout(SETS_TIMEOUT_S + 60)
@needs_torch
@pytest.mark.parametrize("np_, modules", [(1, AT_ONE), (4, AT_FOUR)], ids=["1", "4"])
def test_torch_collectives_optimizer_and_sets_on_one_and_four_ranks(
        tmp_path: Path, np_: int, modules: list[Path]) -> None:
    """At 1 and 4 ranks, in one launch each: ``tests/torch/test_ops.py`` (every collective of
    ``hvdlite.torch`` against its reference from every rank's inputs),
    ``test_optimizer_step.py`` (the default step against DDP) and, at 4 ranks,
    ``test_process_sets.py`` (sets of 2 of 4 ranks, [1, 3] and [0, 2], DistributedOptimizer on
    a set that does not hold rank 0). The 2-rank job above runs them with the rest."""
    skips = {**CPU_SKIPS, r"^needs 2 ranks$": "a refused allgather needs a peer (1 rank)"}
    run_pytest_job(np_, modules, tmp_path, SETS_TIMEOUT_S, skips, OMP_NUM_THREADS="1")


@pytest.mark.mpi
@pytest.mark.timeout(SETS_TIMEOUT_S + 60)
@needs_torch
def test_torch_collectives_on_three_ranks(tmp_path: Path) -> None:
    """``tests/torch/test_ops.py`` at 3 ranks: a size that is not a power of two, where
    Average's 1 / n rounds and Adasum is refused."""
    run_pytest_job(3, TORCH_TESTS / "test_ops.py", tmp_path, SETS_TIMEOUT_S, CPU_SKIPS,
                   OMP_NUM_THREADS="1")


@pytest.mark.mpi
@pytest.mark.timeout(200)
@needs_torch
def test_bench_t1_correctness_check_on_four_cpu_ranks(tmp_path: Path) -> None:
    """``scripts/gpu/bench_t1.py --no-cuda`` at 4 ranks (a BatchNorm model, MPI for hvdlite,
    gloo for DDP): its check runs the first-step comparison of every eager variant and both
    reduction-order references, and hvdlite's default is within every bound it reports; the
    report names the route its buckets took, and the switch interval it was given."""
    out_json = tmp_path / "t1.json"
    cmd = [mpiexec(), "-n", "4", sys.executable, "scripts/gpu/bench_t1.py", "--np", "4",
           "--model", "tiny", "--no-cuda", "--image-size", "32", "--batch-size", "4",
           "--iters", "1", "--warmup", "1", "--batches-per-iter", "1", "--check-steps", "10",
           "--comm-reps", "1", "--switch-interval-us", "1000", "--json", str(out_json)]
    rc, out = run_group(cmd, clean_env(OMP_NUM_THREADS="1"), 150)
    assert rc == 0, out[-6000:]
    assert "note: sys.setswitchinterval(1000 us) for every variant" in out, out[-6000:]
    results = json.loads(out_json.read_text(encoding="utf-8"))["results"]
    check = results["correctness"]
    hvd, ddp = "hvdlite DistributedOptimizer, default", "torch DDP"
    # The route each hvdlite variant took, as the optimizer says it (host buckets: negotiated
    # unless optimizer_host_schedule is on), in the JSON and the report's notes.
    assert results["routes"][hvd].startswith("negotiated, "), results["routes"]
    assert "optimizer_host_schedule is off" in results["routes"][hvd]
    assert f"note: route of {hvd}: negotiated" in out
    assert check["steps"] == 4  # a BatchNorm model past two ranks (check_steps)
    for order in ("torch DDP, 1 MB buckets (the reduction-order reference)",
                  "torch DDP, one bucket (the second reduction-order reference)"):
        assert f"{order}: max abs diff vs {ddp}" in check
    first = check[f"{hvd}: first step, max abs diff vs {ddp}"]
    assert 0 <= first < 1e-6  # rounding only: gloo and MPI sum four ranks in other orders
    assert check[f"{hvd}: max abs diff vs {ddp}"] <= check[f"bound vs {ddp}"]
    assert check[f"{hvd}: max abs change from init"] > 0


@pytest.mark.timeout(60)
def test_without_torch_hvdlite_imports_and_hvdlite_torch_says_how_to_install() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import hvdlite\n"
        "try:\n"
        "    import hvdlite.torch\n"
        "except ImportError as e:\n"
        "    print('MSG:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "pip install hvdlite[torch]" in out.stdout


def _run_example(*argv: str) -> str:
    cmd = [mpiexec(), "-n", "2", sys.executable, *argv]
    rc, out = run_group(cmd, clean_env(OMP_NUM_THREADS="1"), 150)
    assert rc == 0, f"{' '.join(argv)} (rc={rc}):\n{out[-6000:]}"
    return out


@pytest.mark.mpi
@pytest.mark.timeout(200)
@needs_torch
def test_torch_examples_train_and_benchmark() -> None:
    """The training example learns with identical parameters on both ranks; the synthetic
    benchmark (its torchvision-free model) reports per-rank and total throughput."""
    out = _run_example("examples/torch_mnist_like.py", "--epochs", "3")
    ok = re.search(r"^OK: parameters identical on all ranks; loss ([\d.]+) -> ([\d.]+)$", out,
                   re.M)
    assert ok is not None and float(ok.group(2)) < float(ok.group(1)), out[-6000:]
    assert len(re.findall(r"^epoch \d/3: loss", out, re.M)) == 3
    out = _run_example("examples/torch_synthetic_benchmark.py", "--model", "tiny", "--no-cuda",
                       "--batch-size", "4", "--image-size", "32", "--num-warmup-batches", "1",
                       "--num-batches-per-iter", "2", "--num-iters", "2", "--fp16-allreduce")
    assert re.search(r"^Img/sec per rank: [\d.]+ \+-[\d.]+$", out, re.M), out[-6000:]
    assert re.search(r"^Total img/sec on 2 rank\(s\): [\d.]+", out, re.M), out[-6000:]
