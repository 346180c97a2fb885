"""Where hvdlite's gradient hooks run: after autograd accumulates a parameter's gradient, or
inside a compiled backward that accumulates it itself.

Every hook hvdlite puts on a parameter's gradient (a ``DistributedOptimizer``'s bucket
counting, its first step's ready order, the Adasum optimizer's deltas) is registered here with
:func:`hook`. Normally that is
a post-accumulate-grad hook, run by autograd once the gradient has accumulated into ``.grad``.
A compiled model's backward is one autograd operation, so those hooks all run at its end. A
parameter **claimed** by a compiled graph (:func:`claim`, ``hvdlite/torch/overlap.py``) is
accumulated by that graph's backward instead, at the point its gradient is made: the graph
writes the gradient where :func:`targets` says (the parameter's home, such as its bucket's
view, or a new tensor), then calls :func:`accumulate`, which makes it ``.grad`` (or adds it
into the ``.grad`` there is) as autograd would and runs the parameter's hooks there, while the
rest of the backward still runs. The graph hands autograd no
gradient for it, so autograd accumulates nothing more, and hvdlite's hooks are no longer
registered with autograd. Hooks that others put on the parameter still run where autograd
runs them, at the end, and see the accumulated gradient.

A claim lasts as long as the parameter, unless the graph of another compiled frame has the
parameter too: it is then shared, and its hooks go back to autograd for good (each frame's
call adds only its part). Not thread-safe: an optimizer's constructor and step, and a
compile, register and claim.
"""

from __future__ import annotations

import itertools
import operator
import random
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hvdlite.errors import HvdliteError

__all__ = ["ALIGN_BYTES", "accumulate", "claim", "claimable", "hook", "new_group", "targets"]

Hook = Callable[[torch.Tensor], Any]
# A group member as a call resolves it: (parameter, its hooks, its home, the autograd node
# that accumulates into it).
Row = tuple[torch.Tensor | None, tuple[Hook, ...], Any, Any]


class _Owned:
    """A parameter's hooks registered here (by key, in order), with autograd's handles for
    them while the parameter is not claimed, and where a new gradient of it may live."""

    __slots__ = ("fns", "handles", "claimed", "frame", "shared", "home")

    def __init__(self) -> None:
        self.fns: dict[int, Hook] = {}
        self.handles: dict[int, Any] = {}
        self.claimed = False
        self.frame: object = None  # the compiled frame that claimed it
        # In more than one frame: each frame's call only accumulates its part, and autograd,
        # which runs the hooks, adds the last (hooks run once, with the whole gradient).
        self.shared = False
        self.home: Callable[[], torch.Tensor | None] | None = None


_OWNED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_KEYS = itertools.count()
# Each group's rows (``Row``) as its last call resolved them, emptied by every change of a
# hook or claim: resolved once per change, not per call (this runs on the autograd thread of
# every step). A row's accumulator node holds its parameter, as the hooks do; the rows go
# with the hooks (an optimizer collected removes its hooks, and so empties this).
_resolved: dict[int, tuple[int, _Group | None, int]] = {}
# An autograd node keeps the stream that was current when it was made, and at the end of each
# backward the engine joins the caller's stream to the stream of every leaf node it ran. Kept
# here across steps, a node would tie every later backward to the stream of the step that
# made it: an extra wait eagerly, and under CUDA graph capture an illegal dependency on work
# outside the capture (the same trap as DDP's kept accumulators). So each group's kept rows
# are of the stream they were made on (its ``_resolved`` entry: stream, rows); the backward
# that finds another stream keeps none (None, and that backward's id: every call of it, as
# ``targets`` and ``accumulate`` of one group, resolves anew), so its nodes go with its graph,
# the next forward makes new ones, and the next backward keeps those.
_task: list[Any] = [-1, None, 0]  # the latest call's backward, device and stream


