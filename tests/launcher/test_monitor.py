"""The launcher <-> rank control channel (hvdlite/launcher/monitor.py) over real TCP sockets."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jobs_util import REPO

from hvdlite.launcher import rankwrap as _rankwrap
from hvdlite.launcher.monitor import Agent, Event, Monitor, group_by_host


def _wait_for(monitor: Monitor, kind: str, timeout: float = 10.0) -> list[Event]:
    seen: list[Event] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        seen += monitor.events(timeout=0.1)
        if any(e.kind == kind for e in seen):
            return seen
    raise AssertionError(f"no {kind!r} event in {timeout} s; saw {seen}")


@pytest.fixture
def monitor() -> Monitor:
    mon = Monitor("127.0.0.1", beat_s=0.1, timeout_s=0.8)
    mon.start()
    yield mon
    mon.close()


def _agent(mon: Monitor, rank: int, host: str, **callbacks: object) -> Agent:
    agent = Agent.from_env(rank, mon.env(), **callbacks)
    assert agent is not None
    agent.host = host
    agent.connect(timeout=5.0)
    return agent


def test_join_exit_and_messages(monitor: Monitor) -> None:
    got: list[dict[str, object]] = []
    agents = [_agent(monitor, r, f"h{r // 2}", on_message=got.append) for r in range(4)]
    for a in agents:
        a.start()
    end = time.monotonic() + 10
    while len(monitor.ranks()) < 4 and time.monotonic() < end:
        time.sleep(0.02)
    assert group_by_host(monitor.ranks()) == {"h0": [0, 1], "h1": [2, 3]}
    assert monitor.running() == [0, 1, 2, 3]
    assert agents[1].send({"t": "custom", "x": 7})
    events = _wait_for(monitor, "message")
    msg = [e for e in events if e.kind == "message"][0]
    assert (msg.rank, msg.host, msg.payload["x"]) == (1, "h0", 7)
    assert monitor.send(3, {"t": "hello-rank", "n": 3})
    end = time.monotonic() + 5
    while not got and time.monotonic() < end:
        time.sleep(0.02)
    assert got == [{"t": "hello-rank", "n": 3}]
    agents[2].report_exit(5)
    agents[2].close()
    exited = [e for e in _wait_for(monitor, "exited") if e.kind == "exited"]
    assert (exited[0].rank, exited[0].code) == (2, 5)
    time.sleep(0.3)  # the close after an exit report is not a loss
    assert not [e for e in monitor.events() if e.kind == "lost"]
    assert monitor.running() == [0, 1, 3]
    for a in agents:
        a.close()


def test_closed_connection_is_lost_at_once(monitor: Monitor) -> None:
    agent = _agent(monitor, 0, "hx")
    agent.start()
    _wait_for(monitor, "joined")
    start = time.monotonic()
    agent.close()  # no exit report: as if the host's processes were killed
    lost = [e for e in _wait_for(monitor, "lost") if e.kind == "lost"][0]
    assert time.monotonic() - start < 0.7  # sooner than the heartbeat timeout
    assert (lost.rank, lost.host) == (0, "hx")
    assert "closed without an exit report" in lost.reason


def test_silent_rank_is_lost_after_the_timeout(monitor: Monitor) -> None:
    # Connected, said hello, then silent (never started: no heartbeats), like a host whose
    # link went down: nothing closes the connection, only the timeout notices.
    agent = _agent(monitor, 1, "hy")
    _wait_for(monitor, "joined")
    start = time.monotonic()
    lost = [e for e in _wait_for(monitor, "lost", timeout=5) if e.kind == "lost"][0]
    assert 0.7 <= time.monotonic() - start < 3.0
    assert "no heartbeat" in lost.reason and lost.rank == 1
    agent.close()


def test_abort_reaches_the_agent(monitor: Monitor) -> None:
    orders: list[tuple[str, int]] = []
    done = threading.Event()

    def on_abort(reason: str, code: int) -> None:
        orders.append((reason, code))
        done.set()

    agent = _agent(monitor, 0, "hz", on_abort=on_abort)
    agent.start()
    _wait_for(monitor, "joined")
    assert monitor.abort("host n2 lost", code=3) == [0]
    assert done.wait(5)
    assert orders == [("host n2 lost", 3)]
    agent.close()


def test_agent_notices_a_silent_or_gone_monitor() -> None:
    # A monitor that accepts but never answers: the agent gives up after its timeout.
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    lost: list[str] = []
    done = threading.Event()

    def on_lost(reason: str) -> None:
        lost.append(reason)
        done.set()

    agent = Agent(f"127.0.0.1:{port}", "t", 0, beat_s=0.1, timeout_s=0.6, on_lost=on_lost)
    agent.connect(timeout=5)
    peer, _ = server.accept()
    start = time.monotonic()
    agent.start()
    assert done.wait(5)
    assert 0.5 <= time.monotonic() - start < 3.0
    assert "no heartbeat from hvdliterun" in lost[0]
    agent.close()
    peer.close()
    server.close()


def test_wrong_token_is_dropped(monitor: Monitor) -> None:
    env = monitor.env() | {"HVDLITE_MONITOR_TOKEN": "wrong"}
    agent = Agent.from_env(0, env)
    assert agent is not None
    agent.connect(timeout=5)
    agent.start()
    time.sleep(0.4)
    assert monitor.ranks() == {}
    assert not [e for e in monitor.events() if e.kind in ("joined", "lost")]
    agent.close()


def test_from_env_without_a_monitor() -> None:
    assert Agent.from_env(0, {}) is None
    with pytest.raises(ValueError, match="HOST:PORT"):
        Agent("nowhere", "t", 0)
    with pytest.raises(ValueError, match="beat_s"):
        Monitor("127.0.0.1", beat_s=1.0, timeout_s=0.5)


# -- the whole chain: monitor <-> rank wrapper (a real process) <-> the rank's watchdog --------

_RANK = r"""
import json, os, sys, threading, time
from hvdlite._rankside import watchdog


