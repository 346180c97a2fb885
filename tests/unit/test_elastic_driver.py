"""The elastic driver's pieces that need no job: host lists, slot assignment, blacklisting
with Horovod's cool-down, worker identities across resets, the commit files a restarted world
reads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hvdlite.elastic import _worker
from hvdlite.launcher.discovery import ADDED, REMOVED, Hosts, Workers, parse_hosts
from hvdlite.launcher.hosts import worker_table


def _hosts(max_np: int | None = None, hosts: tuple[tuple[str, int], ...] = (),
           cooldown: tuple[int, int] | None = None) -> Hosts:
    return Hosts(discovery=None, static=hosts, slots=None, max_np=max_np, interval_s=0.01,
                 cooldown=cooldown)


def test_parse_hosts() -> None:
    assert parse_hosts("a:2,b", 3, "-H") == [("a", 2), ("b", 3)]
    assert parse_hosts("# comment\nn1:4\n\nn2:1\n", None, "script") == [("n1", 4), ("n2", 1)]
    with pytest.raises(ValueError, match="'b' has no ':slots' and --slots is not given"):
        parse_hosts("a:1\nb", None, "host discovery script")
    with pytest.raises(ValueError, match="bad slot count in 'a:0'"):
        parse_hosts("a:0", None, "-H")
    with pytest.raises(ValueError, match="host 'a' is listed twice"):
        parse_hosts("a:1,a:2", None, "-H")


def test_assignment_keeps_host_order_caps_at_max_np_and_leaves_out_blacklisted_hosts() -> None:
    hosts = _hosts(max_np=5, hosts=(("a", 2), ("b", 2), ("c", 4)))
    assert hosts.discover(first=True) == ADDED
    assert hosts.assignment() == [("a", 2), ("b", 2), ("c", 1)]
    hosts.blacklist("b", "rank 2 failed")
    assert hosts.assignment() == [("a", 2), ("c", 3)]
    hosts.blacklist("a", "rank 0 failed")
    assert hosts.assignment() == [("c", 4)]
    assert not hosts.can_return()  # fixed hosts, no cool-down: a blacklisted host is out


def test_blacklisted_host_returns_after_its_cooldown_as_an_added_host() -> None:
    hosts = _hosts(hosts=(("a", 1), ("b", 1)), cooldown=(1, 2))
    hosts.discover(first=True)
    hosts.blacklist("b", "rank 1 failed")
    entry = hosts.blacklisted["b"]
    assert entry.until is not None and entry.count == 1
    # Horovod's delay for the first blacklisting: 1 * 2**1 + U(0, 1), clamped to [1, 2].
    assert entry.until - time.monotonic() == pytest.approx(2.0, abs=0.1)
    assert hosts.can_return() and hosts.assignment() == [("a", 1)]
    entry.until = hosts.next_poll = time.monotonic()  # the cool-down is over
    assert hosts.poll() == ADDED
    assert hosts.assignment() == [("a", 1), ("b", 1)]
    hosts.blacklist("b", "rank 1 failed again")
    assert hosts.blacklisted["b"].count == 2  # the next cool-down is longer (up to MAX)


def test_discovery_reports_added_and_removed_hosts(tmp_path: Path) -> None:
    listing = tmp_path / "hosts"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    hosts = Hosts(discovery=str(script), static=(), slots=None, max_np=None, interval_s=0.01)
    listing.write_text("a:2\n")
    assert hosts.discover(first=True) == ADDED
    listing.write_text("a:2\nb:2\n")
    assert hosts.discover() == ADDED
    listing.write_text("b:2\n")
    assert hosts.discover() == REMOVED
    listing.write_text("b:1\nc:1\n")
    assert hosts.discover() == ADDED | REMOVED
    assert hosts.assignment() == [("b", 1), ("c", 1)]


def test_worker_table_is_horovods_slot_assignment() -> None:
    # [host, rank, size, local_rank, local_size, cross_rank, cross_size]
    assert worker_table([("a", 2), ("b", 1)], 3) == [
        ["a", 0, 3, 0, 2, 0, 2], ["a", 1, 3, 1, 2, 0, 1], ["b", 2, 3, 0, 1, 1, 2]]
    assert worker_table([("localhost", 4)], 2) == [
        ["localhost", 0, 2, 0, 2, 0, 1], ["localhost", 1, 2, 1, 2, 0, 1]]


def test_workers_keep_their_identity_until_their_host_leaves() -> None:
    workers = Workers()
    first = workers.table([("localhost", 2)])
    assert [row[1] for row in first] == [0, 1]
    grown = workers.table([("localhost", 2), ("127.0.0.1", 2)])
    assert [row[:3] for row in grown] == [["localhost", 0, 2], ["localhost", 1, 2],
                                          ["127.0.0.1", 2, 4], ["127.0.0.1", 3, 4]]
    shrunk = workers.table([("127.0.0.1", 2)])  # localhost removed: HOROVOD_RANK stays 2, 3
    assert [row[:3] for row in shrunk] == [["127.0.0.1", 2, 4], ["127.0.0.1", 3, 4]]
    workers.leave("127.0.0.1")  # its host failed: new workers there get new identities
    assert [row[1] for row in workers.table([("127.0.0.1", 2)])] == [0, 1]


def test_commit_files(tmp_path: Path) -> None:
    d = str(tmp_path / "state" / "host")
    assert _worker.newest_commit(d) == 0
    _worker.write_commit(d, 1, {"x": [1]})
    _worker.write_commit(d, 2, {"x": [1, 2]})
    assert _worker.newest_commit(d) == 2
    assert _worker.read_commit(d, 2) == {"x": [1, 2]}
    assert sorted(p.name for p in Path(d).iterdir()) == ["commit-2.pkl"]  # older ones go
    Path(d, "commit-7.pkl.123.tmp").write_bytes(b"partial")  # a writer killed mid-write
    assert _worker.newest_commit(d) == 2
