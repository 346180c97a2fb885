"""Per-rank wrapper used by ``hvdliterun``: ``python -I .../hvdlite/launcher/rankwrap.py CMD...``.

It is run by path in isolated mode, not with ``-m``: then it depends on
nothing the user's environment puts on the path (PYTHONPATH, the working directory), and it
must never initialise MPI, which would take the rank's place in the job. It uses the standard
library only.

It runs the user's command as a child, forwards signals to it, and when the child fails
(non-zero exit or killed by a signal) drops a small JSON report into
``$HVDLITE_RUN_REPORT_DIR``, so that the launcher can name the rank that failed first, once.
Only where no report can be written does the wrapper print the failure itself (one tagged
line). The wrapper then exits the way the child did: with its exit code, or killed by the same
signal (without a core file of its own), and never with a traceback of its own.

When one rank fails, the MPI launcher ends the others by killing their process groups with
SIGKILL (MPICH's Hydra does; the rank gets no chance to write what it holds, such as its
timeline queue). So the child runs in a process group of its own: the launcher's SIGKILL ends
this wrapper only, and the child gets SIGTERM instead (``PR_SET_PDEATHSIG``), which lets
hvdlite's signal hook write the timeline before the child dies by it. A small guard process
(its own session too) makes sure the child does not outlive that: ``GUARD_GRACE_S`` after the
wrapper is gone it SIGKILLs a child that is still there (one blocked in C code, where no Python
signal handler runs, or one whose own handler goes on), and the child's process group with it.
While the child runs, a marker ``live-<rank>`` in the report directory tells ``hvdliterun`` to
wait for it before it returns.

It gives the rank its worker identity: Horovod's per-worker variables (``HOROVOD_RANK``,
``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK``,
``HOROVOD_CROSS_SIZE``, ``HOROVOD_HOSTNAME``) and the same values as ``HVDLITE_*``, from the
plan the launcher passes in ``WORKERS_ENV`` (its size grows with the hosts, not the ranks:
each wrapper computes its own row). It gives the rank the launcher's caller's ``PATH``
(``RANK_PATH_ENV``), first entry first, whatever folders the MPI launcher put ahead of it:
``python3`` on a rank is what ``command -v python3`` finds where ``hvdliterun`` was started.

Under ``hvdliterun`` the wrapper also holds the rank's connection to the launcher's monitor
(``hvdlite/launcher/monitor.py``, loaded by path): heartbeats both ways and the exit report,
which reach the launcher from any host (the report directory is only on the launcher's). When
the launcher orders the job ended (a host was lost), or the launcher goes silent (this host is
cut off), the wrapper hands the reason to the rank's watchdog thread
(``hvdlite/_rankside/watchdog.py``, through a socket named by ``HVDLITE_WATCHDOG_FD``), which
writes the timeline and ends the rank; ``ABORT_GRACE_S`` later a rank still there gets SIGTERM,
then SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, path: str) -> ModuleType:
    """A module of hvdlite's loaded by path (isolated mode: hvdlite is not importable)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:  # only for the checker: this file runs without hvdlite on the path
    from hvdlite import _threads
    from hvdlite._rankside import protocol
    from hvdlite.launcher.monitor import Agent
else:
    protocol = _load("_hvdlite_rankside_protocol",
                     os.path.join(os.path.dirname(_HERE), "_rankside", "protocol.py"))
    _threads = _load("_hvdlite_threads", os.path.join(os.path.dirname(_HERE), "_threads.py"))
start_quietly = _threads.start_quietly