class _Group:
    """A group's rows (``rows``) as :func:`_members` resolved them, and what the common
    step's calls need of them, each in one C-level pass (this runs per bucket and step on
    the autograd thread): where every member is alive, its ``params``, their accumulator
    ``nodes`` and homes, and every (hook, parameter) call in order; ``views``, once a
    :func:`targets` call found every home an aligned tensor, those tensors."""

    __slots__ = ("rows", "params", "nodes", "homes", "calls", "views")

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows
        live = all(r[0] is not None and r[3] is not None for r in rows)
        self.params: tuple[torch.Tensor, ...] | None = \
            tuple(r[0] for r in rows) if live else None  # type: ignore[misc]
        self.nodes = tuple(r[3] for r in rows)
        self.homes = tuple(r[2] for r in rows) \
            if live and all(r[2] is not None for r in rows) else None
        self.calls: tuple[tuple[Hook, torch.Tensor], ...] = tuple(
            (fn, param) for param, fns, _home, _node in rows if param is not None
            for fn in fns)
        self.views: list[torch.Tensor] | None = None

    def fresh(self) -> bool:
        """Whether every member is alive and has no ``.grad`` (after ``zero_grad()``)."""
        return self.params is not None \
            and all(map(operator.is_, map(_GRAD, self.params), repeat(None)))


_GRAD = operator.attrgetter("grad")


class HookHandle:
    """Removes one hook registered by :func:`hook` (idempotent), wherever it runs."""

    __slots__ = ("_param", "_key")

    def __init__(self, param: torch.Tensor, key: int) -> None:
        self._param = weakref.ref(param)
        self._key = key

    def remove(self) -> None:
        param = self._param()
        owned = _OWNED.get(param) if param is not None else None
        if owned is None:
            return
        _resolved.clear()
        owned.fns.pop(self._key, None)
        handle = owned.handles.pop(self._key, None)
        if handle is not None:
            handle.remove()
        if not owned.fns:  # its home holds a bucket, which holds the parameter
            owned.home = None


def hook(param: torch.Tensor, fn: Hook,
         home: Callable[[], torch.Tensor | None] | None = None) -> HookHandle:
    """Run ``fn(param)`` each time ``param``'s gradient has accumulated: as a post-accumulate
    -grad hook, or, once ``param`` is claimed, from the compiled backward that accumulates it.
    ``home``: where a claimed parameter's new gradient is to live (a tensor of its shape, such
    as its bucket's view; None: a new one), asked at each accumulation into no ``.grad``."""
    _resolved.clear()
    owned = _OWNED.get(param)
    if owned is None:
        owned = _OWNED[param] = _Owned()
    if home is not None:
        owned.home = home
    key = next(_KEYS)
    owned.fns[key] = fn
    if not owned.claimed:
        owned.handles[key] = param.register_post_accumulate_grad_hook(fn)
    return HookHandle(param, key)


def claimable(param: object, frame: object) -> bool:
    """Whether the compiled backward of ``frame`` (dynamo's frame, whose recompiles claim
    alike) may accumulate ``param``'s gradient itself: a dense leaf parameter that needs a
    gradient, with hvdlite's hooks, without gradient hooks of anyone else that would have to
    see the gradient before it accumulates, and not claimed by another frame (a parameter in
    two frames, such as a weight tied across a graph break, is then shared: see ``_Owned``)."""
    if not isinstance(param, torch.nn.Parameter) or not param.requires_grad \
            or param.layout is not torch.strided:
        return False
    owned = _OWNED.get(param)
    if owned is None or not owned.fns or owned.shared \
            or getattr(param, "_backward_hooks", None):
        return False
    if owned.claimed and owned.frame != frame:
        _share(owned, param)
        return False
    return True


def claim(params: Sequence[torch.Tensor], frame: object) -> None:
    """From now on the compiled backward of ``frame`` accumulates ``params`` and runs their
    hooks: hvdlite's hooks are taken off autograd (each stays registered here)."""
    for param in params:
        owned = _OWNED.get(param)
        if owned is None or owned.shared or (owned.claimed and owned.frame == frame):
            continue
        if owned.claimed:
            _share(owned, param)
            continue
        _resolved.clear()
        owned.claimed, owned.frame = True, frame
        for handle in owned.handles.values():
            handle.remove()
        owned.handles.clear()


