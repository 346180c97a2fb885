"""A channel: one process set as the engine runs it.

Every process set (the global one included) negotiates its own order on its own control
communicator, with its own coordinator (the set's rank 0), response cache and stall inspector,
and moves data on its own data communicator (MPI) and NCCL communicators. The engine runs one
round of every channel this rank belongs to per cycle, in set-id order; channels are created
and removed at agreed points of the global order (see ``Engine._apply_set_change``), so the
members of a set run its rounds in lockstep and every communicator sees the same sequence of
collectives on every member.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hvdlite._lru import Bounded
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.fusion import FusionBuffers, nbytes, plan_buckets
from hvdlite._vocab.messages import SPECS, Request, Response
from hvdlite._vocab.plans import Lanes
from hvdlite.config import Config
from hvdlite.errors import BackendUnavailableError, HvdliteError, MismatchError

if TYPE_CHECKING:
    from mpi4py import MPI

    from hvdlite._backends.base import Backend
    from hvdlite._control.negotiator import CycleResult
    from hvdlite._gpu.runtime import GpuRuntime
    from hvdlite._observe.tracer import Tracer

__all__ = ["Channel"]


class Channel:
    """Communicators, negotiator, data planes and pending work of one process set."""

    def __init__(self, set_id: int, ranks: tuple[int, ...], ctrl: MPI.Intracomm,
                 data: MPI.Intracomm, config: Config, tracer: Tracer, fusion: FusionBuffers,
                 gpu: Callable[[], GpuRuntime], block: bool, nap: Callable[[float], bool],
                 agreed: Callable[[Response], Any], buckets: itertools.count[int]) -> None:
        # Imported here: both import mpi4py.MPI, which initialises MPI, and importing hvdlite
        # must not.
        from hvdlite._backends.mpi import MPIBackend
        from hvdlite._control.negotiator import Negotiator

        self.id, self.ranks = set_id, ranks
        self.ctrl, self.data = ctrl, data
        # Duplicated only by the agreed schedules' opens (collective, one at a time per rank):
        # a host schedule's own communicator, made with no cycle's traffic beside it.
        self.agreed_comm = ctrl.Dup()
        self.rank, self.size = ctrl.Get_rank(), ctrl.Get_size()
        self.config, self.tracer = config, tracer
        self.negotiator = Negotiator(ctrl, config, tracer, block, nap, self.forget)
        self.mpi = MPIBackend(data, fusion, self.negotiator.failures, tracer, block)
        self.backends: dict[str, Backend] = {"cpu": self.mpi}
        self.entries: dict[str, Entry] = {}
        self.in_flight: set[str] = set()
        # Per tensor name: the last request (a call whose parameters did not change reuses
        # it, so the cache matches it by identity, see ResponseCache.lookup) and the steady
        # state of its calls (_vocab/plans.py). A name leaves both when the response cache
        # lets it go (forget, agreed), so they hold the cached names; the bound (oldest out,
        # hvdlite/_lru.py) leaves room for as many names again in flight or never cached.
        capacity = config.cache_capacity
        self.requests: Bounded[str, Request] = Bounded(2 * capacity)
        self.lanes = Lanes(2 * capacity)
        # Execution plans by agreed response list (see plan), least recently used out.
        self._plans: Bounded[tuple[int, ...], tuple[tuple[Response, ...],
                                                    list[tuple[list[Response], int]]]]
        self._plans = Bounded(capacity)
        self._gpu = gpu
        self._agreed = agreed  # the engine's executor for set changes (agreed on this set)
        self._buckets = buckets

    def remember(self, name: str, fields: tuple[Any, ...]) -> Request:
        """The request for ``fields``: the name's last one if nothing changed (any thread)."""
        req = self.requests.get(name)
        if req is None or req != fields:
            req = Request._make(fields)
            self.requests.keep(name, req)
        return req

    def forget(self, name: str, cached: Request | None) -> None:
        """``name`` left the response cache (under the cycle lock, at the same point of the
        agreed order on every rank), where it was cached for ``cached`` (None: this rank had
        no request then): its request and lane go too, unless a call has already replaced
        them with different parameters (the invalidation that let the name go was theirs).
        A later call of the name builds them again and goes through a full round."""
        req = self.requests.get(name)
        if req is not None and (cached is None or req == cached):
            self.requests.drop(name)
        lane = self.lanes.get(name)
        if lane is not None and (cached is None or lane.request == cached):
            self.lanes.drop(name)

    # -- one round (under the engine's cycle lock) -------------------------------------------
    def negotiate(self, new: list[Entry], stopping: bool, expecting_stall: bool,
                  caller: bool) -> CycleResult:
        negotiator = self.negotiator
        negotiator.in_caller = self.mpi.in_caller = caller
        return negotiator.cycle(new, self.entries, stopping, expecting_stall)

    def execute(self, responses: list[Response], lock: threading.Lock) -> None:
        """Run the agreed responses in order; ``lock`` guards the names in flight."""
        threshold = self.config.fusion_threshold
        pop = self.entries.pop
        for bucket, payload in self.plan(responses, threshold):
            entries = [pop(r.name, None) for r in bucket]
            self._account(bucket, payload, threshold)
            # Free the names before any handle completes: a caller that reuses a name right
            # after wait() returns must not see it as still in flight.
            with lock:
                if len(bucket) == 1:
                    self.in_flight.discard(bucket[0].name)
                else:
                    self.in_flight.difference_update([r.name for r in bucket])
            try:
                self._run_bucket(bucket, entries)
            except BaseException as exc:
                for e in entries:
                    if e is not None:  # popped above, so the engine's stop would miss them
                        why = str(exc) if isinstance(exc, HvdliteError) else repr(exc)
                        err = type(exc) if isinstance(exc, BackendUnavailableError) else (
                            HvdliteError)
                        e.fail(err(f"tensor {e.request.name!r}: {why}"))
                if isinstance(exc, BackendUnavailableError):
                    continue  # decided alike on every rank (collectively): the rest goes on
                raise
            finally:
                if self.tracer.timeline is not None:  # the op's top-level span ends
                    self.tracer.executed([r.name for r in bucket], bucket[0])

    def plan(self, responses: list[Response],
             threshold: int) -> list[tuple[list[Response], int]]:
        """Buckets and their payloads, cached per agreed response list: in steady state the
        responses come from the response cache, the same objects in the same order every
        step, so the plan is one lookup. The key holds the responses' ids, and the entry the
        responses themselves, so no id is reused by another response while it is cached."""
        if len(responses) == 1:
            return [(responses, nbytes(responses[0]))]
        key = tuple(map(id, responses))
        hit = self._plans.used(key)
        if hit is not None:
            return hit[1]
        plan = [(b, sum(nbytes(r) for r in b)) for b in plan_buckets(responses, threshold)]
        # Weighed by its responses: a plan over a step of names seen once holds them all.
        self._plans.keep(key, (tuple(responses), plan), len(responses))
        return plan

    def _account(self, bucket: list[Response], payload: int, threshold: int) -> None:
        # The buffer a bucket could fill: the fusion threshold, or its own size unfused (a
        # lone tensor, any non-allreduce) -- the same figure for stats() and the timeline.
        room = payload if len(bucket) == 1 else threshold
        self.tracer.stats.record_bucket(len(bucket), payload, room)
        if self.tracer.timeline is not None:
            self.tracer.dequeued([r.name for r in bucket], next(self._buckets), room)

    def _run_bucket(self, bucket: list[Response], entries: list[Entry | None]) -> None:
        head = bucket[0]
        if head.error:  # the ranks disagreed: nothing runs
            for e in entries:
                if e is not None:
                    e.fail(MismatchError(head.error))
            return
        spec = SPECS[head.kind]
        if spec.result is not None or spec.engine_action:  # an agreement only
            value = self._agreed(head) if spec.engine_action else spec.result(head)  # type: ignore[misc]
            for e in entries:
                if e is not None:
                    e.finish(value)
            return
        self.backend(head.device).run(bucket, entries)

    def backend(self, device: str) -> Backend:
        """The data plane for ``device`` memory ("cpu": MPI; "cuda": NCCL or CUDA IPC, made
        on first use, since it imports CuPy and creates communicators over this set)."""
        backend = self.backends.get(device)
        if backend is None:
            from hvdlite._backends.nccl import NcclBackend

            backend = self.backends[device] = NcclBackend(
                self.data, self._gpu(), self.config, self.tracer, self.mpi.wait)
        return backend

    # -- the end --------------------------------------------------------------------------
    def abort_device(self) -> None:
        """The job is ending with an error: abort this set's NCCL communicators and release
        its CUDA IPC waits (the NCCL watchdog: see ``NcclBackend.abort``)."""
        backend = self.backends.get("cuda")
        if backend is not None:
            backend.abort()

    def take_pending(self) -> list[Entry]:
        """Every pending entry, removed (the caller fails them); names in flight forgotten."""
        pending = list(self.entries.values())
        self.entries.clear()
        self.in_flight.clear()
        return pending

    def close(self, free_comms: bool = True) -> None:
        """Release the data planes and (unless the engine frees them) the communicators."""
        from mpi4py import MPI

        self.negotiator.failures.close()
        for backend in self.backends.values():
            backend.shutdown()
        if self.agreed_comm != MPI.COMM_NULL:
            self.agreed_comm.Free()
        if free_comms:
            for comm in (self.ctrl, self.data):
                if comm != MPI.COMM_NULL:
                    comm.Free()
