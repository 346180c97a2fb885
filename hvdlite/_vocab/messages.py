"""The words every plane shares: what a collective is (:class:`Kind`, one :class:`Spec` row
each in :data:`SPECS`), what a rank asks for (:class:`Request`) and what the ranks agreed
(:class:`Response`), and their compact wire form. Pure data: no MPI, no engine."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["Kind", "Spec", "SPECS", "Request", "Response", "is_unit", "pack_request",
           "unpack_request", "pack_response", "unpack_response"]

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

def is_unit(r: Request | Response) -> bool:
    """Whether ``r`` is a grouped call's unit (its shape is the tuple of its members')."""
    shape = r.shape
    return bool(shape) and type(shape[0]) is tuple


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