REPORT_DIR_ENV = protocol.REPORT_DIR_ENV
LIVE_PREFIX = protocol.LIVE_PREFIX
WATCHDOG_FD_ENV = protocol.WATCHDOG_FD_ENV
RANK_ENVS = protocol.RANK_ENVS
rank_from_env = protocol.rank_from_env
describe_status = protocol.describe_status
# The launcher's plan of worker identities, one per MPI rank of the world (JSON).
WORKERS_ENV = protocol.WORKERS_ENV
IDENTITY_NAMES = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
# horovodrun's --output-filename: each rank's stdout and stderr also go to DIR/rank.<N>/.
OUTPUT_DIR_ENV = "HVDLITE_OUTPUT_DIR"
# The PATH the launcher means the rank's program to have (its caller's): an MPI launcher may
# have put folders of its own first (Open MPI's --prefix puts its bin there).
RANK_PATH_ENV = "HVDLITE_RANK_PATH"
FORWARDED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# Signals whose handler cannot be changed: re-raise them without touching their disposition.
UNCATCHABLE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGSTOP})
_PR_SET_PDEATHSIG = 1
# After the wrapper is gone, the child has this long to end (write its timeline) before SIGKILL.
GUARD_GRACE_S = 5.0
# After an abort was handed to the rank's watchdog: this long to end, then SIGTERM; SIGKILL
# TERM_GRACE_S after that.
ABORT_GRACE_S = 4.0
TERM_GRACE_S = 2.0

# The guard process. argv: the child's pid, the grace in seconds, the marker file ("" for
# none), the monitor connection's descriptor (-1 for none) and the line to send on it. Its
# stdin is a pipe from the wrapper: a byte means the wrapper is done (the child ended); EOF
# without one means the wrapper was killed (while the child ran, or the child ended of its
# parent-death signal as the wrapper was dying: either way the guard waits for the
# wrapper's word once the child has ended). Then the guard tells the
# launcher's monitor on the wrapper's connection, which its copy keeps open, that this host
# is alive (the MPI launcher is ending the job: not this host's loss).
_GUARD = r"""
import os, select, signal, sys, time
child, grace, marker = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
agent, orphaned = int(sys.argv[4]), sys.argv[5].encode()
try:
    fd = os.pidfd_open(child)  # readable once the child has ended; immune to pid reuse
except (AttributeError, OSError):
    fd = None
def ended(timeout):
    if fd is not None:
        return bool(select.select([fd], [], [], timeout)[0])
    end = time.monotonic() + timeout
    while True:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(min(0.05, max(end - time.monotonic(), 0)))
def kill(sig):
    try:
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(child, sig)
    except OSError:
        pass
watch = [0] + ([fd] if fd is not None else [])
timeout = None if fd is not None else 0.2
while True:
    ready = select.select(watch, [], [], timeout)[0]
    if 0 in ready:
        if os.read(0, 64):
            break  # the wrapper is done: the child ended
        # EOF without the byte: the wrapper was killed. The child may have ended first: its
        # parent-death signal comes when the wrapper's main thread dies, before the wrapper's
        # other threads let go of this pipe.
        if agent >= 0:
            try:
                os.write(agent, orphaned)
            except OSError:
                pass
        if not ended(grace):
            kill(signal.SIGKILL)
            try:  # and what it started in its process group (the child leads it)
                os.killpg(child, signal.SIGKILL)
            except OSError:
                pass
            ended(5.0)
        break
    if fd in ready or (timeout is not None and ended(0)):
        watch, timeout = [0], None  # the child ended: the wrapper's byte, or EOF, says how
if marker:
    try:
        os.remove(marker)
    except OSError:
        pass
"""


def _signal_on_parent_death(sig: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)


