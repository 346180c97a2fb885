"""Helpers for tests that start their own MPI jobs (the suite runner, examples, benchmarks,
the launcher): finding mpiexec, a clean environment, running a job in its own process group
with a hard timeout, knowing whether we already are inside a job, and whether torch is
installed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from hvdlite.run import find_mpiexec

REPO = Path(__file__).resolve().parent.parent

# Variables that common launchers (MPICH/Hydra, Open MPI, PMIx) set in every rank.
LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_LAUNCHER_VARS = LAUNCHER_RANK_VARS + LAUNCHER_SIZE_VARS


def under_mpi_launcher() -> bool:
    """True inside a rank of an MPI job (tests that start jobs must not nest them)."""
    return any(var in os.environ for var in _LAUNCHER_VARS)


def _torch_installed() -> bool:
    # ``tests/`` is on sys.path (pytest puts a conftest's folder there), so without torch
    # ``import torch`` finds the folder ``tests/torch`` as a namespace package (a spec with no
    # origin) instead of failing, and ``pytest.importorskip("torch")`` would not skip.
    module = sys.modules.get("torch")
    if module is not None:
        return getattr(module, "__file__", None) is not None
    spec = importlib.util.find_spec("torch")
    return spec is not None and spec.origin is not None


HAS_TORCH = _torch_installed()
NO_TORCH_REASON = "torch is not installed (pip install -e '.[torch]')"
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason=NO_TORCH_REASON)


def import_torch() -> Any:
    """``torch``, or skip the calling test (or module) saying how to install it; unlike
    ``pytest.importorskip("torch")`` not fooled by the folder ``tests/torch``."""
    if not HAS_TORCH:
        pytest.skip(NO_TORCH_REASON, allow_module_level=True)
    import torch

    return torch


def mpiexec() -> str:
    """The MPI launcher hvdliterun would use, or fail the test saying what to install."""
    found = find_mpiexec()
    if found is None:
        pytest.fail("mpiexec not found next to the interpreter or on PATH; install hvdlite[local]")
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without HVDLITE_*/HOROVOD_* (a stray knob must not change what a
    test checks), unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env | extra


def run_group(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group from the repository root; kill the whole group on
    timeout (the exit code is then None). Returns stdout and stderr together."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


# A job script's own rank under either launcher (MPICH: PMI_RANK; Open MPI: OMPI_COMM_WORLD_RANK).
RANK_OF = "int(os.environ.get('PMI_RANK') or os.environ.get('OMPI_COMM_WORLD_RANK'))"
HVDLITE_FRAME = re.compile(r'File "[^"]*/hvdlite/')  # a traceback line in hvdlite's code
HVDLITERUN_TIMEOUT_S = 90.0


def write_script(tmp_path: Path, name: str, body: str) -> str:
    """Write ``body`` (dedented) to ``tmp_path/name``; returns its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


