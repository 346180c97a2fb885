"""``hvdliterun`` end to end: real jobs under the installed mpiexec, each with a timeout."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from jobs_util import (
    HVDLITERUN_TIMEOUT_S,
    RANK_OF,
    REPO,
    clean_env,
    hvdliterun,
    probe,
    write_script,
)

from hvdlite.config import KNOBS, Config, load_config
from hvdlite.launcher.hosts import PRIVATE_NAMES
from hvdlite.run import find_mpiexec, mpi_flavor

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

# A failed job must end far sooner than the 60 s its surviving rank would sleep.
PROMPT_S = 30
JOB_TIMEOUT_S = HVDLITERUN_TIMEOUT_S


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _failing_job(tmp_path: Path, rank1_action: str) -> str:
    """Rank 1 does ``rank1_action``; rank 0 records its pid and sleeps 60 s."""
    return write_script(
        tmp_path,
        "fail.py",
        f"""
        import os, signal, sys, time
        rank = {RANK_OF}
        if rank == 1:
            {rank1_action}
        with open(sys.argv[1], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
        """,
    )


def test_rank_exit_code_ends_the_job_and_is_named(tmp_path: Path) -> None:
    script = _failing_job(tmp_path, "sys.exit(3)")
    pid_file = tmp_path / "rank0.pid"
    start = time.monotonic()
    result = hvdliterun("-np", "2", "--", sys.executable, script, str(pid_file))
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stderr
    assert elapsed < PROMPT_S
    last = _last_line(result.stderr)
    assert "rank 1 " in last and "failed first with exit code 3" in last, result.stderr
    if pid_file.exists():  # rank 0 may have been ended before it wrote its pid
        assert _gone(int(pid_file.read_text()))


def test_rank_killed_by_signal_is_named(tmp_path: Path) -> None:
    script = _failing_job(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    start = time.monotonic()
    result = hvdliterun("-np", "2", "--", sys.executable, script, str(tmp_path / "pid"))
    assert time.monotonic() - start < PROMPT_S
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert "rank 1 " in _last_line(result.stderr)
    assert "failed first with signal 9 (SIGKILL)" in _last_line(result.stderr)


def test_the_first_failure_is_named_not_a_later_one(tmp_path: Path) -> None:
    # Rank 0 fails (code 4) only after rank 1's failure (code 5) was reported.
    script = write_script(
        tmp_path,
        "two_failures.py",
        f"""
        import os, sys, time
        rank = {RANK_OF}
        if rank == 1:
            sys.exit(5)
        report = os.path.join(os.environ["HVDLITE_RUN_REPORT_DIR"], "rank-1.json")
        while not os.path.exists(report):
            time.sleep(0.01)
        sys.exit(4)
        """,
    )
    result = hvdliterun("-np", "2", "--", sys.executable, script)
    assert result.returncode == 5, result.stderr
    assert "rank 1 " in _last_line(result.stderr)
    assert "exit code 5" in _last_line(result.stderr)


def test_successful_job_without_separator(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "hello.py",
        f"import os, sys\nrank = {RANK_OF}\nsys.stdout.write(f'hello from {{rank}}\\n')\n",
    )
    result = hvdliterun("-np", "2", sys.executable, script)
    assert result.returncode == 0, result.stderr
    hellos = sorted(line for line in result.stdout.splitlines() if line.startswith("hello"))
    assert hellos == ["hello from 0", "hello from 1"]
    assert "failed" not in result.stderr


def test_timeout_ends_the_job(tmp_path: Path) -> None:
    start = time.monotonic()
    result = hvdliterun(
        "-np", "2", "--timeout", "2", "--", sys.executable, "-c", "import time; time.sleep(60)"
    )
    assert time.monotonic() - start < PROMPT_S
    assert result.returncode == 124
    assert "exceeded --timeout 2 s" in _last_line(result.stderr)


def test_sigterm_to_the_launcher_ends_the_job(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "sleeper.py",
        f"""
        import os, sys, time
        path = os.path.join(sys.argv[1], f"rank{{{RANK_OF}}}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        time.sleep(60)
        """,
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hvdlite.run", "-np", "2", "--", sys.executable, script,
         str(tmp_path)],
        env=clean_env(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pid_files = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not all(p.exists() for p in pid_files) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.exists() for p in pid_files), "the ranks never started"
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=PROMPT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode != 0
    assert "SIGTERM" in err
    assert all(_gone(int(p.read_text())) for p in pid_files)


# Each rank writes what it sees to OUT/rank-R.json (stdout lines of ranks may interleave).
def test_settings_reach_every_rank_with_precedence(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("fusion_threshold: 1000\ncycle_time_ms: 2\ncache_capacity: 3\n")
    env = clean_env(HOROVOD_FUSION_THRESHOLD="2000", HVDLITE_CYCLE_TIME_MS="4")
    reports = probe(
        tmp_path, "--config", str(config), "--fusion-threshold", "3000", "--async-completion",
        env=env,
    )  # fmt: skip
    expected = Config(
        fusion_threshold=3000, cycle_time_ms=4.0, cache_capacity=3, async_completion=True
    )
    for report in reports:
        assert report["config"]["fusion_threshold"] == 3000  # flag > env > YAML
        assert report["config"]["cycle_time_ms"] == 4.0  # env > YAML
        assert report["config"]["cache_capacity"] == 3  # YAML > default
        assert report["env"]["HVDLITE_FUSION_THRESHOLD"] == "3000"
        # Exactly what was set is forwarded; knobs left at their defaults are not.
        set_here = {"fusion_threshold", "cycle_time_ms", "cache_capacity", "async_completion"}
        launcher_own = PRIVATE_NAMES - {"HVDLITE_CONFIG"}  # the report dir, monitor, watchdog
        assert report["env"] == expected.to_env(set_here) | {
            k: v for k, v in report["env"].items() if k in launcher_own}
        unset_here = {"HVDLITE_RUN_REPORT_DIR", "HVDLITE_OUTPUT_DIR", "HVDLITE_ELASTIC_DIR",
                      "HVDLITE_ELASTIC_GENERATION", "HVDLITE_WORKERS", "HVDLITE_RANK_PATH"}
        assert {n for n in launcher_own - unset_here if n.startswith("HVDLITE_")} \
            <= set(report["env"])
        # Horovod's per-worker variables, and the HVDLITE_ names beside them.
        rank = str(report["rank"])
        assert report["horovod"] == {
            "HOROVOD_FUSION_THRESHOLD": "2000",  # forwarded from the environment
            "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": rank, "HOROVOD_SIZE": "2",
            "HOROVOD_LOCAL_RANK": rank, "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0",
            "HOROVOD_CROSS_SIZE": "1"}
        assert {k.replace("HOROVOD_", "HVDLITE_"): v for k, v in report["horovod"].items()
                if "FUSION" not in k}.items() <= report["env"].items()
        assert load_config(environ=report["env"]) == expected
        assert "HVDLITE_CONFIG" not in report["env"]


def test_rank_config_file_applies_to_knobs_not_set_at_launch(tmp_path: Path) -> None:
    """A rank's own init(config=...) file: the launcher's flags still win (they reach the
    rank as environment), but knobs the launch left at their defaults come from the file."""
    own = tmp_path / "rank.yaml"
    own.write_text("fusion_threshold: 5\ncache_capacity: 7\n")
    reports = probe(tmp_path, "--fusion-threshold", "3000", env=clean_env(), own=own)
    for report in reports:
        assert report["own"]["fusion_threshold"] == 3000  # launcher flag > rank's file
        assert report["own"]["cache_capacity"] == 7  # rank's file > default


def test_hvdlite_config_variable_is_resolved_by_the_launcher(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("log_level: debug\ntimeline_mark_cycles: true\n")
    reports = probe(tmp_path, env=clean_env(HVDLITE_CONFIG=str(config)))
    for report in reports:
        assert report["env"]["HVDLITE_LOG_LEVEL"] == "debug"
        assert report["env"]["HVDLITE_TIMELINE_MARK_CYCLES"] == "1"
        assert "HVDLITE_CONFIG" not in report["env"]


@pytest.mark.parametrize("name", ["latency", "throughput", "debug", "gpu-async"])
def test_config_flag_with_example_files(tmp_path: Path, name: str) -> None:
    path = REPO / "configs" / f"{name}.yaml"
    reports = probe(tmp_path, "--config", str(path))
    expected = load_config(path, environ={})
    assert expected != Config()
    for report in reports:
        assert Config(**report["config"]) == expected


def test_every_knob_has_a_working_flag(tmp_path: Path) -> None:
    changed = {
        "fusion_threshold": ("5KiB", 5120), "fusion_direct_bytes": ("2KiB", 2048),
        "ipc": ("off", "off"), "ipc_max_bytes": ("4KiB", 4096),
        "ipc_buffer_bytes": ("1MiB", 1 << 20), "cycle_time_ms": ("0.5", 0.5),
        "cache_capacity": ("10", 10), "async_completion": (None, True),
        "timeline": ("/tmp/x.json", "/tmp/x.json"), "timeline_mark_cycles": (None, True),
        "stall_check": ("no", False), "stall_check_time_s": ("7", 7.0),
        "stall_shutdown_time_s": ("8", 8.0), "idle_backoff_max_ms": ("2", 2.0),
        "peer_timeout_s": ("45", 45.0),
        "log_level": ("error", "error"), "nvtx": (None, True),
        "timeline_device_events": (None, True), "timeline_max_bytes": ("1MiB", 1 << 20),
        "timeline_max_files": ("5", 5),
        "gil_switch_interval_us": ("100", 100.0), "optimizer_size1_shortcut": ("no", False),
        "optimizer_schedule": ("no", False), "optimizer_host_schedule": (None, True),
            "optimizer_max_ctas": ("8", 8), "stream_priority": ("normal", "normal"),
            "schedule_transport": ("ipc", "ipc"),
        "start_timeout_s": ("40", 40.0), "elastic_timeout_s": ("50", 50.0),
        "discovery_interval_s": ("0.5", 0.5),
    }  # fmt: skip
    assert set(changed) == {k.name for k in KNOBS}
    args: list[str] = []
    for k in KNOBS:
        text, _ = changed[k.name]
        if text is None:
            args.append(k.flag)
        elif text == "no":
            args.append(k.flag.replace("--", "--no-", 1))
        else:
            args += [k.flag, text]
    reports = probe(tmp_path, *args)
    for report in reports:
        assert report["config"] == {name: value for name, (_, value) in changed.items()}


def test_verbose_prints_command_and_settings(tmp_path: Path) -> None:
    script = write_script(tmp_path, "check.py", "import os, sys\nassert sys.argv[1] == 'a b'\n")
    result = hvdliterun(
        "-np", "2", "--verbose", "--cycle-time-ms", "3", "--", sys.executable, script, "a b"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    command = [line for line in lines if line.startswith("hvdliterun: command: ")]
    assert len(command) == 1
    openmpi = mpi_flavor(find_mpiexec(None) or "") == "openmpi"
    # Open MPI's mpirun takes -np (and is launched with it); MPICH's mpiexec -n.
    assert "mpiexec" in command[0] and (" -np 2 " if openmpi else " -n 2 ") in command[0]
    assert command[0].endswith(f"{script} 'a b'")
    words = shlex.split(command[0].removeprefix("hvdliterun: command: "))
    # Names only, never values (issue 43: the monitor's token was readable in ps).
    if openmpi:
        assert words[words.index("HVDLITE_CYCLE_TIME_MS") - 1] == "-x"
    else:
        assert "HVDLITE_CYCLE_TIME_MS" in words[words.index("-genvlist") + 1].split(",")
    assert "-genv" not in words and "3.0" not in words
    assert "hvdliterun: cycle_time_ms = 3.0  [--cycle-time-ms]" in lines
    assert "hvdliterun: log_level = 'warning'  [default]" in lines


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["-np", "2", "--bogus", "--", "true"], {}, "unrecognized arguments: --bogus"),
        (["-np", "2", "--fusion-threshold", "12QB", "--", "true"], {}, "--fusion-threshold"),
        (["-np", "2", "--log-level", "loud", "--", "true"], {}, "expected one of trace"),
        (["-np", "2", "--cycle-time-ms", "0", "--", "true"], {}, "expected a number > 0"),
        (["-np", "two", "--", "true"], {}, "invalid int value: 'two'"),
        (["-np", "0", "--", "true"], {}, "N must be >= 1"),
        (["--", "true"], {}, "-np N is required"),
        (["-np", "2"], {}, "no command to run"),
        (["-np", "2", "--timeout", "-1", "--", "true"], {}, "--timeout must be > 0"),
        (["-np", "2", "--", "true"], {"HVDLITE_NVTX": "maybe"}, "HVDLITE_NVTX: bad value"),
        (["-np", "2", "--", "true"], {"HOROVOD_CYCLE_TIME": "x"}, "HOROVOD_CYCLE_TIME: bad"),
        (["-np", "2", "--config", "/nonexistent.yaml", "--", "true"], {}, "cannot be read"),
        (["-np", "2", "--mpi-args=-v 'x", "--", "true"], {}, "--mpi-args: No closing"),
    ],
)
def test_bad_usage_exits_2(args: list[str], env: dict[str, str], message: str) -> None:
    result = hvdliterun(*args, env=clean_env(**env))
    assert result.returncode == 2
    assert message in result.stderr
    assert "usage: hvdliterun" in result.stderr


def test_unknown_yaml_key_exits_2_with_valid_keys(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("fusion_thresold: 1MiB\n")
    result = hvdliterun("-np", "2", "--config", str(config), "--", "true")
    assert result.returncode == 2
    assert "did you mean 'fusion_threshold'" in result.stderr
    assert all(k.name in result.stderr for k in KNOBS)


def test_print_default_config_matches_the_file() -> None:
    result = hvdliterun("--print-default-config")
    assert result.returncode == 0
    assert result.stdout == (REPO / "configs" / "default.yaml").read_text(encoding="utf-8")


ALLREDUCE_JOB = f"""
import os
import sys
import numpy as np
import hvdlite as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
assert rank == {RANK_OF}
def data(r):
    return np.random.default_rng((1234, r)).integers(-1000, 1000, size=37, dtype=np.int64)
got = hvd.allreduce(data(rank), name="x", op=hvd.Sum)
want = sum(data(r) for r in range(size))
assert np.array_equal(got, want), (got, want)
# One write per line: ranks share the job's stdout, and print() writes the newline apart.
sys.stdout.write(f"allreduce ok {{rank}} {{size}} {{int(got.sum())}}\\n")
hvd.shutdown()
"""


def test_allreduce_job_end_to_end(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", ALLREDUCE_JOB)
    result = hvdliterun("-np", "2", "--fusion-threshold", "1MiB", "--", sys.executable, script)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("allreduce ok"))
    data = [np.random.default_rng((1234, r)).integers(-1000, 1000, 37, np.int64) for r in (0, 1)]
    total = int(sum(d.sum() for d in data))
    assert lines == [f"allreduce ok 0 2 {total}", f"allreduce ok 1 2 {total}"]


def test_mpi_args_reach_the_mpi_launcher(tmp_path: Path) -> None:
    found = find_mpiexec()
    assert found is not None
    if mpi_flavor(found) != "hydra":
        pytest.skip("uses the Hydra flag -genv")
    script = write_script(tmp_path, "mark.py", "import os\nassert os.environ['MY_MARK'] == 'a b'\n")
    result = hvdliterun("-np", "2", "--mpi-args=-genv MY_MARK 'a b'", "--", sys.executable, script)
    assert result.returncode == 0, result.stderr
