"""The launcher <-> rank control channel: heartbeats, exit reports, lost ranks and hosts.

One TCP connection per rank, from an :class:`Agent` on the rank's host (``hvdliterun`` runs
one in each rank wrapper) to the :class:`Monitor` in the launcher. Both sides send a heartbeat
every ``beat_s``; both sides give up on the other after ``timeout_s`` of silence. So:

- a host whose processes are all killed: its connections close without an exit report, and
  the monitor reports its ranks ``lost`` at once (the kernel closes the sockets);
- a host cut off (link down, host hung): no heartbeat; the monitor reports its ranks ``lost``
  after ``timeout_s``, and on the cut-off host each agent reports the launcher lost after the
  same time (``Agent(on_lost=...)``), so the ranks there end too;
- a rank that ends: its agent sends an ``exit`` report (code, whether it was signalled);
- a rank whose agent is killed while the host lives on (the MPI launcher tearing the job down
  after another host was lost): the rank's guard process, which holds a copy of the agent's
  connection, sends ``orphaned``, and the monitor reports the rank ``lost`` with
  ``Event.alive`` set: its host still answers, so it is not the host that was lost.

Messages are JSON objects, one per line, each with a type ``"t"``. Reserved types: ``hello``
(agent -> monitor, first message: token, rank, host, pid), ``beat`` (both ways), ``exit``
(agent -> monitor), ``orphaned`` (the rank's guard -> monitor, see above), ``abort``
(monitor -> agent: ``reason``, ``code``). Any other type is a
user message, delivered as it is: :meth:`Monitor.send` / :meth:`Monitor.broadcast` to agents
(``on_message``), :meth:`Agent.send` to the monitor (an :class:`Event` of kind ``message``).
That is the hook for more launcher-side control (elastic training's re-rendezvous, say). Under
``hvdliterun`` the agent lives in the rank wrapper, which relays user messages to and from the
rank process itself (``hvdlite._rankside.watchdog.send`` / ``subscribe``).

The monitor's address and a random token travel to the ranks in the environment
(:meth:`Monitor.env`; :meth:`Agent.from_env` reads them back). A connection whose first line
does not carry the token is dropped.

Standard library only, and no hvdlite import: the rank wrapper runs in isolated mode and
loads this file by path. Thread-safety: every public method of both classes may be called
from any thread; callbacks and events come from each object's own thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENV_ADDR", "ENV_BEAT", "ENV_TIMEOUT", "ENV_TOKEN", "ORPHANED_LINE", "Agent", "Event",
           "Monitor", "RankState", "group_by_host"]

ENV_ADDR = "HVDLITE_MONITOR_ADDR"  # host:port of the monitor
ENV_TOKEN = "HVDLITE_MONITOR_TOKEN"
ENV_BEAT = "HVDLITE_MONITOR_BEAT_S"
ENV_TIMEOUT = "HVDLITE_MONITOR_TIMEOUT_S"

DEFAULT_BEAT_S = 1.0
DEFAULT_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 2.0  # a send that cannot go out in this long means the peer is gone
MAX_LINE = 1 << 20  # a longer line is a protocol error: the connection is dropped
# The line a rank's guard sends on the agent's connection when the agent's process was killed
# while the rank still ran (its host is alive). A newline first ends any line cut short.
ORPHANED_LINE = b'\n{"t":"orphaned"}\n'
CLOSED_REASON = "its connection to hvdliterun closed without an exit report"
ORPHANED_REASON = ("its wrapper was killed while the rank ran (the MPI launcher ending the job; "
                   "the host still answers)")


def _line(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _send(sock: socket.socket, lock: threading.Lock, message: Mapping[str, Any]) -> bool:
    data = _line(message)
    with lock:  # the socket's timeout is SEND_TIMEOUT_S; reads wait in select, not in recv
        try:
            sock.sendall(data)
            return True
        except OSError:
            return False


class _Lines:
    """Splits a byte stream into JSON objects (one per line)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        if len(self._buf) > MAX_LINE and b"\n" not in self._buf:
            raise ValueError("line too long")
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for raw in lines:
            if raw.strip():
                msg = json.loads(raw)
                if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
                    raise ValueError(f"not a message: {raw[:80]!r}")
                out.append(msg)
        return out


