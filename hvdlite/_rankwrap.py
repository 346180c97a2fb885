"""Per-rank wrapper used by ``hvdliterun``: ``python -I .../hvdlite/_rankwrap.py <command...>``.

It is run by path in isolated mode, not with ``-m hvdlite._rankwrap``: then it depends on
nothing the user's environment puts on the path (PYTHONPATH, the working directory), and it
must never initialise MPI, which would take the rank's place in the job. It uses the standard
library only.

It runs the user's command as a child, forwards signals to it, and when the child fails
(non-zero exit or killed by a signal) drops a small JSON report into
``$HVDLITE_RUN_REPORT_DIR``, so that the launcher can name the rank that failed first, once.
Only where no report can be written does the wrapper print the failure itself (one tagged
line). The wrapper then exits the way the child did: with its exit code, or killed by the same
signal (without a core file of its own), and never with a traceback of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

REPORT_DIR_ENV = "HVDLITE_RUN_REPORT_DIR"
RANK_ENVS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
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


def rank_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """The MPI rank of this process, from the variables MPICH, Open MPI or PMIx set."""
    for name in RANK_ENVS:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def describe_status(code: int) -> str:
    """``"exit code 3"`` or ``"signal 9 (SIGKILL)"`` for a ``Popen.returncode``."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown signal"
    return f"signal {-code} ({name})"


def _signal_on_parent_death(sig: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)


def _die_with_parent(parent: int) -> None:
    # Runs in the child before exec: if this wrapper is SIGKILLed, the child must not linger.
    _signal_on_parent_death(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _write_report(rank: int | None, code: int, signalled: bool) -> bool:
    """Drop the failure report for the launcher; False when there is nowhere to put it."""
    directory = os.environ.get(REPORT_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return False
    report = {
        "rank": rank,
        "code": code,
        "time": time.time(),
        "signalled": signalled,
        "host": socket.gethostname(),
    }
    final = os.path.join(directory, f"rank-{rank if rank is not None else os.getpid()}.json")
    partial = f"{final}.{os.getpid()}.tmp"
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump(report, handle)
        os.replace(partial, final)
    except OSError:
        return False
    return True


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


def main(argv: list[str] | None = None) -> None:
    """Run ``argv`` (default: ``sys.argv[1:]``) as the rank's program; exit as it did."""
    command = sys.argv[1:] if argv is None else argv
    if not command:
        sys.exit("usage: python -I .../hvdlite/_rankwrap.py COMMAND [ARGS...]")
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
    try:
        child = subprocess.Popen(
            command, preexec_fn=lambda: _die_with_parent(parent), close_fds=False
        )
    except OSError as exc:
        print(f"hvdliterun: rank {rank}: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        _write_report(rank, 127, signalled=False)
        sys.exit(127)
    forward_pending()
    code = child.wait()
    # The launcher names the rank that failed first, once; print here only if it cannot.
    if code != 0 and not _write_report(rank, code, signalled=bool(received)):
        cause = f" after it was sent {signal.Signals(received[0]).name}" if received else ""
        print(f"hvdliterun: rank {rank} ended with {describe_status(code)}{cause}",
              file=sys.stderr, flush=True)
    _exit_like(code)


if __name__ == "__main__":
    main()
