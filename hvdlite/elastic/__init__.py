"""Elastic training, framework-free: Horovod's ``State``/``ObjectState``, ``run`` and
``HostsUpdatedInterrupt`` for NumPy code (``hvdlite.torch.elastic`` adds ``TorchState`` and
``ElasticSampler``). Start the job with ``hvdliterun --min-np``/``--host-discovery-script``
(:mod:`hvdlite.launcher.elastic`); see ``docs/horovod.md``, "Elastic training".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from hvdlite.elastic._state import ObjectState, State, broadcast_object, run_fn
from hvdlite.errors import HostsUpdatedInterrupt, HvdliteError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "broadcast_object", "run"]

#: Horovod's name for hvdlite's run-time error.
HorovodInternalError = HvdliteError

T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorator: run ``func(state, ...)`` elastically (Horovod's ``hvd.elastic.run``).

    Before the first call the state is synced from rank 0. Under the elastic ``hvdliterun``,
    a world that starts after a reset first loads the newest commit (from the lowest rank
    whose host kept it), runs the reset callbacks, syncs it to every rank and calls ``func``
    again; when ``func`` raises :class:`HostsUpdatedInterrupt` or
    :class:`HorovodInternalError` this process leaves its world (``SystemExit`` with a code
    the launcher reads) and the job goes on in the next one. Collectives must not run in
    ``func``'s arguments. Blocking; call it from the training thread.
    """
    return run_fn(func)