@dataclass
class RankState:
    """What the monitor knows of one rank (a snapshot from :meth:`Monitor.ranks`)."""

    rank: int
    host: str
    pid: int
    joined_at: float  # time.monotonic()
    last_seen: float  # time.monotonic() of its last message
    exit_code: int | None = None  # set by an exit report
    signalled: bool = False  # the exit came after the wrapper forwarded a signal to it
    lost: str | None = None  # why the monitor gave up on it (no exit report)


@dataclass(frozen=True)
class Event:
    """Something the monitor saw. ``kind``: ``joined``, ``exited`` (``code``), ``lost``
    (``reason``; ``silent_s``: how long the rank had not answered when it was given up, 0 when
    its connection closed; ``alive``: its host still answers, see ``orphaned``) or ``message``
    (``payload``: the agent's message)."""

    kind: str
    rank: int
    host: str
    code: int | None = None
    reason: str = ""
    payload: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.monotonic)
    silent_s: float = 0.0
    alive: bool = False


def group_by_host(states: Mapping[int, RankState] | list[RankState]) -> dict[str, list[int]]:
    """``{host: sorted ranks}`` of the given ranks, hosts in the order of their lowest rank."""
    items = states.values() if isinstance(states, Mapping) else states
    hosts: dict[str, list[int]] = {}
    for st in sorted(items, key=lambda s: s.rank):
        hosts.setdefault(st.host, []).append(st.rank)
    return hosts


@dataclass
class _Conn:
    sock: socket.socket
    lock: threading.Lock
    lines: _Lines
    opened: float
    rank: int | None = None