def _share(owned: _Owned, param: torch.Tensor) -> None:
    """``param`` is in the graphs of two frames: its hooks go back to autograd for good."""
    _resolved.clear()
    owned.shared, owned.claimed = True, False
    for key, fn in owned.fns.items():
        if key not in owned.handles:
            owned.handles[key] = param.register_post_accumulate_grad_hook(fn)


# Groups of parameters a compiled backward accumulates in one call, by the key its graph
# passes: weakly held, and dropped with their parameters (a compile makes a few; recompiles
# are bounded by dynamo's cache size). Keys start at a random offset: a compiled graph of
# another process that slipped past the caches names groups that do not exist here (an
# error), never other ones.
_GROUPS: dict[int, tuple[weakref.ref[torch.Tensor], ...]] = {}
_GROUP_KEYS = itertools.count(random.getrandbits(40))


def new_group(params: Sequence[torch.Tensor]) -> int:
    """A key for ``params`` (in the order the graph will pass their gradients)."""
    for key in [k for k, refs in _GROUPS.items() if any(r() is None for r in refs)]:
        del _GROUPS[key]
        _resolved.pop(key, None)
    key = next(_GROUP_KEYS)
    _GROUPS[key] = tuple(weakref.ref(p) for p in params)
    return key


def _members(key: int) -> _Group:
    """Group ``key``'s (parameter, its hooks, its home, its accumulator node) as of the hooks'
    latest change, kept while its backward runs on one stream (see ``_resolved``).
    ``HvdliteError`` if a capture runs it on another stream than its last backward (the
    capture would fail at the backward's end)."""
    stream = _stream_of_backward(key)
    seen = _resolved.get(key)
    keep = seen is None
    if seen is not None and seen[0] == stream:
        if seen[1] is not None:
            return seen[1]
        # A later backward on this stream than the one that found it: its nodes are of it.
        keep = torch._C._current_graph_task_id() != seen[2]
    elif seen is not None and stream and torch.cuda.is_current_stream_capturing():
        raise HvdliteError(
            "compile_overlap: a step is being captured on another CUDA stream than its "
            "warm-up steps ran on; run at least two warm-up steps on the capture stream "
            "(torch.cuda.graph(g, stream=s)), or capture with hvd.make_graphed_step")
    refs = _GROUPS.get(key)
    if refs is None:
        raise RuntimeError(f"hvdlite: a compiled backward passed gradient group {key}, which "
                           "no longer exists (its parameters were freed)")
    rows: list[Row] = []
    for ref in refs:
        param = ref()
        owned = _OWNED.get(param) if param is not None else None
        if param is None or owned is None:
            rows.append((param, (), None, None))
            continue
        with torch.enable_grad():  # the autograd node that accumulates into ``param``
            view = param.view_as(param).grad_fn
            node = view.next_functions[0][0] if view is not None else None
        # unclaimed (shared): autograd runs the hooks
        rows.append((param, tuple(owned.fns.values()) if owned.claimed else (), owned.home,
                     node))
    # After a change of stream this backward's nodes may be the old stream's: not kept.
    group = _Group(rows)
    _resolved[key] = (stream, group, -1) if keep \
        else (stream, None, torch._C._current_graph_task_id())
    return group


def _stream_of_backward(key: int) -> int:
    """The current CUDA stream of this call's backward on the device of group ``key`` (asked
    once per backward and device); 0 for a group on the CPU, as for CUDA's default stream
    (neither is ever being captured)."""
    refs = _GROUPS.get(key, ())
    param = refs[0]() if refs else None
    if param is None or not param.is_cuda:
        return 0
    task, device = torch._C._current_graph_task_id(), param.get_device()
    if task != _task[0] or device != _task[1]:
        _task[:] = [task, device, torch.cuda.current_stream(device).cuda_stream]
    return int(_task[2])


