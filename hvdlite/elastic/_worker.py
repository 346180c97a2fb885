"""The rank's side of an elastic job: where commits are kept, how a restarted world finds the
newest one, and how a rank leaves its world for a reset.

Standard library and hvdlite's core only (no torch). The elastic ``hvdliterun``
(:mod:`hvdlite.launcher.elastic`) starts every world with ``ELASTIC_DIR_ENV`` (the job's
directory, the same path on every host) and ``GENERATION_ENV`` (0 for the first world, then
1, 2, ... after each reset). Without them a rank is not elastic and nothing here touches the
disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import socket
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import numpy as np

import hvdlite
from hvdlite._rankside import watchdog
from hvdlite._rankside.protocol import (
    ELASTIC_DIR_ENV,
    EXIT_HOSTS_UPDATED,
    EXIT_INTERNAL_ERROR,
    GENERATION_ENV,
    HOSTS_UPDATED_FILE,
    HOSTS_UPDATED_MESSAGE,
    RESET_EXIT_CODES,
    generation_dir,
)


class State(Protocol):
    """What this module uses of an elastic state (``hvdlite/elastic/_state.py``, which
    imports this module: a protocol, so the import runs one way)."""

    _commit_number: int
    _sync_root: int

    def save(self) -> None: ...

    def _payload(self) -> Any: ...

    def _load_payload(self, payload: Any) -> None: ...

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None: ...


__all__ = ["ELASTIC_DIR_ENV", "EXIT_HOSTS_UPDATED", "EXIT_INTERNAL_ERROR", "GENERATION_ENV",
           "HOSTS_UPDATED_FILE", "HOSTS_UPDATED_MESSAGE", "RESET_EXIT_CODES", "Context",
           "context", "generation_dir", "hosts_updated", "leave_for_reset", "listen",
           "newest_commit", "persist", "read_commit", "recover", "write_commit"]

_COMMIT = re.compile(r"^commit-(\d+)\.pkl$")


@dataclass(frozen=True)
class Context:
    """This rank's elastic job: the job directory, its host's commits and the generation."""

    job_dir: str
    generation: int

    @property
    def state_dir(self) -> str:
        # Per host: hosts that share a file system (namespaces of one machine, NFS) must not
        # read each other's copies, or a host that lost its own would look as if it had one.
        return os.path.join(self.job_dir, "state", socket.gethostname())

    @property
    def updates_file(self) -> str:
        return os.path.join(generation_dir(self.job_dir, self.generation), HOSTS_UPDATED_FILE)


def context() -> Context | None:
    """The elastic job this rank belongs to, or None when it was not started elastically."""
    job_dir = os.environ.get(ELASTIC_DIR_ENV)
    if not job_dir:
        return None
    try:
        generation = int(os.environ.get(GENERATION_ENV, "0"))
    except ValueError:
        generation = 0
    _listen()
    return Context(job_dir, generation)


def newest_commit(state_dir: str) -> int:
    """The number of the newest commit kept in ``state_dir`` (0: none)."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return 0
    found = [int(m.group(1)) for m in map(_COMMIT.match, names) if m]
    return max(found, default=0)


def write_commit(state_dir: str, number: int, payload: Any) -> None:
    """Keep ``payload`` as commit ``number`` (atomically: a rank killed while writing leaves
    the previous commit), then drop the older ones."""
    os.makedirs(state_dir, exist_ok=True)
    final = os.path.join(state_dir, f"commit-{number}.pkl")
    partial = f"{final}.{os.getpid()}.tmp"
    with open(partial, "wb") as handle:
        pickle.dump({"commit": number, "state": payload}, handle, protocol=5)
    os.replace(partial, final)
    for name in os.listdir(state_dir):
        m = _COMMIT.match(name)
        if m and int(m.group(1)) < number:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(state_dir, name))


def read_commit(state_dir: str, number: int) -> Any:
    """The payload of commit ``number``."""
    with open(os.path.join(state_dir, f"commit-{number}.pkl"), "rb") as handle:
        record = pickle.load(handle)
    if record.get("commit") != number:
        raise ValueError(f"{state_dir}: commit-{number}.pkl holds commit {record.get('commit')}")
    return record["state"]


def _reduce(value: int, op: Any, name: str) -> int:
    out = hvdlite.allreduce(np.array([value], dtype=np.int64), op=op, name=name)
    return int(out[0])


