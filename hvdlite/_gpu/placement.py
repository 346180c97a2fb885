"""Where a process set's ranks sit on the GPUs, and which transport their device data takes.

The policy (``ipc`` in the config; ``docs/config.md``):

======== ============================== ============================ ========================
``ipc``  ranks share a GPU               one host, a GPU per rank,     ranks on several hosts
                                         peer access between them
======== ============================== ============================ ========================
auto     IPC (NCCL refuses to run)       NCCL; IPC for buckets up to   NCCL
                                         ``ipc_max_bytes`` (default 0)
always   IPC                             IPC                           NCCL
off      error (NCCL refuses to run)     NCCL                          NCCL
======== ============================== ============================ ========================

Ranks that share a GPU across several hosts (some pairs share, the set spans hosts) cannot
use either: the error says so. Deciding is collective (one allgather over the set).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hvdlite.errors import BackendUnavailableError

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["Placement", "placement", "transport"]


@dataclass(frozen=True)
class Placement:
    """The set's ranks by (host, GPU bus id), and whether IPC can join them all."""

    gpus: dict[tuple[str, str], list[int]]  # (host, PCI bus id) -> set ranks, in order
    one_host: bool
    peer_access: bool  # every GPU of the set can map every other's memory (one host only)

    @property
    def shared(self) -> list[tuple[tuple[str, str], list[int]]]:
        return [(key, ranks) for key, ranks in self.gpus.items() if len(ranks) > 1]

    def describe(self) -> str:
        return "; ".join(f"{host} GPU {bus}: ranks {ranks}"
                         for (host, bus), ranks in self.gpus.items())


def placement(comm: MPI.Intracomm, cupy: Any, device_id: int) -> Placement:
    """Collective over ``comm``: every rank's host and GPU, and peer access among them."""
    try:
        bus = str(cupy.cuda.Device(device_id).pci_bus_id)
    except Exception:  # an old driver without the attribute: the ordinal will do
        bus = f"device {device_id}"
    count = cupy.cuda.runtime.getDeviceCount()
    access = [i == device_id or bool(cupy.cuda.runtime.deviceCanAccessPeer(device_id, i))
              for i in range(count)]
    rows = comm.allgather((socket.gethostname(), bus, device_id, access))
    gpus: dict[tuple[str, str], list[int]] = {}
    for rank, (host, b, _, _) in enumerate(rows):
        gpus.setdefault((host, b), []).append(rank)
    hosts = {row[0] for row in rows}
    one_host = len(hosts) == 1
    peer = one_host and all(row[3][other[2]] for row in rows for other in rows
                            if other[2] < len(row[3]))
    return Placement(gpus, one_host, peer)


def transport(where: Placement, mode: str, max_bytes: int) -> str:
    """``"ipc"``, ``"nccl"`` or ``"mixed"`` (IPC up to ``max_bytes``, NCCL above) for the
    set at ``where`` under the ``ipc`` setting ``mode``; BackendUnavailableError (alike on
    every rank) where no transport can join the ranks."""
    ipc_ok = where.one_host and where.peer_access
    if where.shared:
        (host, gpu), ranks = where.shared[0]
        if mode != "off" and ipc_ok:
            return "ipc"
        why = ("ipc is off (HVDLITE_IPC=off): set it to auto to let ranks that share a GPU "
               "use CUDA IPC" if mode == "off" else
               "CUDA IPC joins ranks of one host only, and this set spans hosts")
        raise BackendUnavailableError(
            f"ranks {ranks} on host {host} share one GPU ({gpu}); NCCL needs one GPU per "
            f"rank and {why}; or launch at most as many ranks per host as it has GPUs "
            "(CUDA_VISIBLE_DEVICES)")
    if mode == "always" and ipc_ok:
        return "ipc"
    if mode == "auto" and ipc_ok and max_bytes > 0:
        return "mixed"
    return "nccl"
