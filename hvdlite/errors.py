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
    "HostsUpdatedInterrupt",
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


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic training: the launcher changed the set of hosts (Horovod's name and meaning).

    Raised on every rank at once by ``State.commit()`` / ``State.check_host_updates()`` when
    the job runs under an elastic ``hvdliterun``; ``hvdlite.elastic.run`` catches it and the
    job goes on in a world of the new size from that point. ``skip_sync``: True when hosts
    were only removed (Horovod's flag; hvdlite always syncs, see docs/horovod.md).
    Not an :class:`HvdliteError`: nothing failed.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed; the elastic job restarts at the new size")
        self.skip_sync = skip_sync