def _accumulating(node: Any) -> bool:
    """Whether this backward accumulates into the parameter of ``node`` (``backward()``:
    yes; ``torch.autograd.grad`` of other tensors, or ``backward(inputs=...)`` without it:
    no); yes outside a backward (a direct call)."""
    if node is None:
        return True
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True


def _all_accumulating(nodes: tuple[Any, ...]) -> bool:
    """:func:`_accumulating` of every node, in one pass."""
    try:
        return all(map(torch._C._will_engine_execute_node, nodes))
    except (RuntimeError, TypeError):  # not in a backward, or a node gone (None)
        return all(map(_accumulating, nodes))


#: Where a tensor a compiled graph writes in place must start (bytes): inductor compiles for
#: inputs aligned so and runs a misaligned one on an aligned copy (``copy_misaligned_inputs``).
#: Bucket buffers place their members' views on it (``_buckets._layout``).
ALIGN_BYTES = 16


def targets(key: int) -> list[torch.Tensor]:
    """Where a compiled backward about to run is to write the gradients of group ``key``'s
    members (its ``hvdlite_grad_*`` inputs, in order): a member's home (its bucket's view) if
    it has no gradient yet and starts on a 16-byte boundary, else a new tensor
    (:func:`accumulate` then makes it ``.grad``, or adds it)."""
    group = _members(key)
    views = group.views
    # The common step (every .grad None): the homes found last time, unless their bucket's
    # views were made anew (first and last compared: one group, at most two buckets).
    if views is not None and group.fresh() and group.homes is not None \
            and group.homes[0]() is views[0] and group.homes[-1]() is views[-1]:
        return views
    out = []
    homed = group.homes is not None
    for param, _fns, home, _node in group.rows:
        if param is None:
            raise RuntimeError(f"hvdlite: a compiled backward runs gradient group {key}, "
                               "whose parameters were freed")
        into = home() if home is not None and param.grad is None else None
        # Inductor compiles for aligned inputs and runs a misaligned one on a copy, written
        # back only when the graph returns: after this group's bucket was launched from it.
        if into is None or into.data_ptr() % ALIGN_BYTES:
            into, homed = torch.empty_like(param), False
        out.append(into)
    group.views = out if homed else None
    return out


def accumulate(key: int, into: Sequence[torch.Tensor]) -> None:
    """The compiled backward's accumulation of group ``key``, whose gradients it has written
    into ``into`` (:func:`targets`): where a member has no ``.grad``, its written tensor
    becomes it (its bucket's view, or a new tensor: no copy); where it has one, the written
    one is added to it (one batched add); then each member's hooks, in the group's order. A
    parameter this backward does not accumulate into (``torch.autograd.grad`` of the inputs)
    is left alone, its hooks not run."""
    group = _members(key)
    if group.fresh() and _all_accumulating(group.nodes):  # the common step: no Python per member
        deque(map(setattr, group.params, repeat("grad"), into), maxlen=0)  # type: ignore[arg-type]
        for fn, member in group.calls:
            fn(member)
        return
    adds: list[torch.Tensor] = []
    adds_from: list[torch.Tensor] = []
    done: list[tuple[torch.Tensor, tuple[Hook, ...]]] = []
    for (param, fns, _home, node), written in zip(group.rows, into, strict=True):
        if param is None or not _accumulating(node):
            continue
        done.append((param, fns))
        old = param.grad
        if old is None:
            param.grad = written
        elif old is not written:
            if old.dtype == written.dtype and old.device == written.device \
                    and not old.is_sparse:
                adds.append(old)
                adds_from.append(written)
            else:
                old.add_(written)
    if adds:
        torch._foreach_add_(adds, adds_from)
    for param, fns in done:
        for fn in fns:
            fn(param)