def _die_with_parent(parent: int) -> None:
    # Runs in the child before exec: its own process group (a launcher that kills this
    # wrapper's group with SIGKILL does not reach it), and SIGTERM when this wrapper dies, so
    # hvdlite's signal hook writes the timeline first; the guard process SIGKILLs it later.
    os.setpgid(0, 0)
    _signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def _live_marker(rank: int | None) -> str | None:
    """Create the marker that tells hvdliterun this rank's program still runs."""
    directory = os.environ.get(REPORT_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return None
    path = os.path.join(directory, f"{LIVE_PREFIX}{rank if rank is not None else os.getpid()}")
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(str(os.getpid()))
    except OSError:
        return None
    return path


def _start_guard(child: int, marker: str | None,
                 agent: Agent | None = None) -> subprocess.Popen[bytes] | None:
    """The process that SIGKILLs ``child`` if it outlives this wrapper by GUARD_GRACE_S, and
    (with ``agent``) tells the launcher's monitor that this host lives should this wrapper be
    killed first."""
    fd = agent.fileno() if agent is not None else -1
    monitor = _load_monitor() if fd >= 0 else None
    orphaned = monitor.ORPHANED_LINE.decode() if monitor is not None else ""
    fd = fd if monitor is not None else -1
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD, str(child), repr(GUARD_GRACE_S),
             marker or "", str(fd), orphaned],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, pass_fds=(fd,) if fd >= 0 else (), start_new_session=True)
    except OSError:
        return None


def _end_guard(guard: subprocess.Popen[bytes] | None, marker: str | None) -> None:
    """The child has ended: release the guard (a byte, then EOF, on its stdin) and drop the
    marker."""
    if guard is not None:
        with contextlib.suppress(OSError, ValueError):
            if guard.stdin is not None:
                guard.stdin.write(b"x")
                guard.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            guard.wait(timeout=2.0)
    if marker is not None:
        with contextlib.suppress(OSError):
            os.remove(marker)


def _exit_like(code: int) -> None:
    """Exit with ``code``, or (``code`` < 0) die by the same signal the child died of."""
    if code >= 0:
        sys.exit(code)
    sig = -code
    if sig not in UNCATCHABLE_SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    # The child may have dumped core; a second core file, of this wrapper, helps nobody.
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), sig)
    # Still alive: a signal whose default action is to ignore it (SIGCHLD, SIGWINCH, ...).
    sys.exit(128 + sig)


def _load_monitor() -> ModuleType | None:
    """hvdlite/launcher/monitor.py, loaded by path."""
    try:
        return _load("_hvdlite_launcher_monitor", os.path.join(_HERE, "monitor.py"))
    except ImportError:
        return None


def _output_files(rank: int | None) -> tuple[Any, Any] | None:
    """(stdout, stderr) files under ``$HVDLITE_OUTPUT_DIR/rank.<rank>``, or None."""
    directory = os.environ.get(OUTPUT_DIR_ENV)
    if not directory or rank is None:
        return None
    size = os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or "1"
    width = len(str(max(int(size) - 1, 0))) if size.isdigit() else 1
    folder = os.path.join(directory, f"rank.{rank:0{width}d}")
    # 0600, and never through a symbolic link another user put there (docs/security.md).
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        out = os.open(os.path.join(folder, "stdout"), flags, 0o600)
        try:
            err = os.open(os.path.join(folder, "stderr"), flags, 0o600)
        except OSError:
            os.close(out)
            raise
        return open(out, "wb"), open(err, "wb")
    except OSError as exc:
        print(f"hvdliterun: rank {rank}: --output-filename {directory}: {exc}", file=sys.stderr)
        return None


def _tee(source: Any, sink: Any, copy: Any) -> threading.Thread:
    """Copy ``source`` (a pipe from the child) to ``sink`` (our stdout/stderr) and ``copy``."""

    def run() -> None:
        with contextlib.suppress(OSError, ValueError):
            while data := os.read(source.fileno(), 65536):
                for out in (sink, copy):
                    with contextlib.suppress(OSError, ValueError):
                        out.write(data)
                        out.flush()
        with contextlib.suppress(OSError):
            copy.close()

    thread = threading.Thread(target=run, daemon=True)
    return start_quietly(thread)


def program_env(environ: dict[str, str], rank: int | None) -> dict[str, str]:
    """The rank program's environment: ``environ`` with the ``PATH`` the launcher meant
    (``RANK_PATH_ENV``, where it is set) and the worker identity (:func:`worker_env`), less
    the launcher's table and its ``RANK_PATH_ENV``."""
    env = {k: v for k, v in environ.items() if k not in (WORKERS_ENV, RANK_PATH_ENV)}
    if RANK_PATH_ENV in environ:
        env["PATH"] = environ[RANK_PATH_ENV]
    return env | worker_env(environ, rank)