class Timeline:  # "linger": writing the timeline takes the rank's last second, then a mark
    def close(self, timeout=None):
        time.sleep(1.0)
        # Written whole or not at all: the SIGTERM handler and the watchdog may both close a
        # timeline, and the first to end the process may cut the other's write short.
        part = f"{sys.argv[2]}.{threading.get_ident()}"
        with open(part, "w") as f:  # the rank ended by itself
            f.write("ended")
        os.replace(part, sys.argv[2])


got, box = threading.Event(), []
watchdog.subscribe(lambda m: (box.append(m), got.set()))
if sys.argv[1] == "linger":  # open: what the watchdog's end closes
    from hvdlite._observe import signals
    signals.LIVE.add(Timeline())
assert watchdog.start()
if sys.argv[1] == "linger":  # its wrapper's death: SIGTERM (as hvdlite's signal hook, the
    import signal            # timeline written), or the watchdog, whichever comes first;
    # installed before the ping, after which the test may kill the wrapper at once
    signal.signal(signal.SIGTERM, lambda *_: (Timeline().close(), sys.exit(0)))
assert watchdog.send({"t": "ping", "from": "rank"})
if sys.argv[1] == "talk":
    assert got.wait(20)
    print(json.dumps(box[0]), flush=True)
elif sys.argv[1] == "linger":
    time.sleep(600)
else:
    time.sleep(600)  # blocked outside Python (as in an MPI call): only the watchdog can end it
"""


@pytest.fixture
def patient() -> Monitor:
    """A monitor that gives a loaded machine's processes 10 s of silence."""
    mon = Monitor("127.0.0.1", beat_s=0.2, timeout_s=10.0)
    mon.start()
    yield mon
    mon.close()


