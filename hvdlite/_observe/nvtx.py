"""NVTX ranges around pipeline phases, so Nsight Systems shows what hvdlite was doing.

Uses the ``nvtx`` package when it is installed and ranges are enabled; otherwise every call is a
cheap no-op (``range`` hands back one shared ``nullcontext``). The import happens on first use
and a missing package is logged once at debug level, never raised.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

__all__ = ["DOMAIN", "available", "pop", "push", "range"]

log = logging.getLogger("hvdlite")

DOMAIN = "hvdlite"
_NULL: contextlib.nullcontext[None] = contextlib.nullcontext()
_MAX_CACHED = 4096  # event attributes cached per message; cleared when full

_state: dict[str, Any] = {"loaded": False, "domain": None, "module": None}
_attrs: dict[str, Any] = {}


def _load() -> Any:
    """The nvtx domain (or module, for old nvtx releases); None when nvtx is missing."""
    if _state["loaded"]:
        return _state["domain"] or _state["module"]
    _state["loaded"] = True
    try:
        import nvtx
    except ImportError as exc:
        log.debug("hvdlite: NVTX ranges requested but the nvtx package is unavailable (%s); "
                  "ranges are off", exc)
        return None
    if hasattr(nvtx, "get_domain"):
        _state["domain"] = nvtx.get_domain(DOMAIN)
    else:
        _state["module"] = nvtx
    return _state["domain"] or _state["module"]


def available() -> bool:
    """Whether the nvtx package can be used (imports it on the first call)."""
    return _load() is not None


def push(name: str, enabled: bool) -> None:
    """Open a range named ``name`` on this thread (no-op when disabled or nvtx is missing)."""
    if not enabled:
        return
    target = _load()
    if target is None:
        return
    if _state["domain"] is not None:
        attrs = _attrs.get(name)
        if attrs is None:
            if len(_attrs) >= _MAX_CACHED:
                _attrs.clear()
            attrs = _attrs[name] = target.get_event_attributes(message=name)
        target.push_range(attrs)
    else:
        target.push_range(message=name, domain=DOMAIN)


def pop(enabled: bool) -> None:
    """Close the innermost range this thread opened with :func:`push`."""
    if not enabled:
        return
    target = _load()
    if target is None:
        return
    if _state["domain"] is not None:
        target.pop_range()
    else:
        target.pop_range(domain=DOMAIN)


class _Range:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        push(self.name, True)

    def __exit__(self, *exc: object) -> None:
        pop(True)


def range(name: str, enabled: bool) -> contextlib.AbstractContextManager[None]:
    """``with range("MPI_ALLREDUCE grad/w", cfg.nvtx):`` — an NVTX range, or a shared no-op."""
    if not enabled or _load() is None:
        return _NULL
    return _Range(name)


def _reset_for_tests() -> None:
    """Forget the import outcome so a test can load (or fail to load) nvtx afresh."""
    _state.update(loaded=False, domain=None, module=None)
    _attrs.clear()
