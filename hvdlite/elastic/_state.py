"""Horovod's elastic state objects and ``run`` wrapper, framework-free.

A world of MPI processes cannot shrink or grow in place, so an elastic hvdlite job is a
sequence of worlds started by the elastic ``hvdliterun`` (:mod:`hvdlite.launcher.elastic`):
``commit()`` keeps the state in memory and on disk (once per host), a world that ends (a rank
failed, or the hosts changed) is followed by one on the hosts that are there now, and in it
``run`` loads the newest commit and ``sync()`` sends it to every rank before the wrapped
function runs again. Without the elastic launcher ``run`` is one ``sync()`` and one call.
"""

from __future__ import annotations

import functools
import pickle
import queue
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

import hvdlite
from hvdlite.elastic import _worker
from hvdlite.errors import HostsUpdatedInterrupt, HvdliteError

__all__ = ["ObjectState", "State", "broadcast_object", "run_fn"]

T = TypeVar("T")


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s picklable ``obj`` on every rank (collective, blocking; NumPy only).

    The default ``bcast_object`` of the core :class:`ObjectState`; ``hvdlite.torch`` passes
    its own. Errors of the broadcast are raised as :class:`hvdlite.HvdliteError`.
    """
    me = hvdlite.rank()
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if me == root_rank else b""
    size = hvdlite.broadcast(np.array([len(data)], dtype=np.int64), root_rank,
                             name="hvdlite.elastic.bcast.sz")
    buf = np.frombuffer(data, dtype=np.uint8).copy() if me == root_rank else \
        np.zeros(int(size[0]), dtype=np.uint8)
    out = hvdlite.broadcast(buf, root_rank, name="hvdlite.elastic.bcast.t")
    return obj if me == root_rank else pickle.loads(out.tobytes())


class State:
    """Horovod's elastic ``State``: what a training loop commits, restores and syncs.

    Subclasses implement ``save`` (copy the live values to host memory), ``restore`` (copy
    the saved values back), ``sync`` (make every rank's values the root's) and, for elastic
    jobs, ``_payload``/``_load_payload`` (the saved copy as one picklable object). Not
    thread-safe: call it from the training thread.
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or hvdlite.rank
        self._reset_callbacks: list[Callable[[], None]] = []
        # How many commits the job made (identical on every rank: commits are taken in step).
        self._commit_number = 0
        # The rank that holds the newest commit after a restart; 0 otherwise.
        self._sync_root = 0
        # Horovod's: the driver's host-change notices, (timestamp, result), and the newest
        # timestamp acted on (check_host_updates raises for a newer one).
        self._host_messages: queue.Queue[tuple[int, int]] = queue.Queue()
        self._last_updated_timestamp = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Run ``callbacks`` (no arguments) after every reset, before the state is synced:
        in an elastic hvdlite job, at the start of every world after the first (where
        ``hvdlite.size()`` already is the new size), e.g. to rescale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Call ``reset()`` and the registered reset callbacks (``run`` does, after a reset)."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """Queue the driver's notice that the hosts changed at ``timestamp`` (seconds since
        the epoch; ``update_res``: Horovod's ``HostUpdateResult`` bits, 1 added, 2 removed).
        Called by hvdlite when the elastic ``hvdliterun`` reports a change; the next
        ``commit()`` / ``check_host_updates()`` acts on it. Any thread."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (``save()``), keep it where a restarted world finds it, then
        ``check_host_updates()``.

        Collective in an elastic job (every rank commits at the same step). The copy is on
        disk on every host before any rank returns, so a failure after this call loses
        nothing that was committed. Raises :class:`HostsUpdatedInterrupt` on every rank when
        the launcher changed the hosts; OSError if the job directory cannot be written.
        """
        self.save()
        self._commit_number += 1
        ctx = _worker.context()
        if ctx is not None:
            _worker.persist(ctx, self)
        self._check_host_updates(committed=True)

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if the launcher reported
        changed hosts (collective in an elastic job: all ranks agree on the answer; a no-op
        otherwise). ``run`` catches it, keeps the current state and goes on at the new size.
        """
        self._check_host_updates(committed=False)

    def _drain_host_messages(self) -> bool:
        """Take the queued notices; True if one is newer than the last acted on."""
        newest = self._last_updated_timestamp
        while True:
            try:
                timestamp, _ = self._host_messages.get_nowait()
            except queue.Empty:
                break
            newest = max(newest, timestamp)
        heard = newest > self._last_updated_timestamp
        self._last_updated_timestamp = newest
        return heard

    def _check_host_updates(self, committed: bool) -> None:
        ctx = _worker.context()
        heard = self._drain_host_messages()
        if (ctx is not None and _worker.hosts_updated(ctx, heard)) or (ctx is None and heard):
            interrupt = HostsUpdatedInterrupt(skip_sync=False)
            interrupt._hvdlite_committed = committed  # type: ignore[attr-defined]
            raise interrupt

    def save(self) -> None:
        """Copy the live state to host memory (no communication)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Undo every change since the last ``save()``/``commit()`` (no communication)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state the root's (collective; rank 0 unless a restarted world
        found the newest commit elsewhere)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust to a new world before the sync (default: nothing)."""

    def _payload(self) -> Any:
        raise NotImplementedError

    def _load_payload(self, payload: Any) -> None:
        raise NotImplementedError


class ObjectState(State):
    """State made of picklable Python objects, one attribute per keyword argument.

    ``bcast_object(obj[, root_rank])`` and ``get_rank()`` default to hvdlite's own (Horovod
    requires them; ``hvdlite.torch.elastic.TorchState`` passes the torch ones).
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._broadcast(self._saved_state)
            self._set_attrs()

    def _broadcast(self, obj: Any) -> Any:
        # Horovod's bcast_object takes the object only (root 0); pass a root only when needed.
        if self._sync_root == 0:
            return self._bcast_object(obj)
        return self._bcast_object(obj, root_rank=self._sync_root)

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _payload(self) -> Any:
        return {"objects": self._saved_state}

    def _load_payload(self, payload: Any) -> None:
        self._saved_state = payload["objects"]
        self._set_attrs()


def _say(message: str) -> None:
    print(f"hvdlite.elastic: rank {hvdlite.rank()}: {message}", file=sys.stderr, flush=True)


def run_fn(func: Callable[..., T]) -> Callable[..., T]:
    """Horovod's ``elastic.run`` for any :class:`State` (see ``hvdlite.torch.elastic.run``)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        ctx = _worker.context()
        if ctx is None:  # not under the elastic launcher: nothing to recover, nobody to reset
            state.sync()
            return func(state, *args, **kwargs)
        _worker.listen(state)
        _worker.recover(ctx, state)
        if ctx.generation > 0:
            state.on_reset()
        state.sync()
        state._sync_root = 0
        state.save()  # restore() before the next commit returns to what was recovered
        try:
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt as exc:
            committed = getattr(exc, "_hvdlite_committed", False)
            _worker.leave_for_reset(ctx, state, _worker.EXIT_HOSTS_UPDATED,
                                    persist_state=not committed)
        except HvdliteError as exc:
            _say(f"{type(exc).__name__}: {exc}; leaving the world, which restarts from the "
                 f"last commit")
            _worker.leave_for_reset(ctx, state, _worker.EXIT_INTERNAL_ERROR,
                                    persist_state=False)

    return wrapper
