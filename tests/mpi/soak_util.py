"""The random-order soak's engine, shared by ``tests/mpi/test_soak.py`` (host arrays) and
``tests/gpu/test_gpu_soak.py`` (device arrays, through a :class:`Memory` adapter): each step a
seeded mix of every collective, each rank submitting and waiting in its own order, every result
checked exactly against NumPy (see ``tests/mpi/test_soak.py`` for what a step holds)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi_util import (
    allgather_ints,
    make_input,
    op_allowed,
    reference_allreduce,
    seed_for,
)

SEED = 20_240_612
# Steps per job size, measured on 2 cores (4 ranks oversubscribe them): 1 rank ~2.5 ms a step,
# 2 ranks ~6 ms, 4 ranks 20-35 ms; about 13 collectives a step. A few seconds per size.
STEPS = {1: 800, 2: 500, 4: 150}
SOAK_TIMEOUT_S = 150.0
WAIT_TIMEOUT_S = 60.0

DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]  # fmt: skip
OPS = ["Sum", "Average", "Min", "Max", "Product"]
SCALES = [(1.0, 1.0), (2.0, 1.0), (1.0, 0.25), (0.5, 2.0), (2.0, 0.5)]


@dataclass(frozen=True)
class Memory:
    """Where the soak's tensors live: ``put`` turns a NumPy input into the submitted tensor,
    ``get`` a result (or input) back into NumPy; ``dtypes`` and ``ops`` are what it carries
    (the device soak in ``tests/gpu`` passes CuPy's)."""

    put: Callable[[np.ndarray], Any]
    get: Callable[[Any], np.ndarray]
    dtypes: tuple[str, ...]
    op_ok: Callable[[str, str], bool]


HOST = Memory(lambda a: a, lambda a: a, tuple(DTYPES), op_allowed)


@dataclass
class Op:
    """One collective of a step: how this rank submits it and what it must return."""

    name: str
    submit: Callable[[], Any]  # returns a Handle, or the result itself when blocking
    check: Callable[[Any], None]  # checks the result (raises AssertionError)
    blocking: bool = False


def _exact(got: Any, want: np.ndarray, what: str) -> None:
    assert isinstance(got, np.ndarray), f"{what}: expected an ndarray, got {type(got)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_array_equal(got, want, err_msg=what)


def _input(seed: int, rank: int, shape: tuple[int, ...], dtype: str, low: int = -8,
           high: int = 8) -> np.ndarray:
    """:func:`make_input` as a writable array, also for 0-d shapes (NumPy makes scalars)."""
    return np.array(make_input(seed, rank, shape, dtype, low, high))


def _reference(seed: int, size: int, shape: tuple[int, ...], dtype: str, op: str, low: int,
               high: int, pre: float = 1.0, post: float = 1.0) -> np.ndarray:
    inputs = [_input(seed, r, shape, dtype, low, high) for r in range(size)]
    return np.asarray(reference_allreduce(inputs, op, pre, post))


def _shape(rng: np.random.Generator, max_dims: int = 3) -> tuple[int, ...]:
    return tuple(int(n) for n in rng.integers(1, 5, size=int(rng.integers(0, max_dims + 1))))


def _op_for(rng: np.random.Generator, dtype: str, mem: Memory) -> str:
    return str(rng.choice([op for op in OPS if mem.op_ok(dtype, op)]))


def _value_range(op: str) -> tuple[int, int]:
    """Products over 4 ranks stay exact (and in int8) with factors in [-2, 2]."""
    return (-2, 2) if op == "Product" else (-8, 8)


class _Step:
    """Builds one step's collectives for this rank (the mix is drawn from the shared seed)."""

    def __init__(self, hvd: Any, step: int, seen: set[str], mem: Memory = HOST,
                 unique: bool = False) -> None:
        self.hvd, self.step, self.seen, self.mem = hvd, step, seen, mem
        self.prefix = f"soak.{step}" if unique else "soak"  # unique: names never seen again
        self.dtypes = list(mem.dtypes)
        self.rank, self.size = hvd.rank(), hvd.size()
        self.rng = np.random.default_rng([SEED, step])  # the same on every rank
        self.ops: list[Op] = []
        self.count: dict[str, int] = {}

    def _name(self, kind: str) -> str:
        j = self.count.get(kind, 0)
        self.count[kind] = j + 1
        return f"{self.prefix}.{kind}.{j}"

    def _seed(self, name: str) -> int:
        return seed_for(SEED, self.step, name)

    def allreduce(self, blocking: bool = False) -> None:
        hvd, rng, rank, size = self.hvd, self.rng, self.rank, self.size
        name = self._name("allreduce")
        dtype = str(rng.choice(self.dtypes))
        op = _op_for(rng, dtype, self.mem)
        shape = _shape(rng)
        kind = np.dtype(dtype).kind
        pre, post = SCALES[int(rng.integers(len(SCALES)))] if kind in "iuf" else (1.0, 1.0)
        form = str(rng.choice(["plain", "in_place", "out"]))
        low, high = _value_range(op)
        seed = self._seed(name)
        before = _input(seed, rank, shape, dtype, low, high)
        x = self.mem.put(before.copy())
        out = self.mem.put(np.empty_like(before)) if form == "out" else None
        what = f"step {self.step} {name} {form} {dtype} {op} {shape} pre={pre} post={post}"
        want = _reference(seed, size, shape, dtype, op, low, high, pre, post)
        kwargs = {"name": name, "op": getattr(hvd, op), "prescale_factor": pre,
                  "postscale_factor": post}  # fmt: skip

        def submit() -> Any:
            if form == "in_place":
                return (hvd.allreduce_ if blocking else hvd.allreduce_async_)(x, **kwargs)
            call = hvd.allreduce if blocking else hvd.allreduce_async
            return call(x, out=out, **kwargs)

        def check(got: Any) -> None:
            _exact(self.mem.get(got), want, what)
            if form == "in_place":
                assert got is x, f"{what}: the in-place result is not the input"
            else:
                np.testing.assert_array_equal(self.mem.get(x), before,
                                              err_msg=f"{what}: input modified")
                if form == "out":
                    assert got is out, f"{what}: the result is not out="

        self.seen.update({f"allreduce.op.{op}", f"allreduce.form.{form}",
                          f"allreduce.dtype.{dtype}", f"allreduce.blocking.{blocking}",
                          f"allreduce.scaled.{(pre, post) != (1.0, 1.0)}"})  # fmt: skip
        self.ops.append(Op(name, submit, check, blocking))

    def grouped(self) -> None:
        hvd, rng, rank, size = self.hvd, self.rng, self.rank, self.size
        name = self._name("grouped")
        dtype = str(rng.choice(self.dtypes))
        op = _op_for(rng, dtype, self.mem)
        shapes = [_shape(rng, 2) for _ in range(int(rng.integers(2, 5)))]
        in_place = bool(rng.integers(2))
        low, high = _value_range(op)
        seeds = [self._seed(f"{name}.{i}") for i in range(len(shapes))]
        xs = [self.mem.put(_input(s, rank, sh, dtype, low, high))
              for s, sh in zip(seeds, shapes, strict=True)]
        wants = [_reference(s, size, sh, dtype, op, low, high)
                 for s, sh in zip(seeds, shapes, strict=True)]  # fmt: skip
        what = f"step {self.step} {name} in_place={in_place} {dtype} {op} {shapes}"

        def submit() -> Any:
            call = hvd.grouped_allreduce_async_ if in_place else hvd.grouped_allreduce_async
            return call(xs, name=name, op=getattr(hvd, op))

        def check(got: Any) -> None:
            assert isinstance(got, list) and len(got) == len(wants), f"{what}: got {got!r}"
            for i, (g, w) in enumerate(zip(got, wants, strict=True)):
                _exact(self.mem.get(g), w, f"{what} part {i}")
                if in_place:
                    assert g is xs[i], f"{what} part {i}: the in-place result is not the input"

        self.seen.update({f"grouped.op.{op}", f"grouped.in_place.{in_place}"})
        self.ops.append(Op(name, submit, check))

    def allgather(self) -> None:
        hvd, rng, rank, size = self.hvd, self.rng, self.rank, self.size
        name = self._name("allgather")
        dtype = str(rng.choice(self.dtypes))
        trailing = _shape(rng, 2)
        rows = [int(n) for n in rng.integers(0, 4, size=size)]
        seed = self._seed(name)
        inputs = [_input(seed, r, (rows[r], *trailing), dtype) for r in range(size)]
        want = np.concatenate(inputs)
        what = f"step {self.step} {name} {dtype} rows={rows} trailing={trailing}"
        self.seen.update({"allgather", *(["allgather.zero_rows"] if 0 in rows else [])})
        mine = self.mem.put(inputs[rank])
        self.ops.append(Op(name, lambda: hvd.allgather_async(mine, name=name),
                           lambda got: _exact(self.mem.get(got), want, what)))

    def broadcast(self) -> None:
        hvd, rng, rank = self.hvd, self.rng, self.rank
        name = self._name("broadcast")
        dtype = str(rng.choice(self.dtypes))
        shape = _shape(rng)
        root = int(rng.integers(self.size))
        in_place = bool(rng.integers(2))
        seed = self._seed(name)
        before = _input(seed, rank, shape, dtype)
        x = self.mem.put(before.copy())
        want = _input(seed, root, shape, dtype)
        what = f"step {self.step} {name} in_place={in_place} {dtype} {shape} root={root}"

        def submit() -> Any:
            call = hvd.broadcast_async_ if in_place else hvd.broadcast_async
            return call(x, root, name=name)

        def check(got: Any) -> None:
            _exact(self.mem.get(got), want, what)
            if in_place:
                assert got is x, f"{what}: the in-place result is not the input"
            else:
                np.testing.assert_array_equal(self.mem.get(x), before,
                                              err_msg=f"{what}: input modified")

        self.seen.update({f"broadcast.root.{root}", f"broadcast.in_place.{in_place}"})
        self.ops.append(Op(name, submit, check))

    def alltoall(self) -> None:
        hvd, rng, rank, size = self.hvd, self.rng, self.rank, self.size
        name = self._name("alltoall")
        dtype = str(rng.choice(self.dtypes))
        trailing = _shape(rng, 2)
        default = bool(rng.integers(4) == 0)
        if default:
            per = int(rng.integers(0, 3))
            splits = [[per] * size for _ in range(size)]
        else:
            splits = rng.integers(0, 3, size=(size, size)).tolist()
        seed = self._seed(name)
        inputs = [_input(seed, r, (sum(splits[r]), *trailing), dtype) for r in range(size)]
        parts = []
        for src in range(size):
            start = sum(splits[src][:rank])
            parts.append(inputs[src][start : start + splits[src][rank]])
        want = np.concatenate(parts)
        what = f"step {self.step} {name} {dtype} splits={splits} trailing={trailing}"
        mine = None if default else splits[rank]
        x = self.mem.put(inputs[rank])
        self.seen.add(f"alltoall.default_splits.{default}")
        self.ops.append(Op(name, lambda: hvd.alltoall_async(x, mine, name=name),
                           lambda got: _exact(self.mem.get(got), want, what)))

    def reducescatter(self) -> None:
        hvd, rng, rank, size = self.hvd, self.rng, self.rank, self.size
        name = self._name("reducescatter")
        dtype = str(rng.choice(self.dtypes))
        op = _op_for(rng, dtype, self.mem)
        shape = (int(rng.integers(size, 3 * size + 2)), *_shape(rng, 2))
        low, high = _value_range(op)
        seed = self._seed(name)
        full = _reference(seed, size, shape, dtype, op, low, high)
        base, extra = divmod(shape[0], size)
        rows = [base + (1 if r < extra else 0) for r in range(size)]
        start = sum(rows[:rank])
        want = full[start : start + rows[rank]]
        x = self.mem.put(_input(seed, rank, shape, dtype, low, high))
        what = f"step {self.step} {name} {dtype} {op} {shape}"
        self.seen.update({f"reducescatter.op.{op}", f"reducescatter.uneven.{bool(extra)}"})
        self.ops.append(Op(name, lambda: hvd.reducescatter_async(x, name=name, op=getattr(hvd, op)),
                           lambda got: _exact(self.mem.get(got), want, what)))

    def barrier(self) -> None:
        name = self._name("barrier")

        def check(got: Any) -> None:
            assert got is None, f"step {self.step} {name}: barrier returned {got!r}"

        self.seen.add("barrier")
        self.ops.append(Op(name, lambda: self.hvd.barrier_async(name=name), check))

    def build(self) -> list[Op]:
        makers = [self.allreduce, self.grouped, self.allgather, self.broadcast, self.alltoall,
                  self.reducescatter, self.barrier]  # fmt: skip
        for make in makers:  # every collective every step ...
            make()
        for k in self.rng.integers(0, len(makers), size=int(self.rng.integers(3, 9))):
            makers[int(k)]()  # ... and a few more of a random mix
        if self.rng.integers(2):
            self.allreduce(blocking=True)  # at most one per step: two could deadlock
        return self.ops


def _required(size: int, mem: Memory) -> set[str]:
    """What the soak must have covered by its end (the draws are seeded: no flakiness)."""
    flags = ("True", "False")
    return {
        *(f"allreduce.op.{op}" for op in OPS),
        *(f"allreduce.form.{form}" for form in ("plain", "in_place", "out")),
        *(f"allreduce.dtype.{dtype}" for dtype in mem.dtypes),
        *(f"allreduce.{what}.{flag}" for what in ("blocking", "scaled") for flag in flags),
        *(f"grouped.op.{op}" for op in OPS),
        *(f"grouped.in_place.{flag}" for flag in flags),
        "allgather", "allgather.zero_rows",
        *(f"broadcast.root.{root}" for root in range(size)),
        *(f"broadcast.in_place.{flag}" for flag in flags),
        *(f"alltoall.default_splits.{flag}" for flag in flags),
        *(f"reducescatter.op.{op}" for op in OPS),
        *(f"reducescatter.uneven.{flag}" for flag in (flags if size > 1 else ("False",))),
        "barrier",
    }  # fmt: skip


def _wait(hvd: Any, handle: Any, how: int) -> Any:
    if how == 0:
        return handle.wait()
    if how == 1:
        return handle.wait(timeout=WAIT_TIMEOUT_S)
    if how == 2:
        return hvd.synchronize(handle)
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while not hvd.poll(handle):
        assert time.monotonic() < deadline, f"{handle!r}: not done after {WAIT_TIMEOUT_S} s"
        time.sleep(0.0001)
    return handle.wait()


def run_soak(hvd: Any, steps: int, mem: Memory, first_step: int = 0,
             unique: bool = False) -> int:
    """``steps`` soak steps from ``first_step`` in ``mem``; returns the collectives run.
    Checks every result, and (when ``first_step`` is 0) that every form was covered.
    ``unique``: every step's names are new (``soak.<step>.<kind>.<i>``)."""
    rank, size = hvd.rank(), hvd.size()
    start = time.monotonic()
    total = 0
    seen: set[str] = set()
    for step in range(first_step, first_step + steps):
        ops = _Step(hvd, step, seen, mem, unique).build()
        mine = np.random.default_rng([SEED, rank, step])
        submit_order = mine.permutation(len(ops)).tolist()
        wait_order = mine.permutation(len(ops)).tolist()
        handles: dict[int, Any] = {}
        for i in submit_order:
            op = ops[i]
            if op.blocking:
                op.check(op.submit())
            else:
                handles[i] = op.submit()
        for n, i in enumerate(j for j in wait_order if j in handles):
            ops[i].check(_wait(hvd, handles[i], (n + rank + step) % 4))
        total += len(ops)
    wall = time.monotonic() - start
    if first_step == 0:
        missing = _required(size, mem) - seen
        assert not missing, f"the soak never ran: {sorted(missing)}"
    counts = allgather_ints(total, "comparing soak collective counts")
    assert len(set(counts)) == 1, f"ranks ran different numbers of collectives: {counts}"
    if rank == 0:
        print(f"\nsoak: {size} rank(s), {steps} steps, {total} collectives per rank, "
              f"{wall:.1f} s ({1e3 * wall / steps:.1f} ms/step)")
    return total
