"""``DistributedOptimizer``'s gradient buckets: which parameters are reduced together, and
the optional persistent buffers their gradients live in.

A bucket is reduced by one in-place allreduce once every member's gradient is ready (one
request instead of one per parameter). Without ``groups=`` the buckets are formed
automatically: parameters in reverse registration order (roughly the order backward produces
their gradients), one (device, dtype) per bucket, up to a byte cap; after the first step,
formed again in the order the first backward made the gradients ready (rank 0's, as DDP
rebuilds its buckets), since registration order can differ (a class token or an embedding
registered first whose gradient is not the last). With
``gradient_as_bucket_view`` (the default) each bucket owns one flat buffer and every member's
``.grad`` is a view of it, in order, each starting on a 16-byte boundary (zeros between, see
:func:`_layout`): autograd accumulates straight into the
buffer and the core reduces the buffer in place as one array, with no copy in or out.
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch

from hvdlite._torchref import numpy_dtype
from hvdlite.torch._accumulate import ALIGN_BYTES
from hvdlite.torch._accumulate import hook as accumulation_hook
from hvdlite.torch.compression import Compression, _CastCompressor
from hvdlite.torch.functions import broadcast_object
from hvdlite.torch.process_sets import global_process_set

__all__ = ["Bucket", "Hooks", "ReadyOrder", "auto_buckets", "mib_bytes", "ordered_buckets",
           "param_names", "remove_hooks", "split", "user_groups", "wire_type"]

TOO_MANY = ("gradients were computed more than backward_passes_per_step times before "
            "optimizer.step(): this backward() accumulated into a gradient after its "
            "bucket's allreduce had started, so this step's gradients are not to be "
            "trusted. Call optimizer.step() (or optimizer.synchronize()) between backward "
            "passes, or raise backward_passes_per_step to accumulate gradients locally.")


class Bucket:
    """The parameters reduced together (``params``, in order) under ``name``; ``ready``
    counts members whose gradient is ready this step, ``left[i]`` the backward passes member
    ``i`` still accumulates before it is (``full`` resets it): the per-member hooks' state.
    The counted hooks' (:func:`_register_hooks`): ``arrived`` the members' arrivals this step,
    ``expect`` how many make the bucket ready, ``last`` the member whose gradient backward
    makes ready last (its hook alone is Python).
    With views, ``views[i]`` is member ``i``'s gradient, a view of the flat ``buffer``;
    ``wire`` (compression) is the buffer's compressed twin the allreduce runs on."""

    __slots__ = ("params", "name", "ready", "left", "full", "device", "buffer", "views",
                 "wire", "staging", "staged", "viewed", "arrived", "expect", "last",
                 "offsets", "total")

    def __init__(self, params: Sequence[torch.Tensor], name: str, passes: int) -> None:
        self.params = tuple(params)
        self.name = name
        self.ready = 0
        self.full = [passes] * len(self.params)
        self.left = list(self.full)
        self.arrived: list[torch.Tensor] = []
        self.expect = passes * len(self.params)
        self.last = len(self.params) - 1
        first = self.params[0]
        self.device = first.get_device() if first.is_cuda else -1
        # Where each member lives in a flat buffer of the bucket, and the buffer's length.
        self.offsets, self.total = _layout(self.params)
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.wire: torch.Tensor | None = None
        # Whether the bucket is to live in a buffer: None until its first start decides (a
        # member whose gradient turns out sparse keeps it out for good).
        self.viewed: bool | None = None
        # Without views: the gradients are copied (one torch call) into ``staging``, reduced
        # there by one call whose array the core sees every step (its lane), and copied back.
        self.staging: torch.Tensor | None = None
        self.staged: list[torch.Tensor] = []

    def passes(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes per allreduce from now on."""
        self.full = [passes] * len(self.params)
        self.left = list(self.full)
        self.expect = passes * len(self.params)

    def reset(self) -> None:
        """The end of a step: every count back to its start."""
        self.left[:] = self.full
        self.ready = 0
        self.arrived.clear()

    def viewable(self) -> bool:
        """Whether the members can share one flat buffer (one dtype NumPy can hold, one
        device, dense)."""
        first = self.params[0]
        return numpy_dtype(first.dtype) is not None and all(
            p.dtype == first.dtype and p.device == first.device and p.layout is torch.strided
            for p in self.params)

    def make_views(self, wire: torch.dtype | None = None) -> None:
        """Allocate the flat buffer and point every member's ``.grad`` at its view, keeping
        the values of the gradients there are (one batched copy; zeros where there is none).
        ``wire``: also allocate the compressed twin of that type."""
        first = self.params[0]
        self.buffer = torch.zeros(self.total, dtype=first.dtype, device=first.device)
        self.views = [self.buffer[at:at + p.numel()].view(p.shape)
                      for p, at in zip(self.params, self.offsets, strict=True)]
        if wire is not None:  # zeros: the padding travels too
            self.wire = torch.zeros(self.total, dtype=wire, device=first.device)
        self.viewed = True
        self.realias()

    def view_if_dense(self, compression: Any) -> None:
        """Views wanted and not made yet (``viewed`` None): make them now, of the wire type
        of ``compression``, unless a gradient is sparse (the bucket then stays out of views
        for good)."""
        if any(p.grad is not None and p.grad.is_sparse for p in self.params):
            self.viewed = False
        else:
            wire = wire_type(compression, self)
            self.make_views(wire if isinstance(wire, torch.dtype) else None)

    def make_staging(self, wire: torch.dtype | None = None) -> None:
        """Allocate the persistent staging buffer (``staging``; ``staged`` are the members'
        views of it): each step the gradients are copied in by one batched copy (cast to
        ``wire`` when given: a compressor's type), reduced there as one array and copied back
        by one batched copy."""
        self.viewed = False
        first = self.params[0]
        self.staging = torch.zeros(self.total, dtype=wire or first.dtype, device=first.device)
        self.staged = [self.staging[at:at + p.numel()].view(p.shape)
                       for p, at in zip(self.params, self.offsets, strict=True)]

    def hand_back(self, grads: list[torch.Tensor]) -> None:
        """Copy the reduced staging buffer back into ``grads`` (the gradients it was staged
        from, one batched copy); a ``.grad`` replaced while the bucket was on the wire is
        pointed back at its reduced gradient, as Horovod writes the reduced value back."""
        torch._foreach_copy_(grads, self.staged)
        if not all(map(operator.is_, map(_GRAD, self.params), grads)):
            for p, grad in zip(self.params, grads, strict=True):
                p.grad = grad

    def repoint(self) -> None:
        """Point every member's ``.grad`` at its view (holding the reduced gradient): a
        ``.grad`` replaced while the bucket was on the wire is overwritten, as Horovod writes
        the reduced value back over it."""
        if not all(map(operator.is_, map(_GRAD, self.params), self.views)):
            for p, view in zip(self.params, self.views, strict=True):
                p.grad = view

    def realias(self) -> bool:
        """Make every member's ``.grad`` its view again (a user may have replaced it or set
        it to None; autograd replaces it under ``create_graph``, or makes a new one after
        ``zero_grad()``, torch's default ``set_to_none=True``): one batched copy of the dense
        replacements in, one batched zeroing of the missing ones. False, touching nothing, if
        a member's gradient is sparse (no view can hold it)."""
        grads = list(map(_GRAD, self.params))
        views = self.views
        if all(map(operator.is_, grads, views)):
            return True  # the steady state with zero_grad(set_to_none=False): C-level passes
        if not any(map(operator.is_, grads, views)) and type(None) not in map(type, grads) \
                and not any(map(_SPARSE, grads)):
            # Every gradient made afresh by this backward (after zero_grad() set them to
            # None): in, and point at, without comparing each to its view (no Python per
            # member: this runs on the autograd thread of every step that zeroes with None).
            torch._foreach_copy_(views, grads)
            deque(map(setattr, self.params, repeat("grad"), views), maxlen=0)
            return True
        copy_to, copy_from, zero = [], [], []
        for grad, view in zip(grads, views, strict=True):
            if grad is view:
                continue
            if grad is None:
                zero.append(view)
            elif grad.is_sparse:
                return False
            elif grad.data_ptr() != view.data_ptr() or grad.shape != view.shape \
                    or grad.stride() != view.stride():
                copy_to.append(view)
                copy_from.append(grad)
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)
        if zero:
            torch._foreach_zero_(zero)
        deque(map(setattr, self.params, repeat("grad"), views), maxlen=0)
        return True


_GRAD = operator.attrgetter("grad")
_SPARSE = operator.attrgetter("is_sparse")

def _layout(params: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """(each member's offset in a flat buffer of ``params``, in elements of the first's
    type; the buffer's length): consecutive, each member starting on an ``ALIGN_BYTES``
    boundary. A compiled backward writes a gradient in place only into an aligned view
    (inductor runs a misaligned input on an aligned copy: hvdlite/torch/_accumulate.py), and
    one odd-sized member (a 10-class head's bias) would leave every later view misaligned. The
    padding is zeros, reduced with the rest (any reduction of zeros is zero)."""
    step = max(1, ALIGN_BYTES // params[0].element_size())
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += -(-p.numel() // step) * step
    return offsets, offsets[-1] + params[-1].numel()


def mib_bytes(name: str, mib: object, optional: bool = False) -> int:
    """``mib`` MiB in bytes (``optional``: None is 0, no cap); ``ValueError`` unless it is a
    positive number."""
    if mib is None and optional:
        return 0
    if not isinstance(mib, (int, float)) or isinstance(mib, bool) or mib <= 0:
        raise ValueError(f"{name} must be a positive number{' or None' if optional else ''}, "
                         f"got {mib!r}")
    return max(1, int(mib * 1024 * 1024))


def auto_buckets(params: Sequence[torch.Tensor], cap_bytes: int,
                 tail_bytes: int = 0) -> list[list[torch.Tensor]]:
    """``params`` (in registration order) split into buckets: reverse order, one (device,
    dtype) per bucket, each at most ``cap_bytes`` (a larger parameter is a bucket alone).
    With ``tail_bytes``, the last bucket of each (device, dtype) holds at most that (one
    parameter at least): the first parameters, whose gradients backward computes last, so
    what is left to reduce after backward is short; the rest of what would have been that
    bucket goes before it."""
    buckets: list[list[torch.Tensor]] = []
    open_: dict[tuple[Any, Any], tuple[list[torch.Tensor], int]] = {}
    for p in reversed(list(params)):
        key = (p.device, p.dtype)
        nbytes = _nbytes(p)
        members, size = open_.get(key, ([], 0))
        if members and size + nbytes > cap_bytes:
            buckets.append(members)
            members, size = [], 0
        members.append(p)
        open_[key] = (members, size + nbytes)
    for members, size in open_.values():
        if tail_bytes and size > tail_bytes and len(members) > 1:
            # The tail is the longest end of the members that fits (the last one alone if it
            # does not); what precedes it becomes a bucket of its own.
            k, kept = len(members) - 1, _nbytes(members[-1])
            while k > 1 and kept + _nbytes(members[k - 1]) <= tail_bytes:
                k -= 1
                kept += _nbytes(members[k])
            buckets.append(members[:k])
            members = members[k:]
        buckets.append(members)
    return buckets


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def ordered_buckets(params: Sequence[torch.Tensor], seen: Sequence[int], cap_bytes: int,
                    tail_bytes: int) -> list[list[torch.Tensor]]:
    """:func:`auto_buckets` of ``params`` in the order their gradients became ready
    (``seen``: indices into ``params``, first ready first), the last bucket holding what was
    ready last; the parameters not seen (no gradient in that step) in buckets after them."""
    ready = [params[i] for i in seen]
    taken = set(seen)
    rest = [p for i, p in enumerate(params) if i not in taken]
    return auto_buckets(ready[::-1], cap_bytes, tail_bytes) + (
        auto_buckets(rest, cap_bytes) if rest else [])


class ReadyOrder:
    """The order in which the gradients of ``params`` are first accumulated, seen by hooks
    of its own that :meth:`take` removes (nothing is left on the steady-state path); the
    hooks go with ``owner`` if it is collected first."""

    def __init__(self, owner: object, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.seen: list[int] = []
        marked = [False] * len(self.params)
        seen = self.seen

        def hook_for(i: int) -> Callable[[torch.Tensor], None]:
            def hook(_param: torch.Tensor) -> None:
                if not marked[i]:
                    marked[i] = True
                    seen.append(i)
            return hook

        self.handles = [accumulation_hook(p, _opaque(hook_for(i)))
                        for i, p in enumerate(self.params)]
        weakref.finalize(owner, remove_hooks, self.handles).atexit = False

    def take(self) -> list[int]:
        """The indices seen, in order; the hooks are removed."""
        remove_hooks(self.handles)
        return list(self.seen)


def wire_type(compression: Any, bucket: Bucket) -> torch.dtype | None | bool:
    """What ``bucket``'s buffer travels as under ``compression``: None (itself), the
    compressor's cast type, or False when the compressor is not a plain cast (it then sees
    each gradient)."""
    if compression is Compression.none:
        return None
    if isinstance(compression, type) and issubclass(compression, _CastCompressor):
        dtype = bucket.params[0].dtype
        return compression.wire if dtype.is_floating_point and dtype != compression.wire \
            else None
    return False


def user_groups(plist: list[torch.Tensor], names: dict[torch.Tensor, str], groups: Any,
                process_set: Any) -> list[list[torch.Tensor]]:
    """The buckets of ``groups=`` (a list of parameter lists, or a count): in the set's first
    member's parameter order (collective over the set: one broadcast), the parameters in no
    group one bucket each."""
    root = 0 if process_set is global_process_set else process_set.ranks[0]
    order = broadcast_object([names[p] for p in plist], root, "DistributedOptimizer.order",
                             process_set)
    rank_of = {n: i for i, n in enumerate(order)}
    plist.sort(key=lambda p: rank_of.get(names[p], len(order)))
    if isinstance(groups, list):
        ids = {id(p) for p in plist}
        p_groups = [[p for p in g if id(p) in ids] for g in groups]
        grouped = {id(p) for g in p_groups for p in g}
        return [g for g in p_groups if g] + [[p] for p in plist if id(p) not in grouped]
    return split(plist, groups)


def _register_hooks(owner: object, buckets: Sequence[Bucket], flights: dict[Bucket, Any],
                   start: Callable[[Bucket], Any], counted: bool = False) -> list[Any]:
    """Hook every member of ``buckets`` (after its gradient accumulates): a member counts
    down its passes, and the bucket's last ready member sets ``flights[bucket] =
    start(bucket)``. Returns the hooks' handles.

    ``counted`` (once the order backward makes the gradients ready is known, each bucket's
    ``last`` member the one it makes ready last): every member but ``last`` is hooked by
    ``bucket.arrived.append`` itself, a C function (no Python frame: on a host-bound model a
    Python hook per parameter cost 2-3% of the step, run 120), and ``last``'s Python hook
    starts the bucket when every arrival is in. Where a step's order differs,
    :func:`_arrivals` says so and the caller goes back to per-member hooks.

    ``start`` (a method of ``owner``) is held weakly, and once ``owner`` is collected its
    hooks are removed: the collector does not see a parameter's hooks, so a hook holding the
    owner would keep a dropped optimizer (and its agreed schedule) alive, and each hook holds
    its bucket, which holds the parameters. Not thread-safe: call it from the owner's
    constructor.
    """
    begin = weakref.WeakMethod(start)
    if counted:
        handles = [accumulation_hook(p, _counted(bucket, flights, begin) if i == bucket.last
                                     else bucket.arrived.append, _home(bucket, i))
                   for bucket in buckets for i, p in enumerate(bucket.params)]
    else:
        handles = [accumulation_hook(p, _hook(bucket, i, flights, begin), _home(bucket, i))
                   for bucket in buckets for i, p in enumerate(bucket.params)]
    weakref.finalize(owner, remove_hooks, handles).atexit = False
    return handles


def _home(bucket: Bucket, i: int) -> Callable[[], torch.Tensor | None]:
    """Where member ``i``'s new gradient is to live when a compiled backward accumulates it
    (``_accumulate.py``): its view, once the bucket has them (no copy in at the start)."""
    def home() -> torch.Tensor | None:
        views = bucket.views
        return views[i] if views else None
    return home


class Hooks:
    """An optimizer's gradient hooks over its buckets (:func:`_register_hooks`): per member
    until the order backward makes the gradients ready is known (:meth:`count`), counted
    from then on, and per member again for good after a step in another order. ``owner``,
    ``flights`` and ``start`` as :func:`_register_hooks` takes them. Not thread-safe: the
    owner's constructor and ``synchronize()`` call it."""

    def __init__(self, owner: object, flights: dict[Bucket, Any],
                 start: Callable[[Bucket], Any]) -> None:
        # Weakly: the owner holds this, and a cycle through it would leave a dropped owner
        # to the collector, whose pass removes the hooks (the finalizer) only after it has
        # chosen what to free, so the parameters the hooks held would wait for another pass.
        self.owner, self.start = weakref.ref(owner), weakref.WeakMethod(start)
        self.flights = flights
        self.handles: list[Any] = []
        self.counted = False

    def register(self, buckets: Sequence[Bucket], counted: bool | None = None) -> None:
        """Hook ``buckets`` (the hooks before removed); ``counted`` changes the kind."""
        remove_hooks(self.handles)
        if counted is not None:
            self.counted = counted
        owner, start = self.owner(), self.start()
        assert owner is not None and start is not None  # (called by the owner)
        self.handles = _register_hooks(owner, buckets, self.flights, start, self.counted)

    def count(self, buckets: Sequence[Bucket], params: Sequence[torch.Tensor],
              seen: Sequence[int]) -> None:
        """The order is known (``seen``, as :func:`_mark_last` takes it): counted hooks."""
        _mark_last(buckets, params, seen)
        self.register(buckets, _counting_allowed())

    def check(self, buckets: Sequence[Bucket]) -> tuple[bool, bool]:
        """Before a step's end: :func:`_arrivals` (nothing to say with per-member hooks)."""
        return _arrivals(buckets, self.flights) if self.counted else (False, False)

    def settle(self, buckets: Sequence[Bucket], verdict: tuple[bool, bool]) -> None:
        """After a step's end (the counts reset): per-member hooks for good if the step's
        order differed; ``AssertionError`` if a gradient accumulated after its bucket
        started."""
        missed, extra = verdict
        if missed:
            self.register(buckets, False)
        if extra:
            raise AssertionError(TOO_MANY)


def _counting_allowed() -> bool:
    """Whether counted hooks may replace per-member ones: not under compiled autograd,
    which traces a backward's hooks (a C-level hook there is untested; the Python ones
    route themselves around the trace)."""
    auto = sys.modules.get("torch._dynamo.compiled_autograd")  # (never imported here)
    config = sys.modules.get("torch._dynamo.config")
    return not (getattr(auto, "compiled_autograd_enabled", False)
                or getattr(config, "compiled_autograd", False))


def _mark_last(buckets: Sequence[Bucket], params: Sequence[torch.Tensor],
              seen: Sequence[int]) -> None:
    """Each bucket's ``last``: its member whose gradient was made ready last in the order
    ``seen`` (indices into ``params``, first ready first; a member not seen counts first)."""
    when = {id(params[i]): k for k, i in enumerate(seen)}
    for b in buckets:
        b.last = max(range(len(b.params)), key=lambda i: when.get(id(b.params[i]), -1))


def _arrivals(buckets: Sequence[Bucket], flights: dict[Bucket, Any]) -> tuple[bool, bool]:
    """At a step's end, with counted hooks (``flights``: the buckets a hook started): (a
    bucket whose every arrival came in without its ``last`` member's hook starting it: this
    step's order was another; a bucket with more arrivals than it expects: a gradient
    accumulated after its allreduce started)."""
    missed = any(b not in flights and len(b.arrived) == b.expect for b in buckets)
    return missed, any(len(b.arrived) > b.expect for b in buckets)


def _counted(bucket: Bucket, flights: dict[Bucket, Any],
             begin: Callable[[], Callable[[Bucket], Any] | None]) -> Callable[[torch.Tensor], None]:
    arrived = bucket.arrived
    compiling = _COMPILING or _never

    # The last member's hook: its own arrival, then the bucket if every arrival is in.
    def hook(param: torch.Tensor) -> None:
        if compiling():  # traced by compiled autograd: see _opaque
            return opaque(param)
        arrived.append(param)
        n = len(arrived)
        if n >= bucket.expect:
            if n > bucket.expect:
                del arrived[bucket.expect:]  # said here: _arrivals() need not say it again
                raise AssertionError(TOO_MANY)
            _start(bucket, flights, begin)
        return None
    opaque = _disabled(hook)
    return hook


def _start(bucket: Bucket, flights: dict[Bucket, Any],
           begin: Callable[[], Callable[[Bucket], Any] | None]) -> None:
    """The bucket is ready: ``flights[bucket] = start(bucket)`` while the owner lives."""
    start = begin()
    if start is not None:
        flights[bucket] = start(bucket)


def _hook(bucket: Bucket, i: int, flights: dict[Bucket, Any],
          begin: Callable[[], Callable[[Bucket], Any] | None]) -> Callable[[torch.Tensor], None]:
    size = len(bucket.params)
    compiling = _COMPILING or _never

    # The whole per-parameter host cost of a step: count down, count the bucket ready.
    def hook(param: torch.Tensor) -> None:
        if compiling():  # traced by compiled autograd: see _opaque
            return opaque(param)
        left = bucket.left[i] - 1
        if left < 0:
            raise AssertionError(TOO_MANY)
        bucket.left[i] = left
        if left == 0:
            bucket.ready += 1
            if bucket.ready == size:
                _start(bucket, flights, begin)
        return None
    opaque = _disabled(hook)
    return hook


def _opaque(hook: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``hook``, opaque to torch.compile. Compiled autograd traces a backward's hooks, and
    tracing into the runtime fails deep inside dynamo; so where dynamo traces the hook
    (``is_compiling()`` is constant True there) it meets ``hook`` disabled, which it calls
    eagerly where backward reaches it. Outside a trace the hook runs as it is, because the
    disabled wrapper switches dynamo's frame callback on every call (0.35 us a call on the
    CPU box: 161 hooks, a backward 1,506 us disabled against 1,448 us guarded), on the
    autograd thread's path of a host-bound model. ``_hook`` writes the same test inline (one
    frame less per parameter and step)."""
    compiling = _COMPILING or _never
    opaque = _disabled(hook)

    def guarded(param: torch.Tensor) -> None:
        if compiling():
            return opaque(param)
        return hook(param)
    return guarded


def _never() -> bool:
    return False


def _disabled(hook: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    # A torch whose dynamo cannot load cannot trace either: the hook stays as it is.
    try:
        return torch.compiler.disable(hook)
    except Exception:  # noqa: BLE001
        return hook


_COMPILING: Callable[[], bool] | None = getattr(getattr(torch, "compiler", None), "is_compiling",
                                                None)


def remove_hooks(handles: list[Any]) -> None:
    """Remove the hooks of ``handles`` (emptied; idempotent)."""
    for handle in handles:
        handle.remove()
    handles.clear()


def split(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` in ``n`` consecutive groups of sizes differing by one at most (empty ones
    left out): Horovod's ``groups=n``."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        if stop > start:
            out.append(items[start:stop])
        start = stop
    return out


def param_names(named_parameters: Any, param_groups: list[dict[str, Any]],
           all_params: list[torch.Tensor]) -> dict[torch.Tensor, str]:
    """Every parameter's allreduce name, checked as Horovod checks them."""
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
            raise ValueError("named_parameters must be a sequence of (name, parameter) "
                             "tuples, as model.named_parameters() yields")
    else:
        named = [(f"allreduce.noname.{i}.{j}", p) for i, g in enumerate(param_groups)
                 for j, p in enumerate(g["params"])]
    names = [k for k, _ in named]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique; "
                         f"duplicates: {', '.join(dups)}")
    named_ids = {id(p) for _, p in named}
    unnamed = [p for p in all_params if id(p) not in named_ids]
    if unnamed:
        raise ValueError(f"named_parameters was given but {len(unnamed)} of the "
                         "optimizer's parameters are not in it; pass "
                         "model.named_parameters() of the model the optimizer trains")
    return {p: f"DistributedOptimizer.{k}" for k, p in named}
