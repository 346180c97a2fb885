"""What a frontend may ask of the runtime, beyond the collectives: the one place a frontend
(``hvdlite.torch``, and any other) reaches the engine for anything but a call's route.

A frontend never owns a communicator, never holds the engine and never reads a private field:
it asks here, by process-set id, and gets the runtime's own objects back (an
:class:`~hvdlite._control.agreed.AgreedSchedule`, a knob value). Everything here acts on the
process's default engine; each function raises :class:`hvdlite.NotInitializedError` before
``init()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from hvdlite._engine import default_engine
from hvdlite._vocab.agreed import Slot, slot_rows

if TYPE_CHECKING:
    from hvdlite._control.agreed import AgreedSchedule
    from hvdlite.config import Config

__all__ = ["Slot", "agree", "capture", "check_agreed", "check_usable", "config", "host_waits",
           "open_schedule", "record_capture", "replay", "running", "set_ranks", "sets",
           "slot_rows"]


def running() -> object:
    """A token of the running engine: another one after ``shutdown()`` and ``init()`` (an
    elastic reset), so a frontend can tell that what it opened belongs to a world now gone."""
    return default_engine()


def config() -> Config:
    """The running engine's configuration (read-only)."""
    return default_engine().config


def check_usable() -> None:
    """Raise the engine's sticky error, ``ShutdownError`` once it stopped, or
    ``HvdliteError`` on a thread capturing a CUDA graph."""
    default_engine().scheduler.check_usable()


def host_waits() -> bool:
    """Whether device completions are waited on the host (the timeline is on without device
    event timing, so that its spans bracket device work) rather than by stream order."""
    return default_engine().gpu_runtime().cpu_sync


def sets() -> dict[int, tuple[int, ...]]:
    """Every registered process set's id and global ranks (a copy)."""
    return dict(default_engine().sets)


def set_ranks(set_id: int | None) -> tuple[int, ...] | None:
    """The global ranks of process set ``set_id``, in set order; None if it is not registered
    (or ``set_id`` is None)."""
    return default_engine().sets.get(set_id) if set_id is not None else None


def agree(what: str, mine: Any, set_id: int = 0) -> list[Any]:
    """Every member's ``mine`` (JSON-able), in set order. Blocking; collective over the set
    (one allgather on the negotiated route: a member that never comes is a stall, named);
    raises the engine's errors. Thread-safe, but members must call in the same order."""
    engine = default_engine()
    return engine.scheduler.schedules.agree(engine.channel_for(set_id), what, mine)


def check_agreed(what: str, mine: Any, hint: str, set_id: int = 0) -> list[Any]:
    """:func:`agree`, then :class:`hvdlite.MismatchError` on every member unless every member
    showed the same (naming each differing rank and its first difference, then ``hint``)."""
    engine = default_engine()
    return engine.scheduler.schedules.check(engine.channel_for(set_id), what, mine, hint)


def open_schedule(name: str, slots: Sequence[Slot], buffers: Sequence[tuple[int, int]],
                  device_id: int, set_id: int = 0,
                  usable: str = "", via: str = "") -> tuple[AgreedSchedule | None, str]:
    """An agreed schedule of in-place allreduces (``slots[i]`` on ``buffers[i]``: address and
    element count, on CUDA device ``device_id`` or the host for -1, alive as long as the
    schedule), on its own transport (device buffers over NCCL or CUDA IPC, a GPU per rank:
    ``via`` "nccl" or "ipc", '' for the ``schedule_transport`` knob's; host buffers over MPI),
    or (None, why not) where a member cannot run it (``usable``: why this rank's caller
    cannot, '' if it can); the same answer on every member. Blocking;
    collective over the set; ``MismatchError`` on every member if they opened different
    slots. Launch its slots in order (``schedule.launch(i, stream)``) and order consumers
    after them (``schedule.wait(i, stream)``): see ``hvdlite/_control/agreed.py``."""
    engine = default_engine()
    channel = engine.channel_for(set_id)
    if device_id >= 0:
        engine.gpu_runtime()  # the device runtime exists before a transport is made
    return engine.scheduler.schedules.open(channel, name, slots, buffers, device_id, usable,
                                           via)


@contextlib.contextmanager
def capture(schedules: Sequence[AgreedSchedule], graph: object) -> Iterator[None]:
    """While ``graph`` (a CUDA graph, weakly referenced) is captured on this thread: every
    other hvdlite call on it raises ``HvdliteError`` (it would replay un-negotiated) and
    ``schedules``' launches are captured; their transports then live at least as long as
    ``graph`` (tearing one down under a live graph waits for it)."""
    with default_engine().scheduler.schedules.capture(schedules, graph):
        yield


def record_capture() -> None:
    """Count a captured step in ``hvdlite.stats()["graphs"]``."""
    default_engine().tracer.stats.record_capture()


def replay(run: Callable[[], None], name: str, replays: int, sync: Callable[[], None]) -> None:
    """Run ``run`` (a graph's replay), counted in ``stats()["graphs"]`` and, with the timeline
    on, as one ``GRAPH_REPLAY`` span on the track ``name`` (``sync``: waits for the replay,
    so the span brackets it)."""
    tracer = default_engine().tracer
    if tracer.on:
        with tracer.phase([name], "GRAPH_REPLAY", {"replay": replays}, sync=sync):
            run()
    else:
        run()
    tracer.stats.record_replay()