def persist(ctx: Context, state: State) -> None:
    """Keep ``state``'s saved copy on disk, once per host (the host's local rank 0)."""
    if hvdlite.local_rank() == 0:
        write_commit(ctx.state_dir, state._commit_number, state._payload())


# The newest generation the driver told this process about (over the control channel).
_told_generation = -1
_listening = False
_lock = threading.Lock()
# The states that hear of host changes (Horovod's State.on_hosts_updated), and the notices
# seen so far (each is handed to a state once; the driver repeats its notice).
_states: weakref.WeakSet[State] = weakref.WeakSet()
_notices: set[tuple[int, int]] = set()
_given: weakref.WeakKeyDictionary[State, set[tuple[int, int]]] = weakref.WeakKeyDictionary()


def _deliver(timestamp: int, result: int) -> None:
    with _lock:
        _notices.add((timestamp, result))
        states = list(_states)
        for state in states:
            given = _given.setdefault(state, set())
            if (timestamp, result) not in given:
                given.add((timestamp, result))
                state.on_hosts_updated(timestamp, result)


def _on_message(message: dict[str, Any]) -> None:
    global _told_generation
    generation = message.get("generation")
    if message.get("t") == HOSTS_UPDATED_MESSAGE and isinstance(generation, int):
        _told_generation = max(_told_generation, generation)
        timestamp, result = message.get("timestamp"), message.get("res")
        if isinstance(timestamp, int) and isinstance(result, int):
            _deliver(timestamp, result)


def _listen() -> None:
    """Subscribe once to the launcher's messages (the rank wrapper hands them to the rank's
    watchdog thread); the driver repeats its message until the world ends, so one sent
    before this is not lost."""
    global _listening
    if not _listening:
        _listening = True
        watchdog.subscribe(_on_message)


def listen(state: State) -> None:
    """Let ``state`` hear of host changes from the driver (``state.on_hosts_updated(
    timestamp, result)``, as Horovod's notification manager calls it), including notices
    that came before this call. Any thread."""
    _listen()
    with _lock:
        _states.add(state)
        notices = sorted(_notices)
    for timestamp, result in notices:
        _deliver(timestamp, result)


def _told(ctx: Context) -> bool:
    """The driver said the hosts changed: through the launcher's control channel, or in the
    job directory where this host shares the launcher's file system (then the notice is
    handed to the states as well)."""
    if _told_generation >= ctx.generation:
        return True
    try:
        with open(ctx.updates_file, encoding="utf-8") as handle:
            notice = json.load(handle)
    except (OSError, ValueError):
        return False
    if isinstance(notice, dict) and isinstance(notice.get("timestamp"), int):
        _deliver(notice["timestamp"], int(notice.get("res", 1)))
    return True


def hosts_updated(ctx: Context, heard: bool = False) -> bool:
    """True on every rank when the driver reported changed hosts to any rank, or any rank
    ``heard`` of a change through its state's messages (collective)."""
    seen = int(_told(ctx) or heard)
    return _reduce(seen, hvdlite.Max, "hvdlite.elastic.hosts_updated") > 0


def recover(ctx: Context, state: State) -> None:
    """Agree on the newest commit any host kept, load it on the lowest rank that has it and
    make that rank the root of the next ``sync()`` (collective)."""
    mine = newest_commit(ctx.state_dir)
    best = _reduce(mine, hvdlite.Max, "hvdlite.elastic.newest_commit")
    if best == 0:
        return
    me, size = hvdlite.rank(), hvdlite.size()
    root = _reduce(me if mine == best else size, hvdlite.Min, "hvdlite.elastic.commit_root")
    if me == root:
        state._load_payload(read_commit(ctx.state_dir, best))
    state._commit_number = best
    state._sync_root = root


def leave_for_reset(ctx: Context, state: State, code: int, persist_state: bool) -> NoReturn:
    """End this rank's part of the world so that the driver starts the next one.

    With ``persist_state`` the current state becomes a commit first (Horovod keeps a rank's
    in-memory state across a hosts-updated reset; a restarted process can only read it from
    disk). The barrier makes every host's copy complete before any rank exits (the MPI
    launcher ends the world as soon as one rank has exited). Without it, the commit that was
    kept before ``check_host_updates``' collective stands; a broken world gets no barrier.
    """
    if persist_state:
        state.save()
        state._commit_number += 1
        persist(ctx, state)
        hvdlite.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)
