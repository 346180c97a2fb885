"""What hvdlite takes from places other users can reach (issue 43, docs/security.md), piece by
piece: host names, the discovery script's output, the horovodrun config file, the worker plan,
the elastic commit files and the timeline file. Each probe is local and bounded."""

from __future__ import annotations

import os
import pickle
import stat
import time
from pathlib import Path

import pytest

from hvdlite._observe.timeline import Timeline
from hvdlite._rankside import protocol
from hvdlite.config import ConfigError, load_config
from hvdlite.elastic import _worker
from hvdlite.errors import HvdliteError
from hvdlite.launcher import compat, monitor, rankwrap
from hvdlite.launcher.discovery import MAX_DISCOVERY_BYTES, Hosts, Workers, parse_hosts
from hvdlite.launcher.hosts import Host, check_host, check_ssh, parse_hostfile
from hvdlite.launcher.hosts import parse_hosts as parse_h

# -- finding 7: host names -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["localhost", "node-1", "n1.cluster.example", "10.0.0.7",
                                  "a" * 63 + ".b", "xn--bcher-kva.example."])
def test_host_names_that_are_accepted(name: str) -> None:
    assert check_host(name, "-H") == name


@pytest.mark.parametrize("name", ["-oProxyCommand=touch /tmp/x", "-p2222", "a b", "a;b",
                                  "$(id)", "`id`", "node_1", "-node", "node-", "a..b",
                                  "a" * 64, "h\n", "a/b"])
def test_host_names_that_could_be_options_or_shell_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="is not a host name or an IP address"):
        check_host(name, "-H")


def test_every_source_of_hosts_checks_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"-H .*'-oProxyCommand=x' is not a host name"):
        parse_h("-oProxyCommand=x:1")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n-oProxyCommand=x slots=1\n")
    with pytest.raises(ValueError, match="line 2: '-oProxyCommand=x' is not a host name"):
        parse_hostfile(str(hostfile))
    with pytest.raises(ValueError, match="discovery script: 'a;b' is not a host name"):
        parse_hosts("n1:2\na;b:2\n", None, "discovery script")
    assert parse_h("n1:2,10.1.2.3") == [Host("n1", 2), Host("10.1.2.3", 1)]


