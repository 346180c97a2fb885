"""``DistributedOptimizer``: average gradients across ranks while ``backward()`` runs.

One hook per parameter counts it ready the moment its gradient has accumulated (autograd's
post-accumulate hook, or a compiled backward's call: ``_accumulate.py``, ``overlap.py``); the
last member of a bucket starts that bucket's one allreduce, of the bucket's flat buffer (its
gradients copied in by one batched copy, or, with ``gradient_as_bucket_view``, living there),
so communication overlaps the rest of the backward pass. Once the first step has shown the
order backward takes, the hooks are C-level appends but for each bucket's last member
(``_buckets.Hooks``: no Python frame per parameter). ``step()`` orders the current CUDA
stream after each bucket's collective (no host wait on the device), then runs the wrapped
optimizer's own step, whose kernels follow on that stream.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

import hvdlite
from hvdlite import _runtime_api as runtime
from hvdlite import _sets
from hvdlite._torchref import stream_of
from hvdlite.torch import mpi_ops
from hvdlite.torch._buckets import (
    Bucket,
    Hooks,
    ReadyOrder,
    auto_buckets,
    mib_bytes,
    ordered_buckets,
    param_names,
    user_groups,
    wire_type,
)
from hvdlite.torch._scheduled import VIAS, ScheduledBuckets, move_scheduled, open_scheduled, slots
from hvdlite.torch.basics import Adasum, Average, InvalidArgumentError, resolve_op, size
from hvdlite.torch.compression import Compression, Compressor
from hvdlite.torch.process_sets import global_process_set, resolve

__all__ = ["DistributedOptimizer"]

_ZERO_GRAD = ("optimizer.zero_grad() was called after loss.backward() but before "
              "optimizer.step() or optimizer.synchronize(): the gradients' allreduces are still "
              "in flight and would race with the zeroing. Call step() or synchronize() first.")


class _Flight:
    """One bucket on the wire: the dense members' handle, their compression contexts, the
    sparse members' own handles (``sparse_allreduce_async``), and the staged members' handle
    with the gradients their staging views are copied back into. ``bucket``: set when the
    whole bucket is reduced in its buffer (``handle`` then covers it; with a ``wire``, the
    reduced wire is copied back into the buffer)."""

    __slots__ = ("handle", "dense", "ctxs", "sparse", "staged", "targets", "bucket")

    def __init__(self, handle: Any, dense: list[torch.Tensor], ctxs: list[Any],
                 sparse: list[tuple[torch.Tensor, Any]], staged: Any = None,
                 targets: list[torch.Tensor] | None = None, bucket: Bucket | None = None
                 ) -> None:
        self.handle = handle
        self.dense = dense
        self.ctxs = ctxs
        self.sparse = sparse
        self.staged = staged
        self.targets = targets or []
        self.bucket = bucket


class _DistributedOptimizer(torch.optim.Optimizer):
    # Its methods are copied into a subclass of the wrapped optimizer's class (see
    # DistributedOptimizer), so `super(self.__class__, self)` is that optimizer's class.

    def __init__(self, params: Any, named_parameters: Any, compression: type[Compressor],
                 backward_passes_per_step: int, op: Any, gradient_predivide_factor: float,
                 groups: Any, sparse_as_dense: bool, process_set: Any,
                 gradient_as_bucket_view: bool, caps: tuple[int, int]) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        self._compression = compression
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._parameter_names = param_names(named_parameters, self.param_groups, all_params)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._handles: dict[Bucket, _Flight] = {}
        self._hooks = Hooks(self, self._handles, self._start)
        self._synchronized = False
        self._should_synchronize = True
        self._caps = caps
        self._ready_order: ReadyOrder | None = None  # until the first step's end
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[torch.Tensor, Bucket] = {}
        self._unbucketed: list[torch.Tensor] = list(all_params)
        # The buckets on an agreed schedule, launched by the autograd thread (_scheduled.py),
        # opened at the end of the first step; None before, or where the ranks cannot.
        self._scheduled: ScheduledBuckets | None = None
        self._schedule_tried = False
        self._unscheduled = "the first step has not run yet"  # why there is no schedule
        self._slots: list[Any] | None = None  # the buckets as every rank agreed them
        self._index: dict[Bucket, int] = {}
        # As Horovod: on a rank outside process_set nothing is communicated (no hooks, and
        # synchronize() is a no-op), so step() applies this rank's own gradients; and at
        # one rank neither, unless the optimizer_size1_shortcut knob is off (benchmarks).
        self._member = process_set is global_process_set or bool(process_set.included())
        if self._member and (hvdlite.size() > 1
                             or not runtime.config().optimizer_size1_shortcut):
            plist = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
            if plist:
                self._form_buckets(auto_buckets(plist, *caps) if groups is None else user_groups(
                    plist, self._parameter_names, groups, process_set))
                self._hooks.register(self._buckets)
                if groups is None:  # the first step shows the order backward really takes
                    self._ready_order = ReadyOrder(self, plist)

    # -- buckets and hooks ------------------------------------------------------------------
    def _form_buckets(self, members: list[list[torch.Tensor]]) -> None:
        passes = self.backward_passes_per_step
        for i, ps in enumerate(members):
            # Named after its first member, so two optimizers' buckets never share a name.
            bucket = Bucket(ps, f"{self._parameter_names[ps[0]]}.bucket{i}", passes)
            self._index[bucket] = len(self._buckets)
            self._buckets.append(bucket)
            for p in ps:
                self._bucket_of[p] = bucket
            wire = wire_type(self._compression, bucket)
            if not bucket.viewable() or wire is False:
                bucket.viewed = False
            elif not self.gradient_as_bucket_view:
                bucket.make_staging(wire if isinstance(wire, torch.dtype) else None)
            # else: the views are made at the bucket's first start, once its gradients are
            # seen to be dense (a sparse one keeps the bucket out of views for good).
        self._unbucketed = [p for p in self._unbucketed if p not in self._bucket_of]

    def _rebucket(self) -> None:
        """At the end of the first step: the buckets again in the order rank 0's backward made
        the gradients ready (collective over the set), when that differs from the guess by
        registration order. This step's reduced gradients move into the new buckets' views
        now (their buffers are what the schedule about to open reduces in place)."""
        order, self._ready_order = self._ready_order, None
        if order is None:
            return
        seen = runtime.agree(f"{self._what()} gradient order", order.take(),
                             self.process_set_id)[0]
        members = ordered_buckets(order.params, seen, *self._caps)
        same = [[id(p) for p in m] for m in members] == [[id(p) for p in b.params]
                                                        for b in self._buckets]
        if not same:
            self._buckets, self._index, self._bucket_of, self._slots = [], {}, {}, None
            self._unbucketed = [p for g in self.param_groups for p in g["params"]]
            self._form_buckets(members)
            for bucket in self._buckets:
                if bucket.viewed is None:
                    bucket.view_if_dense(self._compression)
        self._hooks.count(self._buckets, order.params, seen)  # the order known: counted
        if not same:
            self._check_buckets()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before one allreduce."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")
        self.backward_passes_per_step = passes
        for bucket in self._buckets:
            bucket.passes(passes)

    # -- communication ----------------------------------------------------------------------
    def _factors(self) -> tuple[float, float]:
        if self.op is Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _start(self, bucket: Bucket) -> _Flight:
        """Start reducing ``bucket`` (its members' gradients in place)."""
        bucket.ready = 0
        scheduled = self._scheduled
        if scheduled is not None:  # the steady state: launched here, in the agreed order
            if scheduled.world is runtime.running():
                scheduled.ready(self._index[bucket])
                return _SCHEDULED
            self._forget_schedule()  # hvdlite was initialised again (an elastic reset)
        if self._slots is None:
            self._check_buckets()
        pre, post = self._factors()
        if bucket.viewed is None:  # first start, views wanted: dense gradients only
            bucket.view_if_dense(self._compression)
        if bucket.views and bucket.realias():
            return self._start_viewed(bucket, pre, post)
        if bucket.staging is not None:
            flight = self._start_staged(bucket, pre, post)
            if flight is not None:
                return flight
        dense, sparse = [], []
        for p in bucket.params:
            if p.grad is None:
                # Not computed here (a branch this rank did not take); the others may have it.
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse and not self.sparse_as_dense:
                sparse.append((p, mpi_ops.sparse_allreduce_async(
                    p.grad, self._parameter_names.get(p), self.op, self.process_set)))
            else:
                dense.append(p)
        if not dense:
            return _Flight(None, [], [], sparse)
        # sparse_as_dense: reduce a dense copy; p.grad stays sparse (as in Horovod) so that
        # optimizers that need sparse gradients (SparseAdam) still step.
        grads = [_dense(p.grad) for p in dense]
        pairs = [self._compression.compress(g) for g in grads]
        sends = [c for c, _ in pairs]
        if len(sends) == 1:
            handle = mpi_ops.allreduce_async_(sends[0], name=bucket.name, op=self.op,
                                              prescale_factor=pre, postscale_factor=post,
                                              process_set=self.process_set)
        else:
            handle = mpi_ops.grouped_allreduce_async_(
                sends, name=bucket.name, op=self.op, prescale_factor=pre,
                postscale_factor=post, process_set=self.process_set)
        return _Flight(handle, dense, [ctx for _, ctx in pairs], sparse)

    def _start_viewed(self, bucket: Bucket, pre: float, post: float) -> _Flight:
        """The whole bucket in place in its buffer: one allreduce of the flat buffer (the
        core's steady-state lane for one array: no per-member work), or, compressed, one
        cast into the wire buffer and one allreduce of it."""
        flat = bucket.buffer
        assert flat is not None
        if bucket.wire is not None:
            bucket.wire.copy_(flat)
            flat = bucket.wire
        handle = mpi_ops.allreduce_one(flat, bucket.name, self.op, pre, post,
                                       self.process_set, True, "DistributedOptimizer")
        return _Flight(handle, [], [], [], bucket=bucket)

    def _start_staged(self, bucket: Bucket, pre: float, post: float) -> _Flight | None:
        """Reduce the bucket in its staging buffer: one batched copy in, one allreduce, one
        batched copy out (at :meth:`_finish`); None if a gradient is sparse."""
        grads: list[torch.Tensor] = []
        for p in bucket.params:
            grad = p.grad
            if grad is None:
                grad = p.grad = torch.zeros_like(p)
            elif grad.is_sparse:
                return None
            grads.append(grad)
        torch._foreach_copy_(bucket.staged, grads)
        assert bucket.staging is not None
        staged = mpi_ops.allreduce_one(bucket.staging, bucket.name, self.op, pre, post,
                                       self.process_set, True, "DistributedOptimizer")
        return _Flight(None, [], [], [], staged, grads, bucket)

    def _finish(self, flight: _Flight, stream: Any) -> None:
        """Hand every member of ``flight`` its reduced gradient. ``stream``: CUDA work reads
        them on it (a CuPy stream object, ordered after the collectives: no host wait), or
        None (wait on the host)."""
        bucket = flight.bucket
        if bucket is not None and flight.staged is None:
            if stream is None or bucket.device < 0:
                flight.handle.wait()
            else:
                flight.handle.wait_stream(stream)
            if bucket.wire is not None:
                assert bucket.buffer is not None
                bucket.buffer.copy_(bucket.wire)
            bucket.repoint()
            return
        if flight.staged is not None:
            if stream is None:
                flight.staged.wait()
            else:
                flight.staged.wait_stream(stream)
            assert bucket is not None
            bucket.hand_back(flight.targets)
        if flight.handle is not None:
            outs = flight.handle.wait() if stream is None else flight.handle.wait_stream(stream)
            if len(flight.dense) == 1 and not isinstance(outs, list):
                outs = [outs]
            for p, out, ctx in zip(flight.dense, outs, flight.ctxs, strict=True):
                self._write_back(p, out, ctx)
        for p, handle in flight.sparse:
            p.grad = handle()

    def _write_back(self, p: torch.Tensor, output: torch.Tensor, ctx: Any) -> None:
        grad = p.grad
        assert grad is not None
        if output is grad:
            return
        restored = self._compression.decompress(output, ctx)
        if grad.is_sparse:  # sparse_as_dense: reduced densely, handed back sparse
            p.grad = restored.to_sparse()
        elif restored is not grad:
            grad.copy_(restored)

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (starting those that no hook started, e.g.
        for parameters this rank's backward did not reach) and write the averaged gradients
        into ``p.grad``. Call it before gradient clipping or ``GradScaler.unscale_``, then
        step inside :meth:`skip_synchronize`."""
        if not self._buckets:
            self._synchronized = True
            return
        handles = self._handles
        scheduled = self._scheduled
        if scheduled is not None and scheduled.world is not runtime.running():
            self._forget_schedule()
            scheduled = None
        verdict = self._hooks.check(self._buckets)
        try:
            if scheduled is not None:
                scheduled.finish(self._stream_ordered())
            else:
                for bucket in self._buckets:
                    if bucket not in handles:
                        handles[bucket] = self._start(bucket)
                ordered = self._stream_ordered()
                for bucket, flight in handles.items():
                    stream = stream_of(bucket.device) if ordered and bucket.device >= 0 \
                        else None
                    self._finish(flight, stream)
        finally:
            handles.clear()
            for bucket in self._buckets:
                bucket.reset()
        self._hooks.settle(self._buckets, verdict)
        self._synchronized = True
        if not self._schedule_tried:
            self._schedule_tried = True
            self._rebucket()
            self._scheduled, self._unscheduled = open_scheduled(
                self._buckets, self._slots or [], self.process_set_id, self._what())

    def _forget_schedule(self) -> None:
        """Agree again from the next bucket on: the schedule belonged to an engine that is
        gone (its world ended in an elastic reset, or hvdlite was shut down and initialised
        again), and the new world may have other ranks."""
        self._scheduled, self._schedule_tried, self._slots = None, False, None
        self._unscheduled = "the step after hvdlite was initialised again has not run yet"

    def _what(self) -> str:
        # Named after the first bucket, so two optimizers' agreements never share a name.
        return f"DistributedOptimizer[{self._buckets[0].name}]"

    # -- what make_graphed_step (and a user) may ask ----------------------------------------
    @property
    def process_set_id(self) -> int:
        """The id of the process set the gradients are reduced over (0: every rank)."""
        ps = resolve(self.process_set, "DistributedOptimizer")
        return 0 if ps.core is None else ps.core.process_set_id

    @property
    def bucket_names(self) -> list[str]:
        """The names of the gradient buckets, in launch order (empty where this rank
        communicates nothing: one rank, or outside ``process_set``); formed again at the end
        of the first step, in the order its backward made the gradients ready."""
        return [b.name for b in self._buckets]

    @property
    def agreed_schedule(self) -> Any:
        """The runtime's agreed schedule the buckets are launched on (from the second step),
        or None (before it, or where the ranks cannot: see :attr:`unscheduled_reason`)."""
        return self._scheduled.schedule if self._scheduled is not None else None

    @property
    def unscheduled_reason(self) -> str:
        """Why the buckets are not on an agreed schedule ('' when they are)."""
        return "" if self._scheduled is not None else self._unscheduled

    def move_schedule(self, via: str) -> str:
        """Move the buckets' agreed schedule to ``via``, "nccl" or "ipc" (CUDA IPC: the copy
        engines move the data, no SMs taken from compute; a GPU per rank, one host, NVIDIA's
        cuda-python). Returns '' once they run on it, else why not (the same on every rank;
        they stay where they were). Collective over the process set and blocking; between
        steps only (``HvdliteError`` otherwise); ``ValueError`` for another ``via``.
        ``make_graphed_step`` calls it under ``schedule_transport=auto``."""
        if via not in VIAS:
            raise ValueError(f"move_schedule: via must be one of {', '.join(VIAS)}, got "
                             f"{via!r}")
        if self._scheduled is None and not self._schedule_tried:  # (no step ended yet)
            return self._unscheduled
        moved, why = move_scheduled(self._scheduled, self._buckets, self._slots or [],
                                    self.process_set_id, self._what(), via)
        if moved is not None:
            self._scheduled, self._unscheduled = moved, ""
        return why

    def _check_buckets(self) -> None:
        """Before the first bucket's reduction: every member of the set built the same
        buckets (collective over it; MismatchError on every rank, naming the ranks and the
        first differing bucket, instead of a stall on a bucket some ranks never reduce)."""
        wires = []
        for b in self._buckets:
            wire = wire_type(self._compression, b)
            wires.append(wire if isinstance(wire, torch.dtype) else b.params[0].dtype)
        pre, post = self._factors()
        found = slots(self._buckets, wires, self.op, pre, post)
        runtime.check_agreed(f"{self._what()} gradient buckets", runtime.slot_rows(found),
                             "every rank must wrap the same model's parameters, in the same "
                             "order, with the same settings", self.process_set_id)
        self._slots = found

    def _stream_ordered(self) -> bool:
        """Whether CUDA gradients are handed over by stream order (the current stream waits
        on each bucket's completion event, in either completion mode) rather than a host
        wait: always, except while the timeline is on (it brackets device work by host
        waits, and wants them here too)."""
        if not any(b.device >= 0 for b in self._buckets):
            return False
        return not runtime.host_waits()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (you already called
        :meth:`synchronize`), as the AMP ``GradScaler`` recipe needs."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize the gradients (unless inside :meth:`skip_synchronize`), then take the
        wrapped optimizer's step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): the gradients are reduced "
                              "again, which slows training", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; ``AssertionError`` if their allreduces are still in flight.

        ``set_to_none=True`` (the default): every ``.grad`` becomes None, as with torch, and
        no device work is done; backward then makes fresh gradients (no accumulation kernel
        per parameter), and each bucket's are copied into its buffer by one batched copy when
        it is reduced. ``set_to_none=False``: gradients that live in bucket buffers are zeroed
        in place, one memset per bucket, and stay views; the others as the wrapped optimizer
        zeroes them."""
        if self._handles:
            raise AssertionError(_ZERO_GRAD)
        viewed = [b for b in self._buckets if b.views]
        if set_to_none or not viewed:
            super(self.__class__, self).zero_grad(set_to_none)
            return
        for bucket in viewed:
            assert bucket.buffer is not None
            bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if p.grad is not view:
                    p.grad = view
        rest = self._unbucketed + [p for b in self._buckets if not b.views for p in b.params]
        for p in rest:
            grad = p.grad
            if grad is not None:
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()


_SCHEDULED = _Flight(None, [], [], [])  # a bucket launched on its schedule (state there)


def _dense(grad: torch.Tensor | None) -> torch.Tensor:
    assert grad is not None
    return grad.to_dense() if grad.is_sparse else grad


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set, *,
                         gradient_as_bucket_view: bool = True, bucket_cap_mb: float = 25.0,
                         last_bucket_cap_mb: float | None = 1.0) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so each ``step()`` uses gradients averaged over all ranks (over the
    members of ``process_set`` when one is given).

    Returns an instance of a subclass of ``optimizer``'s class sharing its param groups.
    ``named_parameters``: ``model.named_parameters()`` (names key the allreduces; default
    positional names). ``compression``: ``Compression.none``/``fp16``/``bf16``.
    ``backward_passes_per_step``: local accumulation steps per allreduce. ``op``: Average, Sum
    or Adasum. ``gradient_predivide_factor``: divide before the sum and multiply after (Average
    only). ``groups``: an int (that many fused groups) or a list of lists of parameters
    reduced together; ``num_groups`` is its deprecated name. ``sparse_as_dense``: densify
    sparse gradients instead of gathering them. ``process_set``: a registered set whose
    members reduce among themselves (``Average`` divides by its size); on a rank outside it,
    as in Horovod, nothing is communicated and ``step()`` applies that rank's own gradients.

    hvdlite's own keywords (Horovod has neither): without ``groups``, gradients are reduced
    in buckets of at most ``bucket_cap_mb`` MiB (one device and dtype each), each by one
    allreduce of the bucket's flat buffer once all its gradients are ready, the last of at most
    ``last_bucket_cap_mb`` MiB (None: ``bucket_cap_mb``), so little is left to reduce when
    backward ends: in reverse parameter order for the first step, then in the order its
    backward made the gradients ready (rank 0's; collective at its end). By default
    (``gradient_as_bucket_view=True``, DDP's option of that name, on here because it was the
    faster at two GPUs in every same-launch comparison: see
    docs/benchmarks.md, T1) each bucket owns one flat buffer: when it is reduced its gradients
    are copied into the buffer (none when they are its views already), reduced there in place,
    and every member's ``.grad`` is then a view of it, which ``step()`` reads.
    ``zero_grad()`` (``set_to_none``) sets them to None, so backward makes fresh gradients
    instead of accumulating into the views (one kernel per parameter);
    ``zero_grad(set_to_none=False)`` zeroes each buffer in place (one memset) and keeps the
    views, which backward then accumulates into. As with DDP's option: ``p.grad.detach_()``
    raises while ``p.grad`` is a view, and a tensor you keep from ``p.grad`` changes with the
    buffer. ``gradient_as_bucket_view=False``: the gradients stay their own tensors, copied into
    a staging buffer by one batched copy, reduced there and copied back by one batched copy.
    A bucket whose gradient is sparse at its first reduction never gets views, and with a
    compressor other than ``Compression.fp16``/``bf16`` no bucket does;
    ``Compression.fp16``/``bf16`` cast the whole buffer at once. Either way a ``.grad`` you
    replace or set to None before its bucket is reduced is what is reduced, and one replaced
    while its bucket is on the wire gets the reduced value back (Horovod's
    write-back); a sparse gradient, a compressor, or gradients of mixed types make their
    bucket fall back to one call per bucket over the gradients themselves.

    The buckets are checked alike on every member of the set before the first is reduced
    (:class:`~hvdlite.MismatchError` on every rank if a rank built others). From the second
    step, CUDA buckets over NCCL are launched by the autograd thread itself, in bucket order
    (a bucket ready early waits for the ones before it), on their own NCCL communicator: no
    negotiation per bucket (``optimizer_schedule`` knob; see docs/architecture.md, "The
    training step").

    Completion: ``step()`` and ``synchronize()`` never wait on the host for CUDA work
    (except with the timeline on): they order torch's current stream after each bucket's
    collective (a CUDA event wait), so the optimizer's kernels, and anything you launch after
    ``step()`` on that stream, see the averaged gradients. This holds in both completion
    modes: ``HVDLITE_ENABLE_ASYNC_COMPLETION`` governs only the handles you wait on yourself
    (``hvd.synchronize(handle)``, ``handle.wait()``). Host code that reads a gradient's
    values (``.item()``, ``.cpu()``) synchronizes as torch always does.
    ``op=Adasum`` (more than one rank): Horovod's delta optimizer (each parameter's update,
    not its gradient, is combined with Adasum; see ``docs/horovod.md``); global set only
    (``NotImplementedError`` otherwise, as in Horovod). ``ValueError``/``TypeError`` for bad
    arguments.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer expects a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    op = resolve_op(op, None, "DistributedOptimizer")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step,
                                                                    int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got "
                         f"{backward_passes_per_step!r}")
    if not isinstance(gradient_predivide_factor, (int, float)) or gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be a positive number, got "
                         f"{gradient_predivide_factor!r}")
    caps = (mib_bytes("bucket_cap_mb", bucket_cap_mb),
            mib_bytes("last_bucket_cap_mb", last_bucket_cap_mb, optional=True))
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups=", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None:
        if isinstance(groups, list):
            seen: set[int] = set()
            for g in groups:
                for p in g:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must be a list of lists of torch.Tensor")
                    if id(p) in seen:
                        raise ValueError("a parameter can appear in only one of groups")
                    seen.add(id(p))
        elif isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
            raise ValueError(f"groups must be a positive int or a list of lists of tensors, "
                             f"got {groups!r}")
    if process_set is not global_process_set:
        if not isinstance(process_set, _sets.ProcessSet):
            raise TypeError(f"DistributedOptimizer: process_set must be a "
                            f"hvdlite.torch.ProcessSet, got {type(process_set).__name__}")
        if process_set.process_set_id is None:
            raise InvalidArgumentError(f"DistributedOptimizer: {process_set!r} is not "
                                       "registered; pass it to hvd.init(process_sets=[...]) or "
                                       "hvd.add_process_set first")
        if process_set.included():
            resolve(process_set, "DistributedOptimizer")  # still registered (not stale)?
    if op is Adasum and size() > 1:
        if process_set is not global_process_set:
            raise NotImplementedError("DistributedOptimizer: op=Adasum reduces over the "
                                      "global process set only (as in Horovod)")
        from hvdlite.torch._adasum_optimizer import _DistributedAdasumOptimizer

        adasum_cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                          dict(_DistributedAdasumOptimizer.__dict__))
        return adasum_cls(optimizer.param_groups, named_parameters, compression,
                          backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step, op, gradient_predivide_factor, groups,
               sparse_as_dense, process_set, bool(gradient_as_bucket_view), caps)
