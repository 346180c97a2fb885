"""A repeated grouped allreduce on an agreed schedule: the same tensors, reduced again and again
(a metric set, an optimizer's state outside its gradients), with no negotiation per call.

:func:`grouped_allreduce_init` is the persistent form of :func:`grouped_allreduce` (MPI 4's
``MPI_Allreduce_init`` is the model): every member of the process set calls it once with tensors
of the same shapes, dtype and order; one exchange checks them alike (``MismatchError`` naming the
ranks and the first difference otherwise). Its first call is negotiated like any collective
(which settles the device transport); then the members open an agreed schedule of the runtime
(``hvdlite/_control/agreed.py``: NCCL for CUDA tensors with a GPU per rank, MPI for host
tensors), and each later call copies the tensors' current values into the schedule's buffer
and launches one in-place allreduce on it. Results are views of that buffer, overwritten by
the next call::

    metrics = hvd.grouped_allreduce_init([loss_sum, correct, seen], name="metrics")
    for batch in loader:
        ...
        loss_avg, correct_avg, seen_avg = metrics()     # the same three tensors' values, reduced

With ``inplace=True`` the tensors themselves become views of that buffer (their values kept,
their storage replaced once, at construction), so a call copies nothing: it reduces the buffer
in place and the tensors hold the results, as :func:`grouped_allreduce_` leaves them. The
tensors must then be dense, contiguous, not requiring grad and without shared memory, and keep
their storage (a tensor given another storage later, by ``set_`` or ``.data =``, is refused at
the next call).

The schedule's guarantees hold: a member that stops calling, or calls another schedule's
allreduce in its place, leaves its peers' launches pending and the stall watchdog raises
``StallError`` naming the schedule; after the engine fails or shuts down every call raises
``HvdliteError``. Where a member cannot run the schedule (ranks sharing a GPU, the
``optimizer_schedule`` knob off, a type the transport lacks) every member takes the negotiated
:func:`grouped_allreduce` instead, with the same results, and :attr:`unscheduled_reason` says
why.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch

from hvdlite import _runtime_api as runtime
from hvdlite._ops import ReduceOp
from hvdlite._runtime_api import Slot
from hvdlite._torchref import stream_of
from hvdlite.errors import HvdliteError
from hvdlite.torch._scheduled import wire_name
from hvdlite.torch.basics import resolve_op
from hvdlite.torch.functional_ops import grouped_allreduce
from hvdlite.torch.process_sets import global_process_set, resolve

__all__ = ["PersistentGroupedAllreduce", "grouped_allreduce_init"]

_WHAT = "grouped_allreduce_init"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class PersistentGroupedAllreduce:
    """An agreed grouped allreduce of fixed tensors: call it (or :meth:`start` then
    :meth:`wait`) to reduce their current values. Made by :func:`grouped_allreduce_init`.

    Not thread-safe: one thread calls it, and every member calls it the same number of times.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], name: str, op: ReduceOp, pre: float,
                 post: float, process_set: Any, inplace: bool = False) -> None:
        self.name = name
        self.tensors = list(tensors)
        first = self.tensors[0]
        self.device = first.get_device() if first.is_cuda else -1
        self._op, self._pre, self._post = op, pre, post
        self._process_set = process_set
        self.inplace = inplace
        ps = resolve(process_set, _WHAT)
        set_id = 0 if ps.core is None else ps.core.process_set_id
        sizes = [t.numel() for t in self.tensors]
        self._flat = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        self.outputs: list[torch.Tensor] = [
            v.view(t.shape) for v, t in zip(self._flat.split(sizes), self.tensors, strict=True)]
        wire = wire_name(first.dtype) or str(first.dtype)
        slot = Slot(name, self._flat.numel(), wire, int(op), pre, post)
        runtime.check_agreed(
            f"{_WHAT}[{name}]",
            {"slot": runtime.slot_rows([slot]), "shapes": [list(t.shape) for t in tensors],
             "device": self.device >= 0},
            "every member must pass tensors of the same shapes and dtype, in the same order, "
            "with the same op and factors", set_id)
        self._slot, self._set_id = slot, set_id
        self._ptrs: tuple[int, ...] = ()
        # Only once every member agreed: a mismatch must leave the caller's tensors as they were.
        if inplace:  # the tensors move into the buffer: their values first, then their storage
            with torch.no_grad():
                torch._foreach_copy_(self.outputs, self.tensors)
                storage, offset = self._flat.untyped_storage(), 0
                for t, n in zip(self.tensors, sizes, strict=True):
                    t.set_(storage, offset, t.shape, t.stride())
                    offset += n
            self.outputs = self.tensors
            self._ptrs = tuple(map(_DATA_PTR, self.tensors))
        self._schedule: Any = None
        #: Why calls take the negotiated route ('' once on the schedule); the first call
        #: always does: it settles the device transport the schedule is opened on.
        self.unscheduled_reason = "the first call is negotiated; the schedule opens after it"
        self._opened = False
        self._pending = False

    def _open(self) -> None:
        # Collective: every member makes its first call at the same point of its sequence.
        self._opened = True
        buffers = [(self._flat.data_ptr(), self._flat.numel())]
        self._schedule, self.unscheduled_reason = runtime.open_schedule(
            f"{_WHAT}[{self.name}]", [self._slot], buffers, self.device, self._set_id,
            self._why_not())

    def _why_not(self) -> str:
        if self._op == ReduceOp.AVERAGE and self.tensors[0].dtype not in _FLOATS:
            return f"an Average of {self.tensors[0].dtype} (integers average on the " \
                   "negotiated route, with its rounding)"
        if self._op == ReduceOp.ADASUM:
            return "Adasum is not an allreduce a schedule runs"
        return ""

    @property
    def agreed_schedule(self) -> Any:
        """The runtime's agreed schedule the calls launch on (from the second call), or None
        (before it, or where the members cannot: see :attr:`unscheduled_reason`)."""
        return self._schedule

    @property
    def scheduled(self) -> bool:
        """Whether calls launch on the agreed schedule (from the second call where every
        member can; else the negotiated route, :attr:`unscheduled_reason` saying why)."""
        return self._schedule is not None

    def start(self) -> None:
        """Copy the tensors' current values into the buffer (on torch's current stream for
        CUDA tensors) and launch the allreduce without waiting. Blocking on the host only
        for the negotiated fallback. ``HvdliteError`` if the previous call was not waited
        for, or the engine failed; ``StallError`` past the stall shutdown time."""
        if self._pending:
            raise HvdliteError(f"{_WHAT}[{self.name}]: start() again before wait(); wait for "
                               "each call before the next reuses its buffer")
        if self.inplace and tuple(map(_DATA_PTR, self.tensors)) != self._ptrs:
            moved = next(i for i, (t, ptr) in enumerate(zip(self.tensors, self._ptrs,
                                                            strict=True))
                         if t.data_ptr() != ptr)
            raise ValueError(f"{_WHAT}[{self.name}]: tensor {moved} no longer lies in the "
                             "in-place buffer (its storage was replaced); keep the tensors' "
                             "storage, or build the persistent allreduce again")
        if self._schedule is None:
            with torch.no_grad():
                got = grouped_allreduce(self.tensors, name=self.name, op=self._op,
                                        prescale_factor=self._pre,
                                        postscale_factor=self._post,
                                        process_set=self._process_set)
                torch._foreach_copy_(self.outputs, list(got))
            self._pending = True
            if not self._opened:
                self._open()
            return
        if not self.inplace:  # in place, the tensors are the buffer already
            with torch.no_grad():
                torch._foreach_copy_(self.outputs, self.tensors)
        stream = stream_of(self.device) if self.device >= 0 else None
        self._schedule.launch(0, stream)
        self._pending = True

    def wait(self) -> list[torch.Tensor]:
        """The reduced values, as views of the buffer (valid until the next :meth:`start`;
        in place: the tensors themselves).
        CUDA: torch's current stream is ordered after the allreduce (no host wait, unless
        the timeline asks for it); host tensors: blocks until it completed. Raises the
        schedule's error (``HvdliteError``, ``StallError``)."""
        if not self._pending:
            raise HvdliteError(f"{_WHAT}[{self.name}]: wait() without start()")
        self._pending = False
        if self._schedule is not None:
            ordered = self.device >= 0 and not runtime.host_waits()
            self._schedule.wait(0, stream_of(self.device) if ordered else None)
        return list(self.outputs)

    def __call__(self) -> list[torch.Tensor]:
        """:meth:`start` then :meth:`wait`."""
        self.start()
        return self.wait()


