"""The rank's side of an elastic job: where commits are kept, how a restarted world finds the
newest one, and how a rank leaves its world for a reset.

Standard library and hvdlite's core only (no torch). The elastic ``hvdliterun``
(:mod:`hvdlite.launcher.elastic`) starts every world with ``ELASTIC_DIR_ENV`` (the job's
directory, the same path on every host) and ``GENERATION_ENV`` (0 for the first world, then
1, 2, ... after each reset). Without them a rank is not elastic and nothing here touches the
disk.

Commits are pickles, so they are read only where no other user can have put them: the
directories from the report directory down (``<report>/<job>/state/<host>``, and
``<report>/<job>/gen-N`` for the driver's notice) are made 0700 where missing (a host without
the launcher's file system makes them itself) and must otherwise be directories of this user
that no other user can write, or :class:`~hvdlite.errors.HvdliteError` names the one that is
not; the commit files are written 0600 and opened without following a symbolic link, and a
file another user owns is never unpickled. See docs/security.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import socket
import stat
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
from hvdlite.errors import HvdliteError


class StateView(Protocol):
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


# <report>/<job>/state/<host>: the levels below the report directory's parent are private.
_PRIVATE_LEVELS = 4
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(path: str, why: str) -> HvdliteError:
    return HvdliteError(f"elastic job directory {path}: {why}; hvdlite keeps a job's commits "
                        "(pickles) only where no other user can write, so it neither reads nor "
                        "writes them there: remove it, or start the job again (a fresh "
                        "directory)")


def _private_dir(path: str, create: bool, levels: int = _PRIVATE_LEVELS) -> int | None:
    """A descriptor of directory ``path``, whose last ``levels`` components are checked, one
    by one without following a link: made 0700 where missing (with ``create``; else None),
    otherwise directories of this user that no other user can write (HvdliteError)."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    levels = min(levels, len(parts) - 1)  # parts[0] is "" (the root)
    top, private = os.sep.join(parts[:-levels]) or os.sep, parts[-levels:]
    if create:
        os.makedirs(top, exist_ok=True)
    try:
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    where = top
    try:
        for part in private:
            where = os.path.join(where, part)
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse(where, "a symbolic link or not a directory") from exc
                raise
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise _refuse(where, f"owned by uid {st.st_uid}, not by this user "
                                     f"({os.geteuid()})")
            if st.st_mode & 0o022:
                raise _refuse(where, f"other users can write in it (mode "
                                     f"{stat.S_IMODE(st.st_mode):o})")
        result, fd = fd, -1
        return result
    finally:
        if fd >= 0:
            os.close(fd)


def _open_own(dir_fd: int, name: str, where: str) -> int:
    """A descriptor of this user's regular file ``name`` in ``dir_fd``, read-only, not
    followed if a link (FileNotFoundError when absent; HvdliteError when not this user's)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(os.path.join(where, name), "a symbolic link") from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise _refuse(os.path.join(where, name), f"not a file of this user (uid {st.st_uid}, "
                                                 f"mode {st.st_mode:o})")
    return fd


def _own_file(directory: str, name: str, levels: int = _PRIVATE_LEVELS) -> int:
    """A read-only descriptor of this user's file ``name`` in the private ``directory``
    (FileNotFoundError when either is absent)."""
    fd = _private_dir(directory, create=False, levels=levels)
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "no such directory", directory)
    try:
        return _open_own(fd, name, directory)
    finally:
        os.close(fd)


def newest_commit(state_dir: str) -> int:
    """The number of the newest commit kept in ``state_dir`` (0: none); HvdliteError when
    the directory is not private (see the module's note)."""
    fd = _private_dir(state_dir, create=False)
    if fd is None:
        return 0
    try:
        names = os.listdir(fd)
    finally:
        os.close(fd)
    found = [int(m.group(1)) for m in map(_COMMIT.match, names) if m]
    return max(found, default=0)


def write_commit(state_dir: str, number: int, payload: Any) -> None:
    """Keep ``payload`` as commit ``number`` (atomically: a rank killed while writing leaves
    the previous commit; the file 0600), then drop the older ones."""
    fd = _private_dir(state_dir, create=True)
    assert fd is not None
    try:
        final = f"commit-{number}.pkl"
        partial = f"{final}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial, dir_fd=fd)  # a writer of an earlier life of this pid
        out = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o600, dir_fd=fd)
        with open(out, "wb") as handle:
            pickle.dump({"commit": number, "state": payload}, handle, protocol=5)
        os.replace(partial, final, src_dir_fd=fd, dst_dir_fd=fd)
        for name in os.listdir(fd):
            m = _COMMIT.match(name)
            if m and int(m.group(1)) < number:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(name, dir_fd=fd)
    finally:
        os.close(fd)


def read_commit(state_dir: str, number: int) -> Any:
    """The payload of commit ``number``: unpickled only from this user's own file in a
    private directory (HvdliteError otherwise, FileNotFoundError when there is none)."""
    with open(_own_file(state_dir, f"commit-{number}.pkl"), "rb") as handle:
        record = pickle.load(handle)
    if not isinstance(record, dict) or record.get("commit") != number:
        raise ValueError(f"{state_dir}: commit-{number}.pkl does not hold commit {number}")
    return record["state"]


def _reduce(value: int, op: Any, name: str) -> int:
    out = hvdlite.allreduce(np.array([value], dtype=np.int64), op=op, name=name)
    return int(out[0])


def persist(ctx: Context, state: StateView) -> None:
    """Keep ``state``'s saved copy on disk, once per host (the host's local rank 0)."""
    if hvdlite.local_rank() == 0:
        write_commit(ctx.state_dir, state._commit_number, state._payload())


# The newest generation the driver told this process about (over the control channel).
_told_generation = -1
_listening = False
_lock = threading.Lock()
# The states that hear of host changes (Horovod's State.on_hosts_updated), and the notices
# seen so far (each is handed to a state once; the driver repeats its notice).
_states: weakref.WeakSet[StateView] = weakref.WeakSet()
_notices: set[tuple[int, int]] = set()
_given: weakref.WeakKeyDictionary[StateView, set[tuple[int, int]]] = weakref.WeakKeyDictionary()


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


def listen(state: StateView) -> None:
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
    handed to the states as well; read only from a private directory, as commits are)."""
    if _told_generation >= ctx.generation:
        return True
    gen_dir = generation_dir(ctx.job_dir, ctx.generation)
    try:
        with open(_own_file(gen_dir, HOSTS_UPDATED_FILE, _PRIVATE_LEVELS - 1),
                  encoding="utf-8") as handle:
            notice = json.load(handle)
    except (OSError, ValueError, HvdliteError):  # no notice there (or none to trust)
        return False
    if isinstance(notice, dict) and isinstance(notice.get("timestamp"), int):
        res = notice.get("res", 1)
        _deliver(notice["timestamp"], res if isinstance(res, int) else 1)
    return True


def hosts_updated(ctx: Context, heard: bool = False) -> bool:
    """True on every rank when the driver reported changed hosts to any rank, or any rank
    ``heard`` of a change through its state's messages (collective)."""
    seen = int(_told(ctx) or heard)
    return _reduce(seen, hvdlite.Max, "hvdlite.elastic.hosts_updated") > 0


def recover(ctx: Context, state: StateView) -> None:
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


def leave_for_reset(ctx: Context, state: StateView, code: int, persist_state: bool) -> NoReturn:
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