def _wrapped_rank(monitor: Monitor, mode: str, *args: str) -> subprocess.Popen[str]:
    wrapper = Path(_rankwrap.__file__).resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "PMI_"))}
    env |= monitor.env() | {"PMI_RANK": "0", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-I", str(wrapper), sys.executable, "-c", _RANK,
                             mode, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_messages_both_ways_through_the_rank_wrapper(patient: Monitor) -> None:
    monitor = patient
    proc = _wrapped_rank(monitor, "talk")
    try:
        events = _wait_for(monitor, "message", timeout=30)
        ping = [e for e in events if e.kind == "message"][0]
        assert (ping.rank, ping.payload) == (0, {"t": "ping", "from": "rank"})
        assert monitor.send(0, {"t": "pong", "n": 1})
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out) == {"t": "pong", "n": 1}
    exited = [e for e in _wait_for(monitor, "exited") if e.kind == "exited"]
    assert exited[0].code == 0


def test_abort_ends_a_rank_blocked_outside_python(patient: Monitor) -> None:
    monitor = patient
    proc = _wrapped_rank(monitor, "block")
    try:
        _wait_for(monitor, "message", timeout=30)  # the rank's watchdog runs
        start = time.monotonic()
        assert monitor.abort("host n9 (ranks 4, 5) lost: test", code=5) == [0]
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - start < 3.0  # the watchdog, not the wrapper's SIGTERM at 4 s
    assert proc.returncode == 5, err
    assert ("[hvdlite rank 0] host n9 (ranks 4, 5) lost: test; this rank ends now (its "
            "timeline is written)") in err


def test_a_killed_wrapper_is_a_teardown_not_a_lost_host(patient: Monitor) -> None:
    # The MPI launcher kills the wrappers of the hosts that live on when it ends a job: the
    # rank's guard, which holds a copy of the wrapper's connection, says so (alive), at once.
    monitor = patient
    proc = _wrapped_rank(monitor, "block")
    try:
        _wait_for(monitor, "message", timeout=30)  # the rank runs
        start = time.monotonic()
        proc.kill()
        events = _wait_for(monitor, "lost", timeout=5)
    finally:
        proc.kill()
        proc.communicate()
    lost = [e for e in events if e.kind == "lost"][0]
    assert time.monotonic() - start < 2.0
    assert (lost.rank, lost.alive, lost.silent_s) == (0, True, 0.0), lost
    assert lost.reason.startswith("its wrapper was killed while the rank ran"), lost
    assert monitor.running() == []


def test_a_rank_whose_wrapper_was_killed_stays_connected_until_it_ended(
        patient: Monitor, tmp_path: Path) -> None:
    # hvdliterun waits on the monitor's open connections before it returns: a rank on another
    # host whose wrapper the MPI launcher killed still writes its timeline (no live marker of
    # it reaches the launcher's host). Its guard holds the connection until the rank ended.
    monitor = patient
    mark = tmp_path / "ended"
    proc = _wrapped_rank(monitor, "linger", str(mark))
    try:
        _wait_for(monitor, "message", timeout=30)
        assert monitor.connected() == [0]
        proc.kill()
        _wait_for(monitor, "lost", timeout=5)
        assert monitor.running() == [] and monitor.connected() == [0]  # the rank lingers
        assert not mark.exists()
        _wait_until(lambda: monitor.connected() == [])
    finally:
        proc.kill()
        proc.communicate()
    # Released once the rank had finished its last work and ended (it writes the mark last; a
    # connection dropped with the wrapper would have closed before it).
    assert mark.read_text() == "ended"


