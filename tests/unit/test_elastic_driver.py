"""The elastic driver's pieces that need no job: host lists, slot assignment, the commit
files a restarted world reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvdlite.elastic import _worker
from hvdlite.elastic.driver import ElasticArgs, _Hosts, parse_hosts


def _args(max_np: int | None = None, hosts: tuple[tuple[str, int], ...] = ()) -> ElasticArgs:
    return ElasticArgs(np=2, min_np=1, max_np=max_np, discovery=None, slots=None,
                       static_hosts=hosts, elastic_timeout=5.0, reset_limit=None)


def test_parse_hosts() -> None:
    assert parse_hosts("a:2,b", 3, "-H") == [("a", 2), ("b", 3)]
    assert parse_hosts("# comment\nn1:4\n\nn2:1\n", None, "script") == [("n1", 4), ("n2", 1)]
    with pytest.raises(ValueError, match="'b' has no ':slots' and --slots is not given"):
        parse_hosts("a:1\nb", None, "host discovery script")
    with pytest.raises(ValueError, match="bad slot count in 'a:0'"):
        parse_hosts("a:0", None, "-H")
    with pytest.raises(ValueError, match="host 'a' is listed twice"):
        parse_hosts("a:1,a:2", None, "-H")


def test_assignment_keeps_host_order_caps_at_max_np_and_drops_failed_slots() -> None:
    hosts = _Hosts(_args(max_np=5, hosts=(("a", 2), ("b", 2), ("c", 4))))
    hosts.discover(first=True)
    assert hosts.assignment() == [("a", 2), ("b", 2), ("c", 1)]
    hosts.failed["b"] = 1
    assert hosts.assignment() == [("a", 2), ("b", 1), ("c", 2)]
    hosts.failed["a"] = 2
    assert hosts.assignment() == [("b", 1), ("c", 4)]


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
