"""Adasum (adaptive summation; Maleki et al., MLSys 2021), Horovod's algorithm.

Two vectors combine as ``a + b - (a.b / 2|a|^2) a - (a.b / 2|b|^2) b`` (a coefficient stays 1
where a squared norm is below ``sqrt(DBL_MIN)``, as in Horovod): parallel vectors average,
orthogonal ones add. Over ``p = 2^k`` ranks the combination is applied as a binary tree (ranks
``[0, p/2)`` against ``[p/2, p)``, recursively), computed by recursive vector halving and
distance doubling:

- level ``l = 0 .. k-1`` (distance ``d = 2^l``, partner ``r ^ d``): the pair holds the same
  segment of the buffer; the rank with bit ``l`` clear keeps its first half, the other the
  second; each sends the half it gives up and receives the partner's copy of the half it keeps.
  Dot products and squared norms of the kept half, per tensor, in float64, are summed over the
  ``2^(l+1)`` ranks of the block (which together hold the whole vectors being combined), and
  the kept half becomes ``a_coeff * left + b_coeff * right``.
- then the halves travel back (distance halving) until every rank holds the whole result.

Each element is combined by exactly one rank and the partial sums are reduced alike everywhere,
so every rank ends with the same bits. A fused bucket keeps one set of dot products per tensor.
The same code runs on NumPy (host, MPI point-to-point) and CuPy (device, NCCL or CUDA IPC, all
on hvdlite's stream: the coefficients never leave the device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["adasum", "check_size", "schedule", "THRESHOLD"]

THRESHOLD = float(np.sqrt(np.finfo(np.float64).tiny))  # Horovod's sqrt(DBL_MIN)

# exchange(send_view, recv_view, partner, level, halving): send one, receive the other. While
# halving every rank sends the range it gives up, while doubling back the range it kept.
Exchange = Callable[[Any, Any, int, int, bool], None]
# block_sum(partials, level): the (T, 3) float64 partials summed over the level's block.
BlockSum = Callable[[Any, int], Any]


def check_size(size: int, what: str) -> None:
    """``ValueError`` unless ``size`` is a power of two (Horovod's rule for Adasum)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"{what}: op Adasum needs a power-of-two number of ranks (as in "
                         f"Horovod), this process set has {size}; use a set of 1, 2, 4, 8, "
                         "... ranks, or op=Average")


def schedule(n: int, size: int, rank: int) -> list[tuple[int, int, tuple[int, int],
                                                         tuple[int, int], bool]]:
    """The halving levels of ``rank``: (level, partner, kept range, given range, is_left)."""
    steps = []
    lo, hi = 0, n
    level = 0
    while (1 << level) < size:
        d = 1 << level
        mid = lo + (hi - lo) // 2
        left = not rank & d
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        steps.append((level, rank ^ d, keep, give, left))
        lo, hi = keep
        level += 1
    return steps


def adasum(xp: Any, buf: Any, counts: Sequence[int], rank: int, size: int,
           exchange: Exchange, block_sum: BlockSum) -> None:
    """Replace the flat ``buf`` (every rank's, the same length and dtype) by the Adasum of all
    ranks' buffers, per tensor (``counts`` elements each, in order), in place."""
    if size == 1 or buf.size == 0:
        return
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    theirs = xp.empty_like(buf)
    steps = schedule(buf.size, size, rank)
    for level, partner, keep, give, left in steps:
        lo, hi = keep
        exchange(buf[give[0]:give[1]], theirs[lo:hi], partner, level, True)
        mine, other = buf[lo:hi], theirs[lo:hi]
        parts = _parts(offsets, lo, hi)
        partials = _partials(xp, mine, other, parts, len(counts), left)
        _combine(xp, mine, other, block_sum(partials, level), parts, left)
    for level, partner, keep, give, _ in reversed(steps):
        exchange(buf[keep[0]:keep[1]], buf[give[0]:give[1]], partner, level, False)


