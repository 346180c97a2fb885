"""The error types of ``hvdlite.torch`` (Horovod's names over hvdlite's errors).

A module of their own so that :mod:`hvdlite.torch.process_sets` and
:mod:`hvdlite.torch.basics` both use them without importing each other.
"""

from __future__ import annotations

from hvdlite.errors import HostsUpdatedInterrupt, HvdliteError, NotInitializedError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "InvalidArgumentError",
           "NotInitializedValueError"]

#: What Horovod users catch: hvdlite's run-time error (an alias, so every hvdlite failure is
#: caught by ``except hvd.HorovodInternalError``).
HorovodInternalError = HvdliteError


class NotInitializedValueError(NotInitializedError, ValueError):
    """hvdlite is not initialized: hvdlite's ``NotInitializedError`` that is also the
    ``ValueError`` Horovod raises for a query before ``init()``."""


class InvalidArgumentError(HvdliteError, ValueError):
    """A bad argument to a collective: a ``ValueError`` (hvdlite's rule) that is also a
    ``RuntimeError`` (what Horovod's engine raises for the same mistakes)."""
