"""The monitor (hvdlite/launcher/monitor.py) against peers that do not play by its protocol.

Issue 43's findings 1, 3, 4 and the token comparison of 8, each a probe over real TCP on
127.0.0.1, bounded in count and time: the bytes of a peer without the token end nothing but
its own connection; a peer with the token cannot take over another rank's channel or end the
monitor with a malformed message; a rank's user code cannot send the channel's own types.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs_util import REPO

from hvdlite.launcher import monitor as monitor_module
from hvdlite.launcher import rankwrap as _rankwrap
from hvdlite.launcher.monitor import MAX_HELLO, MAX_PENDING, Agent, Event, Monitor


@pytest.fixture
def monitor() -> Iterator[Monitor]:
    mon = Monitor("127.0.0.1", beat_s=0.1, timeout_s=5.0)
    mon.start()
    yield mon
    mon.close()


def _events(mon: Monitor, until: object, timeout: float = 5.0) -> list[Event]:
    seen: list[Event] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        seen += mon.events(timeout=0.05)
        if until(seen):  # type: ignore[operator]
            return seen
    raise AssertionError(f"not within {timeout} s; saw {seen}")


def _dial(mon: Monitor) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", mon.port), timeout=5.0)
    return sock


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """The monitor closed ``sock`` within ``timeout`` (EOF or a reset)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1 << 16) == b"" or _closed_by_peer(sock, timeout)
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _hello(mon: Monitor, rank: object, **extra: object) -> bytes:
    return json.dumps({"t": "hello", "token": mon.token, "rank": rank, "host": "probe",
                       "pid": 1} | extra).encode() + b"\n"


def _joins(mon: Monitor, rank: int) -> Agent:
    """A well-behaved agent of ``rank``, joined: the monitor's thread still runs."""
    agent = Agent.from_env(rank, mon.env())
    assert agent is not None
    agent.connect(timeout=5.0)
    agent.start()
    _events(mon, lambda seen: any(e.kind == "joined" and e.rank == rank for e in seen))
    return agent


def test_a_deeply_nested_line_without_the_token_ends_only_its_connection(
        monitor: Monitor) -> None:
    # Finding 1: 2 KB of "[" raised RecursionError in json.loads, which ended the thread.
    probe = _dial(monitor)
    probe.sendall(b"[" * 2000 + b"\n")
    assert _closed_by_peer(probe, 5.0)
    probe.close()
    agent = _joins(monitor, 0)
    assert monitor.abort("still here", code=3) == [0]
    agent.close()


@pytest.mark.parametrize("line", [
    b'{"t": "exit"}',  # no code
    b'{"t": "exit", "code": "3"}',  # not an integer
    b'{"t": "exit", "code": true}',
    b'{"t": "exit", "code": 3, "signalled": "no"}',
    b'{"t": "beat", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}",  # nested past the recursion limit
    b"\xff\xfe not utf-8",
])
def test_a_malformed_message_after_the_hello_drops_that_rank_only(
        monitor: Monitor, line: bytes) -> None:
    # Finding 3: a peer with the token sending {"t":"exit"} with no code ended the thread.
    other = _joins(monitor, 1)
    probe = _dial(monitor)
    probe.sendall(_hello(monitor, 0))
    _events(monitor, lambda seen: any(e.kind == "joined" and e.rank == 0 for e in seen))
    probe.sendall(line + b"\n")
    lost = [e for e in _events(monitor, lambda seen: any(e.kind == "lost" for e in seen))
            if e.kind == "lost"]
    assert lost[0].rank == 0 and "sent a malformed message" in lost[0].reason, lost
    assert not [e for e in monitor.events() if e.kind == "exited"]
    assert monitor.running() == [1]
    assert monitor.abort("still here", code=3) == [1]  # the thread runs on
    probe.close()
    other.close()


@pytest.mark.parametrize("hello", [
    {"rank": "x"}, {"rank": None}, {"rank": -1}, {"rank": 1.5}, {"rank": True},
    {"rank": 0, "pid": "1"}, {"rank": 0, "host": ["a"]}, {"rank": 0, "host": "h" * 300},
    {"rank": 0, "token": 5}, {"rank": 0, "token": "\udcff"},
])
def test_a_malformed_hello_is_refused(monitor: Monitor, hello: dict[str, object]) -> None:
    # Finding 3: a hello whose rank is not a number ended the thread (int("x")).
    probe = _dial(monitor)
    line = _hello(monitor, **{"rank": 0} | hello)
    probe.sendall(line)
    assert _closed_by_peer(probe, 5.0)
    probe.close()
    assert monitor.ranks() == {}
    agent = _joins(monitor, 0)
    agent.close()


