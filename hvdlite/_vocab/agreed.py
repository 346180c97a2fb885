"""The words of an agreed schedule: the slots every rank must show alike before a sequence of
collectives may run with no negotiation, and how a disagreement between ranks is told.

Pure: no MPI, no device. The runtime's :mod:`hvdlite._control.agreed` exchanges what each rank
shows (one exchange, :meth:`~hvdlite._control.agreed.Schedules.agree`) and uses
:func:`disagreement` on the result; transports (``_backends/schedule_*.py``) read the slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Slot", "disagreement", "slot_rows"]


@dataclass(frozen=True)
class Slot:
    """Collective ``i`` of an agreed schedule: an in-place allreduce of ``count`` elements of
    ``dtype`` (a ``_ops.DTYPES`` key, or ``"bfloat16"``) with ``op`` (a ``ReduceOp`` value)
    and the pre/post scale factors, named for errors and the timeline."""

    name: str
    count: int
    dtype: str
    op: int
    pre: float = 1.0
    post: float = 1.0


def slot_rows(slots: Sequence[Slot]) -> list[dict[str, Any]]:
    """``slots`` as they travel in an agreement (JSON-able rows)."""
    return [asdict(s) for s in slots]


def _first_difference(mine: Any, theirs: Any) -> str:
    if isinstance(mine, list) and isinstance(theirs, list):
        if len(mine) != len(theirs):
            return f"{len(theirs)} entries, expected {len(mine)}"
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            diff = _first_difference(a, b)
            if diff:
                label = f" {b['name']!r}" if isinstance(b, dict) and "name" in b else ""
                return f"entry {i}{label}: {diff}"
        return ""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in list(mine) + [k for k in theirs if k not in mine]:
            if key not in theirs or key not in mine:
                return f"{key} {theirs.get(key)!r}, expected {mine.get(key)!r}"
            diff = _first_difference(mine[key], theirs[key])
            if diff:
                return diff if isinstance(mine[key], (list, dict)) else \
                    f"{key} {theirs[key]!r}, expected {mine[key]!r}"
        return ""
    return "" if mine == theirs else f"{theirs!r}, expected {mine!r}"


def disagreement(shown: Sequence[Any], ranks: Sequence[int]) -> str:
    """'' if every rank showed the same thing (``shown[k]``: what ``ranks[k]`` showed), else
    one line naming each rank that differs from the set's first and its first difference."""
    bad = []
    for rank, theirs in zip(ranks, shown, strict=True):
        diff = _first_difference(shown[0], theirs)
        if diff:
            bad.append(f"rank {rank}: {diff} (as rank {ranks[0]} has it)")
    return "; ".join(bad)
