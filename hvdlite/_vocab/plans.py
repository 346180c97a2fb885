"""The steady state of a training step, recognised at the call and replayed.

A data-parallel step submits the same tensors, under the same names, with the same parameters,
step after step. Two records turn that repeat into a few comparisons:

- :class:`Lane`, on the caller's side, one per tensor name and process set: the last call's
  tensor layout and parameters, the :class:`Request` they made (so the response cache hits by
  identity), and the result arrays it may hand out again (:class:`Results`). A call that
  matches its lane skips wrapping, the dtype lookup, every check and the request; a grouped
  call that matches skips them for all its members at once (its members are the same objects
  as last time, with the same shapes and dtypes).
- :class:`MemberPlan`, on the executing side, one per bucket: which members are reduced on
  their own (large ones, no copy) and which are fused, their offsets, and the pointer tables
  the device copy kernels read. It is rebuilt only when a member's address changed.

Both follow ``cache_capacity`` (``hvdlite/_lru.py``): a name's lane goes when the response
cache lets the name go (an agreed eviction, the same on every rank: see ``Channel.forget``),
or, oldest first, beyond twice that many lanes (names in flight or never cached); member
plans, at most that many, least recently used out.

Result arrays are recycled the way a caching allocator recycles memory, and only for a name
that repeats (a lane's first call keeps nothing, so names made up per step hold no memory):
a result is handed out again only once nothing but hvdlite refers to it (the caller dropped
it, every view of it and the handle that returned it), which ``sys.getrefcount`` tells
exactly. On the device the new call's READY event orders the reuse after the caller's own
stream, as CuPy's memory pool orders a freed block's reuse (a kernel on *another* stream
still reading a dropped result is as unsafe here as with CuPy's pool).
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

from hvdlite._handles import Handle
from hvdlite._lru import Bounded
from hvdlite._ops import DTYPES, ReduceOp
from hvdlite._vocab.entry import Entry
from hvdlite._vocab.messages import Request, Response

__all__ = ["Call", "Lane", "Lanes", "Results", "MemberPlan", "span_of", "refcounts",
           "unit_groups"]

_RESULT_SETS = 2  # result sets kept per lane: the one the caller holds and one to fill next
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def refcounts(items: Sequence[Any]) -> list[int]:
    """Reference counts of ``items``, measured the same way every time (see :class:`Results`)."""
    return list(map(sys.getrefcount, items))


class Results:
    """One set of result arrays a lane may hand out again: ``views`` (one per member) and the
    ``flat`` buffer they are views of (None for a single tensor or mixed dtypes).

    ``free`` holds the reference counts measured right after creation (by :meth:`Lane.result`,
    once the frames that made the arrays are gone), when only this object referred to them;
    the set is free again when the counts are back to those values (a view a caller made of
    a result refers to the result or to ``flat``, and so keeps it busy).

    A framework whose tensors are viewed (torch) gets ``user``: its own tensors over the
    views, made once with the set, handed out instead of the arrays and counted by
    ``counter``, made once with them by the framework (a view of a torch tensor holds its
    storage, not the tensor).
    """

    __slots__ = ("flat", "views", "free", "user", "counter")

    def __init__(self, flat: Any, views: list[Any]) -> None:
        self.flat = flat
        self.views = views
        self.free: list[int] = []
        self.user: list[Any] | None = None
        self.counter: Callable[[], list[int]] | None = None

    def _counts(self) -> list[int]:
        if self.counter is not None:
            # The framework's tensors alone: whoever holds the arrays (an entry in flight, the
            # handle once done) holds them too.
            return self.counter()
        flat = self.flat
        return refcounts(self.views if flat is None else [flat, *self.views])

    def idle(self) -> bool:
        return self._counts() == self.free


class Call:
    """One call bound to its lane (the plan): what it moves and where the results go.

    ``inputs`` is the input array (a grouped call: the tuple of member arrays), ``output`` the
    result array (a grouped call: the list of result arrays; None where the collective
    allocates it), ``span`` one flat array over a grouped call's outputs when they lie end to
    end, ``user`` the caller's own object(s) to hand back (in place or ``out=``), ``nbytes``
    the payload.
    """

    __slots__ = ("inputs", "output", "span", "user", "nbytes")

    def __init__(self, inputs: Any, output: Any, span: Any, user: Any, nbytes: int) -> None:
        self.inputs, self.output, self.span, self.user = inputs, output, span, user
        self.nbytes = nbytes

    def value(self, lane: Lane) -> Any:
        """What a blocking call returns when its collective ran on the calling thread."""
        if self.user is not None:
            return list(self.user) if lane.shapes else self.user
        if lane.shapes:
            return (list(self.output) if lane.to_user is None
                    else [lane.to_user(r) for r in self.output])
        return self.output if lane.to_user is None else lane.to_user(self.output)

    def entry(self, lane: Lane) -> Entry:
        """The call as the engine's queue takes it (one entry, one handle)."""
        handle = Handle(lane.request.name)
        if not lane.shapes:
            return Entry(lane.request, self.inputs, self.output, handle, self.user,
                         lane.device_id, lane.to_user)
        entry = Entry(lane.request, self.inputs[0], None, handle, self.user, lane.device_id,
                      lane.to_user)
        entry.members, entry.outputs, entry.span = self.inputs, self.output, self.span
        entry.size = self.nbytes
        return entry