def _parts(offsets: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(tensor index, start, end) of each tensor's piece of [lo, hi), relative to lo."""
    first = int(np.searchsorted(offsets, lo, side="right")) - 1
    parts = []
    t = max(first, 0)
    while t < len(offsets) - 1 and offsets[t] < hi:
        s, e = max(int(offsets[t]), lo), min(int(offsets[t + 1]), hi)
        if e > s:
            parts.append((t, s - lo, e - lo))
        t += 1
    return parts


def _partials(xp: Any, mine: Any, other: Any, parts: list[tuple[int, int, int]], tensors: int,
              left: bool) -> Any:
    """(T, 3) float64: per tensor [a.b, |left|^2, |right|^2] over this rank's piece."""
    out = xp.zeros((tensors, 3), dtype=np.float64)
    a64 = mine.astype(np.float64)
    b64 = other.astype(np.float64)
    if xp is np and len(parts) > 1:  # one pass per product over the whole piece
        starts = [s for _, s, _ in parts]
        idx = [t for t, _, _ in parts]
        out[idx, 0] = np.add.reduceat(a64 * b64, starts)
        out[idx, 1] = np.add.reduceat(a64 * a64, starts)
        out[idx, 2] = np.add.reduceat(b64 * b64, starts)
    else:
        for t, s, e in parts:
            a, b = a64[s:e], b64[s:e]
            out[t, 0] = xp.dot(a, b)
            out[t, 1] = xp.dot(a, a)
            out[t, 2] = xp.dot(b, b)
    if not left:  # column 1 is always the left subtree's norm, column 2 the right's
        out[:, 1:] = out[:, 2:0:-1].copy()
    return out


def _combine(xp: Any, mine: Any, other: Any, sums: Any, parts: list[tuple[int, int, int]],
             left: bool) -> None:
    """``mine = coeff_mine * mine + coeff_other * other`` per tensor, in float64."""
    if not parts:  # (a kept half can be empty: fewer elements than ranks)
        return
    dot, lsq, rsq = sums[:, 0], sums[:, 1], sums[:, 2]
    ones = xp.ones_like(dot)
    a_coeff = xp.where(lsq >= THRESHOLD, 1.0 - dot / xp.where(lsq > 0, lsq, 1.0) * 0.5, ones)
    b_coeff = xp.where(rsq >= THRESHOLD, 1.0 - dot / xp.where(rsq > 0, rsq, 1.0) * 0.5, ones)
    c_mine, c_other = (a_coeff, b_coeff) if left else (b_coeff, a_coeff)
    if xp is np:
        idx = [t for t, _, _ in parts]
        lengths = [e - s for _, s, e in parts]
        start, end = parts[0][1], parts[-1][2]
        cm = np.repeat(c_mine[idx], lengths)
        co = np.repeat(c_other[idx], lengths)
        seg = slice(start, end)
        mine[seg] = cm * mine[seg].astype(np.float64) + co * other[seg].astype(np.float64)
        return
    kernel = _device_kernel(xp, mine.dtype == np.float16)
    for t, s, e in parts:
        kernel(mine[s:e], other[s:e], c_mine[t], c_other[t], mine[s:e])


_KERNELS: dict[bool, Any] = {}


def _device_kernel(cupy: Any, half: bool) -> Any:
    """One launch per tensor piece, the coefficients read on the device (no host sync).
    float16 goes through float (CuPy's half type converts to and from float only)."""
    kern = _KERNELS.get(half)
    if kern is None:
        body = ("y = (T)(float)(ca * (double)(float)a + cb * (double)(float)b)" if half else
                "y = (T)(ca * (double)a + cb * (double)b)")
        kern = _KERNELS[half] = cupy.ElementwiseKernel(
            "T a, T b, float64 ca, float64 cb", "T y", body,
            "hvdlite_adasum_combine_half" if half else "hvdlite_adasum_combine")
    return kern
