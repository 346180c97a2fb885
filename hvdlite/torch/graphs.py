"""The captured step: a whole data-parallel training step (forward, backward, the gradient
buckets' allreduces, the optimizer) captured once as one CUDA graph and replayed.

A replay runs no Python, takes no lock, wakes no thread and makes no MPI call: what makes it
possible is the runtime's agreed schedule (``hvdlite/_control/agreed.py``), which a
``DistributedOptimizer`` launches its buckets on (``hvdlite/torch/_scheduled.py``). After the
warm-up steps every rank launches its buckets itself, in the agreed order, on the schedule's own
communicator and stream, so capturing a step captures those launches too: the READY event
of each bucket forks the schedule's stream off the captured stream and the step's waits join it
back, so the buckets keep overlapping backward inside the graph. Before the first replay every
member of the set shows what it captured (the buckets and how many launches of each), and a
rank whose capture differs raises :class:`~hvdlite.MismatchError` on every rank.

Usage (see docs/horovod.md, "The captured step")::

    step = hvd.make_graphed_step(train_step, static_x, static_y, optimizer=opt)
    for x, y in loader:
        loss = step(x, y)          # copies x, y into the static inputs, replays

``train_step(x, y)`` runs one whole step on those tensors (``opt.zero_grad()``, forward,
``loss.backward()``, ``opt.step()``) and returns what the caller wants back (a loss tensor, a
tuple of tensors); it must be capturable: static shapes, no host synchronisation (``.item()``,
printing a tensor, data-dependent Python control flow), a capturable optimizer (``SGD``,
``Adam(capturable=True)``, ``AdamW(capturable=True)``), learning rates that live in tensors if
they change. What it returns is the same tensors every replay, overwritten by each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hvdlite import _runtime_api as runtime
from hvdlite.errors import HvdliteError
from hvdlite.torch._rehearsal import rehearsing

log = logging.getLogger("hvdlite")

__all__ = ["GraphedStep", "make_graphed_step"]


def _optimizers(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for o in items:
        if not hasattr(o, "agreed_schedule") or not hasattr(o, "bucket_names"):
            raise TypeError(f"make_graphed_step: optimizer must be a hvdlite.torch."
                            f"DistributedOptimizer (or a list of them), got {type(o).__name__}")
    return items


def _move_schedules(opts: list[Any], side: torch.cuda.Stream) -> None:
    """Under ``schedule_transport=auto``, before the last warm-up step (so one eager step runs
    on what gets captured): each optimizer's schedule moves to CUDA IPC where every rank can,
    which takes no SMs from the captured backward, and buckets on no schedule (ranks that
    share a GPU: NCCL refuses them) get one there (collective, like the optimizers' steps)."""
    if runtime.config().schedule_transport != "auto":
        return
    side.synchronize()  # the previous step's launches complete before their schedule closes
    for opt in opts:
        why = opt.move_schedule("ipc")
        if why:
            where = opt.agreed_schedule.via if opt.agreed_schedule is not None else \
                "the negotiated route"
            log.info("make_graphed_step: the captured buckets stay on %s: %s", where, why)


def _schedules(opts: list[Any]) -> list[Any]:
    """The agreed schedules the optimizers' buckets run on (after the warm-up steps)."""
    schedules = []
    for opt in opts:
        schedule = opt.agreed_schedule
        if opt.bucket_names and schedule is None:
            raise HvdliteError(f"make_graphed_step: {type(opt).__name__}'s buckets are not on "
                               f"an agreed schedule: {opt.unscheduled_reason}; "
                               "run this step eagerly (a captured step needs CUDA buckets "
                               "on an agreed schedule: over NCCL, or CUDA IPC on one host)")
        if schedule is not None:
            schedules.append(schedule)
    return schedules


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    """The current device's stream for warm-up steps and captures: one per device, so that
    graphs sharing a memory pool are captured on one stream, as torch asks."""
    device = torch.cuda.current_device()
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def _capture(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream,
             schedules: list[Any], step_fn: Callable[..., Any],
             inputs: list[torch.Tensor]) -> Any:
    """``step_fn(*inputs)`` captured into ``graph`` on ``stream``; its outputs."""
    try:
        with runtime.capture(schedules, graph), \
                torch.cuda.graph(graph, pool=pool, stream=stream,
                                 capture_error_mode="thread_local"):
            return step_fn(*inputs)
    except Exception as exc:
        if not _compiling_failed(exc):
            raise
        raise HvdliteError(
            "make_graphed_step: a compiled part of the step compiled again during the capture "
            "(its guards failed: its inputs differed from the warm-up steps'), and compiling "
            "cannot run inside a capture; run with TORCH_LOGS=recompiles to see the guard, and "
            f"make the step's inputs to that part the same in every step ({type(exc).__name__})"
        ) from exc


def _compiling_failed(exc: BaseException) -> bool:
    """Whether torch.compile failed in ``exc`` or the error it ended in (a capture invalidated
    by a compile is reported by ``capture_end``, the compile's error as its context)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _check_inputs(inputs: Sequence[Any]) -> list[torch.Tensor]:
    out = []
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise TypeError(f"make_graphed_step: static input {i} must be a CUDA tensor, got "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.device}")
        out.append(t)
    return out


class GraphedStep:
    """A captured training step; call it with new inputs (copied into the static ones) to
    replay it. Build it with :func:`make_graphed_step`.

    Blocking: a call enqueues the replay and returns at once (stream-ordered on the current
    stream), except with the timeline on (it waits for the replay, so the span brackets it).
    Not thread-safe: replay from the thread that captured. Inputs may live on any device (a
    host batch is copied in, asynchronously from pinned memory). Errors: ``ValueError`` for
    inputs whose shape or dtype differ from the captured ones (capture again), and the
    engine's sticky :class:`~hvdlite.HvdliteError` (a peer failed, the job is ending) or an
    ``HvdliteError`` after a re-init or elastic reset (the graph's communicators are gone:
    capture again).
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], outputs: Any,
                 world: object, name: str) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.name = name
        self.replays = 0
        self._world = world
        self._facts = [(t.shape, t.dtype) for t in inputs]

    def __call__(self, *inputs: Any) -> Any:
        """Copy ``inputs`` (tensors of the captured shapes and dtypes; none to replay on what
        the static inputs hold) into the static inputs and replay; returns the captured
        outputs, overwritten by this replay."""
        if runtime.running() is not self._world:
            raise HvdliteError(f"{self.name}: captured before hvdlite was initialised again "
                               "(an elastic reset or a re-init): its communicators are gone; "
                               "capture the step again with make_graphed_step")
        runtime.check_usable()
        if inputs:
            self._copy_in(inputs)
        runtime.replay(self.graph.replay, self.name, self.replays,
                       torch.cuda.current_stream().synchronize)
        self.replays += 1
        return self.outputs

    def _copy_in(self, inputs: Sequence[Any]) -> None:
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{self.name}: {len(inputs)} inputs given, the step was captured "
                             f"with {len(self.inputs)}")
        for i, (t, (shape, dtype)) in enumerate(zip(inputs, self._facts, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.name}: input {i} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
            if t.shape != shape or t.dtype != dtype:
                raise ValueError(f"{self.name}: input {i} is {tuple(t.shape)} {t.dtype}, the "
                                 f"step was captured for {tuple(shape)} {dtype}; a captured "
                                 "step replays fixed shapes: capture again with "
                                 "make_graphed_step (or run that batch eagerly)")
        for dst, src in zip(self.inputs, inputs, strict=True):
            if src is not dst:
                dst.copy_(src, non_blocking=True)


def _kept_graph() -> tuple[torch.cuda.CUDAGraph, bool]:
    """A graph whose cudaGraph_t outlives the capture, so that it can be written as DOT.
    torch 2.11's debug mode alone no longer keeps it (its ``debug_dump`` found no graph on the
    GPU machine, run 79); ``keep_graph`` (torch >= 2.9) does, and instantiates at the first
    replay unless asked before (``_dump`` asks). Returns the graph and whether it is kept."""
    try:
        graph, kept = torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:  # an older torch: debug mode keeps the graph there
        graph, kept = torch.cuda.CUDAGraph(), False
    graph.enable_debug_mode()
    return graph, kept


def _dump(graph: torch.cuda.CUDAGraph, kept: bool, path: str) -> None:
    graph.debug_dump(path)
    if kept:
        graph.instantiate()  # now, not inside the first replay the caller may time
    if not os.path.exists(path):
        # Not raised: every rank dumps, and a rank raising here would leave its peers in the
        # capture check below until the stall timeout.
        warnings.warn(f"make_graphed_step: torch {torch.__version__} wrote no graph to "
                      f"{path!r} (CUDAGraph.debug_dump); the step is captured and runs",
                      RuntimeWarning, stacklevel=3)


def make_graphed_step(step_fn: Callable[..., Any], *static_inputs: torch.Tensor,
                      optimizer: Any = None, warmup_steps: int = 3, pool: Any = None,
                      name: str = "graphed_step",
                      debug_dump: str | os.PathLike[str] | None = None,
                      rehearse: bool = True) -> GraphedStep:
    """Capture ``step_fn(*static_inputs)``, one whole training step, as one CUDA graph.

    Collective over the members of each ``optimizer``'s process set (every rank captures
    together). Runs ``warmup_steps`` eager steps first on a side stream (at least 2: the first
    agrees the buckets, after it the optimizer launches them on its agreed schedule, which is
    what gets captured), then captures one step on the same stream (as with torch, capturing
    runs nothing: the first replay is the step after the warm-up ones), then checks that
    every rank captured the same launches. During the last warm-up step and the capture,
    ``torch.cuda.is_current_stream_capturing()`` answers True on this thread, so code that
    branches on it around a compiled region (Hugging Face's causal mask) compiles the
    capture's variant before the capture, not inside it. ``optimizer``: the
    ``DistributedOptimizer`` (or a list of them) the step uses; each must run its buckets on
    the agreed schedule (CUDA buckets, a GPU per rank: over NCCL, or CUDA IPC under
    ``schedule_transport`` ipc, and under auto for the captured step where every rank can,
    moved there before the last warm-up step; ranks that share a GPU, which NCCL refuses, get
    a schedule there too, its waits stream memory operations): buckets on the CPU, or a
    transport the ranks cannot take, raise ``HvdliteError`` naming why, and the step can run
    eagerly instead. Other hvdlite
    collectives cannot be captured (they are negotiated on the host at run time): called
    inside ``step_fn`` during the capture they raise ``HvdliteError``.
    ``pool``: a graph memory pool handle to share (``torch.cuda.graph_pool_handle()``).
    ``debug_dump``: a path to write the captured graph to as Graphviz DOT (CUDA's
    ``cudaGraphDebugDotPrint``, through torch's ``CUDAGraph.debug_dump``): every node, the
    buckets' NCCL kernels among them, and their dependencies (``scripts/gpu/graph_overlap.py``
    tells which backward kernels each NCCL kernel may overlap). ``rehearse`` (default True):
    run the last warm-up step and the capture with ``torch.cuda.is_current_stream_capturing()``
    True on this thread (above); False for a step whose code, seeing a capture, makes calls
    that only a real capture allows (``torch.cond`` under torch's CUDA-graph conditional
    nodes); a compiled region whose inputs follow the capture then compiles again inside it
    (``HvdliteError``).

    Async completion is moot inside a graph (every wait in it is a stream wait). The timeline
    records each replay as one span ``GRAPH_REPLAY`` on the track ``name``; ``hvd.stats()``
    counts replays under ``"graphs"``. After an elastic reset capture again (the graph holds
    the old world's communicators). Blocking: returns once captured. Raises
    :class:`~hvdlite.MismatchError` on every rank if ranks captured different launches, and
    :class:`~hvdlite.HvdliteError` (from torch's error) if a compiled part of the step compiled
    again during the capture.
    """
    if not isinstance(rehearse, bool):
        raise TypeError(f"make_graphed_step: rehearse must be a bool, got "
                        f"{type(rehearse).__name__}")
    if debug_dump is not None and not isinstance(debug_dump, (str, os.PathLike)):
        raise TypeError(f"make_graphed_step: debug_dump must be a path (str or os.PathLike), "
                        f"got {type(debug_dump).__name__}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 2:
        raise ValueError(f"make_graphed_step: warmup_steps must be an int >= 2, got "
                         f"{warmup_steps!r}")
    opts = _optimizers(optimizer)
    inputs = _check_inputs(static_inputs)
    world = runtime.running()
    side = _side_stream()
    side.wait_stream(torch.cuda.current_stream())
    # The last warm-up step and the capture are rehearsed (see _rehearsal.py): compiled code
    # sees the same answer and the same function in both, so the capture compiles nothing.
    with contextlib.ExitStack() as rehearsal:
        with torch.cuda.stream(side):
            for k in range(warmup_steps):
                if k == warmup_steps - 1:
                    _move_schedules(opts, side)
                    if rehearse:
                        rehearsal.enter_context(rehearsing())
                step_fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        schedules = _schedules(opts)
        before = [s.launches for s in schedules]
        graph, kept = (torch.cuda.CUDAGraph(), False) if debug_dump is None else _kept_graph()
        # Captured on the warm-up steps' stream: autograd nodes kept from them (a compiled
        # backward's accumulators, hvdlite/torch/_accumulate.py) carry that stream, and the
        # backward's end joins it, which a capture allows only from the capturing stream.
        outputs = _capture(graph, pool, side, schedules, step_fn, inputs)
    if debug_dump is not None:
        _dump(graph, kept, os.fspath(debug_dump))
    # Every rank shows what it captured (per optimizer: its buckets and how many launches the
    # capture took): MismatchError on every rank if they differ, before any replay.
    launches = iter([s.launches - n for s, n in zip(schedules, before, strict=True)])
    mine = [{"buckets": opt.bucket_names,
             "launches": next(launches) if opt.agreed_schedule is not None else 0,
             "via": opt.agreed_schedule.via if opt.agreed_schedule is not None else ""}
            for opt in opts]
    runtime.check_agreed(f"{name}.capture", mine,
                         "every rank must run the same step (the same backward passes and "
                         "optimizer steps) when it is captured",
                         opts[0].process_set_id if opts else 0)
    runtime.record_capture()
    return GraphedStep(graph, inputs, outputs, world, name)