class Lane:
    """The steady state of one tensor name on one process set (see the module docstring).

    ``params`` is the call's parameters with their types (``1 == Sum`` and ``True == 1.0``
    compare equal but must not pass for each other), ``shape``/``dtype``/``strides`` the
    input's layout, ``ttype`` its array type and ``device_id`` its device (-1: host).
    """

    __slots__ = ("request", "params", "ttype", "shape", "dtype", "strides", "device_id",
                 "framework", "to_user", "inputs", "shapes", "span", "results", "alloc",
                 "inplace", "request_bytes", "allocated", "view", "counts", "last", "ring")

    def __init__(self, request: Request, params: tuple[Any, ...], array: Any, device_id: int,
                 framework: str, to_user: Callable[[Any], Any] | None,
                 alloc: Callable[[], Results] | None) -> None:
        self.request = request
        self.params = params
        self.ttype = type(array)
        self.shape = array.shape
        self.dtype = array.dtype
        self.strides = array.strides
        self.device_id = device_id
        self.framework = framework
        self.to_user = to_user
        self.inputs: tuple[Any, ...] = ()
        self.shapes: tuple[tuple[int, ...], ...] = ()
        self.span: Any = None
        self.inplace = False
        self.request_bytes = array.nbytes  # the payload (a grouped call's: all members')
        self.allocated = 0  # result sets made (the engine's stats add them up)
        self.results: list[Results] = []
        self.alloc = alloc  # makes a new Results (None: the collective allocates no output)
        # A viewed framework's edge (torch: the caller's tensors -> their cached arrays, one
        # call for all members) and the maker of its result counters (see Results); None for
        # arrays hvdlite uses as they are.
        self.view: Callable[[Sequence[Any]], list[Any]] | None = None
        self.counts: Callable[[Sequence[Any]], Callable[[], list[int]]] | None = None
        # A viewed framework's last matched array: its edge hands the same (immutable) view
        # while the tensor holds the same memory, so that one needs no layout check.
        self.last: Any = None
        # A viewed framework's single tensor keeps its recycled results (_tensorref.Ring).
        self.ring: Any = None

    def matches(self, array: Any, params: tuple[Any, ...]) -> bool:
        """Whether a single-tensor call of ``array`` with ``params`` repeats this lane."""
        return (type(array) is self.ttype and array.shape == self.shape
                and array.dtype is self.dtype and array.strides == self.strides
                and params == self.params
                and (self.device_id < 0 or array.data.device_id == self.device_id))

    def matches_group(self, tensors: Sequence[Any], params: tuple[Any, ...]) -> bool:
        """Whether a grouped call repeats this lane: the same member objects (so the same
        addresses), still of the same shapes (and dtype: NumPy lets a caller reassign it;
        a CuPy array's is fixed), with the same parameters."""
        inputs = self.inputs
        if self.view is not None:
            # A viewed framework's cached arrays (torch): its edge hands out the same array only
            # while its tensor keeps the memory, shape and dtype the array was made for, and
            # nothing else reshapes it; the same objects are the same layout.
            return (len(tensors) == len(inputs) and params == self.params
                    and all(map(operator.is_, tensors, inputs)))
        return (len(tensors) == len(inputs) and params == self.params
                and all(map(operator.is_, tensors, inputs))
                and tuple(map(_SHAPE, tensors)) == self.shapes
                and (self.device_id >= 0
                     or all(map(operator.is_, map(_DTYPE, tensors), repeat(self.dtype)))))

    def bind(self, tensors: Sequence[Any], users: Sequence[Any], out: Any, inplace: bool,
             params: tuple[Any, ...], reclaim: Callable[[], None]) -> Call | None:
        """This call bound to the lane if it repeats it (same layout, same parameters, for a
        grouped call the same member objects), else None (the call builds a new lane).
        ``tensors`` are the arrays (a viewed framework's cached views), ``users`` the
        caller's own objects (handed back when in place)."""
        if self.shapes:
            if not self.matches_group(tensors, params):
                return None
            members = self.inputs
            if self.inplace:
                return Call(members, members, self.span, users, self.request_bytes)
            res = self.result(reclaim)
            assert res is not None  # an allreduce always has results
            return Call(members, res.views, res.flat, res.user, self.request_bytes)
        tensor = tensors[0]
        if tensor is not self.last or self.view is None:
            if not self.matches(tensor, params):
                return None
            self.last = tensor if self.view is not None else None
        elif params != self.params:
            return None
        user = None
        if inplace:
            if self.device_id < 0 and not tensor.flags.writeable:
                return None  # building the lane raises the error
            output, user = tensor, users[0]
        elif out is not None:
            if not (type(out) is self.ttype and out.shape == self.shape
                    and out.dtype is self.dtype and out.strides == self.strides
                    and (out.data.device_id == self.device_id if self.device_id >= 0
                         else out.flags.writeable)):
                return None
            output = user = out
        else:
            res = self.result(reclaim)
            output = res.views[0] if res is not None else None
            if res is not None and res.user is not None:
                user = res.user[0]
        return Call(tensor, output, None, user, self.request_bytes)  # the same layout

    def result(self, reclaim: Callable[[], None] | None = None,
               keep: bool = True) -> Results | None:
        """A result set nothing outside hvdlite refers to, or a new one (kept for reuse while
        fewer than ``_RESULT_SETS`` exist, and only if ``keep``: a name's first call keeps
        none, since a name that never repeats would hold it for nothing); None if the
        collective allocates no output. ``reclaim`` drops hvdlite's own references to finished
        device work (its retirement), tried once before allocating."""
        if self.alloc is None:
            return None
        ring = self.ring
        if ring is not None:  # the tensor's own results, whichever lane made them
            results = ring.sets
            keep = ring.used
            if not keep:  # written once, not per call
                ring.used = True
        else:
            results = self.results
        if reclaim is not None and results:
            reclaim()
        for res in results:
            if res.idle():
                return res
        res = self.alloc()
        self.allocated += 1
        if self.counts is not None and self.to_user is not None:
            res.user = [self.to_user(v) for v in res.views]
            res.counter = self.counts(res.user)  # counted from here on (Results._counts)
        if keep and len(results) < _RESULT_SETS:
            res.free = res._counts()  # only ``res`` refers to them now
            results.append(res)
        return res