def grouped_allreduce_init(tensors: Sequence[torch.Tensor], name: str, op: Any = None,
                           average: bool | None = None, prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0,
                           process_set: Any = global_process_set,
                           inplace: bool = False) -> PersistentGroupedAllreduce:
    """A persistent :func:`grouped_allreduce` of ``tensors`` (see the module docstring):
    reduce their current values by calling the object it returns.

    Collective and blocking: every member of ``process_set`` calls it, in the same order as
    its other collectives, with tensors of the same shapes, one dtype and one device (dense);
    ``name`` is required (the schedule's name in errors and the timeline). ``op``,
    ``average``, ``prescale_factor`` and ``postscale_factor`` as :func:`grouped_allreduce`
    takes them. ``inplace``: the tensors become views of the schedule's buffer (values kept)
    and each call reduces them in place, with no copy (contiguous tensors that do not
    require grad and share no memory). Not thread-safe. ``TypeError``/``ValueError`` for bad
    arguments; ``MismatchError`` on every member if the members' tensors or settings differ.
    """
    reduce_op = resolve_op(op, average, _WHAT)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{_WHAT}: name must be a non-empty str, got {name!r}")
    members = list(tensors) if isinstance(tensors, (list, tuple)) else None
    if not members:
        raise ValueError(f"{_WHAT}: tensors must be a non-empty list or tuple of tensors, got "
                         f"{type(tensors).__name__}")
    for i, t in enumerate(members):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_WHAT}: tensor {i} must be a torch.Tensor, got "
                            f"{type(t).__name__}")
        if t.is_sparse:
            raise ValueError(f"{_WHAT}: tensor {i} is sparse; pass dense tensors")
        if t.dtype != members[0].dtype or t.device != members[0].device:
            raise ValueError(f"{_WHAT}: tensor {i} is {t.dtype} on {t.device}, expected "
                             f"{members[0].dtype} on {members[0].device} as tensor 0; one "
                             "dtype and one device per persistent allreduce")
    if not isinstance(inplace, bool):
        raise TypeError(f"{_WHAT}: inplace must be a bool, got {inplace!r}")
    if inplace:
        _check_movable(members)
    for factor, label in ((prescale_factor, "prescale_factor"),
                          (postscale_factor, "postscale_factor")):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"{_WHAT}: {label} must be a number, got {factor!r}")
    return PersistentGroupedAllreduce(members, name, reduce_op, float(prescale_factor),
                                      float(postscale_factor), process_set, inplace)


def _check_movable(members: Sequence[torch.Tensor]) -> None:
    """``ValueError`` unless every member can move into the in-place buffer: contiguous, not
    requiring grad (autograd would lose track of a leaf whose storage changes), no two
    sharing memory (one buffer slot each: shared memory would be reduced twice)."""
    spans = []
    for i, t in enumerate(members):
        if not t.is_contiguous():
            raise ValueError(f"{_WHAT}: inplace=True needs contiguous tensors; tensor {i} is "
                             "not (pass t.contiguous() and use that tensor)")
        if t.requires_grad:
            raise ValueError(f"{_WHAT}: inplace=True moves the tensors' storage; tensor {i} "
                             "requires grad (pass a gradient or a detached buffer)")
        start = t.data_ptr()
        spans.append((start, start + t.numel() * t.element_size(), i))
    spans.sort()
    for (_, end, i), (start, _, j) in pairwise(spans):
        if start < end:
            raise ValueError(f"{_WHAT}: inplace=True needs tensors that share no memory; "
                             f"tensors {min(i, j)} and {max(i, j)} overlap")


_DATA_PTR = torch.Tensor.data_ptr
