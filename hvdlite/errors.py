"""The hvdlite exception hierarchy.

Bad arguments at a call raise the built-in ``TypeError`` / ``ValueError`` in the caller.
Everything that goes wrong at run time (after a request was accepted) is an
:class:`HvdliteError`, a ``RuntimeError``; the subclasses tell the cause apart.
"""

from __future__ import annotations

__all__ = [
    "HvdliteError",
    "NotInitializedError",
    "ShutdownError",
    "MismatchError",
    "StallError",
    "BackendUnavailableError",
    "ConfigError",
]


class HvdliteError(RuntimeError):
    """Base class of every hvdlite run-time failure."""


class NotInitializedError(HvdliteError):
    """A call needs ``hvdlite.init()`` first."""


class ShutdownError(HvdliteError):
    """hvdlite was shut down (here or on another rank) before the work completed."""


class MismatchError(HvdliteError):
    """Ranks submitted the same tensor name with different parameters.

    Raised on every rank; the message names the tensor and what each differing rank sent.
    """


class StallError(HvdliteError):
    """Some ranks never submitted a tensor that others are waiting on."""


class BackendUnavailableError(HvdliteError):
    """A transport (MPI, NCCL, CUDA) that the work needs is missing or failed to start."""


class ConfigError(HvdliteError, ValueError):
    """A configuration key is unknown or its value is malformed.

    Also a ``ValueError``, so code that validates arguments generically still catches it.
    """