class Lanes(Bounded[str, Lane]):
    """The lanes of one process set, by tensor name, at most ``capacity`` (any thread: single
    dict operations). A call reads its lane with ``get``; the response cache's use order
    decides which names go (``Channel.forget``), so a hit does not reorder here."""


def span_of(arrays: Sequence[Any], framework: str) -> Any:
    """One flat array over ``arrays`` if they lie end to end in one allocation, in order, all
    C-contiguous and of one dtype (the caller-owned bucket layout); else None."""
    first = arrays[0]
    dtype = first.dtype
    if any(a.dtype != dtype for a in arrays):
        return None
    total = sum(a.size for a in arrays)
    if framework == "cupy":
        ptr = first.data.ptr
        device = first.data.device_id
        for a in arrays:
            if (a.data.ptr != ptr or a.data.device_id != device
                    or not a.flags.c_contiguous):
                return None
            ptr += a.nbytes
        import cupy

        return cupy.ndarray((total,), dtype, first.data)
    return _host_span(arrays, dtype, total)


def _host_span(arrays: Sequence[Any], dtype: Any, total: int) -> Any:
    import numpy as np

    def address(a: Any) -> int:
        return int(a.__array_interface__["data"][0])

    base = arrays[0].base if arrays[0].base is not None else arrays[0]
    if not isinstance(base, np.ndarray) or not base.flags.c_contiguous:
        return None
    ptr = address(arrays[0])
    for a in arrays:
        owner = a.base if a.base is not None else a
        if owner is not base or address(a) != ptr or not a.flags.c_contiguous:
            return None
        ptr += a.nbytes
    start = address(arrays[0]) - address(base)
    raw = base.reshape(-1).view(np.uint8)
    return raw[start:start + total * dtype.itemsize].view(dtype)