def test_verdict_names_the_host_that_went_alone(monitor: Monitor) -> None:
    # Host "hb" closes (killed); host "ha"'s wrappers are then killed by the MPI launcher,
    # their guards say so: only "hb" is named. Then host "hc" goes silent: it stopped answering.
    from hvdlite.launcher.verdict import Verdict

    agents = [_agent(monitor, r, h) for r, h in enumerate(["ha", "ha", "hb", "hb", "hc"])]
    for a in agents:
        a.start()
    _wait_until(lambda: len(monitor.ranks()) == 5)
    verdict = Verdict(monitor, "head", gather_s=0.3)
    for a in agents[2:4]:
        a.close()
    for a in agents[:2]:
        assert a.send({"t": "orphaned"})
    _wait_until(lambda: (verdict.poll(), verdict.loss(time.monotonic()))[1] is not None)
    assert verdict.lost_host == ("host hb (ranks 2, 3) lost: its connection to hvdliterun "
                                 "closed without an exit report"), verdict.lost_host
    assert verdict.lost_ranks == [2, 3]
    silent = Verdict(monitor, "head", gather_s=0.3)
    agents[4]._stop.set()  # its heartbeats stop; the connection stays open
    _wait_until(lambda: (silent.poll(), silent.loss(time.monotonic()))[1] is not None)
    assert re.fullmatch(r"host hc \(rank 4\) stopped answering: no heartbeat for \d\.\d s "
                        r"\(network cut, host down or hung\)", silent.lost_host or ""), \
        silent.lost_host
    for a in agents:
        a.close()


def test_verdict_names_a_cut_off_host_whose_ranks_fell_silent_apart(monitor: Monitor) -> None:
    # A cut-off host's ranks are each found silent a timeout after their own last heartbeat:
    # here 0.7 s apart, more than the window of one event (0.5 s), within the gathering. The
    # verdict names the host with both ranks, not its first rank alone (a suite run on a
    # loaded VM named "rank 2 on host n2" for a cut-off host of ranks 2 and 3).
    from hvdlite.launcher.verdict import Verdict

    agents = [_agent(monitor, r, h) for r, h in enumerate(["ha", "hd", "hd"])]
    for a in agents:
        a.start()
    _wait_until(lambda: len(monitor.ranks()) == 3)
    verdict = Verdict(monitor, "head", gather_s=1.5)
    agents[1]._stop.set()
    time.sleep(0.7)
    agents[2]._stop.set()
    _wait_until(lambda: (verdict.poll(), verdict.loss(time.monotonic()))[1] is not None)
    assert re.fullmatch(r"host hd \(ranks 1, 2\) stopped answering: no heartbeat for \d\.\d s "
                        r"\(network cut, host down or hung\)", verdict.lost_host or ""), \
        verdict.lost_host
    assert verdict.lost_ranks == [1, 2]
    for a in agents:
        a.close()


def _wait_until(ok: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not ok():  # type: ignore[operator]
        assert time.monotonic() < end, "not within the time"
        time.sleep(0.02)


def test_a_wrapper_killed_by_hand_is_named(tmp_path: Path) -> None:
    # Rank 1's wrapper SIGKILLed (by hand, by the OOM killer): no failure report, no lost
    # host (its guard says the host answers); hvdliterun names the rank.
    script = tmp_path / "forever.py"
    script.write_text(
        "import os, sys, time, numpy as np, hvdlite as hvd\n"
        "hvd.init()\n"
        "p = f'{sys.argv[1]}/wrapper-{hvd.rank()}'\n"
        "open(p + '.tmp', 'w').write(str(os.getppid()))\n"
        "os.replace(p + '.tmp', p)  # whole when it appears: the test reads it at once\n"
        "while True:\n"
        "    hvd.allreduce(np.ones(4), name='s'); time.sleep(0.01)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "PMI_"))}
    proc = subprocess.Popen([sys.executable, "-m", "hvdlite.run", "-np", "2", "--",
                             sys.executable, str(script), str(tmp_path)], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_until(lambda: (tmp_path / "wrapper-1").exists() or proc.poll() is not None, 60)
        os.kill(int((tmp_path / "wrapper-1").read_text()), 9)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode not in (0, None), err
    assert ("hvdliterun: rank 1 (host " + socket.gethostname() + "): its rank wrapper was "
            "killed while the rank ran; the job of 2 ranks was ended") in err, err