def worker_env(environ: dict[str, str], rank: int | None) -> dict[str, str]:
    """Horovod's per-worker variables and their ``HVDLITE_*`` twins for MPI rank ``rank``,
    computed from the launcher's plan (``WORKERS_ENV``, :func:`protocol.worker_row`); empty
    without one."""
    row = protocol.worker_row(environ.get(WORKERS_ENV, ""), rank) if rank is not None else None
    if row is None:
        return {}
    host, *numbers = row
    out = {"HOROVOD_HOSTNAME": str(host), "HVDLITE_HOSTNAME": str(host)}
    for name, value in zip(IDENTITY_NAMES, numbers, strict=False):
        out[f"HOROVOD_{name}"] = out[f"HVDLITE_{name}"] = str(value)
    return out


class _Supervision:
    """The wrapper's link to the launcher's monitor and to the rank's watchdog thread."""

    def __init__(self, rank: int | None) -> None:
        self.rank = rank
        self.agent: Agent | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.ended_by: str | None = None  # why the wrapper ended the rank
        self.launcher_unreachable = False  # it ended the rank because the launcher went silent
        self._mine: socket.socket | None = None
        self.theirs: socket.socket | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # lines to the rank come from two threads
        monitor = _load_monitor() if os.environ.get("HVDLITE_MONITOR_ADDR") else None
        if monitor is None or rank is None:
            return
        agent = monitor.Agent.from_env(rank, on_abort=self.end_rank,
                                       on_lost=self._launcher_lost, on_message=self._to_rank)
        if agent is None:
            return
        self._mine, self.theirs = socket.socketpair()
        os.set_inheritable(self.theirs.fileno(), True)  # close_fds=False passes it (and PMI's)
        try:
            agent.connect()
        except OSError as exc:
            print(f"hvdliterun: rank {rank} (host {socket.gethostname()}): cannot reach the "
                  f"launcher's monitor at {agent.address}: {exc}; this rank runs unsupervised",
                  file=sys.stderr, flush=True)
            return
        self.agent = agent

    def child_env(self) -> dict[str, str]:
        env = program_env(dict(os.environ), self.rank)
        if self.theirs is None:
            return env
        return env | {WATCHDOG_FD_ENV: str(self.theirs.fileno())}

    def started(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        if self.theirs is not None:
            self.theirs.close()  # the child holds its own copy
        if self.agent is not None:
            self.agent.start()
            start_quietly(threading.Thread(target=self._relay, name="hvdliterun-relay",
                                           daemon=True))

    def _to_rank(self, message: dict[str, object]) -> None:
        """A message from the launcher for the rank (not an abort): hand it on."""
        if self._mine is not None:
            with self._send_lock, contextlib.suppress(OSError):
                self._mine.sendall(json.dumps(message).encode() + b"\n")

    def _relay(self) -> None:
        """Lines from the rank: ``failing`` (hvdlite's abort_job) becomes the exit report now,
        before the MPI launcher kills this wrapper (which would look like a lost host); any
        other message goes to the launcher's monitor as it is, but for the channel's own types
        (``protocol.RESERVED_TYPES``), which only this wrapper and its guard send."""
        buf = b""
        while self._mine is not None:
            try:
                data = self._mine.recv(4096)
            except OSError:
                return
            if not data:
                return
            *lines, buf = (buf + data).split(b"\n")
            for raw in lines:
                with contextlib.suppress(ValueError, KeyError, TypeError, RecursionError):
                    msg = json.loads(raw)
                    kind = msg.get("t") if isinstance(msg, dict) else None
                    if self.agent is None or not isinstance(kind, str):
                        continue
                    if kind == "failing":
                        code = msg["code"]
                        if isinstance(code, int) and not isinstance(code, bool):
                            self.agent.report_exit(code)
                    elif kind not in protocol.RESERVED_TYPES:
                        self.agent.send(msg)

    def _launcher_lost(self, reason: str) -> None:
        self.launcher_unreachable = True
        self.end_rank(f"rank {self.rank} (host {socket.gethostname()}): {reason}", 1)

    def end_rank(self, reason: str, code: int) -> None:
        """Hand ``reason`` to the rank's watchdog; SIGTERM, then SIGKILL, if it stays."""
        with self._lock:
            if self.ended_by is not None:
                return
            self.ended_by = reason
        child = self.child
        self._to_rank({"t": "abort", "reason": reason, "code": code})
        if child is None:
            return
        for sig, grace in ((signal.SIGTERM, ABORT_GRACE_S), (signal.SIGKILL, TERM_GRACE_S)):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=grace)
                return
            with contextlib.suppress(OSError):
                os.killpg(child.pid, sig)

    def finish(self, code: int, signalled: bool) -> bool:
        """The rank ended: report it to the monitor (True if it got there) and disconnect."""
        agent, reached = self.agent, False
        if agent is not None:
            reached = bool(agent.report_exit(code, signalled))
            agent.close()
        if self._mine is not None:
            with contextlib.suppress(OSError):
                self._mine.close()
        return reached


