"""The coordinator's bookkeeping: its table of pending requests (ready order, validation,
joins, the stall inspector's view), the response cache, and the mismatch messages.

Everything here is pure bookkeeping (no MPI), so unit tests drive it directly. The negotiator
moves the words (``hvdlite/_vocab/messages.py``) between ranks; this module decides what is
ready, in which order, and what is wrong with it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from hvdlite._vocab.messages import SPECS, Kind, Request, Response, is_unit

__all__ = ["CoordinatorTable", "ResponseCache", "StallReport", "build_response",
           "mismatch_message"]


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
    # The usual case, on rank 0 for every uncached tensor: requests equal as whole tuples
    # (compared in C) cannot differ in a checked field; only a difference is worth the
    # field-by-field pass that names it.
    if all(req == first for req in by_rank.values()):
        return ""
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
            # With ranks joined, the entry may be ready already (they stood in for a rank
            # that now submits too: a join whose wait was abandoned): once is enough.
            if self._complete(entry) and not (self._joined and req.name in self._ready):
                self._ready.append(req.name)

    def _complete(self, entry: _Pending) -> bool:
        have = len(entry.by_rank)
        if have == self.size:  # every rank submitted (its keys are ranks of the set)
            return True
        if not self._joined or next(iter(entry.by_rank.values())).kind is Kind.JOIN:
            return False
        # Ranks that joined stand in for their requests: O(size) only while some have.
        return have + sum(1 for r in self._joined if r not in entry.by_rank) == self.size

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

    def cached(self, req: Request) -> tuple[int, Response] | None:
        """(slot, response) if ``req`` is cached with the same parameters, else None."""
        slot, same = self.lookup(req)
        return (slot, self.response(slot)) if same else None

    def take(self, slot: int) -> Response:
        """The response of ``slot``, marked used (least recently used goes first)."""
        cached = self._slots[slot]
        assert cached is not None, f"cache slot {slot} is empty"
        self._by_name.move_to_end(cached[0].name)
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