def hvdliterun(*args: str, env: dict[str, str] | None = None,
               timeout: float = HVDLITERUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``python -m hvdlite.run ARGS`` from the repository root (in :func:`clean_env`
    unless ``env``) and capture its output."""
    return subprocess.run([sys.executable, "-m", "hvdlite.run", *args],
                          env=clean_env() if env is None else env, cwd=REPO,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, check=False)


# What each rank of a job sees: its HVDLITE_/HOROVOD_ variables and the config it loads (and,
# given a second argument, the config its own YAML would give), as rank-<R>.json in argv[1].
ENV_PROBE = """
import dataclasses, json, os, sys
from hvdlite.config import load_config
rank = RANK
report = {
    "rank": rank,
    "env": {k: v for k, v in os.environ.items() if k.startswith("HVDLITE_")},
    "horovod": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
    "config": dataclasses.asdict(load_config()),
    # The rank's own YAML, as init(config=...) would read it (only below the environment).
    "own": dataclasses.asdict(load_config(sys.argv[2])) if len(sys.argv) > 2 else None,
}
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
""".replace("RANK", RANK_OF)


def probe(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
          own: Path | None = None) -> list[dict[str, Any]]:
    """Run :data:`ENV_PROBE` as ``hvdliterun -np 2 ARGS``; returns both ranks' reports."""
    script = write_script(tmp_path, "probe.py", ENV_PROBE)
    out = tmp_path / "out"
    out.mkdir()
    extra = [str(own)] if own is not None else []
    result = hvdliterun("-np", "2", *args, "--", sys.executable, script, str(out), *extra,
                        env=env)
    assert result.returncode == 0, result.stderr
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    return reports


# A pytest -q summary, e.g. "12 passed, 1 skipped in 3.21s" (maybe framed by "="). Not anchored:
# the ranks share mpiexec's stdout, so two ranks' summaries can run together on one line
# ("... in 8.13s236 passed, ...").
SUMMARY = re.compile(
    r"(\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)"
    r"(?:, \d+ \w+)* in [\d.]+s)"
)
TAIL_CHARS = 12_000


# Skips seen inside the jobs run_pytest_job ran: (job, reason, count on rank 0), listed by the
# root conftest at the end of the terminal summary.
INNER_SKIPS: list[tuple[str, str, int]] = []


def run_pytest_job(size: int, tests: Path | Sequence[Path], report_dir: Path, timeout_s: float,
                   skips: Mapping[str, str] | None = None, **env: str) -> None:
    """Run ``tests`` (one path, or several in one launch) as ``mpiexec -n size python -m
    mpi4py -m pytest`` and assert that it finished in time, exited 0, and that every rank
    wrote a tally (``tests/conftest.py``, ``HVDLITE_TEST_REPORT_DIR``) with passes and no
    failures or errors.

    Every test skipped inside the job must be one that ``skips`` allows: it maps a regular
    expression searched in the skip's reason to why that skip is expected in this job (e.g.
    ``{"needs CUDA": "the GPU machine runs them"}``); any other skip fails the job. The skips
    are counted per reason and listed at the end of the terminal summary."""
    paths = [tests] if isinstance(tests, Path) else list(tests)
    cmd = [
        mpiexec(), "-n", str(size),
        sys.executable, "-m", "mpi4py", "-m", "pytest", *map(str, paths),
        "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=120",
        f"--rootdir={REPO}", "-c", str(REPO / "pyproject.toml"),
    ]  # fmt: skip
    job_env = clean_env(HVDLITE_TEST_REPORT_DIR=str(report_dir), PYTHONFAULTHANDLER="1", **env)
    start = time.monotonic()
    rc, out = run_group(cmd, job_env, timeout_s)
    wall = time.monotonic() - start
    job = f"mpiexec -n {size} {' '.join(str(p.relative_to(REPO)) for p in paths)}"
    print(f"{job}: rc={rc} wall={wall:.1f}s")
    tail = out if len(out) <= TAIL_CHARS else "...\n" + out[-TAIL_CHARS:]
    where = f"mpiexec -n {size} (rc={rc}, {wall:.0f}s); output tail:\n{tail}"
    assert rc is not None, f"job timed out after {timeout_s}s: {where}"
    assert rc == 0, f"job failed: {where}"
    tallies = [json.loads(p.read_text()) for p in sorted(report_dir.glob("rank*.json"))]
    assert sorted(t["rank"] for t in tallies) == list(range(size)), f"missing tallies: {where}"
    allowed = dict(skips or {})
    for t in tallies:
        counts = {k: t[k] for k in ("passed", "failed", "errors", "skipped")}
        assert t["size"] == size and t["exitstatus"] == 0, f"rank {t['rank']} {counts}: {where}"
        assert t["passed"] > 0 and t["failed"] == 0 and t["errors"] == 0, \
            f"rank {t['rank']} {counts}: {where}"
        unexpected = {test: reason for test, reason in t["skips"].items()
                      if not any(re.search(pattern, reason) for pattern in allowed)}
        assert not unexpected, (f"rank {t['rank']} skipped tests this job should run "
                                f"(allowed here: {allowed}): {unexpected}")
    for reason, count in sorted(Counter(tallies[0]["skips"].values()).items()):
        INNER_SKIPS.append((job, reason, count))
    summaries = SUMMARY.findall(out)
    assert summaries, f"no pytest summary line: {where}"
    assert not any(re.search(r"\d+ (failed|errors?)\b", s) for s in summaries), where


# How rank 1 goes in the death tests (a line of the job script), and the status hvdliterun's
# verdict names for it: "hvdliterun: rank 1 (host H) failed first with <status>; ...".
GONE = {
    "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
    "raise": "raise RuntimeError('user code failed on rank 1')",
}
GONE_STATUS = {"SIGKILL": "signal 9 (SIGKILL)", "raise": "exit code 1"}
GONE_BOUND_S = 15.0
# A survivor's hvdlite error naming rank 1 as the cause ("hvdlite was shut down by rank 1 ...").
_SURVIVOR_NAMES_RANK_1 = re.compile(r"^(hvdlite\.errors\.\w+: |\[hvdlite rank 0\] ).*\brank 1\b",
                                    re.M)


def rank_one_named(out: str, how: str) -> str:
    """Which line of hvdlite's or hvdliterun's output names rank 1 as the rank that went
    ``how`` (the job's own traceback, which says "rank 1" too, does not count); fails if none.

    For a SIGKILL, hvdliterun's verdict must. For a raise, the verdict may name the survivor
    instead (rank 1 runs its exit handlers, which end hvdlite on rank 0, before it exits), so
    the survivor's hvdlite error naming rank 1 counts as well."""
    verdict = re.compile(rf"^hvdliterun: rank 1 \(host [^)]+\) failed first with "
                         rf"{re.escape(GONE_STATUS[how])}; .*$", re.M)
    named = verdict.search(out)
    if named is None and how == "raise":
        named = _SURVIVOR_NAMES_RANK_1.search(out)
    assert named is not None, f"nothing of hvdlite's names rank 1 ({how}):\n{out}"
    return named.group(0)


def job_ranks() -> int:
    """Ranks of the failure jobs: ``HVDLITE_TEST_JOB_RANKS`` (default 2; the GPU script sets
    it to its NP, so a 4-GPU host runs them with three survivors)."""
    raw = os.environ.get("HVDLITE_TEST_JOB_RANKS", "2")
    if not raw.isdigit() or int(raw) < 2:
        raise ValueError(f"HVDLITE_TEST_JOB_RANKS must be an integer >= 2, got {raw!r}")
    return int(raw)


def rank_one_goes(tmp_path: Path, job: str, how: str, label: str) -> None:
    """Run ``job`` (a script that writes the time rank 1 goes to its first argument, then
    goes ``how``) as an ``hvdliterun`` job of :func:`job_ranks` ranks: it must end with an
    error within ``GONE_BOUND_S`` of rank 1 going, hvdlite naming rank 1
    (:func:`rank_one_named`), with no traceback through hvdlite's code for a SIGKILL (a
    raising rank prints its own, as Python does)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(job), encoding="utf-8")
    stamp = tmp_path / "gone"
    code, out = run_group([sys.executable, "-m", "hvdlite.run", "-np", str(job_ranks()), "--",
                           sys.executable, str(script), str(stamp)], clean_env(), 90.0)
    ended = time.time()
    assert code is not None and code != 0, out
    assert stamp.exists(), f"rank 1 never reached the failure point:\n{out}"
    took = ended - float(stamp.read_text())
    named = rank_one_named(out, how)
    print(f"{how} ({label}): the job ended {took:.1f} s after rank 1 went; named by: {named}",
          flush=True)
    assert took < GONE_BOUND_S, f"the job took {took:.1f} s to end after rank 1 went:\n{out}"
    if how == "SIGKILL":
        assert not HVDLITE_FRAME.search(out), f"a traceback through hvdlite's code:\n{out}"
    else:
        assert "user code failed on rank 1" in out, out
