"""Stall inspector: runs on the coordinator and reports tensors some ranks never submitted."""

from __future__ import annotations

import logging
import time

from hvdlite._control.negotiation import CoordinatorTable, StallReport
from hvdlite.config import Config

__all__ = ["StallInspector", "format_stall_table"]

log = logging.getLogger("hvdlite")

_CHECK_EVERY_S = 1.0


def _ranks(ranks: tuple[int, ...]) -> str:
    return ",".join(map(str, ranks)) or "-"


def format_stall_table(reports: list[StallReport]) -> str:
    """One compact table: tensor, op/dtype/shape, ranks submitted, ranks missing, wait."""
    head = f"{'tensor':<32} {'op':<13} {'dtype':<9} {'shape':<14} {'ready':<10} missing  waited"
    lines = [head]
    for r in sorted(reports, key=lambda r: -r.waited_s):
        lines.append(f"{r.name[:32]:<32} {r.kind:<13} {r.dtype:<9} {str(r.shape)[:14]:<14} "
                     f"{_ranks(r.submitted)[:10]:<10} {_ranks(r.missing):<8} {r.waited_s:6.1f}s")
    return "\n".join(lines)


class StallInspector:
    """Decides, on rank 0, when to warn about waiting tensors and when to give up on them."""

    def __init__(self, config: Config) -> None:
        self.enabled = config.stall_check
        self.warn_after = config.stall_check_time_s
        self.shutdown_after = config.stall_shutdown_time_s
        self._next_check = time.monotonic() + _CHECK_EVERY_S
        self._next_warning = 0.0

    def due(self, now: float) -> bool:
        return self.enabled and now >= self._next_check

    def check(self, table: CoordinatorTable, now: float, quiet: bool = False) -> str:
        """Log a warning table if due; return a fatal stall message ('' when none).

        ``quiet``: some rank declared the stall expected (``hvdlite.expect_stall``).
        """
        self._next_check = now + _CHECK_EVERY_S
        reports = table.stalled(self.warn_after, now)
        if not reports or quiet:
            return ""
        if self.shutdown_after > 0:
            fatal = [r for r in reports if r.waited_s >= self.shutdown_after]
            if fatal:
                return self._fatal_message(fatal)
        if now >= self._next_warning:
            self._next_warning = now + self.warn_after
            log.warning("hvdlite stall: %d tensor(s) waited over %.0f s for other ranks; "
                        "a rank that never submits them stalls the job:\n%s",
                        len(reports), self.warn_after, format_stall_table(reports))
        return ""

    @staticmethod
    def _fatal_message(reports: list[StallReport]) -> str:
        parts = [f"{r.name!r} (missing ranks {_ranks(r.missing)}, submitted by "
                 f"{_ranks(r.submitted)}, waited {r.waited_s:.1f} s)" for r in reports[:8]]
        more = f" and {len(reports) - 8} more" if len(reports) > 8 else ""
        return ("stall shutdown: tensors " + "; ".join(parts) + more +
                ": the missing ranks never submitted them; make every rank submit the same "
                "collectives, or raise stall_shutdown_time_s")
