"""Control plane: requests, responses, the coordinator's table and the response cache.

Everything here is pure bookkeeping (no MPI), so unit tests drive it directly. The engine
moves the data between ranks; this module decides what is ready, in which order, and what is
wrong with it.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Kind", "Spec", "SPECS", "Request", "Response", "CoordinatorTable", "ResponseCache",
           "StallReport", "is_unit", "pack_request", "unpack_request", "pack_response",
           "unpack_response"]


class Kind(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    PROCESS_SET = 7  # add (op 0) or remove (op 1) process set ``root`` of ranks ``shape``


class Request(NamedTuple):
    """What one rank says about one tensor it submitted. Small and hashable; a tuple, so it
    is cheap to build per call, compares in C and travels as itself on the uncached path.

    A grouped allreduce is one request (one *unit*: one cache slot, one bit, one bucket):
    ``shape`` is the tuple of its members' shapes, ``dtype`` their dtype (or the tuple of
    their dtypes when they differ), ``group`` its name and ``group_size`` its member count.
    """

    name: str
    kind: Kind
    dtype: Any = "uint8"  # str; a tuple of str for a grouped call of mixed dtypes
    shape: tuple[Any, ...] = ()  # a grouped call's: the tuple of its members' shapes
    device: str = "cpu"
    op: int = 0
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] = ()
    group: str = ""
    group_size: int = 0


@dataclass(frozen=True, slots=True)
class Response:
    """What every rank executes for one tensor; identical on every rank.

    ``sizes`` holds per-rank first-dimension sizes (allgather) or per-rank split vectors
    flattened (alltoall); ``error`` is set when the ranks disagreed and nothing runs.
    ``joined`` lists the ranks that had joined when the response was decided.
    """

    name: str
    kind: Kind
    dtype: Any  # as in Request
    shape: tuple[Any, ...]
    device: str
    op: int
    root: int
    prescale: float
    postscale: float
    sizes: tuple[int, ...] = ()
    group: str = ""
    error: str = ""
    joined: tuple[int, ...] = ()
    last_joined: int = -1

    def fusion_key(self) -> tuple[object, ...]:
        """Responses with equal keys may share a fusion bucket."""
        return (self.kind, self.dtype, self.device, self.op, self.prescale, self.postscale)


@dataclass(frozen=True, slots=True)
class Spec:
    """One collective, described once: what the call layer validates, what the ranks must
    agree on, whether it fuses and caches, and who executes it. Adding a collective is adding
    a row here plus its executor in each backend (``Backend.run`` dispatches on ``kind``)."""

    kind: Kind
    reduces: bool  # takes a reduce op and scale factors
    preallocated: bool  # output shape known at the call (allocated there, or in place)
    needs_dim0: bool  # refuses 0-d tensors (splits or gathers along dim 0)
    fusable: bool  # compatible instances may share a fusion bucket
    cacheable: bool  # its response may be reused from the response cache
    checks: tuple[tuple[str, str], ...]  # (field, label) compared across ranks
    while_joined: bool = True  # may run while some ranks have joined (Horovod: allreduce only)
    # Agreement-only collectives (no data) complete on the engine with this result...
    result: Callable[[Response], Any] | None = None
    # ...or with what the engine's executor for agreed changes returns (process sets).
    engine_action: bool = False


# Fields compared across ranks, by collective: (field, label for the message).
_COMMON = (("kind", "collective"), ("dtype", "dtype"), ("device", "device"))
_REDUCE = (("op", "reduce op"), ("shape", "shape"))
_ALONE = (("kind", "collective"),)
SPECS: dict[Kind, Spec] = {s.kind: s for s in (
    Spec(Kind.ALLREDUCE, reduces=True, preallocated=True, needs_dim0=False, fusable=True,
         cacheable=True, checks=(*_COMMON, *_REDUCE, ("prescale", "prescale_factor"),
                                 ("postscale", "postscale_factor"))),
    Spec(Kind.REDUCESCATTER, reduces=True, preallocated=False, needs_dim0=True, fusable=False,
         cacheable=True, checks=(*_COMMON, *_REDUCE), while_joined=False),
    Spec(Kind.BROADCAST, reduces=False, preallocated=True, needs_dim0=False, fusable=False,
         cacheable=True, checks=(*_COMMON, ("root", "root rank"), ("shape", "shape")),
         while_joined=False),
    Spec(Kind.ALLGATHER, reduces=False, preallocated=False, needs_dim0=True, fusable=False,
         cacheable=True, checks=(*_COMMON, ("trailing", "shape after dim 0")),
         while_joined=False),
    Spec(Kind.ALLTOALL, reduces=False, preallocated=False, needs_dim0=True, fusable=False,
         cacheable=True, checks=(*_COMMON, ("trailing", "shape after dim 0")),
         while_joined=False),
    Spec(Kind.BARRIER, reduces=False, preallocated=False, needs_dim0=False, fusable=False,
         cacheable=False, checks=_ALONE, result=lambda resp: None),
    Spec(Kind.JOIN, reduces=False, preallocated=False, needs_dim0=False, fusable=False,
         cacheable=False, checks=_ALONE, result=lambda resp: resp.last_joined),
    Spec(Kind.PROCESS_SET, reduces=False, preallocated=False, needs_dim0=False, fusable=False,
         cacheable=False, checks=(*_ALONE, ("op", "process set action"),
                                  ("root", "process set id"), ("shape", "process set ranks")),
         engine_action=True),
)}

_FIXES = {
    "shape": "pass tensors of the same shape on every rank",
    "dtype": "cast to one dtype on every rank",
    "device": "keep the tensor on the same kind of device on every rank",
    "root rank": "pass the same root_rank on every rank",
    "collective": "use a tensor name for one collective only",
    "process set ranks": "add and remove the same process sets, in the same order, on every "
                         "rank",
    "process set id": "add and remove the same process sets, in the same order, on every rank",
}


def is_unit(r: Request | Response) -> bool:
    """Whether ``r`` is a grouped call's unit (its shape is the tuple of its members')."""
    shape = r.shape
    return bool(shape) and type(shape[0]) is tuple


def _field(req: Request, name: str) -> object:
    if name == "trailing":
        return req.shape[1:] if req.shape else ()
    value = getattr(req, name)
    if name == "kind":
        return Kind(value).name.lower()
    if name == "op" and SPECS[req.kind].reduces:
        from hvdlite._ops import ReduceOp

        return ReduceOp(value).name.title()
    return value


def mismatch_message(name: str, by_rank: dict[int, Request]) -> str:
    """'' if the ranks agree on ``name``; else one line naming the field and each rank's value."""
    first = by_rank[min(by_rank)]
    if first.group and len({r.group_size for r in by_rank.values()}) > 1:
        sizes: dict[int, list[int]] = {}
        for rank in sorted(by_rank):
            sizes.setdefault(by_rank[rank].group_size, []).append(rank)
        shown = "; ".join(f"{_ranks(r)} grouped {n} tensors" for n, r in sizes.items())
        return (f"tensor {name!r}: grouped call sizes differ across ranks: {shown}; pass the "
                "same number of tensors on every rank")
    for fld, label in SPECS[first.kind].checks:
        values: dict[object, list[int]] = {}
        for rank in sorted(by_rank):
            values.setdefault(_field(by_rank[rank], fld), []).append(rank)
        if len(values) > 1:
            fix = _FIXES.get(label, f"pass the same {label} on every rank")
            if is_unit(first) and fld in ("shape", "dtype"):
                return _member_message(name, by_rank, fld, label, fix)
            shown = "; ".join(f"{_ranks(r)} sent {v}" for v, r in values.items())
            return f"tensor {name!r}: {label} differs across ranks: {shown}; {fix}"
    return ""