class Monitor:
    """The launcher's end: accepts the agents, watches their heartbeats, reports events.

    ``bind``: the address to listen on (``""`` = every interface); ``advertise``: the address
    the ranks dial (default: ``bind``, or this host's name when ``bind`` is empty). Call
    :meth:`start`, hand :meth:`env` to the ranks, read :meth:`events`, :meth:`close` at the
    end (idempotent). Never blocks the caller except :meth:`events` with a timeout.
    """

    def __init__(self, bind: str = "", advertise: str | None = None, port: int = 0, *,
                 beat_s: float = DEFAULT_BEAT_S, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if beat_s <= 0 or timeout_s <= beat_s:
            raise ValueError(f"Monitor needs 0 < beat_s < timeout_s, got beat_s={beat_s} and "
                             f"timeout_s={timeout_s}")
        self.beat_s, self.timeout_s = beat_s, timeout_s
        self.token = secrets.token_hex(16)
        self._server = socket.create_server((bind, port), backlog=256)
        self._server.setblocking(False)
        self.port = self._server.getsockname()[1]
        self.advertise = advertise or bind or socket.gethostname()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}  # by socket fd
        self._by_rank: dict[int, _Conn] = {}
        self._states: dict[int, RankState] = {}
        self._events: queue.Queue[Event] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvdlite-monitor", daemon=True)

    # -- public --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``host:port`` the agents dial."""
        return f"{self.advertise}:{self.port}"

    def env(self) -> dict[str, str]:
        """The variables an :class:`Agent` needs (:meth:`Agent.from_env`)."""
        return {ENV_ADDR: self.address, ENV_TOKEN: self.token,
                ENV_BEAT: repr(self.beat_s), ENV_TIMEOUT: repr(self.timeout_s)}

    def start(self) -> None:
        """Start the monitor's thread (accepting, reading, heartbeats, timeouts)."""
        self._thread.start()

    def events(self, timeout: float | None = 0.0) -> list[Event]:
        """Every event since the last call, oldest first; with ``timeout`` > 0, wait that long
        for the first one (``None``: until one comes)."""
        out: list[Event] = []
        try:
            if timeout is None or timeout > 0:
                out.append(self._events.get(timeout=timeout))
            while True:
                out.append(self._events.get_nowait())
        except queue.Empty:
            pass
        return out

    def ranks(self) -> dict[int, RankState]:
        """A snapshot of every rank that joined, by rank."""
        with self._lock:
            return {r: RankState(**vars(s)) for r, s in self._states.items()}

    def running(self) -> list[int]:
        """Ranks that joined and neither exited nor were lost."""
        with self._lock:
            return sorted(r for r, s in self._states.items()
                          if s.exit_code is None and s.lost is None)

    def send(self, rank: int, message: Mapping[str, Any]) -> bool:
        """Send ``message`` (a dict with a string ``"t"``) to ``rank``'s agent; False if that
        rank is not connected or the send failed."""
        with self._lock:
            conn = self._by_rank.get(rank)
        return conn is not None and _send(conn.sock, conn.lock, message)

    def broadcast(self, message: Mapping[str, Any], ranks: list[int] | None = None) -> list[int]:
        """Send ``message`` to ``ranks`` (default: every connected rank); the ranks reached."""
        with self._lock:
            targets = sorted(self._by_rank) if ranks is None else ranks
        return [r for r in targets if self.send(r, message)]

    def abort(self, reason: str, code: int = 1, ranks: list[int] | None = None) -> list[int]:
        """Tell ``ranks`` (default: all connected) to end now with ``reason`` and ``code``."""
        return self.broadcast({"t": "abort", "reason": reason, "code": code}, ranks)

    def close(self) -> None:
        """Stop the thread and close every connection (the agents see EOF)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
            self._by_rank.clear()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.close()
        with contextlib.suppress(OSError):
            self._server.close()
        with contextlib.suppress(Exception):
            self._sel.close()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=min(0.25, self.beat_s / 2)):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.beat_s
                self._beat_and_expire(now)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            sock, _ = self._server.accept()
            sock.settimeout(SEND_TIMEOUT_S)
            conn = _Conn(sock, threading.Lock(), _Lines(), time.monotonic())
            with self._lock:
                self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
            messages = conn.lines.feed(data) if data else None
        except (OSError, ValueError):
            data, messages = b"", None
        if messages is None:
            self._drop(conn, CLOSED_REASON)
            return
        for msg in messages:
            self._handle(conn, msg)

    def _handle(self, conn: _Conn, msg: dict[str, Any]) -> None:
        now = time.monotonic()
        kind = msg["t"]
        if conn.rank is None:
            if kind != "hello" or msg.get("token") != self.token:
                self._drop(conn, None)
                return
            rank, host = int(msg["rank"]), str(msg["host"])
            with self._lock:
                conn.rank = rank
                self._by_rank[rank] = conn
                self._states[rank] = RankState(rank, host, int(msg.get("pid", 0)), now, now)
            self._events.put(Event("joined", rank, host))
            return
        with self._lock:
            st = self._states[conn.rank]
            st.last_seen = now
            if kind == "exit":
                st.exit_code, st.signalled = int(msg["code"]), bool(msg.get("signalled"))
        if kind == "exit":
            self._events.put(Event("exited", st.rank, st.host, code=st.exit_code,
                                   payload=msg))
        elif kind == "orphaned":
            self._mark_lost(st, ORPHANED_REASON, alive=True)
        elif kind != "beat":
            self._events.put(Event("message", st.rank, st.host, payload=msg))

    def _mark_lost(self, st: RankState, reason: str, silent_s: float = 0.0,
                   alive: bool = False) -> None:
        """``st``'s rank is ``lost`` (once, and only without an exit report)."""
        with self._lock:
            if st.exit_code is not None or st.lost is not None:
                return
            st.lost = reason
        self._events.put(Event("lost", st.rank, st.host, reason=reason, silent_s=silent_s,
                               alive=alive))

    def _drop(self, conn: _Conn, reason: str | None, silent_s: float = 0.0) -> None:
        """Close ``conn``; a joined rank without an exit report is ``lost`` for ``reason``."""
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        with self._lock:
            self._conns = {fd: c for fd, c in self._conns.items() if c is not conn}
            st = self._states.get(conn.rank) if conn.rank is not None else None
            if conn.rank is not None and self._by_rank.get(conn.rank) is conn:
                del self._by_rank[conn.rank]
        with contextlib.suppress(OSError):
            conn.sock.close()
        if st is not None and reason:
            self._mark_lost(st, reason, silent_s)

    def _beat_and_expire(self, now: float) -> None:
        with self._lock:
            conns = list(self._conns.values())
            states = dict(self._states)
        for conn in conns:
            if conn.rank is None:
                if now - conn.opened > self.timeout_s:
                    self._drop(conn, None)  # never said hello
                continue
            silent = now - states[conn.rank].last_seen
            if silent > self.timeout_s:
                self._drop(conn, f"no heartbeat for {silent:.1f} s (network cut, host down or "
                                 "hung)", silent)
            elif not _send(conn.sock, conn.lock, {"t": "beat"}):
                self._drop(conn, "its connection to hvdliterun failed")


