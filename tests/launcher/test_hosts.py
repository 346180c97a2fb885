"""hvdliterun's host handling on its own: -H and hostfiles, forwarded variables, transport."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvdlite.launcher.cli import EXIT_UNREACHABLE, main
from hvdlite.launcher.hosts import (
    Host,
    forwarded_env,
    interface_for,
    is_local,
    parse_hostfile,
    parse_hosts,
    ssh_for_mpi,
    ssh_options,
    transport,
)


def test_parse_hosts() -> None:
    assert parse_hosts("a:2, b:4,c") == [Host("a", 2), Host("b", 4), Host("c", 1)]
    with pytest.raises(ValueError, match="slots of host 'a' must be an integer"):
        parse_hosts("a:x")
    with pytest.raises(ValueError, match="at least 1 slot"):
        parse_hosts("a:0")
    with pytest.raises(ValueError, match="empty host name"):
        parse_hosts("a:1,,b")


def test_parse_hostfile_every_form(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1 slots=4\nnode2:2  # MPICH form\n\nnode3\n"
                    "node4 slots=2 max_slots=8\n")
    assert parse_hostfile(str(path)) == [Host("node1", 4), Host("node2", 2), Host("node3", 1),
                                         Host("node4", 2)]
    path.write_text("node1 cpus=3\n")
    with pytest.raises(ValueError, match="line 1: unknown field 'cpus=3'"):
        parse_hostfile(str(path))
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no hosts"):
        parse_hostfile(str(path))


def test_local_names() -> None:
    assert is_local("localhost") and is_local("127.0.0.1")
    assert not is_local("no-such-host.invalid")
    assert interface_for("127.0.0.1") == ("lo", "127.0.0.1")


def test_forwarded_env() -> None:
    environ = {"PATH": "/usr/bin", "PYTHONPATH": "/src", "HVDLITE_CYCLE_TIME_MS": "2",
               "HOROVOD_FUSION_THRESHOLD": "1", "HVDLITE_CONFIG": "x.yaml",
               "HVDLITE_WATCHDOG_FD": "9", "HOME": "/root", "MINE": "1"}
    out = forwarded_env(environ, ["MINE", "OTHER=2"])
    # PATH as it is: nothing ahead of the caller's first entry (issue 42).
    assert out == {"PATH": "/usr/bin", "PYTHONPATH": "/src",
                   "HVDLITE_CYCLE_TIME_MS": "2", "HOROVOD_FUSION_THRESHOLD": "1", "MINE": "1",
                   "OTHER": "2"}
    with pytest.raises(ValueError, match="-x/--env NOPE: not set"):
        forwarded_env(environ, ["NOPE"])
    with pytest.raises(ValueError, match="expected NAME or NAME=VALUE"):
        forwarded_env(environ, ["=3"])


def test_transport() -> None:
    assert transport("hydra", "eth1", True) == (
        ["-iface", "eth1"],
        {"FI_TCP_IFACE": "eth1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"})
    assert transport("hydra", None, False) == ([], {})
    assert transport("hydra", "ib0,eth0", False) == (["-iface", "ib0"], {"FI_TCP_IFACE": "ib0"})
    assert transport("openmpi", "eth1", True) == (
        ["--mca", "btl_tcp_if_include", "eth1", "--mca", "oob_tcp_if_include", "eth1",
         "--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp"], {})


def test_bad_hosts_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["-np", "2", "-H", "a:zero", "--", "true"])
    assert info.value.code == 2
    assert "slots of host 'a' must be an integer" in capsys.readouterr().err


def test_unresolvable_host_named_before_start(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["-np", "2", "-H", "no-such-host.invalid:2", "--", "true"])
    assert code == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "host no-such-host.invalid cannot be reached" in err
    assert "not started: 1 of 1 hosts unreachable (no-such-host.invalid)" in err


def test_ssh_options(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("x")
    assert ssh_options(None, None) == []
    assert ssh_options(2222, str(key)) == ["-p", "2222", "-i", str(key)]
    with pytest.raises(ValueError, match="no such file"):
        ssh_options(None, str(tmp_path / "missing"))
    assert ssh_for_mpi("hydra", ["-p", "2222"]) == ([], {"HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222"})
    assert ssh_for_mpi("openmpi", ["-p", "2222"]) == (["--mca", "plm_rsh_args", "-p 2222"], {})
    assert ssh_for_mpi("hydra", []) == ([], {})