def _member_message(name: str, by_rank: dict[int, Request], fld: str, label: str,
                    fix: str) -> str:
    """The first member of a grouped call whose ``fld`` differs across ranks, named."""
    def member(req: Request, i: int) -> object:
        value = getattr(req, fld)
        return value[i] if isinstance(value, tuple) else value

    count = by_rank[min(by_rank)].group_size
    for i in range(count):
        values: dict[object, list[int]] = {}
        for rank in sorted(by_rank):
            values.setdefault(member(by_rank[rank], i), []).append(rank)
        if len(values) > 1:
            shown = "; ".join(f"{_ranks(r)} sent {v}" for v, r in values.items())
            return (f"tensor {name!r} (member {i} of the grouped call): {label} differs "
                    f"across ranks: {shown}; {fix}")
    return f"tensor {name!r}: {label} differs across ranks; {fix}"


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ",".join(map(str, ranks))


def build_response(name: str, by_rank: dict[int, Request], size: int,
                   joined: Sequence[int]) -> Response:
    """The response for a tensor every member rank submitted (``by_rank`` excludes joined)."""
    first = by_rank[min(by_rank)]
    error = mismatch_message(name, by_rank)
    sizes: tuple[int, ...] = ()
    if not error and joined and not SPECS[first.kind].while_joined:
        # As in Horovod: only allreduce runs while ranks have joined.
        error = (f"tensor {name!r}: {first.kind.name.lower()} cannot run while ranks "
                 f"{sorted(joined)} have joined; only allreduce can: run it before join() "
                 "or after every rank has joined")
    elif not error and first.kind is Kind.ALLGATHER:
        sizes = tuple(by_rank[r].shape[0] for r in range(size))
    elif not error and first.kind is Kind.ALLTOALL:
        sizes = tuple(s for r in range(size) for s in by_rank[r].splits)
    return Response(
        name=name, kind=first.kind, dtype=first.dtype, shape=first.shape, device=first.device,
        op=first.op, root=first.root, prescale=first.prescale, postscale=first.postscale,
        sizes=sizes, group=first.group, error=error, joined=tuple(joined),
    )