class Agent:
    """A rank's end: says hello, sends heartbeats and the exit report, receives orders.

    Callbacks (run on the agent's thread, each at most once except ``on_message``):
    ``on_abort(reason, code)`` when the monitor orders the rank to end; ``on_lost(reason)``
    when the monitor is silent for ``timeout_s`` or its connection breaks (the launcher is
    gone or this host is cut off); ``on_message(message)`` for any other message.
    """

    def __init__(self, address: str, token: str, rank: int, host: str | None = None, *,
                 beat_s: float = DEFAULT_BEAT_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 on_abort: Callable[[str, int], None] | None = None,
                 on_lost: Callable[[str], None] | None = None,
                 on_message: Callable[[dict[str, Any]], None] | None = None) -> None:
        host_part, _, port = address.rpartition(":")
        if not host_part or not port.isdigit():
            raise ValueError(f"monitor address must be HOST:PORT, got {address!r}")
        self.address, self._target = address, (host_part, int(port))
        self.token, self.rank = token, rank
        self.host = host or socket.gethostname()
        self.beat_s, self.timeout_s = beat_s, timeout_s
        self._on_abort, self._on_lost, self._on_message = on_abort, on_lost, on_message
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._done = False  # an exit report went out or close(): EOF is expected now
        self._thread = threading.Thread(target=self._run, name="hvdlite-agent", daemon=True)

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] = os.environ,
                 **callbacks: Any) -> Agent | None:
        """An agent for the monitor named in ``environ`` (:meth:`Monitor.env`), or None when
        the process was not started under one."""
        address, token = environ.get(ENV_ADDR), environ.get(ENV_TOKEN)
        if not address or not token:
            return None
        return cls(address, token, rank,
                   beat_s=float(environ.get(ENV_BEAT, DEFAULT_BEAT_S)),
                   timeout_s=float(environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S)), **callbacks)

    def connect(self, timeout: float = 10.0) -> None:
        """Dial the monitor and say hello; OSError if it cannot be reached in ``timeout``."""
        sock = socket.create_connection(self._target, timeout=timeout)
        sock.settimeout(SEND_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        if not _send(sock, self._send_lock, {"t": "hello", "token": self.token,
                                             "rank": self.rank, "host": self.host,
                                             "pid": os.getpid()}):
            raise OSError(f"cannot send to the hvdliterun monitor at {self.address}")

    def fileno(self) -> int:
        """The connection's file descriptor (-1 before :meth:`connect`): the rank wrapper's
        guard holds a copy, to send ``orphaned`` (:data:`ORPHANED_LINE`) should this process
        be killed while its rank runs."""
        return self._sock.fileno() if self._sock is not None else -1

    def start(self) -> None:
        """Start the thread (heartbeats out, orders in). Call after :meth:`connect`."""
        self._thread.start()

    def send(self, message: Mapping[str, Any]) -> bool:
        """Send a message (a dict with a string ``"t"``) to the monitor; False if it failed."""
        return self._sock is not None and _send(self._sock, self._send_lock, message)

    def report_exit(self, code: int, signalled: bool = False) -> bool:
        """Tell the monitor this rank ended with ``code`` (negative: killed by that signal)."""
        self._done = True
        return self.send({"t": "exit", "code": code, "signalled": signalled})

    def close(self) -> None:
        """Stop the thread and close the connection (idempotent)."""
        self._done = True
        self._stop.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        sock = self._sock
        if sock is None:
            return
        lines = _Lines()
        last_heard = next_beat = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.beat_s
                if not self.send({"t": "beat"}):
                    return self._lost(f"cannot reach hvdliterun's monitor at {self.address}")
            if now - last_heard > self.timeout_s:
                return self._lost(f"no heartbeat from hvdliterun at {self.address} for "
                                  f"{now - last_heard:.1f} s (this host cut off from the "
                                  "launcher's, or the launcher hung)")
            try:
                if not select.select([sock], [], [], max(0.05, min(next_beat - now, 0.25)))[0]:
                    continue
                data = sock.recv(65536)
            except (OSError, ValueError):
                data = b""
            if not data:
                return self._lost(f"hvdliterun's monitor at {self.address} closed the "
                                  "connection (the launcher ended)")
            last_heard = time.monotonic()
            try:
                messages = lines.feed(data)
            except ValueError:
                return self._lost(f"garbled message from hvdliterun at {self.address}")
            for msg in messages:
                if msg["t"] == "abort":
                    self._done = True
                    if self._on_abort is not None:
                        self._on_abort(str(msg.get("reason", "")), int(msg.get("code", 1)))
                elif msg["t"] != "beat" and self._on_message is not None:
                    self._on_message(msg)

    def _lost(self, reason: str) -> None:
        if not self._done and not self._stop.is_set() and self._on_lost is not None:
            self._on_lost(reason)