class MemberPlan:
    """How one bucket's members are reduced, for one set of member addresses.

    ``counts`` are the members' element counts on the wire. Members of ``direct_bytes`` or
    more are reduced on their own (``direct``), straight from their input into their output;
    the others (``fused``) are copied into one staging region at ``offsets``, reduced there in
    one call and copied out. ``key`` is the (inputs, outputs) addresses the plan was built
    for; ``tables`` is whatever the backend derived from them (device pointer tables), kept
    until the addresses change; ``source`` the tuple of inputs they were read from, when a lane
    hands the same tuple (of the same arrays, so the same addresses) every step.
    """

    __slots__ = ("counts", "direct", "fused", "offsets", "total", "key", "tables", "source")

    def __init__(self, counts: Sequence[int], itemsize: int, direct_bytes: int) -> None:
        self.counts = list(counts)
        limit = max(direct_bytes, 1)
        self.direct = [i for i, n in enumerate(counts) if n * itemsize >= limit]
        self.fused = [i for i, n in enumerate(counts) if n * itemsize < limit]
        if len(self.fused) == 1:  # one member alone needs no staging
            self.direct = sorted([*self.direct, *self.fused])
            self.fused = []
        offsets = [0]
        for i in self.fused:
            offsets.append(offsets[-1] + counts[i])
        self.offsets = offsets
        self.total = offsets[-1]
        self.key: tuple[Any, ...] | None = None
        self.tables: Any = None
        self.source: tuple[Any, ...] | None = None  # the inputs ``key`` was read from


def unit_groups(resp: Response, entry: Entry | None,
                xp: Any) -> list[tuple[str, Any, Any, Any]]:
    """A grouped call's members as (dtype, inputs, outputs, span) per dtype, in order of
    first appearance (the same on every rank). A joined rank (``entry`` None) contributes the
    identity of the op, in one ``xp`` (NumPy or CuPy) scratch array per dtype, in place."""
    dtypes = resp.dtype if type(resp.dtype) is tuple else (resp.dtype,) * len(resp.shape)
    if entry is None:
        op = ReduceOp(resp.op)
        out = []
        for dtype in dict.fromkeys(dtypes):
            row = DTYPES[dtype]
            n = sum(math.prod(s) for s, d in zip(resp.shape, dtypes, strict=True) if d == dtype)
            scratch = xp.full(n, row.identity(op), dtype=row.np_dtype)
            both = [scratch]  # in place: the same list as inputs and outputs
            out.append((dtype, both, both, scratch))
        return out
    assert entry.members is not None and entry.outputs is not None
    if type(resp.dtype) is str:
        return [(resp.dtype, entry.members, entry.outputs, entry.span)]
    groups: dict[str, tuple[list[Any], list[Any]]] = {}
    for dtype, src, dst in zip(dtypes, entry.members, entry.outputs, strict=True):
        srcs, dsts = groups.setdefault(dtype, ([], []))
        srcs.append(src)
        dsts.append(dst)
    return [(d, srcs, dsts, None) for d, (srcs, dsts) in groups.items()]