def test_a_second_hello_cannot_take_over_a_ranks_channel(monitor: Monitor) -> None:
    # Finding 2's second half: a hello for rank 1 replaced rank 1's abort channel.
    orders: list[tuple[str, int]] = []
    agent = Agent.from_env(1, monitor.env(), on_abort=lambda r, c: orders.append((r, c)))
    assert agent is not None
    agent.connect(timeout=5.0)
    agent.start()
    _events(monitor, lambda seen: any(e.kind == "joined" for e in seen))
    probe = _dial(monitor)
    probe.sendall(_hello(monitor, 1) + b'{"t":"exit","code":3}\n')
    assert _closed_by_peer(probe, 5.0)
    probe.close()
    assert monitor.abort("the launcher's own order", code=4) == [1]
    end = time.monotonic() + 5
    while not orders and time.monotonic() < end:
        time.sleep(0.02)
    assert orders == [("the launcher's own order", 4)]
    assert not [e for e in monitor.events() if e.kind == "exited"]
    agent.close()


def test_unauthenticated_connections_are_bounded() -> None:
    # Finding 4: 300 idle connections held 300 descriptors; 1 MiB without a newline was kept.
    mon = Monitor("127.0.0.1", beat_s=0.1, timeout_s=5.0, hello_timeout_s=30.0)
    mon.start()
    probes: list[socket.socket] = []
    try:
        long_line = _dial(mon)
        long_line.sendall(b"x" * (2 * MAX_HELLO))  # no newline: not a hello, whatever follows
        assert _closed_by_peer(long_line, 5.0)
        long_line.close()
        probes = [_dial(mon) for _ in range(MAX_PENDING + 40)]
        end = time.monotonic() + 5.0
        while True:  # the monitor closes the oldest beyond MAX_PENDING: EOF makes them readable
            readable = select.select(probes, [], [], 0.1)[0]
            if len(readable) >= 40 or time.monotonic() > end:
                break
        closed = sum(_closed_by_peer(p, 1.0) for p in readable)
        assert closed >= 40, f"only {closed} of {len(probes)} idle connections were closed"
        agent = _joins(mon, 0)  # a rank that says hello at once still gets in
        assert mon.running() == [0]
        agent.close()
    finally:
        for p in probes:
            p.close()
        mon.close()


def test_a_connection_without_a_hello_is_closed_after_the_hello_deadline() -> None:
    mon = Monitor("127.0.0.1", beat_s=0.1, timeout_s=30.0, hello_timeout_s=0.5)
    mon.start()
    try:
        probe = _dial(mon)
        probe.sendall(b'{"t": "beat"')  # a line never finished
        start = time.monotonic()
        assert _closed_by_peer(probe, 10.0)
        assert 0.4 <= time.monotonic() - start < 5.0
        probe.close()
    finally:
        mon.close()


def test_the_token_is_compared_in_constant_time(monitor: Monitor,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Finding 8: the token was compared with "!=", whose time depends on the common prefix.
    compared: list[tuple[bytes, bytes]] = []
    real = monitor_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(monitor_module.hmac, "compare_digest", spy)
    agent = _joins(monitor, 0)
    assert compared == [(monitor.token.encode(), monitor.token.encode())]
    agent.close()


# -- a rank's user code cannot speak for the wrapper -----------------------------------------

_RANK = r"""
import os, sys, time
from hvdlite._rankside import watchdog
assert watchdog.start()
refused = []
for kind in ("exit", "abort", "hello", "beat", "orphaned", "failing"):
    try:
        watchdog.send({"t": kind, "code": 3, "rank": 7, "token": "x"})
    except ValueError as exc:
        refused.append(kind)
        assert "reserved" in str(exc), exc
print(",".join(refused), flush=True)
fd = int(os.environ["HVDLITE_WATCHDOG_FD"])
# Straight to the socket, past watchdog.send: the wrapper relays none of these.
os.write(fd, b'{"t":"exit","code":3}\n{"t":"orphaned"}\n{"t":"abort","code":5}\n'
             b'{"t":"hello","rank":7}\n{"t":"failing","code":"9"}\n' + b"[" * 5000 + b"\n")
assert watchdog.send({"t": "done"})
time.sleep(0.5)
"""


def test_reserved_types_from_user_code_are_refused(tmp_path: Path) -> None:
    # Finding 3: watchdog.send({"t": "exit", "code": 3}) reached the launcher as an exit report.
    mon = Monitor("127.0.0.1", beat_s=0.2, timeout_s=10.0)
    mon.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "PMI_"))}
    env |= mon.env() | {"PMI_RANK": "0", "PYTHONPATH": str(REPO)}
    wrapper = Path(_rankwrap.__file__).resolve()
    proc = subprocess.Popen([sys.executable, "-I", str(wrapper), sys.executable, "-c", _RANK],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
        events = _events(mon, lambda seen: any(e.kind == "exited" for e in seen), 10.0)
    finally:
        proc.kill()
        mon.close()
    assert proc.returncode == 0, err
    assert out.split() == ["exit,abort,hello,beat,orphaned,failing"]
    assert [(e.kind, e.payload.get("t")) for e in events if e.kind in ("message", "exited",
                                                                       "lost")] \
        == [("message", "done"), ("exited", "exit")], events
    assert [e.code for e in events if e.kind == "exited"] == [0]
