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

Messages are JSON objects, one per line, each with a type ``"t"``. Reserved types
(:data:`RESERVED_TYPES`): ``hello`` (agent -> monitor, first message: token, rank, host, pid),
``beat`` (both ways), ``exit`` (agent -> monitor: ``code``, ``signalled``), ``orphaned`` (the
rank's guard -> monitor, see above), ``abort`` (monitor -> agent: ``reason``, ``code``). Any
other type is a user message, delivered as it is: :meth:`Monitor.send` /
:meth:`Monitor.broadcast` to agents (``on_message``), :meth:`Agent.send` to the monitor (an
:class:`Event` of kind ``message``).
That is the hook for more launcher-side control (elastic training's re-rendezvous, say). Under
``hvdliterun`` the agent lives in the rank wrapper, which relays user messages to and from the
rank process itself (``hvdlite._rankside.watchdog.send`` / ``subscribe``).

The monitor's address and a random token travel to the ranks in the environment
(:meth:`Monitor.env`; :meth:`Agent.from_env` reads them back), never on a command line. The
monitor's port is open to whoever can reach it (on a multi-host job, the hosts' network), so
it trusts nothing before the token: a first line longer than :data:`MAX_HELLO` bytes, a hello
later than ``hello_timeout_s``, a wrong token (compared in constant time), a malformed hello
or a second hello for a rank that already joined each drop that connection and nothing else;
at most :data:`MAX_PENDING` connections wait for their hello (a new one beyond that pushes out
the oldest). After the hello, a malformed message (not JSON, no string ``"t"``, an ``exit``
without an integer ``code``) drops that rank's connection, which reports the rank ``lost``.
No bytes from anyone end the monitor's thread. See docs/security.md.

Standard library only, and no hvdlite import: the rank wrapper runs in isolated mode and
loads this file by path. Thread-safety: every public method of both classes may be called
from any thread; callbacks and events come from each object's own thread.
"""

from __future__ import annotations

import contextlib
import hmac
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

__all__ = ["ENV_ADDR", "ENV_BEAT", "ENV_TIMEOUT", "ENV_TOKEN", "MAX_HELLO", "MAX_PENDING",
           "ORPHANED_LINE", "RESERVED_TYPES", "Agent", "Event", "Monitor", "RankState",
           "group_by_host"]

ENV_ADDR = "HVDLITE_MONITOR_ADDR"  # host:port of the monitor
ENV_TOKEN = "HVDLITE_MONITOR_TOKEN"
ENV_BEAT = "HVDLITE_MONITOR_BEAT_S"
ENV_TIMEOUT = "HVDLITE_MONITOR_TIMEOUT_S"

DEFAULT_BEAT_S = 1.0
DEFAULT_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 2.0  # a send that cannot go out in this long means the peer is gone
MAX_LINE = 1 << 20  # a longer line is a protocol error: the connection is dropped
# Before the token: a hello is about 150 bytes (a 253-byte host name at most), so a longer
# first line is not one; connections that have not said hello, at most this many, for at most
# hello_timeout_s. Together they bound what an outsider holds of the launcher (about 64 x 4 KiB
# and 64 descriptors).
MAX_HELLO = 4096
MAX_PENDING = 64
HELLO_TIMEOUT_S = 10.0
MAX_HOST = 255
_INT_LIMIT = 1 << 31  # ranks, pids and exit codes are C ints
# The channel's own message types: never a user message (hvdlite._rankside.protocol keeps the
# rank side's list, a superset; the rank wrapper and watchdog.send refuse them from user code).
RESERVED_TYPES = frozenset({"hello", "beat", "exit", "orphaned", "abort"})
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
    """Splits a byte stream into lines; a line still open past ``limit`` bytes is an error."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self._buf = b""
        self.limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        """The complete, non-blank lines ``data`` ends (without their newline); ValueError
        when the line still open is longer than ``limit``."""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > self.limit:
            raise ValueError(f"a line longer than {self.limit} bytes")
        return [raw for raw in lines if raw.strip()]


def _message(raw: bytes) -> dict[str, Any]:
    """One line as a message (a JSON object with a string ``"t"``); ValueError otherwise."""
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested deep
        raise ValueError(f"not JSON: {raw[:80]!r}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ValueError(f"not a message: {raw[:80]!r}")
    return msg


def _int(value: object) -> int | None:
    """``value`` if it is an int (not a bool) of a C int's range, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and -_INT_LIMIT <= value < _INT_LIMIT:
        return value
    return None


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


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    fd: int
    lock: threading.Lock
    lines: _Lines
    opened: float
    rank: int | None = None
    closed: bool = False


class Monitor:
    """The launcher's end: accepts the agents, watches their heartbeats, reports events.

    ``bind``: the address to listen on (``""`` = every interface); ``advertise``: the address
    the ranks dial (default: ``bind``, or this host's name when ``bind`` is empty). Call
    :meth:`start`, hand :meth:`env` to the ranks, read :meth:`events`, :meth:`close` at the
    end (idempotent). Never blocks the caller except :meth:`events` with a timeout.
    ``hello_timeout_s``: how long a connection may take to say hello.
    """

    def __init__(self, bind: str = "", advertise: str | None = None, port: int = 0, *,
                 beat_s: float = DEFAULT_BEAT_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                 hello_timeout_s: float = HELLO_TIMEOUT_S) -> None:
        if not 0 < beat_s < timeout_s < float("inf"):
            raise ValueError(f"Monitor needs 0 < beat_s < timeout_s (finite), got beat_s="
                             f"{beat_s} and timeout_s={timeout_s}")
        if not 0 < hello_timeout_s < float("inf"):
            raise ValueError(f"Monitor needs hello_timeout_s > 0 (finite), got "
                             f"{hello_timeout_s}")
        self.beat_s, self.timeout_s = beat_s, timeout_s
        self.hello_timeout_s = hello_timeout_s
        self.token = secrets.token_hex(16)
        self._server = socket.create_server((bind, port), backlog=256)
        self._server.setblocking(False)
        self.port = self._server.getsockname()[1]
        self.advertise = advertise or bind or socket.gethostname()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}  # by socket fd
        self._pending: dict[int, _Conn] = {}  # not said hello yet, oldest first (by fd)
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

    def connected(self) -> list[int]:
        """Ranks whose connection is open. A rank reported ``lost`` because its agent was killed
        (``orphaned``) stays here while it runs on: its guard holds the connection until the
        rank's program has ended (written its timeline, say)."""
        with self._lock:
            return sorted(self._by_rank)

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
            self._pending.clear()
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
        try:
            sock, _ = self._server.accept()
        except OSError:  # BlockingIOError: another accept took it; EMFILE: the next select
            return
        sock.settimeout(SEND_TIMEOUT_S)
        conn = _Conn(sock, sock.fileno(), threading.Lock(), _Lines(MAX_HELLO), time.monotonic())
        with self._lock:
            oldest = next(iter(self._pending.values())) if len(self._pending) >= MAX_PENDING \
                else None
        if oldest is not None:
            self._drop(oldest, None)
        with self._lock:
            self._conns[conn.fd] = conn
            self._pending[conn.fd] = conn
        try:
            self._sel.register(sock, selectors.EVENT_READ, conn)
        except (OSError, ValueError):
            self._drop(conn, None)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._drop(conn, CLOSED_REASON)
            return
        try:
            for raw in conn.lines.feed(data):
                if conn.rank is None:
                    if len(raw) > MAX_HELLO or not self._hello(conn, _message(raw)):
                        self._drop(conn, None)
                        return
                    conn.lines.limit = MAX_LINE
                elif len(raw) > MAX_LINE:
                    raise ValueError(f"a line longer than {MAX_LINE} bytes")
                else:
                    self._handle(conn, _message(raw))
                if conn.closed:
                    return
        except Exception as exc:  # noqa: BLE001 -- any bytes from anyone: only this one goes
            self._drop(conn, f"its connection to hvdliterun sent a malformed message ({exc})"
                       if conn.rank is not None else None)

    def _hello(self, conn: _Conn, msg: dict[str, Any]) -> bool:
        """Admit ``conn`` as the rank its hello names; False for anything but a well-formed
        hello with the token, of a rank not seen before."""
        token, host = msg.get("token"), msg.get("host")
        rank, pid = _int(msg.get("rank")), _int(msg.get("pid", 0))
        if msg["t"] != "hello" or not isinstance(token, str) or not hmac.compare_digest(
                token.encode("utf-8", "replace"), self.token.encode()):
            return False
        if rank is None or rank < 0 or pid is None or not isinstance(host, str) \
                or not 0 < len(host) <= MAX_HOST:
            return False
        now = time.monotonic()
        with self._lock:
            if rank in self._states or conn.closed:  # a rank says hello once
                return False
            self._pending.pop(conn.fd, None)
            conn.rank = rank
            self._by_rank[rank] = conn
            self._states[rank] = RankState(rank, host, pid, now, now)
        self._events.put(Event("joined", rank, host))
        return True

    def _handle(self, conn: _Conn, msg: dict[str, Any]) -> None:
        now = time.monotonic()
        kind = msg["t"]
        code = _int(msg.get("code")) if kind == "exit" else None
        if kind == "exit" and (code is None or not isinstance(msg.get("signalled", False), bool)):
            raise ValueError(f"an exit report needs an integer code, got {msg!r:.120}")
        with self._lock:
            st = self._states[conn.rank] if conn.rank is not None else None
            if st is None:
                return
            st.last_seen = now
            if kind == "exit":
                st.exit_code, st.signalled = code, bool(msg.get("signalled"))
        if kind == "exit":
            self._events.put(Event("exited", st.rank, st.host, code=code, payload=msg))
        elif kind == "orphaned":
            self._mark_lost(st, ORPHANED_REASON, alive=True)
        elif kind not in RESERVED_TYPES:
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
            conn.closed = True
            if self._conns.get(conn.fd) is conn:
                del self._conns[conn.fd]
            if self._pending.get(conn.fd) is conn:
                del self._pending[conn.fd]
            st = self._states.get(conn.rank) if conn.rank is not None else None
            if conn.rank is not None and self._by_rank.get(conn.rank) is conn:
                del self._by_rank[conn.rank]
        with contextlib.suppress(OSError):
            conn.sock.close()
        if st is not None and reason:
            self._mark_lost(st, reason, silent_s)

    def _beat_and_expire(self, now: float) -> None:
        with self._lock:
            conns = [c for c in self._conns.values() if c.rank is not None]
            pending = list(self._pending.values())
            states = dict(self._states)
        for conn in pending:  # oldest first
            if now - conn.opened <= self.hello_timeout_s:
                break
            self._drop(conn, None)  # never said hello
        for conn in conns:
            st = states.get(conn.rank) if conn.rank is not None else None
            if st is None:
                continue
            silent = now - st.last_seen
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
                messages = [_message(raw) for raw in lines.feed(data)]
            except ValueError:
                return self._lost(f"garbled message from hvdliterun at {self.address}")
            for msg in messages:
                if msg["t"] == "abort":
                    self._done = True
                    code = _int(msg.get("code", 1))
                    if self._on_abort is not None:
                        self._on_abort(str(msg.get("reason", "")), 1 if code is None else code)
                elif msg["t"] not in RESERVED_TYPES and self._on_message is not None:
                    self._on_message(msg)

    def _lost(self, reason: str) -> None:
        if not self._done and not self._stop.is_set() and self._on_lost is not None:
            self._on_lost(reason)
