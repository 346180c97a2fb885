"""Per-rank wrapper used by ``hvdliterun``: ``python -I .../hvdlite/_rankwrap.py <command...>``.

It is run by path in isolated mode, not with ``-m hvdlite._rankwrap``: then it depends on
nothing the user's environment puts on the path (PYTHONPATH, the working directory), and it
must never initialise MPI, which would take the rank's place in the job. It uses the standard
library only.

It runs the user's command as a child, forwards signals to it, and when the child fails
(non-zero exit or killed by a signal) prints one tagged line to stderr and drops a small JSON
report into ``$HVDLITE_RUN_REPORT_DIR``, so that the launcher can name the rank that failed
first. The wrapper then exits the way the child did.
"""

from __future__ import annotations

import ctypes
import json
import os
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


def _write_report(rank: int | None, code: int, signalled: bool) -> None:
    directory = os.environ.get(REPORT_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return
    report = {
        "rank": rank,
        "code": code,
        "time": time.time(),
        "signalled": signalled,
        "host": socket.gethostname(),
    }
    final = os.path.join(directory, f"rank-{rank if rank is not None else os.getpid()}.json")
    partial = f"{final}.{os.getpid()}.tmp"
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    os.replace(partial, final)


def _exit_like(code: int) -> None:
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        sys.exit(128 - code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Run ``argv`` (default: ``sys.argv[1:]``) as the rank's program; exit as it did."""
    command = sys.argv[1:] if argv is None else argv
    if not command:
        sys.exit("usage: python -I .../hvdlite/_rankwrap.py COMMAND [ARGS...]")
    rank = rank_from_env()
    received: list[int] = []
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

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        child.send_signal(signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    code = child.wait()
    if code != 0:
        cause = f" after it was sent {signal.Signals(received[0]).name}" if received else ""
        print(f"hvdliterun: rank {rank} ended with {describe_status(code)}{cause}", file=sys.stderr)
        _write_report(rank, code, signalled=bool(received))
    _exit_like(code)


if __name__ == "__main__":
    main()
