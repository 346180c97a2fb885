"""Helpers shared by the multi-rank tests: deterministic inputs and NumPy references.

Every rank derives its inputs from ``(seed, rank)``, so any rank can rebuild every other rank's
inputs and compute the expected result locally, without extra communication. Values are small
integers (also for float and complex dtypes) so that sums, products and averages over 1, 2 or 4
ranks are exact in every dtype, float16 included.
"""

from __future__ import annotations

import faulthandler
import sys
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

BOOL_DTYPES = ["bool"]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
COMPLEX_DTYPES = ["complex64", "complex128"]
ALL_DTYPES = BOOL_DTYPES + INT_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES
OP_NAMES = ["Sum", "Average", "Min", "Max", "Product"]

# Relative tolerance per float dtype; inputs are chosen so results are exact, this only absorbs
# a different (but legitimate) order of operations in an implementation.
RTOL = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-12, "complex64": 1e-6, "complex128": 1e-12}

BARRIER_TIMEOUT_S = 150.0
_POLL_SLEEP_S = 0.002


def op_allowed(dtype: str, op: str) -> bool:
    """Whether the contract defines reduce op ``op`` (a name, e.g. ``"Sum"``) for ``dtype``."""
    kind = np.dtype(dtype).kind
    if kind == "c":
        return op in ("Sum", "Average", "Product")
    if kind == "b":
        return op != "Average"
    return True


def make_input(
    seed: int, rank: int, shape: Sequence[int], dtype: str, low: int = -8, high: int = 8
) -> np.ndarray:
    """The input rank ``rank`` uses in test ``seed``: small integers in ``[low, high]``.

    Unsigned dtypes clip ``low`` at 0; bool draws 0/1; complex draws both parts.
    """
    rng = np.random.default_rng([seed, rank])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=tuple(shape)).astype(bool)
    if dt.kind == "u":
        low = max(low, 0)
    values = rng.integers(low, high + 1, size=tuple(shape))
    if dt.kind == "c":
        return (values + 1j * rng.integers(low, high + 1, size=tuple(shape))).astype(dt)
    return values.astype(dt)


def all_inputs(
    seed: int, size: int, shape: Sequence[int], dtype: str, low: int = -8, high: int = 8
) -> list[np.ndarray]:
    """Every rank's :func:`make_input`, in rank order."""
    return [make_input(seed, r, shape, dtype, low, high) for r in range(size)]


def _scale_int(values: np.ndarray, factor: float) -> np.ndarray:
    """Integer scaling per the contract: in float64, truncated toward zero."""
    if factor == 1.0:
        return values
    return np.trunc(values.astype(np.float64) * factor).astype(values.dtype)