def main(argv: list[str] | None = None) -> None:
    """Run ``argv`` (default: ``sys.argv[1:]``) as the rank's program; exit as it did."""
    command = sys.argv[1:] if argv is None else argv
    if not command:
        sys.exit("usage: python -I .../hvdlite/launcher/rankwrap.py COMMAND [ARGS...]")
    rank = rank_from_env()
    received: list[int] = []
    sent = 0
    child: subprocess.Popen[bytes] | None = None

    def forward_pending() -> None:
        nonlocal sent
        while child is not None and sent < len(received):
            sig = received[sent]
            sent += 1
            with contextlib.suppress(OSError):
                child.send_signal(sig)

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        forward_pending()

    # Handlers first: a signal that comes while the child starts is passed on once it runs,
    # instead of interrupting this wrapper with a traceback.
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    # If the MPI process manager dies without cleaning up, SIGTERM reaches us and the child.
    _signal_on_parent_death(signal.SIGTERM)
    parent = os.getpid()
    marker = _live_marker(rank)
    supervision = _Supervision(rank)
    outputs = _output_files(rank)
    pipe = subprocess.PIPE if outputs is not None else None
    try:
        child = subprocess.Popen(
            command, preexec_fn=lambda: _die_with_parent(parent), close_fds=False,
            env=supervision.child_env(), stdout=pipe, stderr=pipe
        )
    except OSError as exc:
        print(f"hvdliterun: rank {rank}: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        protocol.write_report(rank, 127, signalled=False)
        supervision.finish(127, False)
        _end_guard(None, marker)
        sys.exit(127)
    # The guard first: once the rank is heard from, a wrapper killed is reported as such.
    guard = _start_guard(child.pid, marker, supervision.agent)
    supervision.started(child)
    forward_pending()
    tees = [] if outputs is None else [
        _tee(child.stdout, sys.stdout.buffer, outputs[0]),
        _tee(child.stderr, sys.stderr.buffer, outputs[1])]
    code = child.wait()
    for tee in tees:
        tee.join(timeout=2.0)
    _end_guard(guard, marker)
    signalled = bool(received) or supervision.ended_by is not None
    reported = (protocol.write_report(rank, code, signalled,
                                      supervision.launcher_unreachable)
                if code != 0 else False)
    reported = supervision.finish(code, signalled) or reported
    # The launcher names the rank that failed first, once; print here only if it cannot.
    if code != 0 and not reported:
        cause = f" after it was sent {signal.Signals(received[0]).name}" if received else ""
        print(f"hvdliterun: rank {rank} ended with {describe_status(code)}{cause}",
              file=sys.stderr, flush=True)
    _exit_like(code)


if __name__ == "__main__":
    main()
