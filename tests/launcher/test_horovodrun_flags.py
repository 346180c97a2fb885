"""``horovodrun``'s flags on ``hvdliterun``: the same meanings (checked in the ranks), or a clear
error naming why not; ``--start-timeout`` ending a world whose ranks do not start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jobs_util import hvdliterun, probe, write_script

from hvdlite.launcher.job import find_mpiexec, mpi_flavor

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def test_horovodrun_spellings_set_the_same_knobs(tmp_path: Path) -> None:
    reports = probe(tmp_path, "--fusion-threshold-mb", "3", "--timeline-filename",
                     "/tmp/t.json", "--stall-check-warning-time-seconds", "9",
                     "--stall-check-shutdown-time-seconds", "11", "--start-timeout", "40",
                     "--disable-cache", "--mpi")
    for report in reports:
        config = report["config"]
        assert config["fusion_threshold"] == 3 * 1024 * 1024
        assert config["timeline"] == "/tmp/t.json"
        assert (config["stall_check_time_s"], config["stall_shutdown_time_s"]) == (9.0, 11.0)
        assert config["start_timeout_s"] == 40.0


def test_horovodrun_config_file_is_read_and_flags_beat_it(tmp_path: Path) -> None:
    path = tmp_path / "horovod.yaml"
    path.write_text("params:\n  fusion_threshold_mb: 2\n  cycle_time_ms: 3\n"
                    "  hierarchical_allreduce: false\ntimeline:\n  filename: /tmp/h.json\n"
                    "  mark_cycles: true\nstall_check:\n  enabled: false\n"
                    "logging:\n  level: DEBUG\n")
    reports = probe(tmp_path, "--config-file", str(path), "--cycle-time-ms", "5")
    for report in reports:
        config = report["config"]
        assert config["fusion_threshold"] == 2 * 1024 * 1024 and config["cycle_time_ms"] == 5.0
        assert config["timeline"] == "/tmp/h.json" and config["timeline_mark_cycles"] is True
        assert config["stall_check"] is False and config["log_level"] == "debug"


@pytest.mark.parametrize("args, message", [
    (["--hierarchical-allreduce"], "--hierarchical-allreduce (horovodrun) has no hvdliterun "
     "counterpart: hvdlite has no hierarchical allreduce"),
    (["--gloo"], "--gloo (horovodrun) has no hvdliterun counterpart: hvdlite runs on MPI"),
    (["--autotune-log-file", "x"], "--autotune-log-file (horovodrun) has no hvdliterun "
     "counterpart"),
    (["--fusion-threshold", "1MiB", "--fusion-threshold-mb", "1"],
     "give the fusion threshold once"),
])
def test_flags_without_a_meaning_here_are_refused_by_name(args: list[str], message: str) -> None:
    result = hvdliterun("-np", "1", *args, "--", sys.executable, "-c", "pass")
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_config_file_key_without_a_counterpart_is_named(tmp_path: Path) -> None:
    path = tmp_path / "horovod.yaml"
    path.write_text("autotune:\n  enabled: true\n")
    result = hvdliterun("-np", "1", "--config-file", str(path), "--", sys.executable, "-c", "1")
    assert result.returncode == 2, result.stderr
    assert "autotune.enabled = True has no hvdlite counterpart" in result.stderr


def test_check_build_lists_what_is_available() -> None:
    result = hvdliterun("--check-build")
    assert result.returncode == 0, result.stderr
    assert "Available Frameworks:" in result.stdout and "[X] MPI" in result.stdout


def test_output_filename_keeps_each_ranks_output(tmp_path: Path) -> None:
    # One write per line: print() writes "out of", " ", "0" and "\n" apart (unbuffered), and
    # MPICH merges the ranks' stdout as the bytes come, so printed lines could interleave.
    script = write_script(tmp_path, "say.py", """
        import os, sys
        rank = os.environ["HOROVOD_RANK"]
        sys.stdout.write(f"out of {rank}\\n")
        sys.stdout.flush()
        sys.stderr.write(f"err of {rank}\\n")
        sys.stderr.flush()
    """)
    out = tmp_path / "logs"
    result = hvdliterun("-np", "2", "--output-filename", str(out), "--", sys.executable, script)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (out / f"rank.{rank}" / "stdout").read_text() == f"out of {rank}\n"
        assert (out / f"rank.{rank}" / "stderr").read_text() == f"err of {rank}\n"
    # Both ranks' lines reach the terminal, whole, in either order.
    assert sorted(result.stdout.splitlines()) == ["out of 0", "out of 1"], result.stdout


def test_start_timeout_ends_a_world_whose_ranks_do_not_start(tmp_path: Path) -> None:
    # The rank wrappers present a wrong token to the launcher's monitor (Hydra: the later
    # -genv wins), so the monitor drops them and no rank counts as started.
    if mpi_flavor(find_mpiexec() or "mpiexec") != "hydra":
        pytest.skip("needs MPICH's Hydra (-genv)")
    script = write_script(tmp_path, "sleep.py", "import time\ntime.sleep(60)\n")
    result = hvdliterun("-np", "2", "--start-timeout", "2", "--mpi-args",
                        "-genv HVDLITE_MONITOR_TOKEN wrong", "--", sys.executable, script,
                        timeout=60)
    assert result.returncode == 124, result.stderr
    assert "ranks 0, 1 on host localhost did not start within --start-timeout 2 s" \
        in result.stderr, result.stderr