def _trunc_div(values: np.ndarray, n: int) -> np.ndarray:
    """Integer division truncated toward zero, exact for 64-bit values (Python ints)."""
    flat = [int(v) for v in values.reshape(-1)]
    out = [abs(v) // n * (1 if v >= 0 else -1) for v in flat]
    return np.array(out, dtype=values.dtype).reshape(values.shape)


def reference_allreduce(
    inputs: Sequence[np.ndarray], op: str, prescale: float = 1.0, postscale: float = 1.0,
    count: int | None = None,
) -> np.ndarray:
    """The contract's allreduce of ``inputs`` (one array per contributing rank) with ``op``;
    Average divides by ``count`` (default: the number of inputs; with joined ranks, the set's
    size, as in Horovod) and truncates integer quotients toward zero."""
    stack = np.stack(inputs)
    dt = stack.dtype
    count = len(inputs) if count is None else count
    if dt.kind == "b":
        logical = np.logical_or if op in ("Sum", "Max") else np.logical_and
        return logical.reduce(stack, axis=0)
    ufunc = {"Sum": np.add, "Average": np.add, "Min": np.minimum, "Max": np.maximum}.get(
        op, np.multiply
    )
    if dt.kind in "iu":
        reduced = ufunc.reduce(_scale_int(stack, prescale), axis=0, dtype=dt)
        if op == "Average":
            reduced = (np.trunc(reduced.astype(np.float64) / count)).astype(dt) if (
                dt.itemsize < 8) else _trunc_div(reduced, count)
        return _scale_int(reduced, postscale)
    wide = np.complex128 if dt.kind == "c" else np.float64
    reduced = ufunc.reduce(stack.astype(wide) * prescale, axis=0)
    if op == "Average":
        reduced = reduced / count
    return (reduced * postscale).astype(dt)


def assert_equal_result(got: object, want: np.ndarray, what: str = "") -> None:
    """``got`` is an ndarray with ``want``'s dtype and shape and its values (exact for ints)."""
    assert isinstance(got, np.ndarray), f"{what}: expected an ndarray, got {type(got)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=RTOL[want.dtype.name], atol=0, err_msg=what)


def wait_or_abort(request: MPI.Request, what: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Wait on ``request`` until a deadline; on timeout dump stacks and abort the whole job."""
    deadline = time.monotonic() + timeout_s
    while not request.Test():
        if time.monotonic() > deadline:
            rank = MPI.COMM_WORLD.Get_rank()
            print(
                f"\n[rank {rank}] timeout after {timeout_s:.0f}s: {what}; "
                "another rank never arrived. Aborting the job.",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            MPI.COMM_WORLD.Abort(1)
        time.sleep(_POLL_SLEEP_S)


def timed_barrier(what: str) -> None:
    """Barrier on COMM_WORLD (not hvdlite's) that aborts the job if a rank never arrives."""
    wait_or_abort(MPI.COMM_WORLD.Ibarrier(), f"barrier {what}")


def allgather_ints(value: int, what: str) -> list[int]:
    """Every rank's ``value`` over COMM_WORLD, with the same deadline as the barriers."""
    comm = MPI.COMM_WORLD
    send = np.array([value], dtype=np.int64)
    recv = np.zeros(comm.Get_size(), dtype=np.int64)
    wait_or_abort(comm.Iallgather(send, recv), what)
    return [int(v) for v in recv]


def seed_for(*parts: object) -> int:
    """A stable seed for one test case, derived from its parameters (same on every rank)."""
    return zlib.crc32(repr(parts).encode())


def bcast_text(text: str | None, what: str, limit: int = 1024) -> str:
    """Rank 0's ``text`` on every rank, over COMM_WORLD with a deadline."""
    comm = MPI.COMM_WORLD
    buf = bytearray(limit)
    if comm.Get_rank() == 0:
        data = (text or "").encode()
        assert len(data) < limit, f"{what}: text longer than {limit} bytes"
        buf[: len(data)] = data
    wait_or_abort(comm.Ibcast(buf, root=0), what)
    return bytes(buf).rstrip(b"\0").decode()


def reference_adasum(inputs: Sequence[np.ndarray]) -> np.ndarray:
    """Adasum of one tensor over ranks (``inputs`` in rank order, a power of two of them): the
    binary tree of Horovod's pairwise rule, ranks [0, n/2) against [n/2, n), in float64."""
    if len(inputs) == 1:
        return np.asarray(inputs[0], dtype=np.float64)
    half = len(inputs) // 2
    a = reference_adasum(inputs[:half]).ravel()
    b = reference_adasum(inputs[half:]).ravel()
    dot, asq, bsq = float(a @ b), float(a @ a), float(b @ b)
    tiny = float(np.sqrt(np.finfo(np.float64).tiny))
    ac = 1.0 - dot / asq * 0.5 if asq >= tiny else 1.0
    bc = 1.0 - dot / bsq * 0.5 if bsq >= tiny else 1.0
    return (ac * a + bc * b).reshape(np.shape(inputs[0]))


def adasum_close(got: np.ndarray, want: np.ndarray, dtype: Any, what: str) -> None:
    """Horovod's Adasum tolerance: relative norm of the difference within 100 epsilons."""
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    norm = float(np.linalg.norm(want64)) or 1.0
    ratio = float(np.linalg.norm(got64 - want64)) / norm
    assert ratio < 100 * float(np.finfo(dtype).eps), f"{what}: off by {ratio:.3g} (relative)"