@dataclass(slots=True)
class _Pending:
    by_rank: dict[int, Request] = field(default_factory=dict)
    first_seen: float = 0.0


@dataclass(frozen=True, slots=True)
class StallReport:
    """One tensor the coordinator has waited on for too long."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    submitted: tuple[int, ...]
    missing: tuple[int, ...]
    waited_s: float


class CoordinatorTable:
    """Rank 0's table of tensors that some but not all member ranks have submitted.

    ``add`` records one rank's requests; ``pop_ready`` returns the responses for every tensor
    that became complete, in the order they completed (ties broken by rank, then by the order
    the rank submitted them), which is the order every rank executes.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._pending: dict[str, _Pending] = {}
        self._ready: list[str] = []
        self._joined: dict[int, None] = {}  # insertion order = join order

    def add(self, rank: int, requests: Iterable[Request], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for req in requests:
            if req.kind is Kind.JOIN:
                self._joined[rank] = None
            entry = self._pending.get(req.name)
            if entry is None:
                entry = self._pending[req.name] = _Pending(first_seen=now)
            entry.by_rank[rank] = req
            if req.kind is Kind.JOIN:
                # A join changes who must submit: tensors waiting only on this rank are ready
                # now, and must run before the join itself completes (which resets the joined
                # set their responses depend on).
                self._ready.extend(n for n, e in self._pending.items()
                                   if n not in self._ready and n != req.name
                                   and self._complete(e))
            if self._complete(entry):
                self._ready.append(req.name)

    def _complete(self, entry: _Pending) -> bool:
        first = next(iter(entry.by_rank.values()))
        if first.kind is Kind.JOIN:
            return len(entry.by_rank) == self.size
        return all(r in entry.by_rank or r in self._joined for r in range(self.size))

    def pop_ready(self) -> list[Response]:
        """The responses of every tensor that became complete, in the order they did (a
        grouped call is one tensor here: it succeeds or fails whole)."""
        out = [self._respond(name, self._pending.pop(name)) for name in self._ready]
        self._ready = []
        return out

    def _respond(self, name: str, entry: _Pending) -> Response:
        first = next(iter(entry.by_rank.values()))
        if first.kind is Kind.JOIN:
            last = next(reversed(self._joined))
            self._joined.clear()
            return Response(name=name, kind=Kind.JOIN, dtype="uint8", shape=(), device="cpu",
                            op=0, root=-1, prescale=1.0, postscale=1.0, last_joined=last)
        joined = tuple(r for r in self._joined if r not in entry.by_rank)
        return build_response(name, entry.by_rank, self.size, joined)

    def joined(self) -> tuple[int, ...]:
        return tuple(self._joined)

    def has_pending(self) -> bool:
        """Whether some tensor waits for a rank (what the stall inspector looks at)."""
        return bool(self._pending)

    def stalled(self, older_than_s: float, now: float | None = None) -> list[StallReport]:
        now = time.monotonic() if now is None else now
        reports = []
        for name, entry in self._pending.items():
            waited = now - entry.first_seen
            if waited < older_than_s:
                continue
            req = next(iter(entry.by_rank.values()))
            submitted = tuple(sorted(entry.by_rank))
            missing = tuple(r for r in range(self.size)
                            if r not in entry.by_rank and r not in self._joined)
            reports.append(StallReport(name, req.kind.name.lower(), req.dtype, req.shape,
                                       submitted, missing, waited))
        return reports


class ResponseCache:
    """Responses seen before, each in a numbered slot, identical on every rank.

    Every rank applies the same ``put``/``touch``/``evict`` calls in the same order (they come
    from the broadcast response list and from the agreed hit bits), so slot numbers agree
    everywhere and a hit is one bit. Least recently used slots are evicted when full.
    ``forget`` is told every name that leaves (evicted, invalidated, or pushed out by a new
    one) with the request it was cached for, so whatever else is kept per name leaves with
    it, at the same point on every rank.
    """

    def __init__(self, capacity: int,
                 forget: Callable[[str, Request | None], None] | None = None) -> None:
        self.capacity = capacity
        self._forget = forget
        self._by_name: OrderedDict[str, int] = OrderedDict()  # LRU order: oldest first
        self._slots: list[tuple[Response, Request | None] | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._by_name)

    def lookup(self, req: Request) -> tuple[int, bool]:
        """(slot, matches): slot -1 if ``req.name`` is not cached; matches if params agree."""
        slot = self._by_name.get(req.name, -1)
        if slot < 0:
            return -1, False
        cached = self._slots[slot]
        # The collective layer reuses a name's Request object while its parameters hold, so
        # the identity test settles the steady state without comparing fields.
        return slot, cached is not None and (cached[1] is req or cached[1] == req)

    def response(self, slot: int) -> Response:
        cached = self._slots[slot]
        assert cached is not None, f"cache slot {slot} is empty"
        return cached[0]

    def put(self, response: Response, request: Request | None) -> int:
        """Cache ``response``; return the slot evicted to make room for it (-1 if none)."""
        if self.capacity == 0 or response.error or not SPECS[response.kind].cacheable:
            return -1
        if response.joined:
            return -1  # depends on who had joined: not reusable later
        old = self._by_name.pop(response.name, None)
        if old is not None:
            self._slots[old] = None
            self._free.append(old)
        victim = -1
        if not self._free:
            gone, victim = self._by_name.popitem(last=False)
            cached = self._slots[victim]
            self._slots[victim] = None
            self._free.append(victim)
            if self._forget is not None and cached is not None:
                self._forget(gone, cached[1])
        slot = self._free.pop()
        self._slots[slot] = (response, request)
        self._by_name[response.name] = slot
        return victim

    def touch(self, slot: int) -> None:
        cached = self._slots[slot]
        if cached is not None:
            self._by_name.move_to_end(cached[0].name)

    def evict(self, slot: int) -> None:
        cached = self._slots[slot]
        if cached is None:
            return
        self._slots[slot] = None
        del self._by_name[cached[0].name]
        self._free.append(slot)
        if self._forget is not None:
            self._forget(cached[0].name, cached[1])

    def occupied(self) -> list[int]:
        return sorted(self._by_name.values())


# Compact wire form for the uncached path: plain tuples pickle several times faster than
# dataclass instances, and this path carries every new tensor's request.
def pack_request(r: Request) -> tuple[object, ...]:
    return (r[0], int(r[1]), *r[2:])


def unpack_request(t: tuple[Any, ...]) -> Request:
    return Request(t[0], Kind(t[1]), *t[2:])


def pack_response(r: Response) -> tuple[object, ...]:
    return (r.name, int(r.kind), r.dtype, r.shape, r.device, r.op, r.root, r.prescale,
            r.postscale, r.sizes, r.group, r.error, r.joined, r.last_joined)


def unpack_response(t: tuple[Any, ...]) -> Response:
    return Response(t[0], Kind(t[1]), *t[2:])