def test_ssh_gets_every_host_after_a_double_dash(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in ssh on PATH that records its arguments: what hvdliterun hands ssh.
    record = tmp_path / "argv"
    (tmp_path / "ssh").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {record}\nexit 0\n")
    (tmp_path / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert check_ssh(["node1"], "/usr/bin/python3", ["-p", "2222"]) == {}
    argv = record.read_text().splitlines()
    assert argv[argv.index("--") + 1] == "node1", argv
    assert argv.index("-p") < argv.index("--")


# -- finding 8: discovery output ---------------------------------------------------------------


def test_duplicate_check_of_discovered_hosts_is_linear() -> None:
    # 16k hosts took 4.5 s per 1 s poll: the duplicate check compared each with all before.
    text = "".join(f"node{i}:8\n" for i in range(20_000))
    start = time.perf_counter()
    hosts = parse_hosts(text, None, "discovery script")
    assert time.perf_counter() - start < 1.5
    assert len(hosts) == 20_000 and hosts[-1] == ("node19999", 8)
    with pytest.raises(ValueError, match="host 'node3' is listed twice"):
        parse_hosts(text + "node3:1\n", None, "discovery script")


def test_discovery_output_is_bounded(tmp_path: Path) -> None:
    script = tmp_path / "discover.py"
    script.write_text("#!/usr/bin/env python3\nimport sys\n"
                      f"sys.stdout.write('#' * {MAX_DISCOVERY_BYTES + 1} + '\\nlocalhost:1\\n')\n")
    script.chmod(0o755)
    hosts = Hosts(str(script), (), None, None, 1.0)
    with pytest.raises(RuntimeError, match=f"printed more than {MAX_DISCOVERY_BYTES} bytes"):
        hosts.discover(first=True)
    script.write_text("#!/bin/sh\necho localhost:2\n")
    assert hosts.discover(first=True) and hosts.assignment() == [("localhost", 2)]


# -- finding 8: the horovodrun config file -----------------------------------------------------


@pytest.mark.parametrize(("body", "message"), [
    ("params:\n  cycle_time_ms: null\n", "params.cycle_time_ms: expected a number, got None"),
    ("params:\n  cycle_time_ms: .inf\n", "params.cycle_time_ms: expected a finite number"),
    ("params:\n  fusion_threshold_mb: [1]\n", "params.fusion_threshold_mb: expected a number"),
    ("params:\n  fusion_threshold_mb: .nan\n", "params.fusion_threshold_mb: expected a finite"),
    ("params:\n  cache_capacity: 1.5\n", "params.cache_capacity: expected a whole number"),
    ("stall_check:\n  enabled: maybe\n", "stall_check.enabled: expected a boolean"),
    ("stall_check:\n  warning_time_seconds: {}\n", "warning_time_seconds: expected a number"),
    ("timeline:\n  filename: [a]\n", "timeline.filename: expected a file path"),
    ("logging:\n  level: 3\n", "logging.level: expected a log level name, got 3"),
    ("params:\n  hierarchical_allreduce: 'true'\n", "hierarchical_allreduce = 'true' has no"),
    ("controller: [mpi]\n", "controller ['mpi']: hvdlite runs on MPI only"),
])
def test_config_file_values_are_parsed_strictly(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "horovod.yaml"
    path.write_text(body)
    with pytest.raises(ValueError, match="^--config-file .*horovod.yaml: ") as caught:
        compat.config_file_overrides(str(path))
    assert message in str(caught.value)


def test_config_file_values_mean_what_they_say(tmp_path: Path) -> None:
    # "false" was True (bool("false")); filename: null wrote a file named "None".
    path = tmp_path / "horovod.yaml"
    path.write_text("timeline:\n  filename: null\n  mark_cycles: 'false'\n"
                    "stall_check:\n  enabled: 'off'\nparams:\n  fusion_threshold_mb: 1.5\n"
                    "  hierarchical_allreduce: 'false'\nlogging:\n  level: INFO\n")
    assert compat.config_file_overrides(str(path)) == {
        "timeline": None, "timeline_mark_cycles": False, "stall_check": False,
        "fusion_threshold": 3 << 19, "log_level": "info"}


def test_a_config_that_is_not_text_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"cycle_time_ms: \xff\xfe\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(path, environ={})


# -- finding 6: the worker plan ---------------------------------------------------------------


def test_the_worker_plan_grows_with_hosts_not_ranks() -> None:
    slots = [("a", 2), ("b", 1)]
    plan = protocol.workers_plan([(slots, 5)], [(0, 0, 5)])
    assert [protocol.worker_row(plan, r) for r in range(5)] == protocol.worker_table(slots, 5)
    assert protocol.worker_row(plan, 5) is None and protocol.worker_row(plan, -1) is None
    assert protocol.worker_row("[" * 5000, 0) is None and protocol.worker_row("", 0) is None
    big = protocol.workers_plan([([("localhost", 10_000)], 10_000)], [(0, 0, 10_000)])
    assert len(big) < 100
    assert protocol.worker_row(big, 9_999) == ["localhost", 9_999, 10_000, 9_999, 10_000, 0, 1]


def test_elastic_worker_plans_keep_identities_in_runs() -> None:
    workers = Workers()
    workers.plan([("h0", 500), ("h1", 500)])
    plan = workers.plan([(f"h{i}", 500) for i in range(20)])  # 18 hosts join: 10,000 ranks
    assert len(plan) < 1000
    rows = protocol.worker_rows(plan)
    assert rows[999][:3] == ["h1", 999, 1000]  # a worker of the first world keeps its identity
    assert rows[1000][:3] == ["h2", 1000, 10_000]


# -- finding 5: elastic commit files -------------------------------------------------------------


def _modes(top: Path) -> dict[str, str]:
    return {str(p.relative_to(top)): oct(stat.S_IMODE(p.stat().st_mode))
            for p in [*top.rglob("*")]}


def test_commits_on_a_host_without_the_directory_are_private(tmp_path: Path) -> None:
    # A host that lacks the launcher's directory makes it: it was 0755, the commit 0644.
    state = tmp_path / "base" / "hvdliterun-x" / "hvdlite-elastic-y" / "state" / "host"
    _worker.write_commit(str(state), 1, {"weights": [1, 2]})
    assert _modes(tmp_path / "base") == {
        "hvdliterun-x": "0o700", "hvdliterun-x/hvdlite-elastic-y": "0o700",
        "hvdliterun-x/hvdlite-elastic-y/state": "0o700",
        "hvdliterun-x/hvdlite-elastic-y/state/host": "0o700",
        "hvdliterun-x/hvdlite-elastic-y/state/host/commit-1.pkl": "0o600"}
    assert _worker.read_commit(str(state), 1) == {"weights": [1, 2]}


class _Plant:
    """A pickle that, once loaded, creates the file ``marker`` (any code could run there)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


def _plant(state: Path, marker: Path) -> None:
    state.mkdir(parents=True)
    (state / "commit-9.pkl").write_bytes(pickle.dumps({"commit": 9, "state": _Plant(marker)}))


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_a_planted_commit_of_another_user_is_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    job = tmp_path / "report" / "job"
    _plant(job / "state" / "host", marker)
    for path in (job, job / "state", job / "state" / "host", job / "state" / "host" /
                 "commit-9.pkl"):
        os.chown(path, 65534, 65534)  # nobody's
    state = str(job / "state" / "host")
    with pytest.raises(HvdliteError, match="owned by uid 65534, not by this user"):
        _worker.newest_commit(state)
    with pytest.raises(HvdliteError, match="owned by uid 65534"):
        _worker.read_commit(state, 9)
    with pytest.raises(HvdliteError, match="owned by uid 65534"):
        _worker.write_commit(state, 10, {})
    assert not marker.exists()


def test_a_planted_link_or_open_directory_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    elsewhere = tmp_path / "elsewhere"
    _plant(elsewhere, marker)
    state = tmp_path / "report" / "job" / "state" / "host"
    state.mkdir(parents=True, mode=0o700)
    (state / "commit-9.pkl").symlink_to(elsewhere / "commit-9.pkl")
    with pytest.raises(HvdliteError, match="commit-9.pkl: a symbolic link"):
        _worker.read_commit(str(state), 9)
    (state / "commit-9.pkl").unlink()
    state.rmdir()
    state.symlink_to(elsewhere)  # the directory itself a link
    with pytest.raises(HvdliteError, match="host: a symbolic link or not a directory"):
        _worker.read_commit(str(state), 9)
    state.unlink()
    (tmp_path / "report" / "job").chmod(0o777)  # ours, but anyone can swap what is inside
    with pytest.raises(HvdliteError, match="other users can write in it"):
        _worker.write_commit(str(state), 1, {})
    assert not marker.exists()


# -- finding 8: the timeline file ------------------------------------------------------------


def test_the_timeline_is_not_written_through_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "trace.json"
    link.symlink_to(victim)
    with pytest.raises(OSError, match="a symbolic link is there"):
        Timeline(str(link), 0, hook_signals=False)
    assert victim.read_text() == "precious"
    fresh = tmp_path / "fresh.json"
    timeline = Timeline(str(fresh), 0, hook_signals=False)
    timeline.close()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600


# -- the two lists of the channel's own message types -------------------------------------------


def test_the_rank_side_reserves_every_type_of_the_monitors() -> None:
    assert monitor.RESERVED_TYPES <= protocol.RESERVED_TYPES
    assert {"failing"} == protocol.RESERVED_TYPES - monitor.RESERVED_TYPES


def test_output_files_are_not_written_through_a_planted_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # horovodrun's --output-filename DIR: DIR/rank.0/stdout, in a directory others may share.
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out" / "rank.0").mkdir(parents=True)
    (tmp_path / "out" / "rank.0" / "stdout").symlink_to(victim)
    monkeypatch.setenv(rankwrap.OUTPUT_DIR_ENV, str(tmp_path / "out"))
    monkeypatch.setenv("PMI_SIZE", "1")
    assert rankwrap._output_files(0) is None
    assert "--output-filename" in capsys.readouterr().err
    assert victim.read_text() == "precious"
    files = rankwrap._output_files(1)
    assert files is not None
    for handle in files:
        handle.close()
    assert stat.S_IMODE((tmp_path / "out" / "rank.1" / "stderr").stat().st_mode) == 0o600
