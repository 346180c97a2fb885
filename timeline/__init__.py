"""Tools for reading hvdlite timelines (Chrome trace event JSON).

Run ``python -m timeline <tool> ...`` or ``hvdlite-timeline <tool> ...`` with a tool among
``summarize``, ``check``, ``merge`` and ``plot``; each is also ``python -m timeline.<tool>``.
The trace format is specified in ``timeline/FORMAT.md``. The loading helpers below are the
tools' own and are importable for tests and notebooks.
"""

from timeline._trace import (
    Instant,
    Pairing,
    Span,
    Trace,
    TraceError,
    comm_phase,
    compute_phase,
    load,
    merge_continued,
    nesting_errors,
    pair,
)

__all__ = [
    "Instant", "Pairing", "Span", "Trace", "TraceError", "comm_phase", "compute_phase", "load",
    "merge_continued", "nesting_errors", "pair",
]
