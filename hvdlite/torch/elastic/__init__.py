"""``hvd.elastic``: Horovod's elastic training API for ``hvdlite.torch``.

``run``, ``TorchState``, ``ObjectState``, ``ElasticSampler``; the job is started by the
elastic ``hvdliterun`` (``--min-np``, ``--host-discovery-script``, ...). How it works and how
it differs from Horovod: ``docs/horovod.md``, "Elastic training".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from hvdlite.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State
from hvdlite.elastic import run as _run
from hvdlite.torch.elastic.sampler import ElasticSampler
from hvdlite.torch.elastic.state import TorchState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run"]

T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorator: run ``func(state, ...)`` elastically; see :func:`hvdlite.elastic.run`."""
    return _run(func)
